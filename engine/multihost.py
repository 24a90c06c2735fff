"""One engine over several processes: the leader's device operations, replayed by the others.

In a multi-process JAX job (engine.distributed) every process must run the same compiled computations,
with the same shapes, in the same order: their collectives meet across processes. Only the leader
(process 0) schedules; its ModelRunner describes each device operation as a `DeviceOp` (host arrays and
JSON-able arguments) and hands it to `publish` just before running it. Every other process holds an
identical engine (same model, configuration and warmup) whose `Follower` applies the same operations in
the same order. The operations (OP_KINDS):

  step        a ragged model step (ModelRunner.run_step): tokens, cu_q_lens, kv_lens, block_tables,
              lora_slots, logits_rows
  sample      sampling from the last step's logits (ModelRunner.run_sample): the SamplingBatch's arrays
  gather_kv   a prompt's KV read for a sender (ModelRunner.gather_kv): block ids and frame plan; the
              chunks are replicated on every process, so the leader reads them from its own memory
  insert_kv   a received KV chunk written into blocks (ModelRunner.insert_kv): the chunk's host array
  lora_write  an adapter written into a LoRA slot (LoraSlots): the adapter's host arrays
  stop        the leader drained; the followers return

Warmup is not an operation: every process compiles and runs the same warmup itself before following.
What carries operations between processes is the daemon's business (services/group.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pdserve.engine.core.kv_groups import BlockTables, KVGroups
from pdserve.engine.model.attention import block_table_width
from pdserve.engine.model.sampler import SamplingBatch
from pdserve.engine.sampling_params import MAX_LOGIT_BIAS
from pdserve.kvtransfer import MAX_FRAME_BYTES, HeadMap, KVChunk
from pdserve.kvtransfer.plan import FramePlan

OP_KINDS = ("step", "prompt_scores", "sample", "gather_kv", "insert_kv", "copy_blocks", "lora_write", "stop")


@dataclasses.dataclass
class DeviceOp:
    kind: str  # one of OP_KINDS
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # JSON-able

    def __post_init__(self):
        if self.kind not in OP_KINDS:
            raise ValueError(f"unknown device operation {self.kind!r}")


Publish = Callable[[DeviceOp], None]


def is_multi_process() -> bool:
    return jax.process_count() > 1


def engine_fingerprint(engine) -> str:
    """What must be equal for two processes to replay each other's operations: the model, the engine
    configuration, the global device count and the JAX version (`engine`: an engine.llm_engine.LLMEngine)."""
    facts = {
        "model": dataclasses.asdict(engine.model.config),
        "engine": dataclasses.asdict(engine.config),
        "devices": jax.device_count(),
        "jax": jax.__version__,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def max_op_bytes(engine) -> int:
    """An upper bound on the arrays of any one device operation of `engine` (an LLMEngine), by kind: a
    step's token and block-table arrays, a sampling batch's (its penalty rows are vocabulary-wide), a KV
    chunk received (a frame's tokens, resharded into this cache's heads and dtype: at most 4 frames'
    bytes), an adapter's slot arrays (float32); 1 MiB more for the encoding and the JSON arguments. The
    group stream's receive limit (services/group.py)."""
    config, model = engine.config, engine.model.config
    tokens, rows = config.max_num_batched_tokens, config.seq_bucket(config.max_num_batched_tokens)
    logits_rows = config.logits_bucket(tokens)  # (sampled rows: with speculation, more than sequences)
    groups = KVGroups.of(model).num_groups
    step = 4 * (tokens + 3 * rows + 2 + logits_rows + groups * rows * block_table_width(config))
    vocab = model.vocab_size
    sample = logits_rows * (64 + 5 * vocab + 4 * -(-vocab // 32) + 4 + 8 * MAX_LOGIT_BIAS)
    lora = 0
    if engine.lora_slots is not None:
        slots = engine.lora_slots
        lora = 4 * sum(leaf.size // slots.num_slots for leaf in jax.tree.leaves(slots.weights))
    return max(step, sample, 4 * MAX_FRAME_BYTES, lora) + (1 << 20)


# ---- operations <-> arguments (one place for each kind's encoding) ---------------------------------------
def sample_op(batch: SamplingBatch) -> DeviceOp:
    """engine.model.sampler.SamplingBatch -> a `sample` operation. Of the allowed-token bitmasks only the rows
    of constrained requests travel (the rest are all ones: about 6 KB a row saved with a 49k vocabulary)."""
    arrays = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    constrained = np.flatnonzero((batch.allowed != -1).any(axis=1)).astype(np.int32)
    arrays.update(allowed=batch.allowed[constrained], allowed_rows=constrained)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    return DeviceOp("sample", arrays, {"mask_words": int(batch.allowed.shape[1])})


def sample_batch(op: DeviceOp) -> SamplingBatch:
    arrays = dict(op.arrays)
    allowed = np.full((len(arrays["logits_row"]), op.args["mask_words"]), -1, np.int32)
    allowed[arrays.pop("allowed_rows")] = arrays["allowed"]
    arrays["allowed"] = allowed
    return SamplingBatch(**{f.name: arrays.get(f.name) for f in dataclasses.fields(SamplingBatch)})


def gather_op(tables: BlockTables, num_tokens: int, max_frame_bytes: int, head_map, frames) -> DeviceOp:
    """The arguments of ModelRunner.gather_kv -> a `gather_kv` operation."""
    return DeviceOp(
        "gather_kv",
        args={
            "block_ids": tables.to_lists(),
            "num_tokens": int(num_tokens),
            "max_frame_bytes": int(max_frame_bytes),
            "head_map": None if head_map is None else dataclasses.asdict(head_map),
            "frames": [dataclasses.asdict(f) for f in frames],
        },
    )


def gather_kwargs(op: DeviceOp) -> dict[str, Any]:
    args = dict(op.args)
    if args["head_map"] is not None:
        h = args["head_map"]
        args["head_map"] = HeadMap(
            tuple(h["head_index"]),
            tuple(tuple(s) for s in h["dim_segments"]),
            tuple(h["src_token_shape"]),
            tuple(h["dst_token_shape"]),
        )
    args["frames"] = [FramePlan(**f) for f in args["frames"]]
    args["block_ids"] = BlockTables.from_lists(args["block_ids"])
    return args


def insert_op(chunk: KVChunk, tables: BlockTables) -> DeviceOp:
    """A host KVChunk and its request's block tables -> an `insert_kv` operation."""
    return DeviceOp(
        "insert_kv",
        {"data": chunk.data},
        {
            "layer_start": chunk.layer_start,
            "token_start": chunk.token_start,
            "num_tokens": chunk.num_tokens,
            "block_ids": tables.to_lists(),
        },
    )


def insert_args(op: DeviceOp) -> tuple[KVChunk, BlockTables]:
    """-> (KVChunk with a host array, block tables)."""
    a = op.args
    chunk = KVChunk(a["layer_start"], a["token_start"], a["num_tokens"], op.arrays["data"])
    return chunk, BlockTables.from_lists(a["block_ids"])


class Follower:
    """Applies a leader's operations to this process's engine (a worker of a multi-process daemon):
    `engine` an engine.llm_engine.LLMEngine built and warmed up like the leader's; `layout` its KV layout."""

    def __init__(self, engine, layout):
        self.engine = engine
        self.layout = layout
        self.applied = 0
        self._logits: jax.Array | None = None

    def apply(self, op: DeviceOp) -> bool:
        """Runs one operation and waits for its results (consecutive operations' collectives must not
        overlap); False for `stop`."""
        runner = self.engine.runner
        if op.kind == "stop":
            return False
        if op.kind == "step":
            result = self._logits = runner.run_step(**op.arrays)
        elif op.kind == "prompt_scores":
            result = runner.run_prompt_scores(op.arrays["targets"])
        elif op.kind == "sample":
            if self._logits is None:
                raise RuntimeError("a sample operation before any step")
            result = runner.run_sample(self._logits, sample_batch(op))
        elif op.kind == "gather_kv":
            result = [c.data for c in runner.gather_kv(self.layout, **gather_kwargs(op))]
        elif op.kind == "insert_kv":
            runner.insert_kv(*insert_args(op))
            result = runner.cache
        elif op.kind == "copy_blocks":
            runner.run_copy_blocks(op.arrays["src"], op.arrays["dst"])
            result = runner.cache
        else:  # lora_write
            self.engine.lora_slots.write(op.arrays, op.args["slot"])
            result = self.engine.lora_slots.weights
        jax.block_until_ready(result)
        self.applied += 1
        return True
