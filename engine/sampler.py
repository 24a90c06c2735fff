"""Token sampling on device: penalties, temperature, min-p, top-k, top-p, Gumbel-max, logprobs.

Randomness of a row comes from (seed, position) only: key = fold_in(key(seed), position). A request's
tokens therefore never depend on which other requests share its batch, or on which server sampled them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.sampling_params import SamplingParams

_NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling inputs, host-built, padded to the batch bucket."""

    logits_row: np.ndarray  # [B] int32: the row of the step's logits this row samples from
    temperature: np.ndarray  # [B] float32, 0 for greedy
    top_k: np.ndarray  # [B] int32, 0 off
    top_p: np.ndarray  # [B] float32
    min_p: np.ndarray  # [B] float32
    seed: np.ndarray  # [B] uint32 x2 packed as [B, 2]
    position: np.ndarray  # [B] int32, position of the token being sampled
    repetition_penalty: np.ndarray  # [B] float32
    presence_penalty: np.ndarray  # [B] float32
    frequency_penalty: np.ndarray  # [B] float32
    prompt_mask: np.ndarray | None  # [B, V] bool: token in prompt or output (repetition penalty)
    output_counts: np.ndarray | None  # [B, V] int32: occurrences in the output (presence/frequency)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        logits_rows: list[int],
        seeds: list[int],
        positions: list[int],
        token_history: list[tuple[list[int], list[int]]] | None,
        batch: int,
        vocab_size: int,
    ) -> SamplingBatch:
        """`token_history` (prompt ids, output ids) per row is needed only when a row has penalties."""
        pad = batch - len(params)

        def col(values, dtype, fill):
            return np.asarray(list(values) + [fill] * pad, dtype=dtype)

        seed_words = [(s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF) for s in seeds] + [(0, 0)] * pad
        prompt_mask = output_counts = None
        if token_history is not None:
            prompt_mask = np.zeros((batch, vocab_size), bool)
            output_counts = np.zeros((batch, vocab_size), np.int32)
            for row, (prompt, output) in enumerate(token_history):
                prompt_mask[row, prompt] = True
                prompt_mask[row, output] = True
                np.add.at(output_counts[row], output, 1)
        return cls(
            logits_row=col(logits_rows, np.int32, 0),
            temperature=col((p.temperature for p in params), np.float32, 0.0),
            top_k=col((p.top_k for p in params), np.int32, 0),
            top_p=col((p.top_p for p in params), np.float32, 1.0),
            min_p=col((p.min_p for p in params), np.float32, 0.0),
            seed=np.asarray(seed_words, dtype=np.uint32),
            position=col(positions, np.int32, 0),
            repetition_penalty=col((p.repetition_penalty for p in params), np.float32, 1.0),
            presence_penalty=col((p.presence_penalty for p in params), np.float32, 0.0),
            frequency_penalty=col((p.frequency_penalty for p in params), np.float32, 0.0),
            prompt_mask=prompt_mask,
            output_counts=output_counts,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleResult:
    tokens: jax.Array  # [B] int32
    logprob: jax.Array  # [B] float32, of the sampled token under the model's distribution
    top_ids: jax.Array  # [B, n] int32 (n = 0 when logprobs were not asked for)
    top_logprobs: jax.Array  # [B, n] float32


def _apply_penalties(logits: jax.Array, s: SamplingBatch) -> jax.Array:
    rep = s.repetition_penalty[:, None]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(s.prompt_mask, penalized, logits)
    counts = s.output_counts.astype(jnp.float32)
    logits = logits - s.frequency_penalty[:, None] * counts
    return logits - s.presence_penalty[:, None] * (counts > 0)


def _truncate(logits: jax.Array, s: SamplingBatch, sort: bool) -> jax.Array:
    """Masks tokens outside min-p, top-k and top-p (logits already divided by temperature)."""
    probs = jax.nn.softmax(logits, axis=-1)
    max_prob = jnp.max(probs, axis=-1, keepdims=True)
    logits = jnp.where(probs < s.min_p[:, None] * max_prob, _NEG_INF, logits)
    if not sort:
        return logits
    sorted_logits = -jnp.sort(-logits, axis=-1)  # descending
    vocab = logits.shape[-1]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    # keep the smallest prefix whose mass reaches top_p: token i stays if the mass before it < top_p
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = (mass_before < s.top_p[:, None]) & (jnp.arange(vocab)[None] < k[:, None])
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((logits < cutoff) | (logits < kth), _NEG_INF, logits)


def _row_keys(s: SamplingBatch) -> jax.Array:
    def one(words, position):
        key = jax.random.key(words[0])
        key = jax.random.fold_in(key, words[1])
        return jax.random.fold_in(key, position)

    return jax.vmap(one)(s.seed, s.position)


@functools.partial(jax.jit, static_argnames=("sort", "num_logprobs"))
def sample(logits: jax.Array, s: SamplingBatch, *, sort: bool, num_logprobs: int) -> SampleResult:
    """Samples one token per row of `s` from `logits` [B, V]. Static flags pick the compiled variant."""
    logits = logits[s.logits_row]
    model_logprobs = jax.nn.log_softmax(logits, axis=-1)
    if s.prompt_mask is not None:
        logits = _apply_penalties(logits, s)
    greedy = jnp.argmax(logits, axis=-1)
    temperature = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    scaled = _truncate(logits / temperature, s, sort)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (logits.shape[-1],)))(_row_keys(s))
    sampled = jnp.argmax(scaled + gumbel, axis=-1)
    tokens = jnp.where(s.temperature > 0, sampled, greedy).astype(jnp.int32)
    chosen = jnp.take_along_axis(model_logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(model_logprobs, num_logprobs)
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SampleResult(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)
