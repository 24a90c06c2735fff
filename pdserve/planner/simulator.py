"""The simulator: a workload replayed against the real scheduler and KV-block manager
(engine.core.scheduler.Scheduler, the code a serving engine runs) with a simulated clock, each step
taking the seconds a cost model (planner.costs.StepCosts) gives its rows instead of running on a device.

Admission, chunked prefill under the token budget, preemption under block pressure, prefix-cache hits
and n-forks are the scheduler's own decisions; the simulator only advances time and samples a fixed
token for every row that samples (no stop token: a request ends at its max_tokens or the model length).
It reports what a client would see, as the load generator's records (pdserve.bench.stats), so simulated
and measured runs go through the same statistics, and the trace of its steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdserve.bench.stats import RequestRecord
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.request import Request
from pdserve.engine.core.scheduler import SampledToken, Scheduler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.planner.costs import RowShape, StepCosts

SAMPLED_TOKEN = 500  # what every sampling row "samples" (an ordinary id; no request stops on it)


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A request of the workload: when it arrives (seconds since the start), its prompt token ids (shared
    prefixes hit the prefix cache as they would), how many tokens it generates, and its n."""

    at_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int
    n: int = 1


@dataclasses.dataclass(frozen=True)
class Step:
    """One simulated step: when it started and ended, its rows (request id, tokens fed, tokens before),
    and the scheduler's queues after it."""

    start_s: float
    end_s: float
    rows: tuple[tuple[str, int, int], ...]
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_preemptions: int


@dataclasses.dataclass
class SimulationResult:
    records: list[RequestRecord]  # one per sequence (a request of n: n records, its index each)
    steps: list[Step]

    @property
    def duration_s(self) -> float:
        return self.steps[-1].end_s if self.steps else 0.0


class _Clock:
    """Simulated seconds since the start (the scheduler stamps a request's admission with it)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(config: EngineConfig, costs: StepCosts, workload: Sequence[Arrival]) -> SimulationResult:
    """Runs `workload` through a fresh Scheduler of `config` until every request has finished."""
    clock = _Clock()
    scheduler = Scheduler(config, clock=clock)
    pending = sorted(enumerate(workload), key=lambda item: (item[1].at_s, item[0]))
    arrivals: dict[str, Arrival] = {}
    tokens: dict[str, list[float]] = {}
    records: list[RequestRecord] = []
    steps: list[Step] = []
    while pending or scheduler.requests:
        while pending and pending[0][1].at_s <= clock.now:
            index, arrival = pending.pop(0)
            rid = str(index)
            params = SamplingParams(max_tokens=arrival.max_tokens, n=arrival.n, ignore_eos=True)
            scheduler.add(Request(rid, list(arrival.prompt_ids), params, index, arrival_time=arrival.at_s))
            arrivals[rid] = arrival
        output = scheduler.schedule()
        if output is None:
            if not pending:
                raise RuntimeError(
                    f"{len(scheduler.requests)} requests can never be scheduled (too few blocks?)"
                )
            clock.now = pending[0][1].at_s  # idle until the next arrival
            continue
        start = clock.now
        clock.now += costs.seconds(RowShape(len(r.tokens), r.num_past) for r in output.rows)
        sampled = {r.request_id: [_sample(scheduler, r.request_id)] for r in output.rows if r.samples}
        for request, _ in scheduler.update_from_output(output, sampled):
            tokens.setdefault(request.request_id, []).append(clock.now)
            if request.finish_reason is not None:
                records.append(_record(request, arrivals, tokens.pop(request.request_id), clock.now))
        scheduler.take_block_copies()  # (the device copies a fork asks for: nothing to copy here)
        steps.append(
            Step(
                start,
                clock.now,
                tuple((r.request_id, len(r.tokens), r.num_past) for r in output.rows),
                len(scheduler.running),
                len(scheduler.waiting),
                scheduler.kv.pool.num_used,
                scheduler.num_preemptions,
            )
        )
    records.sort(key=lambda r: r.index)
    return SimulationResult(records, steps)


def _sample(scheduler: Scheduler, rid: str) -> SampledToken:
    """The token of a sampling row; a request of n > 1 forks its other sequences at its first token."""
    request = scheduler.requests[rid]
    if not request.forks_pending:
        return SampledToken(SAMPLED_TOKEN)
    forks = tuple((request.fork(i), SampledToken(SAMPLED_TOKEN)) for i in range(1, request.params.n))
    return SampledToken(SAMPLED_TOKEN, forks=forks)


def _record(request: Request, arrivals: dict[str, Arrival], times: list[float], now: float) -> RequestRecord:
    """A finished sequence as the client's record (token times since its request arrived)."""
    parent = request.parent_id or request.request_id
    arrival = arrivals[parent]
    return RequestRecord(
        index=int(parent),
        start_s=arrival.at_s,
        prompt_tokens=len(arrival.prompt_ids),
        max_tokens=arrival.max_tokens,
        token_times_s=[t - arrival.at_s for t in times],
        e2e_s=now - arrival.at_s,
        finish_reason=request.finish_reason.value,
    )
