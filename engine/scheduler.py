"""Which requests run in the next step, and admission against free KV blocks. No device code.

A step is either a prefill step (chunks of prompts) or a decode step (one token for every running
request). Prefill steps and decode steps alternate while both have work, so a stream of long prompts
delays running requests by at most one prefill chunk per token (the colocated interference that
disaggregation removes).

Prefill shapes are kept to a bounded set (see EngineConfig): prompts that fit one chunk are prefilled
together, up to `max_prefill_seqs` per step; a longer prompt's first chunk may join them, and its later
chunks run one request per step.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

from engine.block_manager import BlockAllocator
from engine.config import EngineConfig
from engine.request import Request, Status

if TYPE_CHECKING:
    from engine.lora import LoraSlots


@dataclasses.dataclass
class PrefillChunk:
    request: Request
    start: int  # first token position of the chunk (== request.num_computed)
    length: int

    @property
    def samples(self) -> bool:
        """The chunk ends the uncomputed tokens, so its last logits give the next token."""
        return self.start + self.length == self.request.num_tokens


@dataclasses.dataclass
class ScheduledStep:
    prefill: list[PrefillChunk] = dataclasses.field(default_factory=list)
    decode: list[Request] = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: BlockAllocator, lora: LoraSlots | None = None):
        self.config = config
        self.allocator = allocator
        self.lora = lora
        self.waiting: collections.deque[Request] = collections.deque()  # not yet admitted
        self.prefilling: list[Request] = []  # admitted, prompt partly computed
        self.running: list[Request] = []  # decoding
        self.num_incoming = 0  # requests holding blocks while their KV arrives from a prefill server
        self._last_was_prefill = False

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Registers a request whose KV is already in its blocks (inserted from a prefill server)."""
        request.status = Status.RUNNING
        self.running.append(request)

    def remove(self, request: Request, free_blocks: bool = True) -> None:
        """Takes a request out of whichever queue holds it and (by default) frees its blocks."""
        for queue in (self.prefilling, self.running):
            if request in queue:
                queue.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        if free_blocks:
            request.blocks.release()
        self.unpin_adapter(request)

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

    def schedule(self) -> ScheduledStep | None:
        decode_turn = bool(self.running) and self._last_was_prefill
        if not decode_turn:
            step = self._schedule_prefill()
            if step is not None:
                self._last_was_prefill = True
                return step
        self._last_was_prefill = False
        if self.running:
            return ScheduledStep(decode=self._reserve_decode_slots())
        step = self._schedule_prefill()
        self._last_was_prefill = step is not None
        return step

    def _schedule_prefill(self) -> ScheduledStep | None:
        max_chunk = self.config.max_prefill_tokens
        continuing = [r for r in self.prefilling if r.num_computed > 0]
        if continuing:
            request = continuing[0]
            length = min(request.num_uncomputed, max_chunk)
            return ScheduledStep(prefill=[PrefillChunk(request, request.num_computed, length)])
        chunks = [PrefillChunk(r, 0, min(r.num_uncomputed, max_chunk)) for r in self.prefilling]
        passed = []  # their adapter has no free slot: later requests go first, these keep their place
        while self.waiting and len(chunks) < self.config.max_prefill_seqs:
            request = self.waiting[0]
            active = len(self.running) + len(self.prefilling) + self.num_incoming
            if active >= self.config.max_num_seqs or not request.blocks.can_reserve(request.num_tokens):
                break
            self.waiting.popleft()
            if not self.pin_adapter(request):
                passed.append(request)
                continue
            request.blocks.reserve(request.num_tokens)
            self.prefilling.append(request)
            chunks.append(PrefillChunk(request, request.num_computed, min(request.num_uncomputed, max_chunk)))
        self.waiting.extendleft(reversed(passed))
        return ScheduledStep(prefill=chunks) if chunks else None

    def _reserve_decode_slots(self) -> list[Request]:
        """Every running request gets a slot for the token it feeds; preempts the newest when short."""
        scheduled = []
        for request in sorted(self.running, key=lambda r: r.arrival_time):
            if request.status is not Status.RUNNING:  # preempted above as a victim: nothing to reserve
                continue
            while not request.blocks.can_reserve(request.num_computed + 1):
                victim = max(self.running, key=lambda r: r.arrival_time)
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is Status.RUNNING:
                request.blocks.reserve(request.num_computed + 1)
                scheduled.append(request)
        return scheduled

    def _preempt(self, request: Request) -> None:
        """Frees a running request's blocks; it re-enters the queue first and is recomputed."""
        self.running.remove(request)
        request.blocks.release()
        request.num_computed = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def promote(self, request: Request) -> None:
        """A request whose prompt is fully computed (and first token sampled) starts decoding."""
        self.prefilling.remove(request)
        request.status = Status.RUNNING
        self.running.append(request)
