"""The model runner: host batches -> padded, bucketed device arrays -> compiled steps -> sampled tokens.

Every shape the runner feeds to the device comes from a fixed set of buckets (EngineConfig), all compiled
by `warmup()`; steady-state serving compiles nothing new.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from pdserve import kvtransfer
from pdserve.engine import multihost
from pdserve.engine.config import EngineConfig, ModelConfig, bucket_for
from pdserve.engine.core.kv_groups import BlockTables, KVGroups
from pdserve.engine.core.scheduler import Row
from pdserve.engine.host_kv import HostKVStore, HostLoad, padded_pair_batches
from pdserve.engine.lora_slots import LoraSlots
from pdserve.engine.memory import MemoryPlan, StepTemps
from pdserve.engine.model import kv_cache
from pdserve.engine.model.attention import AttentionFn, block_table_width, ragged_paged_attention_reference
from pdserve.engine.model.eagle3 import DraftModel, draft_step
from pdserve.engine.model.forward import forward_step, prompt_scores
from pdserve.engine.model.kv_cache import allocate_cache
from pdserve.engine.model.lora import LoraWeights
from pdserve.engine.model.sampler import SampleResult, SamplingBatch, sample
from pdserve.engine.model.sharding import named
from pdserve.engine.model.weights import Weights
from pdserve.engine.multihost import DeviceOp, Publish
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import HeadMap, KVChunk, KVLayout
from pdserve.kvtransfer.plan import FramePlan

log = logging.getLogger(__name__)

# One jitted step shared by every runner of the process: runners of the same model and shapes (tests,
# the colocated `serve` shape) reuse each other's compilations. The cache keeps its input sharding.
_jitted_step = jax.jit(
    forward_step, static_argnames=("cfg", "attention", "aux_layers"), donate_argnames=("cache",)
)
_jitted_draft = jax.jit(
    draft_step,
    static_argnames=("cfg", "row", "num_drafts", "attention", "norm_before_residual"),
    donate_argnames=("cache",),
)
_jitted_scores = jax.jit(prompt_scores, static_argnames=("cfg", "num_top"))
# Block copies (a forked sequence's own copy of its parent's partial block) go in padded batches of these
COPY_BUCKETS = (4, 16, 64)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy_blocks(cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Every row's block src[i] copied onto block dst[i] (padding repeats a pair: the same write twice)."""
    return cache.at[:, dst].set(cache[:, src])


@dataclasses.dataclass
class PromptScores:
    """prompt_scores' results on the host, one row per token of the step: the target's logprob and rank,
    the top ids and logprobs (max_logprobs of them)."""

    logprob: np.ndarray
    rank: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


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
        attention: AttentionFn = ragged_paged_attention_reference,
        draft: DraftModel | None = None,
    ):
        """`attention`: this runner's implementation (engine.model.attention's seam); `draft`: an EAGLE-3
        head (its KV the cache's last row: `model.draft_layer` names it)."""
        self.model = model
        self.config = config
        self.weights = weights
        self.mesh = mesh
        self.lora = lora  # resident adapters; None: LoRA off (max_loras == 0)
        self.layout = kv_cache.kv_layout(model, config)  # the cache as kvtransfer sees it
        self.cache = allocate_cache(model, config, mesh)
        self.groups = KVGroups.of(model)
        self.attention = attention
        self.draft = draft
        self.aux_layers = () if draft is None else draft.aux_layers
        self._step = functools.partial(
            _jitted_step, cfg=model, attention=attention, aux_layers=self.aux_layers
        )
        self._replicated = jax.jit(lambda x: x, out_shardings=named(mesh))
        # The leader of a multi-process engine hands each device operation here before running it
        # (engine.multihost); None: single process, or a follower.
        self.publish: Publish | None = None
        self.memory: MemoryPlan | None = None  # how the cache was sized (engine.memory; set by its builder)
        self.hidden: jax.Array | None = None  # the last step's final hidden states (prompt_scores reads)
        self.aux: jax.Array | None = None  # the last step's aux states (with a draft head: run_draft reads)
        self._scores = functools.partial(_jitted_scores, cfg=model, num_top=max(config.max_logprobs, 1))
        # The host tier's slots (--kv-offloading-size; None: off), and what every write of the cache calls
        # first: the engine's copies owed to and from the tier (blocks evicted and reused, host hits)
        self.host = HostKVStore(self.cache, config.num_host_blocks) if config.num_host_blocks else None
        self.before_write: Callable[[], None] | None = None

    # ---- shapes ----------------------------------------------------------------------------------------
    def step_shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, sequence slots) a step can have: one per token bucket."""
        c = self.config
        return [(t, c.seq_bucket(t)) for t in c.token_buckets]

    def score_shapes(self) -> list[int]:
        """Every step size prompt_scores is compiled for: one per token bucket."""
        return list(self.config.token_buckets)

    def sampler_shapes(self) -> list[tuple[int, bool]]:
        """Every (rows, penalties) the sampler is compiled for (engine.model.sampler: one variant each): a
        step's logits rows (EngineConfig.logits_bucket)."""
        rows = sorted({self.config.logits_bucket(t) for t, _ in self.step_shapes()})
        return list(itertools.product(rows, (False, True)))

    def copy_shapes(self) -> tuple[int, ...]:
        """Every number of block copies copy_blocks is compiled for (larger batches go in pieces)."""
        return COPY_BUCKETS

    @functools.cached_property
    def block_table_width(self) -> int:
        return block_table_width(self.config)

    # ---- execution ------------------------------------------------------------------------------------
    def forward(self, rows: list[Row]) -> jax.Array:
        """Runs one ragged step over the rows' new tokens; returns the logits [logits rows, vocab] (on
        device) at each row's last token and, with drafts, at the token before each draft: row by row,
        Row.num_logits each (SchedulerOutput.logits_starts)."""
        c = self.config
        num_tokens = sum(len(r.tokens) for r in rows)
        t = bucket_for(num_tokens, c.token_buckets)
        s = c.seq_bucket(t)
        tokens = np.zeros(t, np.int32)
        cu_q_lens = np.full(s + 1, num_tokens, np.int32)
        kv_lens = np.zeros(s, np.int32)
        block_tables = np.zeros((self.groups.num_groups, s, self.block_table_width), np.int32)
        lora_slots = np.full(s, -1, np.int32)
        logits_rows = np.zeros(c.logits_bucket(t), np.int32)
        start = at = 0
        for i, row in enumerate(rows):
            n = len(row.tokens)
            tokens[start : start + n] = row.tokens
            cu_q_lens[i] = start
            kv_lens[i] = row.num_past + n
            num_blocks = -(-kv_lens[i] // c.block_size)
            for g, table in enumerate(row.block_tables.groups):
                block_tables[g, i, :num_blocks] = table[:num_blocks]
            lora_slots[i] = row.lora_slot
            start += n
            logits_rows[at : at + row.num_logits] = np.arange(start - row.num_logits, start)
            at += row.num_logits
        return self.run_step(tokens, cu_q_lens, kv_lens, block_tables, lora_slots, logits_rows)

    def run_step(self, tokens, cu_q_lens, kv_lens, block_tables, lora_slots, logits_rows) -> jax.Array:
        """The compiled step on padded host arrays (see forward); published first (engine.multihost)."""
        if self.publish is not None:
            arrays = dict(
                tokens=tokens,
                cu_q_lens=cu_q_lens,
                kv_lens=kv_lens,
                block_tables=block_tables,
                lora_slots=lora_slots,
                logits_rows=logits_rows,
            )
            self.publish(DeviceOp("step", arrays))
        self._before_write()
        logits, self.cache, self.hidden, self.aux = self._step(
            self.weights,
            self.lora_weights,
            self.cache,
            tokens,
            cu_q_lens,
            kv_lens,
            block_tables,
            lora_slots,
            logits_rows,
        )
        return logits

    def prompt_scores(self, targets: np.ndarray) -> PromptScores:
        """The last step's tokens scored against `targets` [the step's padded tokens] (the next prompt
        token of each, -1: none): engine.model.forward.prompt_scores, on the host; published first
        (engine.multihost)."""
        if self.publish is not None:
            self.publish(DeviceOp("prompt_scores", {"targets": targets}))
        return PromptScores(*jax.device_get(self.run_prompt_scores(targets)))

    def run_prompt_scores(self, targets: np.ndarray) -> tuple[jax.Array, ...]:
        if self.hidden is None:
            raise RuntimeError("prompt scores before any step")
        return self._scores(self.weights, self.hidden, targets)

    def run_draft(
        self,
        tokens: np.ndarray,
        aux_rows: np.ndarray,
        cu_q_lens: np.ndarray,
        kv_lens: np.ndarray,
        block_tables: np.ndarray,
        last_rows: np.ndarray,
        lookahead: np.ndarray,
        aux: np.ndarray | None = None,
    ) -> np.ndarray:
        """The draft head's pass (engine.model.eagle3.draft_step) on padded host arrays, reading the aux
        states of the last step (or `aux`, a peer's, [tokens, aux width]); its drafts on the host [S, k]."""
        d = self.draft
        self._before_write()
        drafts, self.cache = _jitted_draft(
            d.weights,
            self.weights.embed,
            self.cache,
            self.aux if aux is None else aux,
            aux_rows,
            tokens,
            cu_q_lens,
            kv_lens,
            block_tables,
            last_rows,
            lookahead,
            cfg=d.config,
            row=self.model.num_layers,
            num_drafts=self.config.speculation.num_speculative_tokens,
            attention=self.attention,
            norm_before_residual=d.norm_before_residual,
        )
        return np.asarray(jax.device_get(drafts))

    def draft_shapes(self) -> list[int]:
        """Every step size run_draft is compiled for (a draft head: one per token bucket; else none)."""
        return [] if self.draft is None else list(self.config.token_buckets)

    def _compile_draft(self, num_tokens: int) -> None:
        """Compiles run_draft's pass for `num_tokens` tokens (and that step's aux states) ahead of time."""
        d, s = self.draft, self.config.seq_bucket(num_tokens)
        zeros = functools.partial(np.zeros, dtype=np.int32)
        width = len(d.aux_layers) * self.model.hidden_size
        aux = jax.ShapeDtypeStruct(
            (num_tokens, width), np.dtype(self.config.dtype), sharding=named(self.mesh)
        )
        _jitted_draft.lower(
            d.weights,
            self.weights.embed,
            self.cache,
            aux,
            zeros(num_tokens),
            zeros(num_tokens),
            zeros(s + 1),
            zeros(s),
            zeros((s, self.block_table_width)),
            zeros(s),
            zeros(s),
            cfg=d.config,
            row=self.model.num_layers,
            num_drafts=self.config.speculation.num_speculative_tokens,
            attention=self.attention,
            norm_before_residual=d.norm_before_residual,
        ).compile()

    @property
    def lora_weights(self) -> LoraWeights | None:
        return None if self.lora is None else self.lora.weights

    def sample(
        self,
        logits: jax.Array,
        rows: list[SampleRow],
        logits_rows: list[int] | None = None,
        allowed: np.ndarray | None = None,
    ) -> SampleResult:
        """Samples `rows` from rows `logits_rows` (default 0..) of `logits`, each among the tokens its row of
        `allowed` (engine.model.sampler's bitmasks; None: all) lets through; returns host numpy results.
        More rows than logits (n > 1 forks sample one row's logits n times) go in batches of the logits'
        size: the sampler's compiled shapes are the steps'."""
        logits_rows = logits_rows if logits_rows is not None else list(range(len(rows)))
        size = logits.shape[0]
        parts = []
        for start in range(0, len(rows), size):
            part = rows[start : start + size]
            params = [r.params for r in part]
            penalties = any(p.needs_penalties for p in params)
            batch = SamplingBatch.build(
                params,
                logits_rows[start : start + size],
                [r.seed for r in part],
                [r.position for r in part],
                [(r.prompt_ids, r.output_ids) for r in part] if penalties else None,
                size,
                self.model.vocab_size,
                None if allowed is None else allowed[start : start + size],
            )
            result = jax.device_get(self.run_sample(logits, batch))
            parts.append(
                [
                    field[: len(part)]
                    for field in (result.tokens, result.logprob, result.top_ids, result.top_logprobs)
                ]
            )
        return SampleResult(*(np.concatenate(column) for column in zip(*parts, strict=True)))

    def run_sample(self, logits: jax.Array, batch: SamplingBatch) -> SampleResult:
        """The compiled sampler (results on device, replicated); published first (engine.multihost)."""
        if self.publish is not None:
            self.publish(multihost.sample_op(batch))
        return sample(logits, batch, num_logprobs=self.config.max_logprobs)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies blocks (source, destination) in every cache row (Scheduler.take_block_copies)."""
        for src, dst, _ in padded_pair_batches(copies, COPY_BUCKETS):
            self.run_copy_blocks(src, dst)

    def run_copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """One padded batch of copy_blocks; published first (engine.multihost)."""
        if self.publish is not None:
            self.publish(DeviceOp("copy_blocks", {"src": src, "dst": dst}))
        self._before_write()
        self.cache = _copy_blocks(self.cache, src, dst)

    # ---- the host tier (engine.host_kv) -------------------------------------------------------------------
    def _before_write(self) -> None:
        if self.before_write is not None:
            self.before_write()

    def copy_out(self, offloads: Sequence[tuple[int, int]]) -> list[int]:
        """Starts copying evicted blocks (block, host slot) to the host tier (dispatched before any later
        write of the cache); returns the slots whose copies have landed since the last call."""
        if offloads:
            self.host.offload(self.cache, offloads)
        return self.host.landed() if self.host.num_in_flight else []

    def start_load(self, loads: Sequence[tuple[int, int]]) -> HostLoad:
        """Starts copying host tier slots into blocks (host slot, block): the slots are read now."""
        return self.host.start_load(loads)

    def finish_load(self, load: HostLoad) -> None:
        """Writes a started load into its blocks (a write of the cache: the copies owed go first)."""
        self._before_write()
        self.cache = self.host.finish_load(self.cache, load)

    # ---- KV in and out (engine.core.kv_connector) ----------------------------------------------------------
    def gather_kv(
        self,
        layout: KVLayout,
        block_ids: BlockTables | Sequence[int],
        num_tokens: int,
        *,
        max_frame_bytes: int,
        head_map: HeadMap | None,
        frames: Sequence[FramePlan],
    ) -> list[KVChunk]:
        """kvtransfer's chunks of these frames of a request's blocks (engine.core.kv_groups: each layer read
        from its group's table and its row); in a multi-process job the chunks are replicated on every process
        (an all-gather over the hosts), so the leader reads them locally."""
        tables = BlockTables.of(block_ids)
        if self.publish is not None:
            self.publish(multihost.gather_op(tables, num_tokens, max_frame_bytes, head_map, frames))
        if self.groups.is_identity:
            chunks = kvtransfer.gather_request(
                self.cache,
                layout,
                tables.groups[0],
                num_tokens,
                max_frame_bytes=max_frame_bytes,
                head_map=head_map,
                frames=frames,
            )
        else:
            chunks = [self._gather_frame(tables, p, head_map) for p in frames]
        if multihost.is_multi_process():
            chunks = [dataclasses.replace(c, data=self._replicated(c.data)) for c in chunks]
            jax.block_until_ready([c.data for c in chunks])  # no collective may overlap the next step's
        return chunks

    def _gather_frame(self, tables: BlockTables, p: FramePlan, head_map: HeadMap | None) -> KVChunk:
        """One frame of a hybrid model's cache: its layers' runs of rows, each with its group's blocks."""
        ids = tables[p.block_start : p.block_start + p.num_blocks]
        parts = [
            kvtransfer.gather(
                self.cache,
                ids.groups[group],
                p.num_tokens,
                layer_start=row,
                num_layers=count,
                token_start=p.token_start,
                head_map=head_map,
                bucket=p.bucket,
            ).data
            for group, row, count in self.groups.pieces(p.layer_start, p.num_layers)
        ]
        data = parts[0] if len(parts) == 1 else jax.numpy.concatenate(parts)
        return KVChunk(p.layer_start, p.token_start, p.num_tokens, data)

    def insert_kv(self, chunk: KVChunk, block_ids: BlockTables | Sequence[int]) -> None:
        """Writes an arriving chunk (heads in this cache's layout; on the mesh already, or a host array put
        on it here) into a request's blocks (each layer into its group's table and its row). A
        multi-process engine takes host arrays only (every process puts its own shards)."""
        tables = BlockTables.of(block_ids)
        self._before_write()
        if isinstance(chunk.data, np.ndarray):
            if self.publish is not None:
                self.publish(multihost.insert_op(chunk, tables))
            data = jax.device_put(chunk.data, kvtransfer.chunk_sharding(self.mesh, self.layout))
            chunk = dataclasses.replace(chunk, data=data)
        elif self.publish is not None:
            raise ValueError("a multi-process engine inserts host chunks only")
        if self.groups.is_identity:
            self.cache = kvtransfer.insert(self.cache, chunk, tables.groups[0])
            return
        done = 0
        for group, row, count in self.groups.pieces(chunk.layer_start, chunk.num_layers):
            piece = dataclasses.replace(chunk, layer_start=row, data=chunk.data[done : done + count])
            self.cache = kvtransfer.insert(self.cache, piece, tables.groups[group])
            done += count

    # ---- compilation ----------------------------------------------------------------------------------
    def warmup(self, progress: bool = True) -> int:
        """Compiles every step, prompt-scores and sampler shape (and, with LoRA on, the adapter slot write);
        returns the number of those variants."""
        from tqdm import tqdm

        shapes = self.step_shapes()
        sampler_shapes = self.sampler_shapes()
        score_shapes = self.score_shapes()
        draft_shapes = self.draft_shapes()
        total = (
            len(shapes)
            + len(score_shapes)
            + len(sampler_shapes)
            + len(self.copy_shapes())
            + len(draft_shapes)
        )
        bar = tqdm(total=total, desc="compiling", disable=not progress, unit="shape")
        for shape in shapes:
            self._compile_step(shape[0])
            bar.update()
        for num_tokens in draft_shapes:
            self._compile_draft(num_tokens)
            bar.update()
        hidden_sharding = named(self.mesh)
        for num_tokens in score_shapes:  # ahead of time, as the steps
            hidden = jax.ShapeDtypeStruct(
                (num_tokens, self.model.hidden_size),
                jax.numpy.dtype(self.config.dtype),
                sharding=hidden_sharding,
            )
            self._scores.func.lower(
                self.weights, hidden, np.zeros(num_tokens, np.int32), **self._scores.keywords
            ).compile()
            bar.update()
        vocab = self.model.vocab_size
        for b, penalties in sampler_shapes:
            params = SamplingParams(temperature=1.0, repetition_penalty=1.1 if penalties else 1.0)
            logits = jax.device_put(np.zeros((b, vocab), np.float32), named(self.mesh))
            self.sample(logits, [SampleRow(params, 0, 0, [1], [])])
            bar.update()
        for size in self.copy_shapes():
            index = np.zeros(size, np.int32)  # (host arrays, as at run time: the same executable)
            _copy_blocks.lower(self.cache, index, index).compile()
            bar.update()
        if self.lora is not None:
            self.lora.warmup()  # the adapter slot write (a run-time load must not compile)
        if self.host is not None:
            total += self.host.warmup(self.cache)  # the tier's copies both ways
        bar.close()
        return total

    def _compile_step(self, num_tokens: int) -> None:
        """Compiles (or loads from the persistent cache) the step of this shape ahead of time: nothing
        runs, the cache is untouched, and a later step of that shape finds the executable."""
        lower_step(
            self.model,
            self.config,
            self.weights,
            self.lora_weights,
            self.cache,
            num_tokens,
            self.attention,
            self.aux_layers,
        ).compile()


def step_temps(
    model: ModelConfig,
    config: EngineConfig,
    mesh: Mesh,
    weights: Weights,
    lora_weights: LoraWeights | None,
    attention: AttentionFn,
) -> StepTemps:
    """The temporary bytes per device of the steps of `config` (its token budget, sequences and block
    tables) as a line in the cache's blocks, from XLA's memory analysis of the largest step compiled against
    caches of the same layout with one and two tables' width of blocks. Where they grow with the cache (a
    CPU converting a cache narrower than float32), the smallest step, whose line differs, is measured too
    and the larger of each term kept."""
    width = block_table_width(config)

    def line(num_tokens: int) -> StepTemps:
        one, two = (
            step_temp_bytes(model, config, mesh, weights, lora_weights, attention, blocks, num_tokens)
            for blocks in (width, 2 * width)
        )
        per_block = max(0, two - one) // width
        return StepTemps(max(0, one - per_block * width), per_block)

    largest = line(config.max_num_batched_tokens)
    # scoring a prompt's logprobs runs after the step, over its hidden states: its temporaries in turn
    hidden = jax.ShapeDtypeStruct(
        (config.max_num_batched_tokens, model.hidden_size),
        jax.numpy.dtype(config.dtype),
        sharding=named(mesh),
    )
    targets = np.zeros(config.max_num_batched_tokens, np.int32)
    scores = _jitted_scores.lower(weights, hidden, targets, cfg=model, num_top=max(config.max_logprobs, 1))
    analysis = scores.compile().memory_analysis()
    scoring = 0 if analysis is None else int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)
    largest = StepTemps(max(largest.base, scoring), largest.per_block)
    if not largest.per_block:
        return largest
    smallest = line(config.token_buckets[0])
    return StepTemps(max(largest.base, smallest.base), max(largest.per_block, smallest.per_block))


def step_temp_bytes(
    model: ModelConfig,
    config: EngineConfig,
    mesh: Mesh,
    weights: Weights,
    lora_weights: LoraWeights | None,
    attention: AttentionFn,
    num_blocks: int | None = None,
    num_tokens: int | None = None,
) -> int:
    """The temporary bytes per device of the step of `num_tokens` tokens (default: the largest) against a
    cache of `num_blocks` blocks (default: a table's width), and of its outputs other than the cache it
    updates (the logits), from XLA's memory analysis of it compiled ahead of time (nothing runs)."""
    small = dataclasses.replace(config, num_blocks=num_blocks or block_table_width(config))
    sharding = kvtransfer.cache_sharding(mesh, kv_cache.kv_layout(model, config))
    cache = jax.ShapeDtypeStruct(
        kv_cache.cache_shape(model, small), jax.numpy.dtype(config.cache_dtype), sharding=sharding
    )
    compiled = lower_step(
        model, small, weights, lora_weights, cache, num_tokens or config.max_num_batched_tokens, attention
    )
    analysis = compiled.compile().memory_analysis()
    if analysis is None:
        return 0
    outputs = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    return int(analysis.temp_size_in_bytes + max(0, outputs))


def lower_step(
    model: ModelConfig,
    config: EngineConfig,
    weights: Weights,
    lora_weights: LoraWeights | None,
    cache: jax.Array | jax.ShapeDtypeStruct,
    num_tokens: int,
    attention: AttentionFn,
    aux_layers: tuple[int, ...] = (),
) -> jax.stages.Lowered:
    """The step of `num_tokens` tokens (a token bucket) lowered for these weights and cache (an array, or
    only its shape, dtype and sharding: engine.memory profiles the largest step before the cache exists);
    `aux_layers`: a draft head's (forward_step's)."""
    num_seqs = config.seq_bucket(num_tokens)
    zeros = np.zeros
    return _jitted_step.lower(
        weights,
        lora_weights,
        cache,
        zeros(num_tokens, np.int32),
        zeros(num_seqs + 1, np.int32),
        zeros(num_seqs, np.int32),
        zeros((KVGroups.of(model).num_groups, num_seqs, block_table_width(config)), np.int32),
        np.full(num_seqs, -1, np.int32),
        zeros(config.logits_bucket(num_tokens), np.int32),
        cfg=model,
        attention=attention,
        aux_layers=aux_layers,
    )
