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
    # The request's first output, with SamplingParams.prompt_logprobs: an entry per prompt position (None
    # at the first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    queue_s: float | None = None  # the first output's: seconds from arrival to admission (vLLM's queue time)
    index: int = 0  # which of the request's n sequences (SamplingParams.n) this output continues

    @classmethod
    def failed(cls, request: Request) -> RequestOutput:
        """The last output of a request the engine failed on (FinishReason.ERROR, `request.error`)."""
        return cls(
            request.output_id,
            [],
            "",
            finished=True,
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=len(request.output_ids),
            error=request.error,
            index=request.index,
        )


class OutputStream:
    """Per-request detokenizer and stop-string matcher: the client's view of each token. The scheduler
    decides every finish; a stop string found here is reported to it (the output says STOP first)."""

    def __init__(self, request: Request, tokenizer: Tokenizer):
        self.request = request
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.params.skip_special_tokens)
        self.matcher = StopStringMatcher(request.params.stop)

    def on_token(self, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        """The client's view of a sampled token (already appended to the request, which may have finished
        with it). A stop token or a constraint's dead end shows nothing; a stop string cuts the text and
        finishes the output with STOP (the caller tells the scheduler), once the output is past its
        min_tokens (text before that is never matched)."""
        r = self.request
        text = ""
        if token not in r.stop_token_ids and r.finish_reason is not FinishReason.DEAD_END:
            delta = self.detokenizer.add(token)  # stop strings count only past min_tokens (as vLLM's)
            text = delta if len(r.output_ids) <= r.params.min_tokens else self.matcher.feed(delta)
        finish_reason = r.finish_reason
        if self.matcher.stopped and finish_reason in (None, FinishReason.LENGTH):  # the text ends here
            finish_reason = FinishReason.STOP
        if finish_reason is not None and not self.matcher.stopped:
            text += self.matcher.feed(self.detokenizer.finish()) + self.matcher.flush()
        return RequestOutput(
            request_id=r.output_id,
            index=r.index,
            new_token_ids=[token],
            text=text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            logprobs=[logprobs] if logprobs is not None else [],
            num_prompt_tokens=len(r.prompt_ids),
            num_output_tokens=len(r.output_ids),
            num_cached_tokens=r.num_cached_tokens,
            prompt_logprobs=r.prompt_logprobs if len(r.output_ids) == 1 else None,
            queue_s=r.scheduled_time - r.arrival_time
            if len(r.output_ids) == 1 and r.scheduled_time is not None
            else None,
        )
