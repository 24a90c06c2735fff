"""The Admin service: blocks, queue depths, requests served; LoRA adapters loaded at run time."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import grpc

from pdserve.engine.boundary import AdapterState, EngineStats, Utility
from pdserve.engine.core.speculation import SpeculationStats
from pdserve.engine.lora import LoraLoadError
from pdserve.services.engine_loop import EngineLoop
from pdserve.v1 import admin_pb2 as pb
from pdserve.v1 import admin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name


@dataclasses.dataclass
class Counters:
    num_requests_total: int = 0
    num_waiting: int = 0
    prompt_tokens_total: int = 0  # prompt tokens of requests that got their first token (vLLM's meaning)
    generation_tokens_total: int = 0  # tokens generated
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
    # decode: live migration (services.decode.migration), sequences by (direction, outcome): ("out",
    # "moved" | "stayed"), ("in", "accepted" | "refused" | "failed"); the KV bytes moved by direction
    migrations: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    migration_kv_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    drain_handoff_seconds: float | None = None  # from the drain's start until every move was decided
    resumptions_total: int = 0  # requests a client resumed here (resume_token_ids; moved ones not counted)

    def count_outcome(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def count_migration(self, direction: str, outcome: str, sequences: int = 1, kv_bytes: int = 0) -> None:
        key = (direction, outcome)
        self.migrations[key] = self.migrations.get(key, 0) + sequences
        self.migration_kv_bytes[direction] = self.migration_kv_bytes.get(direction, 0) + kv_bytes

    def count_route(self, reason: str, expected_hit_tokens: int, actual_hit_tokens: int) -> None:
        self.routes[reason] = self.routes.get(reason, 0) + 1
        self.route_expected_hit_tokens_total += expected_hit_tokens
        self.route_actual_hit_tokens_total += actual_hit_tokens


def read_load(stats: EngineStats, counters: Counters) -> EngineStats:
    """A daemon's load as Admin.GetStats reports it and a router weighs it (/metrics, services.metrics):
    its engine's stats snapshot (engine.boundary.EngineStats: EngineLoop.stats, at most one step old, or
    a fresh one) with the requests the daemon holds before its engine (a prefill server's queue for a
    prefill slot) counted as waiting."""
    return dataclasses.replace(stats, num_waiting=stats.num_waiting + counters.num_waiting)


class AdminService(pb_grpc.AdminServicer):
    """`lora_root`: LoadLoraAdapter reads only adapter folders inside it (a path relative to it, or an
    absolute one inside it; NOT_FOUND otherwise, the same for a path outside as for a missing one);
    without it run-time loads are off (FAILED_PRECONDITION).
    `mirrors`: engines of the same process that load and unload the same adapters (`pdserve serve`).
    `drain`: the daemon's stop event (Drain sets it, as SIGTERM does)."""

    def __init__(
        self,
        role: str,
        loop: EngineLoop,
        counters: Counters,
        lora_root: str | None = None,
        mirrors: Sequence[EngineLoop] = (),
        drain: asyncio.Event | None = None,
    ):
        self.role, self.loop, self.counters = role, loop, counters
        self.lora_root = Path(lora_root).resolve() if lora_root else None
        self.mirrors = list(mirrors)
        self.drain = drain

    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        if self.drain is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon drains on SIGTERM only")
        already = self.drain.is_set()
        self.drain.set()
        log.warning("drain asked for over Admin.Drain")
        return pb.DrainResponse(already_draining=already)

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context) -> pb.LoraAdapterInfo:
        if not request.name or not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name and path are required")
        if self.lora_root is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "run-time adapter loads are off: start the daemon with --lora-root DIR",
            )
        path = (self.lora_root / request.path).resolve()  # (an absolute path stays itself)
        if not path.is_relative_to(self.lora_root) or not (path / "adapter_config.json").is_file():
            # one answer for outside the root and for missing: a caller learns nothing of other paths
            await context.abort(grpc.StatusCode.NOT_FOUND, "path: no adapter folder there under --lora-root")
        try:  # read off the engine thread (a file), then added on every engine of the process
            adapter = await asyncio.to_thread(self.loop.engine.read_adapter, request.name, str(path))
            for mirror in self.mirrors:
                await mirror.call(Utility("add_adapter", (adapter,)))
            adapter = await self.loop.call(Utility("add_adapter", (adapter,)))
        except LoraLoadError as e:  # INVALID_ARGUMENT, ALREADY_EXISTS, FAILED_PRECONDITION (LoRA off)
            await context.abort(grpc.StatusCode[e.status], str(e))
        states = await self.loop.call(Utility("list_adapters"))
        return next(adapter_info(a) for a in states if a.adapter.name == adapter.name)

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context):
        for mirror in self.mirrors:
            await mirror.call(Utility("remove_adapter", (request.name,)))
        if not await self.loop.call(Utility("remove_adapter", (request.name,))):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.name!r} is not loaded")
        return pb.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(self, request, context) -> pb.LoraAdapterList:
        states = await self.loop.call(Utility("list_adapters"))
        config = self.loop.engine.config
        return pb.LoraAdapterList(
            adapters=[adapter_info(a) for a in states],
            num_slots=config.max_loras,
            max_rank=config.max_lora_rank,
        )

    async def GetStats(self, request, context) -> pb.ServerStats:
        load, c = read_load(await self.loop.call(Utility("stats")), self.counters), self.counters
        return pb.ServerStats(
            role=self.role,
            num_blocks=load.num_blocks,
            num_free_blocks=load.num_free_blocks,
            num_cached_blocks=load.num_cached_blocks,
            prefix_cache_queries_total=load.prefix_cache_queries,
            prefix_cache_hits_total=load.prefix_cache_hits,
            prefix_cache_evictions_total=load.prefix_cache_evictions,
            num_host_blocks=load.num_host_blocks,
            num_host_cached_blocks=load.num_host_cached_blocks,
            num_host_staged_blocks=load.num_host_staged_blocks,
            prefix_cache_host_hits_total=load.prefix_cache_host_hits,
            num_host_offloads_total=load.num_host_offloads,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_requests_total=c.num_requests_total,
            num_incoming=load.num_incoming,
            num_transfers_total=c.num_transfers_total,
            kv_transfer_seconds_total=c.kv_transfer_seconds_total,
            kv_transfer_bytes_total=c.kv_transfer_bytes_total,
            num_transfer_failures_total=c.num_transfer_failures_total,
            kv_frames_sent_total=c.kv_frames_sent_total,
            kv_frames_after_compute_total=c.kv_frames_after_compute_total,
            route_expected_hit_tokens_total=c.route_expected_hit_tokens_total,
            route_actual_hit_tokens_total=c.route_actual_hit_tokens_total,
            engine=self.loop.engine_info,
            **speculation_fields(load.speculation),
        )


def speculation_fields(stats: SpeculationStats | None) -> dict[str, int | list[int]]:
    """ServerStats' spec_decode_* fields of the engine's speculation counters (none when off)."""
    if stats is None:
        return {}
    return dict(
        spec_decode_num_drafts_total=stats.num_drafts,
        spec_decode_num_draft_tokens_total=stats.num_draft_tokens,
        spec_decode_num_accepted_tokens_total=stats.num_accepted_tokens,
        spec_decode_accepted_per_position_total=stats.accepted_per_position,
    )


def adapter_info(state: AdapterState) -> pb.LoraAdapterInfo:
    adapter = state.adapter
    return pb.LoraAdapterInfo(
        name=adapter.name,
        path=adapter.path,
        rank=adapter.rank,
        target_modules=adapter.targets,
        fingerprint=adapter.fingerprint,
        resident=state.resident,
    )
