"""The Admin service: blocks, queue depths, requests served; LoRA adapters loaded at run time."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import grpc

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora import LoraAdapter, LoraLoadError
from pdserve.services.engine_loop import EngineLoop
from pdserve.v1 import admin_pb2 as pb
from pdserve.v1 import admin_pb2_grpc as pb_grpc

SERVICE_NAME = "pdserve.v1.Admin"


@dataclasses.dataclass
class Counters:
    num_requests_total: int = 0
    num_waiting: int = 0
    num_transfers_total: int = 0
    kv_transfer_seconds_total: float = 0.0
    kv_transfer_bytes_total: int = 0
    num_transfer_failures_total: int = 0
    num_local_fallbacks_total: int = 0  # decode: prefilled here after every replica failed
    kv_frames_sent_total: int = 0  # prefill
    kv_frames_after_compute_total: int = 0  # prefill: gathered when the prompt's last chunk computed
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)  # finish reason / error -> count
    # decode: prefills routed, by reason ("prefix": for the blocks a replica holds; "load": least busy;
    # "hint": the replica an endpoint picker named)
    routes: dict[str, int] = dataclasses.field(default_factory=dict)
    route_expected_hit_tokens_total: int = 0  # prompt tokens the chosen replicas held, per their events
    route_actual_hit_tokens_total: int = 0  # prompt tokens they found in their prefix caches

    def count_outcome(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def count_route(self, reason: str, expected_hit_tokens: int, actual_hit_tokens: int) -> None:
        self.routes[reason] = self.routes.get(reason, 0) + 1
        self.route_expected_hit_tokens_total += expected_hit_tokens
        self.route_actual_hit_tokens_total += actual_hit_tokens


@dataclasses.dataclass(frozen=True)
class Load:
    """A daemon's load as Admin.GetStats reports it and a router weighs it (/metrics, services.metrics).

    num_running: requests holding blocks (decoding, prompt being computed, or, on a decode server, KV
    arriving from a prefill server; `num_incoming` of them); num_waiting: queued for blocks or, on a
    prefill server, for a prefill slot. kv_usage: blocks held by requests / all blocks (0-1; blocks kept
    only by the prefix cache are reclaimable, so free). Adapters: names of the LoRA adapters of the
    running and of the waiting requests; max_loras: adapter slots (0: LoRA off)."""

    num_running: int
    num_waiting: int
    num_incoming: int
    num_blocks: int
    block_size: int
    kv_usage: float
    running_adapters: tuple[str, ...]
    waiting_adapters: tuple[str, ...]
    max_loras: int


def read_load(engine: LLMEngine, counters: Counters) -> Load:
    """Reads without locks: on the engine thread (Admin) or a scrape thread (/metrics), which sees a state
    at most one step old. The scheduler's lists are copied first (one C-level call each, under the GIL)."""
    s, pool = engine.scheduler, engine.scheduler.kv.pool
    running = [*list(s.running), *list(s.prefilling), *list(s.remote)]
    waiting = list(s.waiting)

    def adapters(requests) -> tuple[str, ...]:
        return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))

    return Load(
        num_running=len(running),
        num_waiting=len(waiting) + counters.num_waiting,
        num_incoming=len(s.remote),
        num_blocks=pool.num_blocks,
        block_size=engine.config.block_size,
        kv_usage=pool.num_used / pool.num_blocks,
        running_adapters=adapters(running),
        waiting_adapters=adapters(waiting),
        max_loras=engine.config.max_loras,
    )


class AdminService(pb_grpc.AdminServicer):
    """`lora_root`: when set, LoadLoraAdapter reads only folders inside it (PERMISSION_DENIED otherwise).
    `mirrors`: engines of the same process that load and unload the same adapters (`pdserve serve`)."""

    def __init__(
        self,
        role: str,
        loop: EngineLoop,
        counters: Counters,
        lora_root: str | None = None,
        mirrors: Sequence[EngineLoop] = (),
    ):
        self.role, self.loop, self.counters = role, loop, counters
        self.lora_root = Path(lora_root).resolve() if lora_root else None
        self.mirrors = list(mirrors)

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context) -> pb.LoraAdapterInfo:
        if not request.name or not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name and path are required")
        path = Path(request.path).resolve()
        if self.lora_root is not None and not path.is_relative_to(self.lora_root):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"path: adapters load from {self.lora_root} only"
            )
        engine: LLMEngine = self.loop.engine
        try:
            adapter = await asyncio.to_thread(engine.loras.read, request.name, str(path))
            for mirror in self.mirrors:
                await mirror.call(lambda e: e.loras.add(adapter))
            adapter = await self.loop.call(lambda e: e.loras.add(adapter))
        except LoraLoadError as e:  # INVALID_ARGUMENT, ALREADY_EXISTS, FAILED_PRECONDITION (LoRA off)
            await context.abort(grpc.StatusCode[e.status], str(e))
        return await self.loop.call(lambda e: adapter_info(e, adapter))

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context):
        for mirror in self.mirrors:
            await mirror.call(lambda e: e.loras.remove(request.name))
        if not await self.loop.call(lambda e: e.loras.remove(request.name)):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.name!r} is not loaded")
        return pb.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(self, request, context) -> pb.LoraAdapterList:
        def snapshot(engine: LLMEngine) -> pb.LoraAdapterList:
            return pb.LoraAdapterList(
                adapters=[adapter_info(engine, a) for _, a in sorted(engine.loras.adapters.items())],
                num_slots=engine.config.max_loras,
                max_rank=engine.config.max_lora_rank,
            )

        return await self.loop.call(snapshot)

    async def GetStats(self, request, context) -> pb.ServerStats:
        def snapshot(engine):
            kv, load = engine.scheduler.kv, read_load(engine, self.counters)
            return pb.ServerStats(
                role=self.role,
                num_blocks=kv.pool.num_blocks,
                num_free_blocks=kv.pool.num_free,
                num_cached_blocks=kv.pool.num_cached,
                prefix_cache_queries_total=kv.stats.queries,
                prefix_cache_hits_total=kv.stats.hits,
                prefix_cache_evictions_total=kv.pool.num_evictions,
                num_running=load.num_running,
                num_waiting=load.num_waiting,
                num_requests_total=self.counters.num_requests_total,
                num_incoming=load.num_incoming,
                num_transfers_total=self.counters.num_transfers_total,
                kv_transfer_seconds_total=self.counters.kv_transfer_seconds_total,
                kv_transfer_bytes_total=self.counters.kv_transfer_bytes_total,
                num_transfer_failures_total=self.counters.num_transfer_failures_total,
                kv_frames_sent_total=self.counters.kv_frames_sent_total,
                kv_frames_after_compute_total=self.counters.kv_frames_after_compute_total,
                route_expected_hit_tokens_total=self.counters.route_expected_hit_tokens_total,
                route_actual_hit_tokens_total=self.counters.route_actual_hit_tokens_total,
            )

        return await self.loop.call(snapshot)


def adapter_info(engine: LLMEngine, adapter: LoraAdapter) -> pb.LoraAdapterInfo:
    return pb.LoraAdapterInfo(
        name=adapter.name,
        path=adapter.path,
        rank=adapter.rank,
        target_modules=adapter.targets,
        fingerprint=adapter.fingerprint,
        resident=engine.lora_slots is not None and adapter.key in engine.lora_slots.resident,
    )
