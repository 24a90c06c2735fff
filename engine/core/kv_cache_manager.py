"""The KV cache manager: each request's block table, and automatic prefix caching on top of the block pool.

Full blocks are known by a chained hash: hash(parent block's hash, the block's token ids, the request's
adapter fingerprint or none), so a block matches only when every token before it matches too, and a LoRA
request only ever shares blocks computed with the same adapter. A new request looks up its longest cached
prefix (`lookup`) and takes those blocks with a reference each (`allocate`); it computes only the rest.
Blocks are registered in the cache as they fill with computed tokens (`cache_blocks`), prompt and
generated tokens alike; a partial last block is never shared. A finished, aborted or preempted request
gives its references back (`free`); its hashed blocks stay cached, in an LRU set, until allocation needs
them. With `record_events()`, what the cache gains and loses is kept as KV events (engine/core/kv_events.py)
until `take_events()`. A hybrid model's sliding groups (engine.core.kv_groups) hold a ring of blocks per
request besides its table, never cached.

With a host tier (`host_blocks`, engine/core/host_pool.py), a cached block evicted from the device pool is
copied into a host slot (`take_offloads`: the engine copies it before anything writes the block again),
and a lookup continues past the device's hits into the host tier's (`lookup_host`): those blocks get new
device blocks at allocation, filled from their slots (`take_loads`; the request waits for them) and
entered in the device index as computed blocks are, when the request's next step completes a block. No
device code; the scheduler is the only caller.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from pdserve.engine.core.block_pool import BlockPool, blocks_for_tokens
from pdserve.engine.core.host_pool import HostBlockPool
from pdserve.engine.core.kv_events import DEVICE, HOST, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.engine.core.kv_groups import BlockTables


def hash_block(parent: int | None, token_ids: Sequence[int], extra_key: str | None = None) -> int:
    """The 64-bit hash of one full block, chained on its parent's (None: the first block)."""
    h = hashlib.sha256()
    h.update(b"\x00" * 9 if parent is None else b"\x01" + parent.to_bytes(8, "big"))
    h.update(np.asarray(token_ids, "<u4").tobytes())
    if extra_key is not None:
        h.update(b"\x02" + extra_key.encode())
    return int.from_bytes(h.digest()[:8], "big")


def hash_blocks(
    token_ids: Sequence[int], block_size: int, extra_key: str | None = None, start: Sequence[int] = ()
) -> list[int]:
    """Hashes of every full block of `token_ids`, continuing the chain `start` (hashes already known)."""
    hashes = list(start)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key))
    return hashes


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached (on the device or in the host tier)
    host_hits: int = 0  # of the hits, tokens loaded from the host tier


@dataclasses.dataclass
class _Table:
    block_ids: list[int] = dataclasses.field(default_factory=list)
    hashes: list[int] = dataclasses.field(default_factory=list)  # of its full blocks, as far as computed
    num_registered: int = 0  # leading blocks already in the cache index (or found there)
    num_released: int = 0  # leading blocks given back early: out of every layer's sliding window
    rings: list[list[int]] = dataclasses.field(default_factory=list)  # of each sliding group (hybrid)


class KVCacheManager:
    """Block tables of the requests of one engine; `enable_caching=False` turns prefix reuse off.
    `ring_blocks`: KVGroups.ring_blocks, the ring size of each group after the first (hybrid models).
    `host_blocks`: slots of the host tier (0: none; engine.config.EngineConfig.kv_offloading_size)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        ring_blocks: Sequence[int] = (),
        host_blocks: int = 0,
    ):
        self.pool = BlockPool(num_blocks)
        self.ring_blocks = tuple(ring_blocks[1:])
        self.block_size = block_size
        self.enable_caching = enable_caching and not self.ring_blocks  # a ring's blocks get overwritten
        self.stats = PrefixCacheStats()
        self._tables: dict[str, _Table] = {}
        self._events: list[KVEvent] | None = None
        self.host = HostBlockPool(host_blocks) if host_blocks else None
        self.pool.on_evict = self._evicted
        if self.host is not None:
            self.host.on_evict = self._host_evicted
        self._offloads: list[tuple[int, int]] = []  # (device block, host slot) to copy out
        self._loads: list[tuple[str, list[tuple[int, int]]]] = []  # request id, (host slot, block) pairs
        # what BlockStored said of each cached block (parent, tokens, adapter): a block the host tier
        # takes is announced again there (kept while events are recorded)
        self._stored: dict[int, tuple[int | None, tuple[int, ...], str | None]] = {}

    def record_events(self) -> None:
        """Starts keeping KV events; the first says the cache is empty (it may not be: cached blocks
        registered before are forgotten by readers, and found by lookups here until evicted)."""
        if self._events is None:
            self._events = [AllBlocksCleared()]

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first (none unless recording)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def _record_removed(self, block_hash: int, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], medium))

    # ---- the host tier --------------------------------------------------------------------------------
    def _evicted(self, block_hash: int, block: int) -> None:
        """A cached device block is taken for reuse: its KV goes to a host slot (when the tier has one)."""
        if self._events is not None:
            self._record_removed(block_hash, DEVICE)
        slot = None if self.host is None else self.host.store(block_hash)
        if slot is not None:
            self._offloads.append((block, slot))
            info = self._stored.get(block_hash)
            if self._events is not None and info is not None:
                parent, tokens, lora = info
                self._events.append(
                    BlockStored([block_hash], parent, list(tokens), self.block_size, lora, HOST)
                )
        elif self.host is None or self.host.lookup(block_hash) is None:
            self._stored.pop(block_hash, None)

    def _host_evicted(self, block_hash: int) -> None:
        if self._events is not None:
            self._record_removed(block_hash, HOST)
        if self.pool.lookup(block_hash) is None:
            self._stored.pop(block_hash, None)

    def take_offloads(self) -> list[tuple[int, int]]:
        """(device block, host slot) copies owed since the last call: each block was evicted and handed
        out again, so the copy must be made before anything writes into it; `offloads_landed` follows."""
        offloads, self._offloads = self._offloads, []
        return offloads

    def offloads_landed(self, slots: Sequence[int]) -> None:
        """Those slots' copies are complete: lookups may load them."""
        self.host.landed(slots)

    def take_loads(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """The copies owed since the last call for blocks allocated from host hits: each request's (host
        slot, device block) pairs. Read the slots before any offload lands (`offloads_landed`: one may
        reuse a slot); write the blocks before any step reads them."""
        loads, self._loads = self._loads, []
        return loads

    @property
    def has_loads(self) -> bool:
        """Loads are owed (take_loads)."""
        return bool(self._loads)

    def lookup_host(self, block_hashes: Sequence[int]) -> list[int]:
        """The host slots holding the leading run of `block_hashes` (the blocks after the device's hits)
        whose copies have landed. Changes nothing."""
        if self.host is None or not self.enable_caching:
            return []
        slots = []
        for h in block_hashes:
            slot = self.host.lookup(h)
            if slot is None or not self.host.is_readable(slot):
                break
            slots.append(slot)
        return slots

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        return [] if table is None else table.block_ids

    def block_tables(self, request_id: str) -> BlockTables:
        """The request's table of every group: its blocks (the table itself, not a copy: this runs for every
        row of every step), then each ring's blocks repeated over as many."""
        table = self._tables.get(request_id)
        ids = [] if table is None else table.block_ids
        rings = [[]] * len(self.ring_blocks) if table is None else table.rings
        repeated = (
            tuple(r[j % cap] for j in range(len(ids))) for r, cap in zip(rings, self.ring_blocks, strict=True)
        )
        return BlockTables((ids, *repeated))

    def _blocks_needed(self, table: _Table | None, num_tokens: int, have: int) -> int:
        """New blocks for `num_tokens` tokens: the table's beyond `have`, and each ring's up to its size."""
        n = blocks_for_tokens(num_tokens, self.block_size)
        rings = table.rings if table else [[] for _ in self.ring_blocks]
        return max(0, n - have) + sum(
            max(0, min(n, cap) - len(r)) for r, cap in zip(rings, self.ring_blocks, strict=True)
        )

    def lookup(self, token_ids: Sequence[int], extra_key: str | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of `token_ids`, whole blocks only, and never the last
        token (its logits must be computed to sample the next one). Changes nothing."""
        if not self.enable_caching:
            return []
        return self.lookup_hashes(hash_blocks(token_ids[: len(token_ids) - 1], self.block_size, extra_key))

    def lookup_hashes(self, block_hashes: Sequence[int]) -> list[int]:
        """lookup() of a prompt whose blocks' hashes are known (Request.prefix_hashes)."""
        if not self.enable_caching:
            return []
        hits = []
        for h in block_hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether `allocate` would succeed (`cached`: device hits; host hits take new blocks as the rest)."""
        table = self._tables.get(request_id)
        have = len(table.block_ids) if table else len(cached)
        unreferenced_hits = sum(self.pool.ref_counts[b] == 0 for b in cached) if table is None else 0
        return self._blocks_needed(table, num_tokens, have) <= self.pool.num_available - unreferenced_hits

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        cached: Sequence[int] = (),
        token_ids: Sequence[int] = (),
        loaded: Sequence[int] = (),
    ) -> bool:
        """Grows the request's table to hold `num_tokens` tokens (check and do: False changes nothing).

        On a request's first allocation, `cached` are the blocks lookup() found for `token_ids` (counted
        in the prefix-cache stats): they are shared (one more reference each) and become the head of its
        table. `loaded`: the host slots lookup_host() found after them: their blocks come next, new device
        blocks filled from the slots (take_loads).
        """
        if not self.can_allocate(request_id, num_tokens, cached):
            return False
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = _Table(rings=[[] for _ in self.ring_blocks])
            if cached:
                self.pool.touch(cached)
                table.block_ids = list(cached)
                table.hashes = [self.pool.block_hash[b] for b in cached]  # found by them: no rehashing
                table.num_registered = len(cached)
                self.stats.hits += len(cached) * self.block_size
            if loaded:
                self._load(request_id, table, loaded)
            self.stats.queries += len(token_ids)
        need = blocks_for_tokens(num_tokens, self.block_size) - len(table.block_ids)
        if need > 0:
            table.block_ids.extend(self.pool.allocate(need))
        for ring, cap in zip(table.rings, self.ring_blocks, strict=True):
            grow = min(len(table.block_ids), cap) - len(ring)
            if grow > 0:
                ring.extend(self.pool.allocate(grow))
        return True

    def _load(self, request_id: str, table: _Table, slots: Sequence[int]) -> None:
        """A new table's blocks after its device hits, from host slots: new blocks, whose KV the engine
        copies in (take_loads); their hashes are known, and they enter the device index when cache_blocks
        next registers the request's blocks (after a step: never before the copy)."""
        table.hashes += [self.host.slot_hash[s] for s in slots]
        self.host.touch(slots)  # (most recently used: the evictions below take others first)
        blocks = self.pool.allocate(len(slots))
        self._loads.append((request_id, list(zip(slots, blocks, strict=True))))
        table.block_ids += blocks
        self.stats.hits += len(slots) * self.block_size
        self.stats.host_hits += len(slots) * self.block_size

    def cache_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed: int,
        extra_key: str | None = None,
        lora_name: str | None = None,
        block_hashes: Sequence[int] = (),
    ) -> None:
        """Registers the request's blocks that are now full of computed tokens (token_ids: all of them).
        `lora_name`: the adapter `extra_key` fingerprints, named in the events; `block_hashes`: those of
        the full blocks as far as known (Request.block_hashes), not hashed again."""
        table = self._tables.get(request_id)
        if not self.enable_caching or table is None:
            return
        num_full = min(num_computed // self.block_size, len(table.block_ids))
        if num_full <= table.num_registered:
            return
        known = block_hashes if len(block_hashes) > len(table.hashes) else table.hashes
        table.hashes = hash_blocks(
            token_ids[: num_full * self.block_size], self.block_size, extra_key, known[:num_full]
        )
        stored = [
            i
            for i in range(table.num_registered, num_full)
            if self.pool.register(table.block_ids[i], table.hashes[i])
        ]
        table.num_registered = num_full
        if self._events is not None and stored:
            self._record_stored(table.hashes, stored, token_ids, lora_name)

    def _record_stored(self, hashes, stored: list[int], token_ids, lora_name: str | None) -> None:
        """One BlockStored per run of consecutive newly registered blocks (a block that was already
        cached in another copy is not stored again)."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for i in stored:
            self._stored[hashes[i]] = (
                hashes[i - 1] if i else None,
                tuple(token_ids[i * bs : (i + 1) * bs]),
                lora_name,
            )
        for run in runs:
            self._events.append(
                BlockStored(
                    block_hashes=[hashes[i] for i in run],
                    parent_hash=hashes[run[0] - 1] if run[0] else None,
                    token_ids=list(token_ids[run[0] * bs : (run[-1] + 1) * bs]),
                    block_size=bs,
                    lora_name=lora_name,
                )
            )

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Gives `child_id` a table for the parent's first `num_tokens` tokens (its prompt): the blocks they
        fill wholly are shared (a reference each), the partial last one and every ring block (hybrid
        models; a ring is overwritten in place) are new blocks the caller fills by device copies. Returns
        those copies, (source, destination) block ids; None (nothing changed) when the pool is short."""
        table = self._tables[parent_id]
        full = num_tokens // self.block_size
        partial = blocks_for_tokens(num_tokens, self.block_size) - full
        if partial + sum(len(r) for r in table.rings) > self.pool.num_available:
            return None
        child = _Table(
            block_ids=table.block_ids[:full],
            hashes=table.hashes[:full],
            num_registered=min(table.num_registered, full),
            num_released=min(table.num_released, full),
        )
        self.pool.touch(child.block_ids[child.num_released :])
        copies = []
        if partial:
            (block,) = self.pool.allocate(1)
            copies.append((table.block_ids[full], block))
            child.block_ids.append(block)
        for ring in table.rings:
            child.rings.append(self.pool.allocate(len(ring)))
            copies.extend(zip(ring, child.rings[-1], strict=True))
        self._tables[child_id] = child
        return copies

    def release_before(self, request_id: str, num_blocks: int) -> None:
        """Gives back the references of the request's first `num_blocks` blocks, which none of its queries
        reads any more (every layer attends within a sliding window). They keep their places in its table:
        attention never reads them unmasked, and cached ones stay in the prefix cache until evicted."""
        table = self._tables.get(request_id)
        if table is None:
            return
        end = min(num_blocks, len(table.block_ids))
        if end > table.num_released:
            self.pool.release(table.block_ids[table.num_released : end][::-1])
            table.num_released = end

    def free(self, request_id: str) -> None:
        """Gives back the request's references (idempotent). Its cached blocks are kept, tail first in the
        LRU order, so a shared head outlives the tails that only this request used."""
        table = self._tables.pop(request_id, None)
        if table is not None:
            self.pool.release(table.block_ids[table.num_released :][::-1])
            for ring in table.rings:
                self.pool.release(ring[::-1])
