"""Per-request sampling parameters, validated at the door."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math


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
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per token (0: only the sampled token's)
    skip_special_tokens: bool = True  # the text leaves out the model's special tokens (not its stop tokens)
    constraint: Constraint | None = None  # structured output (None: free text)

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
        """Raises InvalidRequestError naming the first bad field. Without `vocab_size` / `max_logprobs`
        (no engine yet, e.g. a command line checking its flags) the checks that need them are skipped."""

        def check(ok: bool, field: str, message: str):
            if not ok:
                raise InvalidRequestError(field, message)

        check(
            math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be finite, >= 0"
        )
        check(self.top_k >= 0, "top_k", "must be >= 0")
        check(math.isfinite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(math.isfinite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be finite, > 0",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(math.isfinite(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")
        check(
            all(0 <= t < (vocab_size or 2**31) for t in self.stop_token_ids),
            "stop_token_ids",
            "outside the vocabulary",
        )
        check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        check(
            self.logprobs is None
            or 0 <= self.logprobs <= (max_logprobs if max_logprobs is not None else 2**31),
            "logprobs",
            f"must be in [0, {max_logprobs}]",
        )
        if self.constraint is not None:
            self.constraint.validate()
