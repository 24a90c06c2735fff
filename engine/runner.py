"""The model runner: host batches -> padded, bucketed device arrays -> compiled steps -> sampled tokens.

Every shape the runner feeds to the device comes from a fixed set of buckets (EngineConfig), all compiled
by `warmup()`; steady-state serving compiles nothing new.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging

import jax
import numpy as np
from jax.sharding import Mesh

from engine.config import EngineConfig, ModelConfig, bucket_for
from engine.kv_cache import allocate_cache
from engine.lora import LoraSlots, LoraWeights
from engine.model import forward_step
from engine.sampler import SampleResult, SamplingBatch, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Row
from engine.sharding import named
from engine.weights import Weights

log = logging.getLogger(__name__)

# One jitted step shared by every runner of the process: runners of the same model and shapes (tests,
# the colocated `serve` shape) reuse each other's compilations. The cache keeps its input sharding.
_jitted_step = jax.jit(forward_step, static_argnames=("cfg",), donate_argnames=("cache",))


@dataclasses.dataclass
class SampleRow:
    params: SamplingParams
    seed: int
    position: int  # position of the token being sampled
    prompt_ids: list[int]
    output_ids: list[int]


class ModelRunner:
    """Owns the weights, the KV cache and the compiled steps of one engine on one mesh."""

    def __init__(
        self,
        model: ModelConfig,
        config: EngineConfig,
        weights: Weights,
        mesh: Mesh,
        lora: LoraSlots | None = None,
    ):
        self.model = model
        self.config = config
        self.weights = weights
        self.mesh = mesh
        self.lora = lora  # resident adapters; None: LoRA off (max_loras == 0)
        self.cache = allocate_cache(model, config, mesh)
        self._step = functools.partial(_jitted_step, cfg=model)

    # ---- shapes ---------------------------------------------------------------------------------------
    def step_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, past blocks) the scheduler can produce."""
        c = self.config
        fresh = itertools.product(c.prefill_batch_buckets, c.prefill_token_buckets, [0])
        continued = itertools.product([1], c.prefill_token_buckets, c.context_block_buckets)
        decode = itertools.product(c.decode_batch_buckets, [1], c.context_block_buckets)
        return sorted(set(fresh) | set(continued) | set(decode))

    def sampler_shapes(self) -> list[tuple[int, bool, bool, int]]:
        rows = sorted(set(self.config.prefill_batch_buckets) | set(self.config.decode_batch_buckets))
        return list(itertools.product(rows, (False, True), (False, True), (0, self.config.max_logprobs)))

    def _shape_for(self, rows: list[Row]) -> tuple[int, int, int]:
        c = self.config
        max_tokens = max(len(r.tokens) for r in rows)
        max_past = max(-(-r.num_past // c.block_size) for r in rows)
        if max_tokens == 1:  # decode
            return (
                bucket_for(len(rows), c.decode_batch_buckets),
                1,
                bucket_for(max_past, c.context_block_buckets),
            )
        if max_past == 0:
            return (
                bucket_for(len(rows), c.prefill_batch_buckets),
                bucket_for(max_tokens, c.prefill_token_buckets),
                0,
            )
        if len(rows) != 1:
            raise ValueError("continued prefill chunks run one request per step")
        return (
            1,
            bucket_for(max_tokens, c.prefill_token_buckets),
            bucket_for(max_past, c.context_block_buckets),
        )

    # ---- execution ------------------------------------------------------------------------------------
    def forward(self, rows: list[Row]) -> jax.Array:
        """Runs one step; returns the logits [bucketed rows, vocab] at each row's last token (on device)."""
        c = self.config
        b, t, p = self._shape_for(rows)
        tokens = np.zeros((b, t), np.int32)
        num_past = np.zeros(b, np.int32)
        num_new = np.zeros(b, np.int32)
        block_tables = np.zeros((b, p), np.int32)
        write_blocks = np.full((b, t), c.num_blocks, np.int32)  # out of range: dropped
        write_offsets = np.zeros((b, t), np.int32)
        lora_slots = np.full(b, rows[-1].lora_slot, np.int32)  # padding rows: the last request's adapter
        for i, row in enumerate(rows):
            n = len(row.tokens)
            tokens[i, :n] = row.tokens
            num_past[i], num_new[i] = row.num_past, n
            past_blocks = row.block_ids[: min(p, -(-row.num_past // c.block_size))]
            block_tables[i, : len(past_blocks)] = past_blocks
            positions = np.arange(row.num_past, row.num_past + n)
            write_blocks[i, :n] = np.asarray(row.block_ids, np.int32)[positions // c.block_size]
            write_offsets[i, :n] = positions % c.block_size
            lora_slots[i] = row.lora_slot
        logits, self.cache = self._step(
            self.weights,
            self.lora_weights,
            self.cache,
            tokens,
            num_past,
            num_new,
            block_tables,
            write_blocks,
            write_offsets,
            lora_slots,
        )
        return logits

    @property
    def lora_weights(self) -> LoraWeights | None:
        return None if self.lora is None else self.lora.weights

    def sample(
        self, logits: jax.Array, rows: list[SampleRow], logits_rows: list[int] | None = None
    ) -> SampleResult:
        """Samples `rows` from rows `logits_rows` (default 0..) of `logits`; returns host numpy results."""
        params = [r.params for r in rows]
        penalties = any(p.needs_penalties for p in params)
        history = [(r.prompt_ids, r.output_ids) for r in rows] if penalties else None
        batch = SamplingBatch.build(
            params,
            logits_rows if logits_rows is not None else list(range(len(rows))),
            [r.seed for r in rows],
            [r.position for r in rows],
            history,
            logits.shape[0],
            self.model.vocab_size,
        )
        wants_logprobs = any(p.logprobs is not None for p in params)
        result = sample(
            logits,
            batch,
            truncate=any(p.needs_truncation for p in params),
            num_logprobs=self.config.max_logprobs if wants_logprobs else 0,
        )
        result = jax.device_get(result)
        n = len(rows)
        return SampleResult(
            result.tokens[:n], result.logprob[:n], result.top_ids[:n], result.top_logprobs[:n]
        )

    # ---- compilation ----------------------------------------------------------------------------------
    def warmup(self, progress: bool = True) -> int:
        """Compiles every step and sampler shape (and, with LoRA on, the adapter slot write); returns the
        number of step and sampler variants."""
        from tqdm import tqdm

        c = self.config
        shapes = self.step_shapes()
        sampler_shapes = self.sampler_shapes()
        bar = tqdm(
            total=len(shapes) + len(sampler_shapes), desc="compiling", disable=not progress, unit="shape"
        )
        scratch = [0] * c.max_blocks_per_seq  # block 0: warmup writes are dropped (num_new == 0 rows only)
        for b, t, p in shapes:
            rows = [Row(tokens=[0] * t, num_past=p * c.block_size, block_ids=scratch) for _ in range(b)]
            self._compile_step(rows)
            bar.update()
        vocab = self.model.vocab_size
        for b, penalties, truncate, num_logprobs in sampler_shapes:
            params = SamplingParams(
                temperature=1.0,
                top_k=5 if truncate else 0,
                repetition_penalty=1.1 if penalties else 1.0,
                logprobs=num_logprobs or None,
            )
            logits = jax.device_put(np.zeros((b, vocab), np.float32), named(self.mesh))
            self.sample(logits, [SampleRow(params, 0, 0, [1], [])])
            bar.update()
        if self.lora is not None:
            self.lora.warmup()  # the adapter slot write (a run-time load must not compile)
        bar.close()
        return len(shapes) + len(sampler_shapes)

    def _compile_step(self, rows: list[Row]) -> None:
        """Compiles (or loads from the persistent cache) the step of these rows' shape, ahead of time:
        nothing runs, the cache is untouched, and a later step of that shape finds the executable."""
        c = self.config
        b, t, p = self._shape_for(rows)
        zeros = np.zeros
        _jitted_step.lower(
            self.weights,
            self.lora_weights,
            self.cache,
            zeros((b, t), np.int32),
            np.full(b, p * c.block_size, np.int32),
            np.full(b, 0, np.int32),
            zeros((b, p), np.int32),
            np.full((b, t), c.num_blocks, np.int32),
            zeros((b, t), np.int32),
            np.full(b, -1, np.int32),
            cfg=self.model,
        ).compile()
