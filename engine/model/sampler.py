"""Token sampling on device: logit biases, allowed-token masks, penalties, temperature, min-p, top-k, top-p,
Gumbel-max, logprobs.

Randomness of a row comes from (seed, position) only: key = fold_in(key(seed), position). A request's
tokens therefore never depend on which other requests share its batch, or on which server sampled them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams

_NEG_INF = -jnp.inf


@dataclasses.dataclass
class SampleRow:
    """One token to sample: its request's parameters and seed, the position it is sampled at, the
    request's tokens so far (for penalties)."""

    params: SamplingParams
    seed: int
    position: int  # position of the token being sampled
    prompt_ids: list[int]
    output_ids: list[int]


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
    truncate: np.ndarray  # [B] bool: the row uses top-k, top-p or min-p
    logprobs: np.ndarray  # [B] bool: the row wants logprobs
    prompt_mask: np.ndarray | None  # [B, V] bool: token in prompt or output (repetition penalty)
    output_counts: np.ndarray | None  # [B, V] int32: occurrences in the output (presence/frequency)
    # [B, ceil(V / 32)] int32: bit t % 32 of word t // 32 allows token t (a constraint's mask, as
    # llguidance fills it); all ones for rows without a constraint
    allowed: np.ndarray
    # [B, MAX_LOGIT_BIAS] the tokens whose logits get a bias (V: none) and the biases (logit_bias)
    bias_ids: np.ndarray
    bias_values: np.ndarray

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
        allowed: np.ndarray | None = None,
    ) -> SamplingBatch:
        """`token_history` (prompt ids, output ids) per row is needed only when a row has penalties;
        `allowed`: the rows' allowed-token bitmasks (None: every token, every row)."""
        pad = batch - len(params)
        mask = np.full((batch, mask_words(vocab_size)), -1, np.int32)
        if allowed is not None:
            mask[: len(allowed)] = allowed

        def col(values, dtype, fill):
            return np.asarray(list(values) + [fill] * pad, dtype=dtype)

        seed_words = [(s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF) for s in seeds] + [(0, 0)] * pad
        bias_ids = np.full((batch, MAX_LOGIT_BIAS), vocab_size, np.int32)
        bias_values = np.zeros((batch, MAX_LOGIT_BIAS), np.float32)
        for row, p in enumerate(params):
            if p.logit_bias:
                ids, values = zip(*p.logit_bias, strict=True)
                bias_ids[row, : len(ids)], bias_values[row, : len(ids)] = ids, values
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
            truncate=col((p.needs_truncation for p in params), bool, False),
            logprobs=col((p.logprobs is not None for p in params), bool, False),
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            allowed=mask,
            bias_ids=bias_ids,
            bias_values=bias_values,
        )


def mask_words(vocab_size: int) -> int:
    """32-bit words of one row's allowed-token bitmask."""
    return -(-vocab_size // 32)


def token_mask(token_ids, vocab_size: int) -> np.ndarray:
    """The bitmask (int32 words) that allows exactly `token_ids`."""
    ids = np.asarray(list(token_ids), np.int64)
    words = np.zeros(mask_words(vocab_size), np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(1, ids % 32).astype(np.uint32))
    return words.view(np.int32)


def _allowed_tokens(words: jax.Array, vocab: int) -> jax.Array:
    """[B, W] int32 bitmasks -> [B, vocab] bool."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab] != 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleResult:
    tokens: jax.Array  # [B] int32
    logprob: jax.Array  # [B] float32, of the sampled token under the model's distribution
    top_ids: jax.Array  # [B, n] int32 (n = 0 when logprobs were not asked for)
    top_logprobs: jax.Array  # [B, n] float32


MAX_TOP_K = 256  # top-k and top-p look at this many most likely tokens (see `_truncate`)


def _apply_penalties(logits: jax.Array, s: SamplingBatch) -> jax.Array:
    rep = s.repetition_penalty[:, None]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(s.prompt_mask, penalized, logits)
    counts = s.output_counts.astype(jnp.float32)
    logits = logits - s.frequency_penalty[:, None] * counts
    return logits - s.presence_penalty[:, None] * (counts > 0)


def _truncate(logits: jax.Array, s: SamplingBatch) -> jax.Array:
    """Masks tokens outside min-p, top-k and top-p (logits already divided by temperature).

    Thresholds come from the MAX_TOP_K most likely tokens: top_k is capped at MAX_TOP_K, and when those
    tokens hold less than top_p of the mass, the nucleus is not cut at all (it would keep more than
    MAX_TOP_K tokens anyway). A row without these options is left untouched, so its tokens do not
    depend on whether its batch needed this function.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    max_prob = jnp.max(probs, axis=-1, keepdims=True)
    logits = jnp.where(probs < s.min_p[:, None] * max_prob, _NEG_INF, logits)
    max_k = min(MAX_TOP_K, logits.shape[-1])
    top_logits, _ = jax.lax.top_k(logits, max_k)  # [B, K] descending
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, max_k), max_k)
    kth = jnp.take_along_axis(top_logits, (k - 1)[:, None], axis=-1)
    kth = jnp.where((s.top_k > 0)[:, None], kth, _NEG_INF)
    top_probs = jnp.exp(top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    mass_before = jnp.cumsum(top_probs, axis=-1) - top_probs  # token i stays if the mass before it < top_p
    keep = mass_before < s.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, top_logits, jnp.inf), axis=-1, keepdims=True)
    reached = jnp.sum(top_probs, axis=-1, keepdims=True) >= s.top_p[:, None]
    cutoff = jnp.where(reached & (s.top_p < 1.0)[:, None], cutoff, _NEG_INF)
    return jnp.where((logits < cutoff) | (logits < kth), _NEG_INF, logits)


def _argmax(x: jax.Array) -> jax.Array:
    """First index of the maximum along the last axis, as jnp.argmax, but as max + compare + min.

    XLA:CPU fuses jnp.argmax's variadic reduction with whatever produces its input into one scalar loop;
    over [32, 49152] noisy logits that is 5x slower than these two vectorized reductions.
    """
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), index, x.shape[-1]), axis=-1)


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection that mixes every input bit into every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _gumbel_noise(s: SamplingBatch, vocab: int) -> jax.Array:
    """[B, V] Gumbel noise, a counter-based hash of (seed, position, token id) per element.

    Threefry over the whole vocabulary costs more than the model's decode step at batch 32 on CPU; the
    row key still comes from threefry (seed words, position), each element from two rounds of fmix32.
    """

    def row_key(words, position):  # seed (two 32-bit words) and position -> two 32-bit words
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(words[0]), words[1]), position)
        return jax.random.key_data(key)

    row_key = jax.vmap(row_key)(s.seed, s.position)  # [B, 2] uint32
    index = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
    bits = _fmix32(_fmix32(index * jnp.uint32(0x9E3779B1) + row_key[:, :1]) ^ row_key[:, 1:])
    uniform = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -jnp.log(-jnp.log(uniform))


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample(logits: jax.Array, s: SamplingBatch, *, num_logprobs: int) -> SampleResult:
    """Samples one token per row of `s` from `logits` [B, V].

    Truncation (top-k, top-p, min-p) and logprobs run only when some row asks for them, branches taken
    at run time, so one compiled variant serves every mix (penalties, which need the token history
    arrays, are the one variant: `s.prompt_mask` None or not). `num_logprobs`: how many top logprobs a
    row may ask for (0: none); they are returned for every row, zeros when no row asked. No branch
    changes any row's token.
    """
    logits = logits[s.logits_row]
    raw = logits  # logprobs are the model's own, before any bias, mask or penalty
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, s.bias_ids].add(s.bias_values, mode="drop")  # (V: dropped)
    logits = jnp.where(_allowed_tokens(s.allowed, logits.shape[-1]), logits, _NEG_INF)
    if s.prompt_mask is not None:
        logits = _apply_penalties(logits, s)
    greedy = _argmax(logits)

    def draw(logits):
        temperature = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
        scaled = logits / temperature
        scaled = jax.lax.cond(jnp.any(s.truncate), lambda x: _truncate(x, s), lambda x: x, scaled)
        return _argmax(scaled + _gumbel_noise(s, logits.shape[-1]))

    sampled = jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda _: greedy, logits)
    tokens = jnp.where(s.temperature > 0, sampled, greedy)
    batch = logits.shape[0]

    def logprobs(raw):
        model_logprobs = jax.nn.log_softmax(raw, axis=-1)
        chosen = jnp.take_along_axis(model_logprobs, tokens[:, None], axis=-1)[:, 0]
        top_logprobs, top_ids = jax.lax.top_k(model_logprobs, num_logprobs)
        return chosen, top_ids.astype(jnp.int32), top_logprobs

    def none(raw):
        return (
            jnp.zeros((batch,), jnp.float32),
            jnp.zeros((batch, num_logprobs), jnp.int32),
            jnp.zeros((batch, num_logprobs), jnp.float32),
        )

    chosen, top_ids, top_logprobs = (
        jax.lax.cond(jnp.any(s.logprobs), logprobs, none, raw) if num_logprobs else none(raw)
    )
    return SampleResult(tokens, chosen, top_ids, top_logprobs)
