"""The simulator: a workload replayed against the real scheduler and KV-block manager
(engine.core.scheduler.Scheduler, the code a serving engine runs) with a simulated clock, each step
taking the seconds a cost model (planner.costs.StepCosts) gives its rows instead of running on a device.

A configuration is a fleet of such replicas on one clock (Fleet):
- colocated: `decode` replicas that compute prompts and decode; a request goes to the replica with the
  fewest unfinished requests;
- disaggregated: with `prefill` replicas too, a request goes to a decode replica, which admits it with a
  ReceiveKV (engine.core.kv_connector.DecodeConnector: blocks for the prompt, or computed there when
  shorter than `local_prefill_below`, as `--local-prefill-below`); once admitted, its prompt goes to the
  prefill replica with the fewest prompt tokens queued, which computes it (a one-token request, as the
  prefill server's). Its KV streams as the prefill server's does: each prefill chunk's tokens leave when
  the step that computed them ends, one after another on the request's stream (Transfer's seconds per
  token), and once the last has arrived (plus Transfer's latency) the request decodes on from the
  prefill's first token at the decode replica's next step boundary, as a decode server's RemoteKVDone
  does.
Commands (arrivals, arrived KV) reach a busy replica at its next step boundary, an idle one at once, as
services.engine_loop runs them. Admission, chunked prefill under the token budget, preemption under
block pressure, prefix-cache hits and n-forks are the scheduler's own decisions; the simulator only
advances time and samples a fixed token for every row that samples (no stop token: a request ends at its
max_tokens or the model length). It reports what a client would see, as the load generator's records
(pdserve.bench.stats), so simulated and measured runs go through the same statistics, and the trace of
every replica's steps.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from collections.abc import Callable, Sequence

from pdserve.bench.stats import RequestRecord
from pdserve.bench.workload import LengthDist, SharedPrefix, arrival_times, make_chats, make_workload
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_cache_manager import hash_blocks
from pdserve.engine.core.kv_connector import DecodeConnector, ReceiveKV
from pdserve.engine.core.request import Request
from pdserve.engine.core.scheduler import SampledToken, Scheduler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.planner.costs import RowShape, StepCosts
from pdserve.services.decode.config import Routing

SAMPLED_TOKEN = 500  # what every sampling row "samples" (an ordinary id; no request stops on it)


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A request of the workload: when it arrives (seconds since the start), its prompt token ids (shared
    prefixes hit the prefix cache as they would), how many tokens it generates, and its n. A conversation's
    first turn also carries the turns after it (`then`: each one's own token ids and max_tokens), each
    arriving `think_s` after the answer before it ended with the conversation so far as its prompt."""

    at_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int
    n: int = 1
    then: tuple[tuple[tuple[int, ...], int], ...] = ()
    think_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A prompt's KV from a prefill replica to a decode replica: `latency_s` plus `seconds_per_token` for
    each token sent (fitted to a decode server's requests: planner.profile.transfer_from_request_log, or
    over_link's bytes at a bandwidth)."""

    latency_s: float = 0.0
    seconds_per_token: float = 0.0

    @classmethod
    def fitted(cls, fit: dict) -> Transfer:
        """From a fit of a decode server's requests (planner.profile.fit_transfer; {}: free)."""
        return cls(fit.get("latency_s", 0.0), fit.get("seconds_per_token", 0.0))

    @classmethod
    def over_link(cls, bytes_per_token: float, bytes_per_s: float, latency_s: float = 0.0) -> Transfer:
        """A token's KV bytes at a link's bandwidth."""
        return cls(latency_s, bytes_per_token / bytes_per_s)

    def seconds(self, num_tokens: int) -> float:
        return self.latency_s + num_tokens * self.seconds_per_token


@dataclasses.dataclass(frozen=True)
class Pool:
    """`replicas` engines of one `config`, each step costing what `costs` says."""

    config: EngineConfig
    costs: StepCosts
    replicas: int = 1


@dataclasses.dataclass(frozen=True)
class Step:
    """One simulated step: when it started and ended, its rows (request id, tokens fed, tokens before),
    the scheduler's queues after it, and the replica (`decode-0`, `prefill-1`, ...)."""

    start_s: float
    end_s: float
    rows: tuple[tuple[str, int, int], ...]
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_preemptions: int
    replica: str = "decode-0"


@dataclasses.dataclass
class SimulationResult:
    records: list[RequestRecord]  # one per sequence (a request of n: n records, its index each)
    steps: list[Step]

    @property
    def duration_s(self) -> float:
        return max((s.end_s for s in self.steps), default=0.0)


def queue_series(steps: Sequence[Step], num_blocks: int) -> dict[str, dict[str, list]]:
    """Per replica, after each of its steps: the time (s), the sequences running and waiting, and the
    share of its KV cache's `num_blocks` in use: the queue and KV-use series a run is judged by."""
    out: dict[str, dict[str, list]] = {}
    for step in steps:
        series = out.setdefault(step.replica, {"t_s": [], "running": [], "waiting": [], "kv_use": []})
        series["t_s"].append(round(step.end_s, 6))
        series["running"].append(step.num_running)
        series["waiting"].append(step.num_waiting)
        series["kv_use"].append(round(step.num_used_blocks / num_blocks, 6) if num_blocks else 0.0)
    return out


def synthetic_workload(
    rate: float,
    num_requests: int,
    prompt_len: LengthDist,
    output_len: LengthDist,
    seed: int = 0,
    shared_prefix: SharedPrefix | None = None,
    burstiness: float = 1.0,
    turns: int = 1,
    think_s: float = 0.0,
) -> list[Arrival]:
    """The arrivals and prompts `pdserve bench serve` sends for the same flags and seed: `num_requests`
    Poisson arrivals at `rate` requests/s (`burstiness`: the gaps' gamma shape, as the load generator's),
    or with `turns` > 1 `num_requests` conversations of that many turns arriving at `rate` conversations/s,
    each later turn `think_s` after the answer before it."""
    times = arrival_times(rate, seed, burstiness)
    if turns <= 1:
        specs = make_workload(prompt_len, output_len, seed, shared_prefix=shared_prefix)
        return [
            Arrival(at, tuple(spec.prompt), spec.max_tokens)
            for at, spec in itertools.islice(zip(times, specs, strict=False), num_requests)
        ]
    chats = make_chats(prompt_len, output_len, turns, think_s, seed, shared_prefix)
    return [
        Arrival(
            at,
            tuple(chat.turns[0].prompt),
            chat.turns[0].max_tokens,
            then=tuple((tuple(t.prompt), t.max_tokens) for t in chat.turns[1:]),
            think_s=think_s,
        )
        for at, chat in itertools.islice(zip(times, chats, strict=False), num_requests)
    ]


def simulate(config: EngineConfig, costs: StepCosts, workload: Sequence[Arrival]) -> SimulationResult:
    """Runs `workload` through one colocated replica of `config` until every request has finished."""
    return Fleet(Pool(config, costs)).run(workload)


class _Replica:
    """One simulated engine: its scheduler, the step it runs (until `busy_until`), the commands it will
    run at its next step boundary."""

    def __init__(self, name: str, pool: Pool, clock: Callable[[], float], connector=None):
        self.name, self.costs = name, pool.costs
        self.scheduler = Scheduler(pool.config, connector=connector, clock=clock)
        self.commands: list[Callable[[], None]] = []
        self.running = None  # the SchedulerOutput of the step under way
        self.start_s = self.busy_until = 0.0
        self.queued_tokens = 0  # prompt tokens sent here and not yet computed (prefill routing)
        self.expected: collections.Counter = collections.Counter()  # block hashes its prompts will cache

    @property
    def busy(self) -> bool:
        return self.running is not None


@dataclasses.dataclass
class _Prompt:
    """A prompt on a prefill replica for a decode replica: the request there, the prompt's tokens the
    decode replica lacks (its last `num_tokens`), how far the KV computed so far has been sent and when the
    stream is free to send more."""

    decode: _Replica
    request_id: str
    num_tokens: int
    sent_upto: int = 0
    stream_free_s: float = 0.0
    hashes: tuple[int, ...] = ()  # its blocks' hashes, expected on its prefill replica (prefix routing)


class Fleet:
    """A configuration to simulate: a `decode` pool (colocated when `prefill` is None) and a `prefill`
    pool, the KV's `transfer` between them and `local_prefill_below` (see the module)."""

    def __init__(
        self,
        decode: Pool,
        prefill: Pool | None = None,
        transfer: Transfer = Transfer(),
        local_prefill_below: int = 0,
        prefix_routing: bool = False,
        routing_load_weight: float = 1.0,
    ):
        self.now = 0.0
        # a prompt's prefill replica: by the blocks of it each holds against its queued work, as the decode
        # server's --prefill-routing prefix (services/decode/routing.py); else the least work queued
        self.routing = Routing("prefix" if prefix_routing else "least-outstanding", routing_load_weight)
        self._turn = 0
        clock = lambda: self.now  # noqa: E731 - the schedulers' admission stamps
        disaggregated = prefill is not None
        self.decodes = [
            _Replica(
                f"decode-{i}",
                decode,
                clock,
                DecodeConnector(decode.config.block_size, local_prefill_below) if disaggregated else None,
            )
            for i in range(decode.replicas)
        ]
        self.prefills = [
            _Replica(f"prefill-{i}", prefill, clock) for i in range(prefill.replicas if prefill else 0)
        ]
        self.transfer = transfer
        self._events: list[tuple[float, int, Callable[[], None]]] = []  # (time, order, action)
        self._order = itertools.count()
        self._arrivals: dict[str, Arrival] = {}
        self._tokens: dict[str, list[float]] = {}
        self._prompts: dict[str, _Prompt] = {}  # by the prefill replica's request id
        self._ids = itertools.count()  # request ids (run: after the workload's own)
        self.records: list[RequestRecord] = []
        self.steps: list[Step] = []

    # ---- the event loop ---------------------------------------------------------------------------------
    def run(self, workload: Sequence[Arrival]) -> SimulationResult:
        """Every request of `workload` through the fleet until each has finished."""
        self._ids = itertools.count(len(workload))  # (a later turn's: after the workload's own)
        for index, arrival in enumerate(workload):
            self._at(arrival.at_s, lambda i=index, a=arrival: self._arrive(str(i), a))
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
            while self._events and self._events[0][0] <= self.now:  # (everything at this instant first)
                action = heapq.heappop(self._events)[2]
                action()
            idle = [r for r in (*self.prefills, *self.decodes) if not r.busy]
            for replica in idle:
                self._boundary(replica)
            # (a boundary can hand an idle replica a command: a decode admission's prompt to a prefill)
            while waiting := [r for r in idle if not r.busy and r.commands]:
                for replica in waiting:
                    self._boundary(replica)
        stuck = [r.name for r in (*self.prefills, *self.decodes) if r.scheduler.requests]
        if stuck:
            raise RuntimeError(f"requests on {', '.join(stuck)} can never be scheduled (too few blocks?)")
        self.records.sort(key=lambda r: r.index)
        return SimulationResult(self.records, self.steps)

    def _at(self, time_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time_s, next(self._order), action))

    def _command(self, replica: _Replica, command: Callable[[], None]) -> None:
        """Runs at `replica`'s next step boundary (now, if it is idle: the event loop calls _boundary)."""
        replica.commands.append(command)

    def _boundary(self, replica: _Replica) -> None:
        """Between two steps: the commands, then the next step if one can run."""
        commands, replica.commands = replica.commands, []
        for command in commands:
            command()
        scheduler = replica.scheduler
        output = scheduler.schedule()
        for ready in scheduler.connector.take_outputs():  # a decode replica admitted a ReceiveKV request
            if ready.num_external_tokens:
                self._prefill(replica, ready.request_id, ready.num_external_tokens)
        if output is None:
            return
        replica.running, replica.start_s = output, self.now
        replica.busy_until = self.now + replica.costs.seconds(
            RowShape(len(r.tokens), r.num_past) for r in output.rows
        )
        self._at(replica.busy_until, lambda: self._step_done(replica))

    def _step_done(self, replica: _Replica) -> None:
        output, replica.running = replica.running, None
        scheduler = replica.scheduler
        sampled = {r.request_id: [_sample(scheduler, r.request_id)] for r in output.rows if r.samples}
        appended = scheduler.update_from_output(output, sampled)
        scheduler.take_block_copies()  # (the device copies a fork asks for: nothing to copy here)
        self._stream_kv(output.rows)
        self._tokens_out(replica, appended)
        self.steps.append(
            Step(
                replica.start_s,
                self.now,
                tuple((r.request_id, len(r.tokens), r.num_past) for r in output.rows),
                len(scheduler.running),
                len(scheduler.waiting),
                scheduler.kv.pool.num_used,
                scheduler.num_preemptions,
                replica.name,
            )
        )

    # ---- requests ---------------------------------------------------------------------------------------
    def _arrive(self, rid: str, arrival: Arrival) -> None:
        self._arrivals[rid] = arrival
        decode = min(self.decodes, key=lambda r: len(r.scheduler.requests) + len(r.commands))
        params = SamplingParams(max_tokens=arrival.max_tokens, n=arrival.n, ignore_eos=True)
        request = Request(rid, list(arrival.prompt_ids), params, int(rid), arrival_time=arrival.at_s)

        def add() -> None:
            if self.prefills:
                decode.scheduler.connector.expect(rid, ReceiveKV())
            decode.scheduler.add(request)

        self._command(decode, add)

    def _prefill(self, decode: _Replica, rid: str, num_tokens: int) -> None:
        """The prompt of `rid`, admitted on `decode`, to a prefill replica (_route)."""
        prompt = self._arrivals[rid].prompt_ids
        prefill, hashes = self._route(prompt)
        pid = f"prefill:{rid}"
        self._prompts[pid] = _Prompt(decode, rid, num_tokens, len(prompt) - num_tokens, hashes=hashes)
        prefill.queued_tokens += len(prompt)
        prefill.expected.update(hashes)
        request = Request(pid, list(prompt), SamplingParams(max_tokens=1, ignore_eos=True), int(rid))
        self._command(prefill, lambda: prefill.scheduler.add(request))

    def _route(self, prompt: tuple[int, ...]) -> tuple[_Replica, tuple[int, ...]]:
        """The prefill replica for `prompt`, and its blocks' hashes when routing by prefix. By prefix: the
        cheapest by Routing.cost (the decode server's), a replica holding the leading blocks its cache holds
        or a prompt in flight there will; when none holds any block (or not by prefix), the least work
        queued, in turns among equals (as the decode server: new prefixes spread out)."""
        if len(self.prefills) == 1:  # (no choice to make)
            return self.prefills[0], ()
        hashes: tuple[int, ...] = ()
        if self.routing.policy == "prefix":
            block_size = self.prefills[0].scheduler.kv.block_size
            hashes = tuple(
                hash_blocks(prompt[: len(prompt) - 1], block_size)
            )  # (as its lookup: not the last)

            def held(replica: _Replica) -> int:
                kv, expected = replica.scheduler.kv, replica.expected
                return block_size * next(
                    (i for i, h in enumerate(hashes) if not expected[h] and not kv.lookup_hashes([h])),
                    len(hashes),
                )

            hits = {r.name: held(r) for r in self.prefills}
            if any(hits.values()):
                cost = self.routing.cost
                best = min(
                    self.prefills,
                    key=lambda r: (cost(len(prompt), hits[r.name], r.queued_tokens), r.queued_tokens),
                )
                return best, hashes
        fewest = min(r.queued_tokens for r in self.prefills)
        tied = [r for r in self.prefills if r.queued_tokens == fewest]
        self._turn += 1
        return tied[self._turn % len(tied)], hashes

    def _tokens_out(self, replica: _Replica, appended) -> None:
        for request, run in appended:
            rid = request.request_id
            if rid in self._prompts:  # a prefill replica's one token: the decode replica has the KV then
                sent = self._prompts.pop(rid)
                replica.queued_tokens -= len(request.prompt_ids)
                replica.expected.subtract(sent.hashes)  # (its blocks are in the replica's cache now)
                self._at(
                    sent.stream_free_s + self.transfer.latency_s,
                    lambda d=sent.decode, t=sent.request_id: self._command(d, lambda: self._kv_arrived(d, t)),
                )
                continue
            self._tokens.setdefault(rid, []).extend([self.now] * len(run))
            if request.finish_reason is not None:
                record = self._record(request, self._tokens.pop(rid))
                self.records.append(record)
                if request.parent_id is None:  # (a conversation's turn: its n is 1)
                    self._next_turn(rid, record.output_tokens)

    def _next_turn(self, rid: str, answered: int) -> None:
        """A conversation's next turn, `think_s` after this one's answer: its prompt the conversation so far
        (the answer as the simulator samples it) and its own tokens."""
        arrival = self._arrivals[rid]
        if not arrival.then:
            return
        (own, max_tokens), *rest = arrival.then
        prompt = (*arrival.prompt_ids, *[SAMPLED_TOKEN] * answered, *own)
        at = self.now + arrival.think_s
        turn = Arrival(at, prompt, max_tokens, then=tuple(rest), think_s=arrival.think_s)
        rid = str(next(self._ids))
        self._at(at, lambda: self._arrive(rid, turn))

    def _stream_kv(self, rows) -> None:
        """A prefill step's rows just computed: the KV of their prompt tokens goes on its way (the tokens
        the decode replica lacks, after what the stream is still sending)."""
        for row in rows:
            sent = self._prompts.get(row.request_id)
            if sent is None:
                continue
            computed = row.num_past + len(row.tokens)
            if computed > sent.sent_upto:
                start = max(sent.stream_free_s, self.now)
                sent.stream_free_s = start + (computed - sent.sent_upto) * self.transfer.seconds_per_token
                sent.sent_upto = computed

    def _kv_arrived(self, decode: _Replica, rid: str) -> None:
        scheduler = decode.scheduler
        appended = scheduler.remote_kv_arrived(rid, _sample(scheduler, rid))
        self._tokens_out(decode, appended)

    def _record(self, request: Request, times: list[float]) -> RequestRecord:
        """A finished sequence as the client's record (token times since its request arrived)."""
        parent = request.parent_id or request.request_id
        arrival = self._arrivals[parent]
        return RequestRecord(
            index=int(parent),
            start_s=arrival.at_s,
            prompt_tokens=len(arrival.prompt_ids),
            max_tokens=arrival.max_tokens,
            token_times_s=[t - arrival.at_s for t in times],
            e2e_s=self.now - arrival.at_s,
            finish_reason=request.finish_reason.value,
        )


def _sample(scheduler: Scheduler, rid: str) -> SampledToken:
    """The token of a sampling row; a request of n > 1 forks its other sequences at its first token."""
    request = scheduler.requests[rid]
    if not request.forks_pending:
        return SampledToken(SAMPLED_TOKEN)
    forks = tuple((request.fork(i), SampledToken(SAMPLED_TOKEN)) for i in range(1, request.params.n))
    return SampledToken(SAMPLED_TOKEN, forks=forks)
