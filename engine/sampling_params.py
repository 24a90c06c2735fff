"""Per-request sampling parameters, validated at the door."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import numpy as np


class InvalidRequestError(ValueError):
    """A request field is out of range; `field` names it.

    `status` is the gRPC status name the services answer with (subclasses refine it)."""

    status = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What the output must match, token by token (engine.constraints): a JSON schema (`value`: its JSON
    text), any JSON object, a regex, a Lark grammar in llguidance's dialect, or one of `choices`."""

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()

    @property
    def fingerprint(self) -> str:
        """Names the constraint across processes (a prefill server and its decode server)."""
        text = json.dumps([self.kind, self.value, list(self.choices)], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def validate(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError("constraint", f"kind {self.kind!r}: one of {CONSTRAINT_KINDS}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                raise InvalidRequestError("constraint", f"json_schema is not JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError("constraint", "json_schema must be a JSON object")
        if self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequestError("constraint", f"{self.kind} must not be empty")
        if self.kind == "choice" and (not self.choices or not all(self.choices)):
            raise InvalidRequestError("constraint", "choice needs one or more non-empty strings")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature == 0 is greedy."""

    temperature: float = 1.0
    # Sequences generated from the prompt: one prefill, then its KV is forked (engine.core.scheduler);
    # sequence i samples with seed child_seed(seed, i)
    n: int = 1
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0  # the stop tokens (EOS, stop_token_ids) are held back until this many are out
    # (token id, bias) pairs: the bias, in [-100, 100], is added to the token's logit before sampling
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # only these may be sampled (empty: any)
    # Never generated: a word's last token is banned where the output ends with the tokens before it (each
    # word as it is and after a space, tokenized by the engine: Request.bad_word_ids), vLLM's bad_words
    bad_words: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per token (0: only the sampled token's)
    # top-n logprobs at each prompt position after the first (0: the prompt token's own), computed with the
    # prompt (every position: the prefix cache is not read for it)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # the text leaves out the model's special tokens (not its stop tokens)
    constraint: Constraint | None = None  # structured output (None: free text)
    # With a constraint: the tokens that end the model's reasoning (its `</think>`): the output is free until
    # it ends with them, then constrained (vLLM's structured outputs under a reasoning parser). Empty: the
    # constraint applies from the first token.
    reasoning_end: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_truncation(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    def validate(self, vocab_size: int | None = None, max_logprobs: int | None = None) -> None:
        """Raises InvalidRequestError naming the first bad field and its range (BOUNDS). Without
        `vocab_size` / `max_logprobs` (no engine yet, e.g. a command line checking its flags) the checks
        that need them are skipped."""
        for name, bound in BOUNDS.items():
            bound.check(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                Bound(0, max_logprobs if max_logprobs is not None else INT32_MAX).check(
                    name, getattr(self, name)
                )
        token_bound = Bound(0, (vocab_size or 2**31) - 1, what="token id")
        max_allowed = vocab_size or MAX_TOKEN_IDS  # (a list of distinct ids is never longer)
        if len(self.allowed_token_ids) > max_allowed:
            what = "the vocabulary's size" if vocab_size else "the limit"
            raise InvalidRequestError(
                "allowed_token_ids", f"{len(self.allowed_token_ids)} token ids: {what} is {max_allowed}"
            )
        if len(self.reasoning_end) > MAX_REASONING_END:
            raise InvalidRequestError("reasoning_end", f"at most {MAX_REASONING_END} tokens")
        for name in ("stop_token_ids", "allowed_token_ids", "reasoning_end"):
            check_token_ids(name, getattr(self, name), token_bound)
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise InvalidRequestError("bad_words", "bad words must be non-blank strings")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                "logit_bias", f"{len(self.logit_bias)} tokens: the limit is {MAX_LOGIT_BIAS}"
            )
        for token, bias in self.logit_bias:
            token_bound.check("logit_bias", token)
            Bound(-100.0, 100.0).check("logit_bias", bias)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.constraint is not None:
            self.constraint.validate()


INT32_MAX = 2**31 - 1
# The longest token-id list a request may carry in any field, checked before the list is read (the
# vocabulary bounds allowed_token_ids further: SamplingParams.validate); above any vocabulary served today
MAX_TOKEN_IDS = 262_144
MAX_REASONING_END = 16  # tokens of the marker that ends a reasoning section
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit); the sampler's columns for them
# Prompt logprobs of one request, prompt tokens x (prompt_logprobs + 1) x n: they travel in one message
# (the prefill server's trailer, each sequence's first response; about 15 bytes a position and 11 a top
# entry) and an HTTP answer repeats them for each of the n choices
MAX_PROMPT_LOGPROB_ENTRIES = 262_144


@dataclasses.dataclass(frozen=True)
class Bound:
    """The closed range [low, high] of one knob (`also`: values outside it that mean something, e.g. a
    temperature of 0 is greedy). An int knob must be an int, a float knob a finite number."""

    low: float
    high: float
    also: tuple = ()
    what: str = ""

    def check(self, field: str, value) -> None:
        if value in self.also and not isinstance(value, bool):
            return
        is_int = isinstance(self.low, int) and isinstance(self.high, int)
        kind_ok = not isinstance(value, bool) and isinstance(value, int if is_int else int | float)
        if not (kind_ok and math.isfinite(value) and self.low <= value <= self.high):
            also = "".join(f"{a!r} or " for a in self.also if a is not None)
            kind = "an int" if is_int else "a number"
            got = f"{self.what} {value!r}" if self.what else f"got {value!r}"
            raise InvalidRequestError(field, f"must be {also}{kind} in [{self.low}, {self.high}] ({got})")


# Each knob's range, from what it becomes on the device: top_k is an int32 column; the float knobs are
# float32 columns that the sampler divides by or multiplies with, so their lower ends keep float32 normal
# (never rounded to 0) and the products finite (a logit over a repetition penalty of 1e-46 is inf: NaN in
# the softmax). seed is two uint32 words; max_tokens is checked against the model length too (make_request);
# logprobs against the engine's max_logprobs and stop_token_ids against its vocabulary (validate).
BOUNDS: dict[str, Bound] = {
    "temperature": Bound(1e-6, 1e3, also=(0, 0.0)),
    "top_k": Bound(0, INT32_MAX),
    "top_p": Bound(1e-6, 1.0),
    "min_p": Bound(0.0, 1.0),
    "repetition_penalty": Bound(1e-2, 1e2),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "seed": Bound(0, 2**63 - 1, also=(None,)),
    "max_tokens": Bound(1, INT32_MAX),
    "min_tokens": Bound(0, INT32_MAX),
    "n": Bound(1, 256),  # and at most the engine's max_num_seqs (make_request): they decode together
}


def check_token_ids(field: str, ids, bound: Bound) -> None:
    """Every id of `ids` an int within `bound` (InvalidRequestError naming `field` and the first bad one),
    the range checked as one array (a list may hold a vocabulary's worth of ids)."""
    if not all(type(t) is int for t in ids):  # (a bool or a float: Bound names it)
        for token in ids:
            bound.check(field, token)
    if not ids:
        return
    try:
        values = np.fromiter(ids, np.int64, len(ids))
    except OverflowError:
        values = np.array([min(max(t, -(2**63)), 2**63 - 1) for t in ids], np.int64)
    bad = np.flatnonzero((values < bound.low) | (values > bound.high))
    if bad.size:
        bound.check(field, ids[int(bad[0])])


def child_seed(seed: int, index: int) -> int:
    """The seed of sequence `index` of a request with n > 1 whose resolved seed is `seed` (vLLM's seed +
    index: sequence 0 samples as the same request with n = 1 would)."""
    return (seed + index) % 2**63
