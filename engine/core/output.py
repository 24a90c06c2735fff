"""Turning sampled tokens into what a client sees: text deltas, stop conditions, finish reasons."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

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
    # A prefill server's last output, with an EAGLE-3 head: the head's input at the prompt's last position
    # (Request.draft_aux), which the trailer carries to the decode server
    draft_aux: Any = None

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
        self._replay(request.output_ids[: request.num_resumed])

    def _replay(self, tokens: list[int]) -> None:
        """A resumed request's output from elsewhere (Request.num_resumed), taken in as it was shown: the
        detokenizer and the stop-string matcher stand where they stood after it (the text a partial stop
        string held back is still held), and nothing of it is shown again."""
        for i, token in enumerate(tokens, 1):
            delta = self.detokenizer.add(token)
            if i > self.request.params.min_tokens:
                self.matcher.feed(delta)

    @property
    def stopped(self) -> bool:
        """A stop string has matched (in the output so far, resumed tokens included)."""
        return self.matcher.stopped

    def on_tokens(self, tokens: list[int], logprobs: list[TokenLogprobs | None]) -> RequestOutput:
        """The client's view of the tokens a step appended to the request (one, or a run of accepted
        drafts and the next; the request may have finished with the last). A stop token or a constraint's
        dead end shows nothing; a stop string cuts the text and finishes the output with STOP at the token
        that completed it (num_output_tokens says where: the caller tells the scheduler), once the output
        is past its min_tokens (text before that is never matched)."""
        r = self.request
        first = len(r.output_ids) - len(tokens)  # index of tokens[0] in the output
        text, shown = "", 0
        for token in tokens:
            shown += 1
            last = shown == len(tokens)
            if token in r.stop_token_ids or (last and r.finish_reason is FinishReason.DEAD_END):
                continue
            delta = self.detokenizer.add(token)  # stop strings count only past min_tokens (as vLLM's)
            text += delta if first + shown <= r.params.min_tokens else self.matcher.feed(delta)
            if self.matcher.stopped:
                break
        finish_reason = r.finish_reason if shown == len(tokens) else None
        if self.matcher.stopped and finish_reason in (None, FinishReason.LENGTH):  # the text ends here
            finish_reason = FinishReason.STOP
        if finish_reason is not None and not self.matcher.stopped:
            text += self.matcher.feed(self.detokenizer.finish()) + self.matcher.flush()
        return RequestOutput(
            request_id=r.output_id,
            index=r.index,
            new_token_ids=tokens[:shown],
            text=text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            logprobs=[lp for lp in logprobs[:shown] if lp is not None],
            num_prompt_tokens=len(r.prompt_ids),
            num_output_tokens=first + shown,
            num_cached_tokens=r.num_cached_tokens,
            prompt_logprobs=r.prompt_logprobs if first == r.num_resumed else None,
            queue_s=r.scheduled_time - r.arrival_time
            if first == r.num_resumed and r.scheduled_time is not None
            else None,
        )


class OutputStreams:
    """Every request's OutputStream (made at its first tokens), and the outputs produced since the engine
    last took them: the scheduler's output sink (engine.core.scheduler.OutputSink)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._streams: dict[str, OutputStream] = {}
        self._outputs: list[tuple[Request, RequestOutput]] = []

    def open(self, request: Request, stream: OutputStream | None = None) -> OutputStream:
        """The request's stream, made now if it has none (`stream`: this one, in place of any)."""
        if stream is not None or request.request_id not in self._streams:
            self._streams[request.request_id] = stream or OutputStream(request, self.tokenizer)
        return self._streams[request.request_id]

    def view(self, request: Request, run) -> RequestOutput:
        """The client's view of the run of tokens (engine.core.scheduler.SampledToken) just appended."""
        return self.open(request).on_tokens([t.token for t in run], [t.logprobs for t in run])

    def put(self, request: Request, output: RequestOutput) -> None:
        """An output to hand out; a finished request's stream ends."""
        if output.finished:
            self._streams.pop(request.request_id, None)
        self._outputs.append((request, output))

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forgets these requests' streams (aborted)."""
        for request_id in request_ids:
            self._streams.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        """Outputs put and not yet taken."""
        return len(self._outputs)

    def discard(self, output_ids: Iterable[str], since: int = 0) -> None:
        """Forgets these requests' outputs put since `since` (num_pending then) and not yet taken: a
        failed step's, which it reports failed instead."""
        ids = set(output_ids)
        kept = self._outputs[since:]
        self._outputs[since:] = [(r, o) for r, o in kept if o.request_id not in ids]

    def take(self) -> list[RequestOutput]:
        """The outputs put since the last call, in order; a finished one carries its request's draft
        head input (Request.draft_aux, a prefill server's, for its trailer: engine.draft_runner)."""
        outputs, self._outputs = self._outputs, []
        for request, output in outputs:
            if output.finished:
                output.draft_aux = request.draft_aux
        return [output for _, output in outputs]
