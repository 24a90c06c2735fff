"""The model runner: host batches -> padded, bucketed device arrays -> compiled steps -> sampled tokens.

It owns one engine's weights, KV cache and device programs on one mesh, and runs what the engine asks:
a step, an EAGLE-3 head's pass, prompt scores, sampling, block copies. Every shape it feeds the device
comes from a fixed set of buckets (EngineConfig), all compiled by `warmup()` (engine.compilation: the
programs, their shapes, their compilation ahead of time); its KV reads and writes for transfers are
engine.kv_io's. In a multi-process engine each device operation is published first (engine.multihost).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from pdserve.engine import multihost
from pdserve.engine.compilation import (
    COPY_BUCKETS,
    RunnerCompilation,
    copy_blocks_program,
    jitted_draft,
    jitted_scores,
    jitted_step,
)
from pdserve.engine.config import EngineConfig, ModelConfig, bucket_for
from pdserve.engine.core.kv_groups import KVGroups
from pdserve.engine.core.scheduler import Row
from pdserve.engine.host_kv import padded_pair_batches
from pdserve.engine.kv_io import RunnerKVIO
from pdserve.engine.lora_slots import LoraSlots
from pdserve.engine.memory import MemoryPlan
from pdserve.engine.model import kv_cache
from pdserve.engine.model.attention import AttentionFn, block_table_width, ragged_paged_attention_reference
from pdserve.engine.model.eagle3 import DraftModel
from pdserve.engine.model.kv_cache import allocate_cache
from pdserve.engine.model.lora import LoraWeights
from pdserve.engine.model.sampler import SampleResult, SampleRow, SamplingBatch, sample
from pdserve.engine.model.sharding import named
from pdserve.engine.model.weights import Weights
from pdserve.engine.multihost import DeviceOp, Publish

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PromptScores:
    """prompt_scores' results on the host, one row per token of the step: the target's logprob and rank,
    the top ids and logprobs (max_logprobs of them)."""

    logprob: np.ndarray
    rank: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class ModelRunner(RunnerCompilation, RunnerKVIO):
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
        # the compiled step of this model and attention (what run_step calls; bench_step_host times it)
        self.step_program = functools.partial(
            jitted_step, cfg=model, attention=attention, aux_layers=self.aux_layers
        )
        self._replicated = jax.jit(lambda x: x, out_shardings=named(mesh))
        # The leader of a multi-process engine hands each device operation here before running it
        # (engine.multihost); None: single process, or a follower.
        self.publish: Publish | None = None
        self.memory: MemoryPlan | None = None  # how the cache was sized (engine.memory; set by its builder)
        self.hidden: jax.Array | None = None  # the last step's final hidden states (prompt_scores reads)
        self.aux: jax.Array | None = None  # the last step's aux states (with a draft head: run_draft reads)
        self._scores = functools.partial(jitted_scores, cfg=model, num_top=max(config.max_logprobs, 1))

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
        logits, self.cache, self.hidden, self.aux = self.step_program(
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
        drafts, self.cache = jitted_draft(
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
        self.cache = copy_blocks_program(self.cache, src, dst)
