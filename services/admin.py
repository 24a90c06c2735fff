"""The Admin service: blocks used and free, queue depths, requests served."""

from __future__ import annotations

import dataclasses

from pdserve.v1 import admin_pb2 as pb
from pdserve.v1 import admin_pb2_grpc as pb_grpc
from services.engine_loop import EngineLoop

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
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)  # finish reason / error -> count

    def count_outcome(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, role: str, loop: EngineLoop, counters: Counters):
        self.role, self.loop, self.counters = role, loop, counters

    async def GetStats(self, request, context) -> pb.ServerStats:
        def snapshot(engine):
            s = engine.scheduler
            return pb.ServerStats(
                role=self.role,
                num_blocks=engine.allocator.num_blocks,
                num_free_blocks=engine.allocator.num_free,
                num_running=len(s.running) + len(s.prefilling),
                num_waiting=len(s.waiting) + self.counters.num_waiting,
                num_requests_total=self.counters.num_requests_total,
                num_incoming=s.num_incoming,
                num_transfers_total=self.counters.num_transfers_total,
                kv_transfer_seconds_total=self.counters.kv_transfer_seconds_total,
                kv_transfer_bytes_total=self.counters.kv_transfer_bytes_total,
                num_transfer_failures_total=self.counters.num_transfer_failures_total,
            )

        return await self.loop.call(snapshot)
