"""EAGLE-3 drafting between the engine's steps: which positions the draft head catches up on, and the
drafts it leaves for the scheduler (engine.model.eagle3 runs it on the device).

After each step, every row whose request is still running (or, on a prefill server, is about to send its
KV) had positions computed for good: a prefill chunk's, a decode row's last token and its accepted drafts.
The head writes its KV at those positions (it reads each one's next token, now known, and the target's aux
states there) and, for a request that decodes next, drafts up to the scheduler's draft_limit tokens after
its last one, with blocks reserved for the positions it writes while drafting
(Scheduler.reserve_lookahead). It returns the drafts (and a prefill server's aux states, DraftResult);
the scheduler keeps them (Scheduler.drafted: Request.proposed waits for the next schedule).

A decode server gets a prompt's head KV with the target's (the head's layer is one more layer of the KV
layout) and, with the first token, the aux states at the prompt's last position (from the prefill
server's trailer, which carried its Request.draft_aux): before its next schedule it runs that one
position (`arrive`), which gives the drafts a colocated engine would have had after the prompt's last
chunk.

Forked sequences (n > 1) share their parent's head KV at the prompt's last position (drafted for the
parent's first token) and draft from their next step on. A prefix-cache hit brings the head's KV with the
target's: its last cached position was written with the token that followed it in the request that
computed it, which may differ; that changes drafts, never outputs (verification keeps every emitted token
the target's own).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from pdserve.engine.config import bucket_for
from pdserve.engine.core.request import Request, Status
from pdserve.engine.core.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.host_tier import HostTier
from pdserve.engine.model.sharding import named
from pdserve.engine.model_runner import ModelRunner


@dataclasses.dataclass
class _Span:
    """Positions [start, start + count) of a request to catch up on, their aux states from row `aux_row`
    on; `propose`: the drafts it may take next (0: none)."""

    request: Request
    start: int
    count: int
    aux_row: int
    propose: int


@dataclasses.dataclass
class DraftResult:
    """What a pass of the head leaves for the scheduler (Scheduler.drafted): each request's drafts for its
    next step, and the aux states at the last prompt position of each request about to send its KV."""

    proposed: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    aux: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


class DraftRunner:
    """The engine's EAGLE-3 side: the head's passes after each step and for arriving requests. `host`:
    the host tier, whose copies owed start before the head writes the cache (None: no tier)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, host: HostTier | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self.host = host
        # decode role: requests whose prompt's KV arrived, with the aux states that came with it
        self.arrivals: list[tuple[Request, np.ndarray]] = []

    def after_step(self, scheduled: SchedulerOutput, requests: dict[str, Request]) -> DraftResult:
        """The head's pass over the step's rows (`requests`: the step's, by id, finished ones too): the
        positions computed for good, the drafts of requests that decode next; a request about to send its
        KV gets its last prompt position's aux states."""
        sending = {r.request_id for r in self.scheduler.sending}
        result = DraftResult()
        spans, start = [], 0
        for row in scheduled.rows:
            request = requests[row.request_id]
            count = request.num_computed - row.num_past
            alive = request.status is Status.RUNNING or request.request_id in sending
            if alive and count > 0 and request.num_tokens > request.num_computed:
                spans.append(_Span(request, row.num_past, count, start, self._drafts(request)))
                if request.request_id in sending:
                    result.aux[request.request_id] = np.asarray(self.runner.aux[start + count - 1])
            start += len(row.tokens)
        if spans:
            result.proposed = self._run(spans, bucket_for(start, self.runner.config.token_buckets), None)
        return result

    def arrive(self) -> DraftResult:
        """The head's pass at the last prompt position of each request whose KV arrived from a prefill
        server (decode role), from the aux states that came with it: their first drafts."""
        arrivals, self.arrivals = self.arrivals, []
        arrivals = [(r, aux) for r, aux in arrivals if r.status is Status.RUNNING]
        size = self.runner.config.max_num_seqs
        result = DraftResult()
        for part in (arrivals[i : i + size] for i in range(0, len(arrivals), size)):
            t = bucket_for(len(part), self.runner.config.token_buckets)
            aux = np.zeros((t, part[0][1].shape[-1]), np.dtype(self.runner.config.dtype))
            for i, (_, request_aux) in enumerate(part):
                aux[i] = request_aux
            aux = jax.device_put(aux, named(self.runner.mesh))
            spans = [_Span(r, len(r.prompt_ids) - 1, 1, i, self._drafts(r)) for i, (r, _) in enumerate(part)]
            result.proposed.update(self._run(spans, t, aux))
        return result

    def _drafts(self, request: Request) -> int:
        """The drafts a request may take after this pass (0 unless it decodes next)."""
        if request.status is not Status.RUNNING or request.num_computed != request.num_tokens - 1:
            return 0
        return self.scheduler.drafts.draft_limit(request)

    def _run(self, spans: list[_Span], num_tokens: int, aux: jax.Array | None) -> dict[str, list[int]]:
        """One pass of the head over `spans` in a step of `num_tokens` (a token bucket) tokens; returns each
        span's drafts."""
        for span in spans:  # the blocks of the positions it drafts into, reserved first
            if span.propose > 1:
                span.propose = 1 + self.scheduler.reserve_lookahead(span.request, span.propose - 1)
        if self.host is not None:  # (a reservation may have evicted a block the tier still has to read)
            self.host.start_copies()
        config = self.runner.config
        s = config.seq_bucket(num_tokens)
        tokens, aux_rows = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
        cu_q_lens = np.full(s + 1, sum(p.count for p in spans), np.int32)
        kv_lens, last_rows, lookahead = (np.zeros(s, np.int32) for _ in range(3))
        tables = np.zeros((s, self.runner.block_table_width), np.int32)
        at = 0
        for i, span in enumerate(spans):
            request, end = span.request, span.start + span.count
            tokens[at : at + span.count] = request.all_ids[span.start + 1 : end + 1]
            aux_rows[at : at + span.count] = np.arange(span.aux_row, span.aux_row + span.count)
            cu_q_lens[i], kv_lens[i], last_rows[i] = at, end, at + span.count - 1
            lookahead[i] = max(0, span.propose - 1)
            table = self.scheduler.block_tables(request.request_id).groups[0]
            tables[i, : len(table)] = table
            at += span.count
        drafts = self.runner.run_draft(
            tokens, aux_rows, cu_q_lens, kv_lens, tables, last_rows, lookahead, aux
        )
        return {span.request.request_id: drafts[i, : span.propose].tolist() for i, span in enumerate(spans)}
