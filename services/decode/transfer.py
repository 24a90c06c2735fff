"""The decode side of a disaggregated prefill: a request's prompt KV streamed in from a prefill replica once
the engine has allocated its blocks (TransferReady). Routing's choice of replica is tried in turn (a busy
one waited for, a failed one avoided), each attempt's KV chunks inserted as they arrive (InsertKV, on the
engine thread, in order), the replica's first token checked (prefillers.check_first_token) and handed to
the engine (RemoteKVDone), which starts the decoding; when no replica could, this engine prefills the
prompt itself (RemoteKVFailed) or the request fails UNAVAILABLE."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from pdserve.engine.boundary import InsertKV, KVInsertError, RemoteKVDone, RemoteKVFailed, TransferReady
from pdserve.engine.core.request import Request
from pdserve.engine.multihost import is_multi_process
from pdserve.kvtransfer import chunk_sharding
from pdserve.services.admin import Counters
from pdserve.services.decode.config import DecodeConfig
from pdserve.services.decode.errors import ServiceError, checked
from pdserve.services.decode.prefillers import FirstToken, PrefillCall, PrefillError, check_first_token
from pdserve.services.decode.routing import PrefillPool, Route
from pdserve.services.decode.timeline import Timeline
from pdserve.services.engine_loop import EngineLoop

log = logging.getLogger(__name__)


class KVTransfers:
    """Prompt KV from `pool`'s replicas into `loop`'s engine, counted in `counters`; `config`: how many
    replicas a request tries, and whether this engine prefills when none could."""

    def __init__(self, loop: EngineLoop, pool: PrefillPool, config: DecodeConfig, counters: Counters):
        self.loop, self.pool, self.config, self.counters = loop, pool, config, counters
        self.engine = loop.engine
        self.layout = self.engine.kv_layout
        # KV arriving from prefill servers: put on this mesh as it arrives, or, in a multi-process engine,
        # kept on the host until its insert (every process puts its own shards: engine.multihost)
        self.sharding = None if is_multi_process() else chunk_sharding(self.engine.mesh, self.layout)

    async def receive(
        self,
        request: Request,
        outputs: asyncio.Queue,
        time_remaining: float | None,
        routed: dict,
        hint: str | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        """For a request queued to receive its KV (GenerationCore's AddRequest with ReceiveKV): streams the
        KV of the prompt blocks it lacks in from a replica (after those found in this engine's prefix
        cache) and starts its decoding: its first token then comes on its stream (`outputs`) like the
        rest. `routed` receives the replica chosen, the prompt tokens it was expected to hold and those it
        did. `hint`: a replica to use first when it is one of the pool's (else ignored, and said so in
        `routed`). `timeline`: its moments (services.decode.timeline) are marked there.

        Returns without a transfer when the request is computed here: short or nearly all cached
        (DecodeConnector), or no replica could prefill it (fallback); ServiceError UNAVAILABLE when no
        replica could and there is no fallback.
        """
        rid = request.request_id
        ready = checked(await outputs.get())
        if not isinstance(ready, TransferReady):
            raise RuntimeError(f"{type(ready).__name__} before the request's blocks were allocated")
        timeline = timeline or Timeline(time.monotonic())
        timeline.mark("admitted")
        if not ready.num_external_tokens:
            return
        num_tokens = len(request.prompt_ids)
        # the prompt's blocks a prefix cache can serve (never the last token): routing and the held head
        hashes = request.prefix_hashes(self.engine.config.block_size)
        held = hashes[: ready.first_block]
        tried: set[str] = set()
        busy: dict[str, int] = {}  # replicas that answered busy, and their retry hints (ms)
        for attempt in range(self.config.max_attempts):
            route = self.pool.pick(exclude=tried, block_hashes=hashes, num_tokens=num_tokens, prefer=hint)
            if route is None and busy:  # every replica left is busy: wait for the soonest, then again
                await asyncio.sleep(min(busy.values()) / 1000)
                tried -= busy.keys()
                busy.clear()
                route = self.pool.pick(exclude=tried, block_hashes=hashes, num_tokens=num_tokens, prefer=hint)
            if route is None:
                break
            if hint is not None and not tried and route.reason != "hint":
                routed["prefill_hint"] = f"ignored {hint}: not one of this server's healthy prefill replicas"
            replica = route.replica
            tried.add(replica.name)
            try:
                first, started, nbytes = await self._transfer(
                    route, request, time_remaining, hashes, held, attempt, timeline
                )
                prompt_logprobs = None if first.prompt_logprobs is None else tuple(first.prompt_logprobs)
                done = RemoteKVDone(
                    rid,
                    first.token,
                    first.logprobs,
                    first.num_cached_tokens,
                    attempt,
                    prompt_logprobs,
                    first.forks,
                    first.draft_aux,
                )
                timeline.mark("kv_done")
                try:
                    await self.loop.call(done)  # after every InsertKV of the attempt
                except KVInsertError as e:  # the attempt is discarded, the blocks are written again
                    raise PrefillError(str(e), replica_down=False) from None
            except PrefillError as e:
                where = {"request_id": request.request_id, "replica": replica.name}
                if e.retry_after_ms is not None:  # up, its cache still known: another one, or later
                    busy[replica.name] = e.retry_after_ms
                    log.info("prefill replica busy: %s", e, extra=where)
                    continue
                if e.replica_down:
                    replica.mark_failed()
                self.counters.num_transfer_failures_total += 1
                log.warning("prefill failed: %s", e, extra=where)
                continue
            timeline.mark("decoding")
            self._count_route(route, first.num_cached_tokens, hashes, routed)
            self.counters.num_transfers_total += 1
            self.counters.kv_transfer_seconds_total += time.perf_counter() - started
            self.counters.kv_transfer_bytes_total += nbytes
            return
        if self.config.fallback_local:
            await self.loop.call(RemoteKVFailed(rid))
            self.counters.num_local_fallbacks_total += 1
            return
        raise ServiceError(
            grpc.StatusCode.UNAVAILABLE, f"no prefill replica could serve the request (tried {sorted(tried)})"
        )

    def _count_route(self, route: Route, actual: int, hashes: list[int], routed: dict) -> None:
        """Counts the choice and its hit (`actual` prompt tokens found cached there; Route.found corrects
        a replica that held less than its events said)."""
        expected = route.expected_hit_tokens
        self.counters.count_route(route.reason, expected, actual)
        routed.update(replica=route.replica.name, expected_hit_tokens=expected, actual_hit_tokens=actual)
        route.found(actual, hashes, self.engine.config.block_size)

    async def _transfer(
        self,
        route: Route,
        request: Request,
        timeout: float | None,
        hashes: list[int],
        held: list[int],
        attempt: int,
        timeline: Timeline,
    ) -> tuple[FirstToken, float, int]:
        """One attempt: (first token, perf_counter when the first KV arrived, KV bytes received). Each chunk
        is inserted as it arrives (InsertKV of transfer `attempt`, on the engine thread, in order).
        `hashes`: the prompt's block hashes; `held`: the leading ones this engine holds. On failure the
        request's blocks stay allocated (to be refilled by the next try).

        Closing the prefill stream (aclosing) cancels it at once when this request is cancelled.
        """
        replica, rid = route.replica, request.request_id
        with route.dispatched(len(request.prompt_ids), hashes):  # (counted against it meanwhile)
            first, started, nbytes = None, None, 0
            async with contextlib.aclosing(
                replica.prefill(
                    request, self.layout, self.sharding, PrefillCall(timeout, held, timeline.traceparent)
                )
            ) as items:
                async for item in items:
                    if isinstance(item, FirstToken):
                        first = item
                    else:
                        if started is None:
                            started = time.perf_counter()
                            timeline.mark("kv_first")
                        nbytes += item.data.nbytes
                        self.loop.submit(InsertKV(rid, item, len(held), attempt))
            if first is None:
                raise PrefillError(f"{replica.name}: no first token")
            width = self.engine.draft_aux_width
            check = (first, request, self.engine.model.config.vocab_size, replica.name, width)
            if first.prompt_logprobs:  # an entry at a time, by the prompt's size: off the event loop
                await asyncio.to_thread(check_first_token, *check)
            else:
                check_first_token(*check)
            return first, started or time.perf_counter(), nbytes
