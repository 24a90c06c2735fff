"""The device programs an engine runs, and their compilation ahead of time.

The jitted programs (the ragged step, an EAGLE-3 head's pass, prompt scores, block copies) are defined
once per process here: runners of the same model and shapes (tests, the colocated `serve` shape) reuse
each other's compilations. Every shape the runner feeds them comes from a fixed set of buckets
(EngineConfig), all compiled by `warmup()`: steady serving compiles nothing new. engine.memory sizes the
KV cache from the largest step's temporaries (`step_temps`), measured by compiling it before the cache
exists.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import numpy as np
from jax.sharding import Mesh

from pdserve import kvtransfer
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.kv_groups import KVGroups
from pdserve.engine.memory import StepTemps
from pdserve.engine.model import kv_cache
from pdserve.engine.model.attention import AttentionFn, block_table_width
from pdserve.engine.model.eagle3 import draft_step
from pdserve.engine.model.forward import forward_step, prompt_scores
from pdserve.engine.model.lora import LoraWeights
from pdserve.engine.model.sampler import SampleRow
from pdserve.engine.model.sharding import named
from pdserve.engine.model.weights import Weights
from pdserve.engine.sampling_params import SamplingParams

# One jitted step shared by every runner of the process: runners of the same model and shapes (tests,
# the colocated `serve` shape) reuse each other's compilations. The cache keeps its input sharding.
jitted_step = jax.jit(
    forward_step, static_argnames=("cfg", "attention", "aux_layers"), donate_argnames=("cache",)
)
jitted_draft = jax.jit(
    draft_step,
    static_argnames=("cfg", "row", "num_drafts", "attention", "norm_before_residual"),
    donate_argnames=("cache",),
)
jitted_scores = jax.jit(prompt_scores, static_argnames=("cfg", "num_top"))
# Block copies (a forked sequence's own copy of its parent's partial block) go in padded batches of these
COPY_BUCKETS = (4, 16, 64)


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_blocks_program(cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Every row's block src[i] copied onto block dst[i] (padding repeats a pair: the same write twice)."""
    return cache.at[:, dst].set(cache[:, src])


class RunnerCompilation:
    """ModelRunner's shapes and ahead-of-time compilation (mixed into it: it uses the runner's config,
    weights, cache and mesh)."""

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
        jitted_draft.lower(
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
        logits_shardings = {}  # a step's logits rows -> the sharding XLA gave them (TP: split over vocab)
        for shape in shapes:
            compiled = self._compile_step(shape[0])
            logits_shardings[self.config.logits_bucket(shape[0])] = compiled.output_shardings[0]
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
            logits = jax.device_put(np.zeros((b, vocab), np.float32), logits_shardings[b])
            self.sample(logits, [SampleRow(params, 0, 0, [1], [])])
            bar.update()
        for size in self.copy_shapes():
            index = np.zeros(size, np.int32)  # (host arrays, as at run time: the same executable)
            copy_blocks_program.lower(self.cache, index, index).compile()
            bar.update()
        if self.lora is not None:
            self.lora.warmup()  # the adapter slot write (a run-time load must not compile)
        bar.close()
        return total

    def _compile_step(self, num_tokens: int) -> jax.stages.Compiled:
        """Compiles (or loads from the persistent cache) the step of this shape ahead of time: nothing
        runs, the cache is untouched, and a later step of that shape finds the executable."""
        return lower_step(
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
    scores = jitted_scores.lower(weights, hidden, targets, cfg=model, num_top=max(config.max_logprobs, 1))
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
    return jitted_step.lower(
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
