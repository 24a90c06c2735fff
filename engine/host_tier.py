"""The host tier (--kv-offloading-size) as one object: its pool, its bytes, its copies and its loads.

Three parts, one per concern, held together here:
  * the pool (engine/core/host_pool.py, inside the KV manager): which slot holds which cached block; the
    KV manager's evictions and lookups decide, and owe copies (KVCacheManager.take_offloads/take_loads);
  * the bytes (engine/host_kv.py HostKVStore): the slots in host memory and the device copies both ways;
  * the copies owed and the loads under way (this module): `start_copies` starts them, `finish_loads`
    writes the loads whose bytes arrived into their blocks.

The engine calls `start_copies` after anything that may allocate blocks (an eviction hands a block out
again) and before the next write of the cache: a block evicted to the tier is read before anything
overwrites it. The runner knows nothing of the tier.
"""

from __future__ import annotations

from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.host_kv import HostKVStore, HostLoad
from pdserve.engine.model_runner import ModelRunner


class HostTier:
    """The host tier of one engine: `scheduler`'s KV manager's pool, the slots' bytes shaped as `runner`'s
    cache blocks."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler):
        self.runner = runner
        self.scheduler = scheduler
        self.pool = scheduler.kv.host
        self.store = HostKVStore(runner.cache, self.pool.num_slots)
        # loads under way: (request id, its number in Scheduler.loading, the load)
        self._loads: list[tuple[str, int, HostLoad]] = []

    @property
    def has_loads(self) -> bool:
        """Loads are owed or under way (a step may have nothing else to wait for)."""
        return bool(self._loads) or self.scheduler.kv.has_loads

    def start_copies(self) -> None:
        """Starts the copies owed since the last call, and takes the offloads that landed. Loads read their
        slots first (an offload landing may reuse one); evicted blocks are read before any later write of
        the cache (the reads are dispatched now)."""
        kv = self.scheduler.kv
        for request_id, pairs in kv.take_loads():  # (admitted in the last schedule)
            number = self.scheduler.loading.get(request_id)
            if number is not None:  # (None: it ended before its load started: its blocks are freed)
                self._loads.append((request_id, number, self.store.start_load(pairs)))
        offloads = kv.take_offloads()
        if offloads:
            self.store.offload(self.runner.cache, offloads)
        if self.store.num_in_flight:
            kv.offloads_landed(self.store.landed())

    def finish_loads(self, wait: bool) -> None:
        """Writes the loads whose bytes are on the devices (all of them with `wait`: nothing else can run)
        into their blocks; their requests may be scheduled now. A request that ended meanwhile gets nothing
        written (its blocks may be another's)."""
        self.start_copies()
        pending, done = [], []
        for request_id, number, load in self._loads:
            if not (wait or load.ready):
                pending.append((request_id, number, load))
                continue
            if self.scheduler.loading.get(request_id) == number:
                self.runner.cache = self.store.finish_load(self.runner.cache, load)
            done.append((request_id, number))
        self._loads = pending
        self.scheduler.kv_loaded(done)

    def warmup(self) -> int:
        """Compiles the copies both ways for every batch size; returns how many variants."""
        return self.store.warmup(self.runner.cache)
