"""The scheduler: every request's state and blocks, which rows run in the next step, and what a step's
results change. No device code.

States (engine.core.request.Status): WAITING (queued, no blocks) -> RUNNING (blocks held: prompt computed in
chunks, then decoding) -> FINISHED. Under block pressure the newest request holding blocks (decoding, or
with its prompt partly computed) is PREEMPTED: it gives its blocks back and is queued first (its prefix
is found in the cache again when it is readmitted). With a KV connector (engine.core.kv_connector), a request
whose prompt KV arrives from elsewhere is admitted into WAITING_FOR_REMOTE_KV instead of RUNNING, and a
finished request whose KV a sender still wants is held in FINISHED_SENDING until the engine has handed
it over.

`schedule()` returns plain data (rows of request ids, token ids, positions, block ids, which rows sample)
for the runner; `update_from_output()` applies what the step produced: computed tokens, cached blocks,
sampled tokens, finishes. No other module changes a request's progress or block table.

A step is ragged and token-budgeted (Sarathi-Serve's stall-free batching, as in vLLM v1): every running
request's decode token goes in first, then prefill chunks of the prompts being computed, oldest first,
until `max_num_batched_tokens` is spent (at most `max_prefill_seqs` prompts are computed at once). A
running request is in every step, so a long prompt delays it by one budget's compute per token at most.

With speculative decoding (engine.core.speculation), a decode row also feeds the drafts proposed for the
request (up to k, within the token budget that decode tokens and prefill chunks left, its max_tokens and
the model length; none when blocks are short; under draft_policy "cost" only those worth the step's
measured cost: engine.core.draft_planner decides how many): the step samples after each, and the request
appends the accepted run. The fed tokens' KV counts as computed up to the first rejected draft; the slots
written past it are overwritten later (blocks stay with the request until it ends, as ever).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.draft_planner import DraftPlanner
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.kv_connector import KVConnector
from pdserve.engine.core.kv_groups import BlockTables
from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import FinishReason, Request, Status, TokenLogprobs
from pdserve.engine.lora import LoraAdapter

log = logging.getLogger(__name__)


class AdapterSlots(Protocol):
    """The device slots of the adapters in use (engine/lora_slots.py LoraSlots), as admission sees them."""

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """Pins the adapter in a slot (loading it if needed); None when every slot is pinned by another."""

    def release(self, adapter: LoraAdapter) -> None:
        """Unpins what acquire pinned."""


class OutputSink(Protocol):
    """Where the client's view of each request's tokens goes (engine/core/output.py OutputStreams): the
    scheduler hands it every run of tokens it appended and applies what the view decides (a stop string
    ends the request at the token that completed it)."""

    def view(self, request: Request, run: list[SampledToken]) -> RequestOutput:
        """The client's view of `run`, just appended to the request (it may have ended with it); raises
        when turning it into text fails (the request then fails alone)."""

    def put(self, request: Request, output: RequestOutput) -> None:
        """The request's output to hand out (after `view`, or RequestOutput.failed)."""


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """A token for a request, sampled here (a step) or elsewhere (a prefill server's first token).
    `finish`: sampling itself ended the request (DEAD_END: its constraint allowed nothing more or refused
    the token; STOP: its constraint is complete; ERROR: sampling failed on it, `error` says how).
    `forks`: for the first token of a request with n > 1, its other sequences (Request.fork) with their
    first tokens, sampled from the same logits; the scheduler adopts them with this token."""

    token: int
    logprobs: TokenLogprobs | None = None
    finish: FinishReason | None = None
    error: str = ""
    forks: tuple[tuple[Request, SampledToken], ...] = ()


@dataclasses.dataclass
class Row:
    """One row of a step: `tokens` fed at positions num_past.., attending to its `block_tables`."""

    tokens: list[int]
    num_past: int
    block_tables: BlockTables
    lora_slot: int = -1  # adapter slot (engine.lora_slots.LoraSlots); -1: the base model
    request_id: str = ""
    samples: bool = False  # the row ends the request's uncomputed tokens: its last logits give the next
    # Speculation: the last `len(drafts)` of `tokens` are drafts; the row samples after its last
    # uncomputed token and after each draft (1 + len(drafts) logits rows)
    drafts: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_logits(self) -> int:
        """Rows of logits the step returns for this row: at its last token, before each draft too."""
        return 1 + len(self.drafts)


@dataclasses.dataclass
class SchedulerOutput:
    rows: list[Row]  # decode rows first, then prefill chunks

    def logits_starts(self) -> list[int]:
        """Where each row's logits start in the step's (row by row, Row.num_logits each)."""
        starts, at = [], 0
        for row in self.rows:
            starts.append(at)
            at += row.num_logits
        return starts


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        lora: AdapterSlots | None = None,
        connector: KVConnector | None = None,
        windowed_transfers: bool = False,
        release_window: int = 0,
        ring_blocks: Sequence[int] = (),
        outputs: OutputSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`outputs`: where each appended run of tokens goes as its client's view (None: nowhere; a stop
        string then ends nothing). `clock`: what stamps a request's admission (a simulation's own time:
        pdserve.planner.simulator). `windowed_transfers`: the model has sliding-window layers, so KV
        received by transfer fills those layers' blocks only within the window (and those blocks never
        enter the prefix cache).
        `release_window`: every layer attends within this many tokens (0: some layer to all), so a request's
        blocks wholly before its last `release_window` tokens are given back as it advances.
        `ring_blocks`: a hybrid model's rings (engine.core.kv_groups.KVGroups.ring_blocks)."""
        self.config, self.clock = config, clock
        self.windowed_transfers = windowed_transfers
        self.release_window = release_window
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            ring_blocks,
            config.num_host_blocks,
        )
        self.lora = lora
        self.connector = connector or KVConnector()
        self.outputs = outputs
        self.requests: dict[str, Request] = {}  # every request not yet FINISHED
        self.waiting: collections.deque[Request] = collections.deque()  # WAITING, PREEMPTED
        self.prefilling: list[Request] = []  # RUNNING, prompt partly computed
        self.running: list[Request] = []  # RUNNING, decoding
        self.remote: list[Request] = []  # WAITING_FOR_REMOTE_KV
        self.sending: list[Request] = []  # FINISHED_SENDING
        self.detached: list[Request] = []  # DETACHED
        # Requests admitted with blocks found in the host tier, until the engine has copied them in
        # (kv_loaded): no step reads their blocks before. Each admission's load has its own number: a
        # request preempted and admitted again waits for its new load, not the one that was under way
        self.loading: dict[str, int] = {}
        self._loads_admitted = itertools.count()
        self.num_preemptions = 0
        # (source, destination) blocks the device must copy before the next step: forked sequences' own
        # copies of their parent's partial last block (take_block_copies)
        self.block_copies: list[tuple[int, int]] = []
        self.drafts = DraftPlanner(config)  # speculation's planning (its proposer None: off)

    # ---- counts ---------------------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        """Requests a step can make progress on (those waiting for remote KV wait for a command)."""
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    @property
    def num_active(self) -> int:
        """Sequence slots taken toward max_num_seqs: requests holding blocks, and the sequences that a
        request with n > 1 will fork into once its first tokens are out."""
        pending = sum(r.fork_slots for r in (*self.prefilling, *self.remote) if r.forks_pending)
        return len(self.running) + len(self.prefilling) + len(self.remote) + len(self.detached) + pending

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.block_ids(request_id)

    def block_tables(self, request_id: str) -> BlockTables:
        return self.kv.block_tables(request_id)

    # ---- requests in and out --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT, error: str = ""
    ) -> Request | None:
        """Takes the request out of whatever state it is in and frees what it holds (its KV is sent
        nowhere); None if unknown. `reason`: ABORT, or ERROR (`error` says what failed)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for child in [r for r in self.requests.values() if r.parent_id == request_id]:  # its sequences
            self.abort(child.request_id, reason, error)
        if request.finish_reason is None or reason is FinishReason.ERROR:
            request.finish_reason, request.error = reason, error or request.error
        self._finish(request, send=False)
        return request

    def finish(
        self, request: Request, reason: FinishReason, error: str = "", num_output: int | None = None
    ) -> None:
        """Ends a request after its last token was handed out: a stop string matched in its text (STOP) or
        turning it into text failed (ERROR). A request already finished keeps its state and takes the
        reason (its output says ERROR); otherwise it finishes as by a stop token. `num_output`: the output
        tokens it keeps (a stop string matched inside a run of accepted drafts: those after it go)."""
        request.finish_reason, request.error = reason, error or request.error
        if num_output is not None:
            del request.output_ids[num_output:], request.logprobs[num_output:]
        if request.status not in (Status.FINISHED, Status.FINISHED_SENDING):
            self._finish(request, send=True)

    def _cache_blocks(self, request: Request) -> None:
        if not request.cacheable or not self.kv.enable_caching:
            return
        lora_name = request.lora.name if request.lora else None
        hashes = request.extend_block_hashes(self.config.block_size)
        self.kv.cache_blocks(
            request.request_id, request.all_ids, request.num_computed, request.cache_key, lora_name, hashes
        )

    def remote_kv_arrived(
        self,
        request_id: str,
        sampled: SampledToken | None,
        num_cached_tokens: int = 0,
        prompt_logprobs: Sequence[TokenLogprobs | None] | None = None,
    ) -> list[tuple[Request, list[SampledToken]]]:
        """Decode role: the prompt's KV is in the request's blocks and its first token was sampled
        elsewhere: record the token and start decoding (the request may already be finished by it), with
        the prompt tokens the sender found cached and, if it asked for them, the prompt logprobs it scored
        (from the second position on). A resumed request (moved here with its KV: Request.num_resumed)
        has all but its last output's KV and no token to record (`sampled` None): it decodes on.
        Returns the request and its token, then its forked sequences' (with n > 1); their client's views
        go to the output sink."""
        request = self.requests[request_id]
        if request.status is not Status.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is {request.status.value}, not waiting for KV")
        if (sampled is None) != bool(request.num_resumed):
            raise ValueError(f"request {request_id!r}: a first token is for a request that is not resumed")
        self.remote.remove(request)
        if sampled is not None:  # (a resumed request keeps the hits its admission here found)
            request.num_cached_tokens = num_cached_tokens
        if prompt_logprobs is not None and request.prompt_logprobs is not None:
            request.prompt_logprobs = [None, *prompt_logprobs]
        request.num_computed = request.num_transfer_tokens
        request.cacheable = not self.windowed_transfers
        self._cache_blocks(request)
        request.status = Status.RUNNING
        self.running.append(request)
        if sampled is None:
            return []
        appended = self._append_token(request, sampled)
        self._emit(appended)
        return appended

    def remote_kv_failed(self, request_id: str) -> None:
        """Decode role: no KV will arrive; the request is prefilled here, in the blocks it holds, after
        the cached prefix it was admitted with (whatever arrived behind it is overwritten)."""
        request = self.requests[request_id]
        if request.status is not Status.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is {request.status.value}, not waiting for KV")
        self.remote.remove(request)
        request.status = Status.RUNNING
        self.prefilling.append(request)

    def detach(self, request_id: str) -> list[Request]:
        """Decode role: takes the request's sequences out of the steps (DETACHED), their blocks held, to
        move them to a peer; the request itself first, then its forks by index. Only when every one of
        them is decoding now (its KV computed up to its last output, none being loaded); else detaches
        nothing and returns []. Sequences that finished are not among them."""
        request = self.requests.get(request_id)
        sequences = [r for r in self.requests.values() if r.parent_id == request_id]
        sequences = ([request] if request is not None else []) + sorted(sequences, key=lambda r: r.index)
        decoding = all(
            r in self.running and r.num_computed == r.num_tokens - 1 and r.request_id not in self.loading
            for r in sequences
        )
        if not sequences or not decoding:
            return []
        for r in sequences:
            self.running.remove(r)
            r.proposed = []  # (drafts for a step it will not have here)
            r.status = Status.DETACHED
            self.detached.append(r)
        return sequences

    def reattach(self, request_ids: Sequence[str]) -> None:
        """Detached sequences decode here again (their move failed); others are left as they are."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and request.status is Status.DETACHED:
                self.detached.remove(request)
                request.status = Status.RUNNING
                self.running.append(request)

    def kv_loaded(self, loads: Sequence[tuple[str, int]]) -> None:
        """The engine copied these loads (request id, its number in `loading`) in: their requests' steps
        may read them (a load of an admission since undone changes nothing)."""
        for request_id, number in loads:
            if self.loading.get(request_id) == number:
                del self.loading[request_id]

    def finish_sending(self, request_id: str) -> None:
        """Prefill role: the KV of a FINISHED_SENDING request has been handed over: free its blocks."""
        request = self.requests[request_id]
        self.sending.remove(request)
        self._release(request)

    # ---- adapters -------------------------------------------------------------------------------------
    def pin_adapter(self, request: Request) -> bool:
        """Pins the request's adapter in a device slot (loading it); False when every slot is pinned by
        other adapters. Idempotent; True for base-model requests."""
        if request.lora is None or request.lora_slot >= 0:
            return True
        slot = self.lora.acquire(request.lora)
        if slot is None:
            return False
        request.lora_slot = slot
        return True

    def unpin_adapter(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.lora.release(request.lora)
            request.lora_slot = -1

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        """The next step's rows (None: nothing can run): decodes, then chunks within the token budget. A step
        that had to preempt admits nobody (as vLLM's): the blocks it freed are for the running requests,
        and a victim must not come straight back."""
        num_preempted = self.num_preemptions
        rows = [self._decode_row(r) for r in self._reserve_decode_slots()]
        decode_rows = list(rows)
        budget = self.config.max_num_batched_tokens - len(rows)
        if self.num_preemptions == num_preempted:
            self._admit()
        for request in self.prefilling:
            if budget <= 0:
                break
            if request.request_id in self.loading:
                continue
            rows.append(self._chunk_row(request, budget))
            budget -= len(rows[-1].tokens)
        self._add_drafts(decode_rows, self.config.max_num_batched_tokens - budget, budget)
        return SchedulerOutput(rows) if rows else None

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, list[SampledToken]]
    ) -> list[tuple[Request, list[SampledToken]]]:
        """Applies a step: every row's tokens are now computed (a decode row's drafts up to the first one
        rejected; full blocks enter the prefix cache); each sampling row's run of tokens (one, or with
        drafts the accepted ones and the target's next) is appended up to one that ends its request (a stop
        token, a length; finished requests leave), then handed to the output sink, whose view may end the
        request at a stop string (the tokens after it go). Returns the requests that got tokens, with the
        tokens appended."""
        outputs = []
        bs = self.config.block_size
        for row in output.rows:
            request = self.requests[row.request_id]
            before = request.num_computed
            run = sampled[row.request_id] if row.samples else []
            appended, ended = self._record_run(request, run)
            if row.drafts:
                self.drafts.observe(len(row.drafts), len(run) - 1)
                request.num_drafted += len(row.drafts)
                request.num_draft_accepted += len(run) - 1
            # the fed tokens are computed up to the first rejected draft
            request.num_computed += len(row.tokens) - len(row.drafts) + (len(run) - 1 if row.drafts else 0)
            if ended:  # (a run its end cut short: the tokens after are not in the request)
                request.num_computed = min(request.num_computed, request.num_tokens - 1)
            if request.num_computed // bs > before // bs:  # a block filled up (decode: 1 step in bs)
                self._cache_blocks(request)
            if self.release_window:  # from the first block kvtransfer would send on (KVLayout)
                first_read = max(0, request.num_computed - self.release_window) // bs
                self.kv.release_before(request.request_id, first_read)
            if appended:
                forks = [(self._adopt(request, child, t), [t]) for child, t in appended[0].forks]
                self._after_tokens(request, ended)
                outputs += [(request, appended), *forks]
        self._emit(outputs)
        return outputs

    def _emit(self, appended: list[tuple[Request, list[SampledToken]]]) -> None:
        """Each run's client view to the output sink; a stop string the view found ends the request there
        (STOP, keeping the tokens up to the one that completed it), a view that failed ends it (ERROR)."""
        if self.outputs is None:
            return
        for request, run in appended:
            output = None
            if request.finish_reason is not FinishReason.ERROR:
                try:
                    output = self.outputs.view(request, run)
                except Exception as e:  # noqa: BLE001 - pinned to this request
                    log.exception("detokenizing failed", extra={"request_id": request.request_id})
                    self.finish(request, FinishReason.ERROR, f"detokenizing: {type(e).__name__}: {e}")
                else:
                    cut = output.num_output_tokens < len(request.output_ids)
                    if output.finish_reason is not request.finish_reason or cut:  # a stop string matched
                        self.finish(request, output.finish_reason, num_output=output.num_output_tokens)
            if request.finish_reason is FinishReason.ERROR:
                output = RequestOutput.failed(request)
            self.outputs.put(request, output)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The block copies forks asked for since the last call (the engine makes them before the next
        step, which may write into the copies)."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def _append_token(
        self, request: Request, sampled: SampledToken
    ) -> list[tuple[Request, list[SampledToken]]]:
        """Appends one token (and adopts its forks, first); returns each request that got a token, with it."""
        forks = [(self._adopt(request, child, token), [token]) for child, token in sampled.forks]
        self._after_tokens(request, self._record(request, sampled))
        return [(request, [sampled]), *forks]

    def _record_run(self, request: Request, run: list[SampledToken]) -> tuple[list[SampledToken], bool]:
        """Appends the run's tokens up to one that ends the request; (those appended, whether it ended)."""
        for i, sampled in enumerate(run):
            if self._record(request, sampled):
                return run[: i + 1], True
        return run, False

    def _after_tokens(self, request: Request, ended: bool) -> None:
        """A request that got tokens: finished when they ended it, else decoding (its first token moves it
        from prefilling to running)."""
        if ended:
            self._finish(request, send=True)
        elif request in self.prefilling:
            self.prefilling.remove(request)
            self.running.append(request)

    def _adopt(self, parent: Request, child: Request, sampled: SampledToken) -> Request:
        """A sequence forked from `parent` (whose prompt is computed, its blocks full or arrived) with its
        first token: it shares the parent's full prompt blocks and decodes on its own copy of the last
        partial one. One that its first token ends holds nothing; when the pool is short of the copy it is
        queued first as preempted (it recomputes its prompt, found in the prefix cache, and its token)."""
        self.requests[child.request_id] = child
        child.num_computed = len(child.prompt_ids)
        child.num_cached_tokens, child.scheduled_time = parent.num_cached_tokens, parent.scheduled_time
        child.prompt_logprobs = parent.prompt_logprobs  # (scored once, for every sequence)
        if self._record(child, sampled):
            self._release(child)
            return child
        if child.index > parent.fork_slots:  # admitted in parts: it waits for a slot behind the queue
            child.num_computed = 0
            child.status = Status.PREEMPTED
            self.waiting.append(child)
            return child
        copies = self.kv.fork(parent.request_id, child.request_id, len(child.prompt_ids))
        if copies is None or not self.pin_adapter(child):  # (a parent's adapter is pinned: it gets a slot)
            self.kv.free(child.request_id)
            child.num_computed = 0
            child.status = Status.PREEMPTED
            self.waiting.appendleft(child)
            return child
        self.block_copies += copies
        self._cache_blocks(child)
        child.status = Status.RUNNING
        self.running.append(child)
        return child

    def _record(self, request: Request, sampled: SampledToken) -> bool:
        """Appends the token (and its logprobs); True when it ends the request (its reason recorded). A
        constraint waiting for the reasoning to end starts applying once the output ends with
        params.reasoning_end."""
        request.output_ids.append(sampled.token)
        if sampled.logprobs is not None:
            request.logprobs.append(sampled.logprobs)
        if request.reasoning:
            end = list(request.params.reasoning_end)
            request.reasoning = request.output_ids[-len(end) :] != end
        reason = sampled.finish or self._stop_reason(request, sampled.token)
        if reason is not None:
            request.finish_reason, request.error = reason, sampled.error
        return reason is not None

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """STOP for one of its stop tokens; LENGTH at max_tokens or the model's length."""
        if token in request.stop_token_ids:
            return FinishReason.STOP
        if len(request.output_ids) >= request.params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, send: bool) -> None:
        for queue in (self.prefilling, self.running, self.remote, self.sending, self.detached):
            if request in queue:
                queue.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.unpin_adapter(request)
        if send and self.connector.request_finished(request):
            request.status = Status.FINISHED_SENDING
            self.sending.append(request)
        else:
            self._release(request)

    def _release(self, request: Request) -> None:
        self.loading.pop(request.request_id, None)  # (a copy under way is dropped: its blocks are freed)
        self.kv.free(request.request_id)
        request.status = Status.FINISHED
        self.requests.pop(request.request_id, None)

    # ---- prefill --------------------------------------------------------------------------------------
    def _chunk_row(self, request: Request, budget: int) -> Row:
        start = request.num_computed
        length = min(request.num_uncomputed, budget)
        return Row(
            request.all_ids[start : start + length],
            start,
            self.kv.block_tables(request.request_id),
            request.lora_slot,
            request.request_id,
            samples=start + length == request.num_tokens,
        )

    def _decode_row(self, request: Request) -> Row:
        return Row(
            [request.output_ids[-1]],
            request.num_computed,
            self.kv.block_tables(request.request_id),
            request.lora_slot,
            request.request_id,
            samples=True,
        )

    def _admit(self) -> None:
        """Admits queued requests in order while blocks and sequence slots last; at most max_prefill_seqs
        prompts are being computed at once. Requests whose adapter has no free slot are passed over (later
        requests go first, these keep their place).

        A request of n sequences is admitted in parts: it needs one free sequence slot, and its forks take
        the slots free then (Request.fork_slots); the others wait at the back of the queue with their first
        tokens (_adopt), so a large n never holds the queue's head while later requests wait."""
        passed = []
        while self.waiting:
            request = self.waiting[0]
            free = self.config.max_num_seqs - self.num_active
            if free < 1:
                break
            rid = request.request_id
            cached, loaded = [], []  # device blocks, then host slots (the host tier) of its prefix
            if self.kv.enable_caching:
                hashes = request.prefix_hashes(self.config.block_size)
                cached = self.kv.lookup_hashes(hashes)
                loaded = self.kv.lookup_host(hashes[len(cached) :])
            num_cached = (len(cached) + len(loaded)) * self.config.block_size
            external = 0  # prompt tokens whose KV arrives from elsewhere (a preempted request recomputes)
            if request.status is Status.WAITING:
                external = self.connector.num_external_tokens(request, num_cached)
            if not external and len(self.prefilling) >= self.config.max_prefill_seqs:
                break
            # arriving KV fills the blocks after the cached ones; one more slot for the first token (or a
            # resumed request's last output, fed next)
            num_tokens = request.num_transfer_tokens + 1 if external else request.num_tokens
            if not self.kv.can_allocate(rid, num_tokens, cached) or not self.connector.admits(request):
                break
            self.waiting.popleft()
            if not self.pin_adapter(request):
                passed.append(request)
                continue
            self.kv.allocate(rid, num_tokens, cached, request.all_ids, loaded)
            request.fork_slots = min(_slots(request), free) - 1
            if loaded:
                self.loading[rid] = next(self._loads_admitted)
            if request.scheduled_time is None:
                request.scheduled_time = self.clock()
            request.num_computed = num_cached
            if request.status is Status.WAITING:
                request.num_cached_tokens = num_cached
            if external:
                request.status = Status.WAITING_FOR_REMOTE_KV
                self.remote.append(request)
            else:
                request.status = Status.RUNNING
                self.prefilling.append(request)
            self.connector.on_blocks_allocated(request, self.kv.block_ids(rid), external)
        self.waiting.extendleft(reversed(passed))

    # ---- decode ---------------------------------------------------------------------------------------
    def _reserve_decode_slots(self) -> list[Request]:
        """Every running request gets a slot for the token it feeds; when short, preempts the newest request
        holding blocks here (decoding, or with its prompt partly computed)."""
        scheduled = []
        for request in sorted(self.running, key=lambda r: r.arrival_time):
            if request.status is not Status.RUNNING:  # preempted above as a victim: nothing to reserve
                continue
            if request.request_id in self.loading:  # (decode role: its KV arrived before its host blocks)
                continue
            while not self.kv.can_allocate(request.request_id, request.num_computed + 1):
                victim = max(self.running + self.prefilling, key=self._preemption_order())
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is Status.RUNNING:
                self.kv.allocate(request.request_id, request.num_computed + 1)
                scheduled.append(request)
        # a request that got its slot may have been preempted since, as the newest, for a later one's
        return [r for r in scheduled if r.status is Status.RUNNING]

    def _preemption_order(self):
        """The key whose largest request is preempted first: a request's sequences count as one request
        for fairness, so the sequences of the request holding the most here go first (its last fork
        first), then the newest request (vLLM's order). A later short request is never preempted for the
        forks of an earlier large n."""
        held = collections.Counter(r.output_id for r in (*self.running, *self.prefilling))
        return lambda r: (held[r.output_id], r.arrival_time, r.index)

    def _add_drafts(self, rows: list[Row], num_tokens: int, budget: int) -> None:
        """Speculation: decode rows (of a step of `num_tokens` tokens) also feed their requests' drafts,
        from the token budget that decode tokens and prefill chunks left (drafts may be rejected: a prompt's
        chunk is not), as many as the planner finds worth the step's cost (engine.core.draft_planner),
        with the slots for them from the free blocks (drafts preempt nobody)."""
        requests = [self.requests[row.request_id] for row in rows]
        planned = self.drafts.plan(requests, num_tokens, budget)
        for row, request, drafts in zip(rows, requests, planned, strict=True):
            if drafts and self.kv.can_allocate(row.request_id, request.num_computed + 1 + len(drafts)):
                self.kv.allocate(row.request_id, request.num_computed + 1 + len(drafts))
                row.tokens += drafts
                row.drafts = drafts
                row.block_tables = self.kv.block_tables(row.request_id)

    def reserve_lookahead(self, request: Request, positions: int) -> int:
        """A draft head drafting after a running request's last token writes its own KV at up to
        `positions` positions from num_computed on: the blocks for as many of them as the free blocks
        allow are allocated now (the next step's drafts use them; nobody is preempted). Returns how many."""
        for n in range(positions, 0, -1):
            if self.kv.can_allocate(request.request_id, request.num_computed + n):
                self.kv.allocate(request.request_id, request.num_computed + n)
                return n
        return 0

    def drafted(self, proposed: dict[str, list[int]], aux: dict[str, object]) -> None:
        """A draft head's pass (engine.draft_runner.DraftResult): each request's drafts for its next step
        (Request.proposed, taken once), and the head's input at the last prompt position of each request
        about to send its KV (Request.draft_aux, for the transfer's trailer)."""
        for request_id, drafts in proposed.items():
            request = self.requests.get(request_id)
            if request is not None and request.status is Status.RUNNING:
                request.proposed = drafts
        for request_id, states in aux.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.draft_aux = states

    def _preempt(self, request: Request) -> None:
        """Gives a running request's blocks back (its full blocks stay cached); it is queued first."""
        self.num_preemptions += 1
        (self.running if request in self.running else self.prefilling).remove(request)
        self.loading.pop(request.request_id, None)
        self.kv.free(request.request_id)
        request.num_computed = 0
        request.proposed = []  # (a draft head's drafts follow the KV just freed)
        request.status = Status.PREEMPTED
        self.waiting.appendleft(request)


def _slots(request: Request) -> int:
    """The sequence slots a request takes: n for one that forks into n sequences that decode (on a prefill
    server, max_tokens 1, its forks end with their first tokens), else one."""
    return request.params.n if request.forks_pending and request.params.max_tokens > 1 else 1
