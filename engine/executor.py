"""One scheduled step on the device, and its logits turned into each sampling row's run of tokens.

`StepExecutor.execute(scheduled)` runs the rows (ModelRunner.forward), scores the prompt positions of
requests that ask for prompt logprobs, builds each sample's allowed-token mask (engine.token_masks) while
the device computes, samples, accepts drafts (engine.core.speculation.accept) and advances constraints.
It returns plain SampledToken runs for Scheduler.update_from_output: it changes no request's progress
(prompt logprobs and a constraint's matcher, which only sampling moves, excepted).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from pdserve.engine.config import bucket_for
from pdserve.engine.core.request import FinishReason, Request, TokenLogprobs
from pdserve.engine.core.scheduler import SampledToken, Scheduler, SchedulerOutput
from pdserve.engine.core.speculation import accept
from pdserve.engine.model.sampler import SampleResult, SampleRow
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.token_masks import TokenMasks

log = logging.getLogger(__name__)


class StepExecutor:
    """Runs the steps of one engine (its runner, its scheduler's requests, its token masks)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, masks: TokenMasks):
        self.runner = runner
        self.scheduler = scheduler
        self.masks = masks

    def execute(self, scheduled: SchedulerOutput) -> dict[str, list[SampledToken]]:
        """Runs the step's rows; scores the prompt tokens of requests that ask for prompt logprobs; samples
        the rows that end their request's uncomputed tokens (a row with drafts: after its last token and
        after each draft, then engine.core.speculation.accept). Returns each sampling row's run of tokens;
        a request's first token with n > 1 carries its other sequences (Request.fork) and theirs."""
        logits = self.runner.forward(scheduled.rows)
        self._score_prompts(scheduled)
        starts = scheduled.logits_starts()
        # one sample per logits row of a sampling row: (request, the drafts before it, its logits row)
        samples: list[tuple[Request, list[int], int]] = []
        runs: dict[str, list[int]] = {}  # request id -> indices of its samples, by position
        forked: dict[str, list[Request]] = {}  # a first token with n > 1: n samples of the same logits
        for row, start in zip(scheduled.rows, starts, strict=True):
            if not row.samples:
                continue
            request = self.scheduler.requests[row.request_id]
            runs[request.request_id] = list(range(len(samples), len(samples) + row.num_logits))
            samples += [(request, row.drafts[:j], start + j) for j in range(row.num_logits)]
            if request.forks_pending:
                forked[request.request_id] = self.forks(request)
                for child in forked[request.request_id]:
                    runs[child.request_id] = [len(samples)]
                    samples.append((child, [], start))
        if not samples:
            return {}
        sample_rows = [
            SampleRow(r.params, r.seed, r.num_tokens + len(d), r.prompt_ids, r.output_ids + d)
            for r, d, _ in samples
        ]
        allowed = self.masks.allowed([(r, d) for r, d, _ in samples])  # on the host while the device runs
        result = self.runner.sample(logits, sample_rows, [i for _, _, i in samples], allowed)
        out = {}
        for rid, indices in runs.items():
            request, drafts = samples[indices[0]][0], samples[indices[-1]][1]
            emitted = accept(drafts, result.tokens[indices].tolist())
            out[rid] = self._sampled_run(request, emitted, result, indices, allowed)
        for rid, children in forked.items():
            forks = tuple((c, out.pop(c.request_id)[0]) for c in children)
            out[rid][0] = dataclasses.replace(out[rid][0], forks=forks)
        return out

    def forks(self, request: Request) -> list[Request]:
        """Sequences 1..n-1 of a request about to take its first token, each with its own matcher; the
        scheduler adopts them with their first tokens."""
        return [request.fork(index, self.masks.matcher(request)) for index in range(1, request.params.n)]

    def _sampled_run(
        self,
        request: Request,
        emitted: list[int],
        result: SampleResult,
        indices: list[int],
        allowed: np.ndarray | None,
    ) -> list[SampledToken]:
        """The tokens a sampling row emits (`emitted`: its i-th from sample indices[i]) through the
        request's constraint, with their logprobs: up to one the constraint ends the request at."""
        run = []
        for token, i in zip(emitted, indices, strict=False):
            logprobs, finish = None, None
            try:
                token, finish = self.masks.advance(request, token, None if allowed is None else allowed[i])
                if request.params.logprobs is not None:
                    n = request.params.logprobs
                    top = list(
                        zip(result.top_ids[i, :n].tolist(), result.top_logprobs[i, :n].tolist(), strict=True)
                    )
                    logprobs = TokenLogprobs(token, float(result.logprob[i]), top)
            except Exception as e:  # noqa: BLE001 - pinned to this request
                run.append(SampledToken(token, None, FinishReason.ERROR, failure(request, "sampling", e)))
                return run
            run.append(SampledToken(token, logprobs, finish))
            if finish is not None:
                return run
        return run

    def _score_prompts(self, scheduled: SchedulerOutput) -> None:
        """The step's prompt positions of requests with prompt_logprobs: each position's logits score the
        prompt's next token (Request.prompt_logprobs[p + 1]), with its rank and the top n."""
        targets, places, start = None, [], 0
        for row in scheduled.rows:
            request = self.scheduler.requests[row.request_id]
            prompt = request.prompt_ids
            if request.prompt_logprobs is not None and row.num_past < len(prompt) - 1:
                if targets is None:
                    num_tokens = sum(len(r.tokens) for r in scheduled.rows)  # padded as the step was
                    targets = np.full(bucket_for(num_tokens, self.runner.config.token_buckets), -1, np.int32)
                for j in range(min(len(row.tokens), len(prompt) - 1 - row.num_past)):
                    targets[start + j] = prompt[row.num_past + j + 1]
                    places.append((request, row.num_past + j + 1, start + j))
            start += len(row.tokens)
        if targets is None:
            return
        scores = self.runner.prompt_scores(targets)
        for request, position, i in places:
            n = request.params.prompt_logprobs
            top = list(zip(scores.top_ids[i, :n].tolist(), scores.top_logprobs[i, :n].tolist(), strict=True))
            logprob, rank = float(scores.logprob[i]), int(scores.rank[i])
            request.prompt_logprobs[position] = TokenLogprobs(int(targets[i]), logprob, top, rank)


def failure(request: Request, what: str, error: Exception) -> str:
    """A failure pinned to one request (its matcher, its detokenizer, its stop strings): logged; the text
    its FinishReason.ERROR carries. The batch goes on."""
    log.exception("%s failed", what, extra={"request_id": request.request_id})
    return f"{what}: {type(error).__name__}: {error}"
