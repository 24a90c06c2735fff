"""Turning sampled tokens into what a client sees: text deltas, stop conditions, finish reasons."""

from __future__ import annotations

import dataclasses

from pdserve.engine.core.request import FinishReason, Request, TokenLogprobs
from pdserve.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text: str  # delta
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed for this request)
    error: str = ""  # with FinishReason.ERROR: what failed

    @classmethod
    def failed(cls, request: Request) -> RequestOutput:
        """The last output of a request the engine failed on (FinishReason.ERROR, `request.error`)."""
        return cls(
            request.request_id,
            [],
            "",
            finished=True,
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=len(request.output_ids),
            error=request.error,
        )


class OutputStream:
    """Per-request detokenizer and stop-string matcher; decides when the request is done."""

    def __init__(self, request: Request, tokenizer: Tokenizer, max_model_len: int):
        self.request = request
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.params.skip_special_tokens)
        self.matcher = StopStringMatcher(request.params.stop)
        self.stop_ids = set(request.params.stop_token_ids)
        if not request.params.ignore_eos:
            self.stop_ids |= tokenizer.eos_token_ids
        self.max_model_len = max_model_len

    def on_token(self, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        """The client's view of a sampled token (already appended to the request by the scheduler); sets
        the request's finish reason when it ends the request."""
        r = self.request
        text = ""
        if token in self.stop_ids or r.finish_reason is FinishReason.DEAD_END:  # shows nothing
            r.finish_reason = r.finish_reason or FinishReason.STOP
        else:
            text = self.matcher.feed(self.detokenizer.add(token))
            if self.matcher.stopped:
                r.finish_reason = FinishReason.STOP
            elif len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                r.finish_reason = FinishReason.LENGTH
        if r.finish_reason is not None and not self.matcher.stopped:
            text += self.matcher.feed(self.detokenizer.finish()) + self.matcher.flush()
        return RequestOutput(
            request_id=r.request_id,
            new_token_ids=[token],
            text=text,
            finished=r.finish_reason is not None,
            finish_reason=r.finish_reason,
            logprobs=[logprobs] if logprobs is not None else [],
            num_prompt_tokens=len(r.prompt_ids),
            num_output_tokens=len(r.output_ids),
            num_cached_tokens=r.num_cached_tokens,
        )
