"""The host-memory tier under the block pool: which host slot holds which cached block, and the slots a
prefill server's streams stage their KV in. No device code (engine/host_kv.py moves the bytes).

A slot is one block's KV in host memory (all of the cache's rows), and is in exactly one of four states:
  * free: holds nothing;
  * in flight: a device block evicted from the pool is being copied into it (pinned: not evictable, and
    not yet readable until `landed`);
  * cached: holds the KV of the full block known by its hash, in an LRU set (oldest first), evictable;
  * staged: reserved by a prefill stream whose gathered KV waits in host memory for its reader
    (`reserve`/`unreserve`): counted against the tier's size, holds nothing the index finds.
`store` takes free slots first, then evicts the least recently used cached ones (`on_evict` is told the
hash). A lookup that hits a cached slot moves it to the recent end. Staging is back-pressure: `reserve`
fails (changes nothing) when free and cached slots together are too few.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable


class HostBlockPool:
    """`num_slots` host slots of one block each."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.on_evict: Callable[[int], None] | None = None  # told each evicted slot's hash
        self.slot_hash: list[int | None] = [None] * num_slots
        self._free: collections.deque[int] = collections.deque(range(num_slots))
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, oldest first
        self._in_flight: set[int] = set()
        self._by_hash: dict[int, int] = {}  # hash -> slot (in flight or cached)
        self._staged: list[int] = []  # slots reserved by streams
        self.num_stored = 0  # blocks copied in since start
        self.num_evictions = 0

    # ---- counts ---------------------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_available(self) -> int:
        """Slots store() or reserve() may take: free, then cached ones evicted."""
        return len(self._free) + len(self._lru)

    # ---- the index ------------------------------------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        """The slot holding `block_hash` (cached or in flight), None when none does. Changes nothing."""
        return self._by_hash.get(block_hash)

    def touch(self, slots: Iterable[int]) -> None:
        """Slots found by lookup are used now: cached ones become the most recently used."""
        for slot in slots:
            if slot in self._lru:
                self._lru.move_to_end(slot)

    def is_readable(self, slot: int) -> bool:
        return slot in self._lru

    # ---- blocks in ------------------------------------------------------------------------------------
    def store(self, block_hash: int) -> int | None:
        """A slot for a device block that leaves the pool with `block_hash`, in flight until `landed`.
        None: the hash is held already (made the most recently used), or no slot is free or evictable."""
        held = self._by_hash.get(block_hash)
        if held is not None:
            self.touch([held])
            return None
        slot = self._take()
        if slot is None:
            return None
        self._by_hash[block_hash] = slot
        self.slot_hash[slot] = block_hash
        self._in_flight.add(slot)
        self.num_stored += 1
        return slot

    def landed(self, slots: Iterable[int]) -> None:
        """The copies into these in-flight slots are complete: they are cached (most recently used)."""
        for slot in slots:
            self._in_flight.remove(slot)
            self._lru[slot] = None

    def _take(self) -> int | None:
        if self._free:
            return self._free.popleft()
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        evicted = self.slot_hash[slot]
        del self._by_hash[evicted]
        self.slot_hash[slot] = None
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(evicted)
        return slot

    # ---- staging --------------------------------------------------------------------------------------
    @property
    def num_staged(self) -> int:
        return len(self._staged)

    def reserve(self, num: int) -> bool:
        """Takes `num` slots for a stream's staged KV (evicting cached blocks as needed); False when fewer
        are free or evictable (nothing changes)."""
        if num > self.num_available:
            return False
        self._staged += [self._take() for _ in range(num)]
        return True

    def unreserve(self, num: int) -> None:
        """Gives back `num` slots reserve() took."""
        if num > len(self._staged):
            raise ValueError(f"{num} staged slots given back, {len(self._staged)} reserved")
        for _ in range(num):
            self._free.append(self._staged.pop())

    def check(self) -> None:
        """Asserts the invariants (tests): every slot free, in flight, cached or staged, exactly once."""
        sets = [set(self._free), set(self._lru), self._in_flight, set(self._staged)]
        assert sum(map(len, sets)) == self.num_slots == len(set().union(*sets))
        for slot in range(self.num_slots):
            holds = slot in self._lru or slot in self._in_flight
            assert (self.slot_hash[slot] is not None) == holds, slot
        for block_hash, slot in self._by_hash.items():
            assert self.slot_hash[slot] == block_hash
        assert len(self._by_hash) == len(self._lru) + len(self._in_flight)
