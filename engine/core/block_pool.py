"""The blocks of the paged KV cache: reference counts, the free list, and the prefix cache's block index.

Every block is in exactly one of three states:
  * referenced (ref count > 0): in the block table of one or more requests;
  * cached: unreferenced, but still holding the KV of a full block known by its hash; it sits in an LRU
    set and may be taken back by a request whose prompt starts with the same tokens, or evicted;
  * free: unreferenced and holding nothing anyone will look up.
`allocate` takes free blocks first, then evicts the least recently used cached blocks. Releasing a block
that is not referenced raises: double frees surface as bugs instead of silent corruption. No device code.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class OutOfBlocksError(RuntimeError):
    """allocate() was called for more blocks than num_available."""


class BlockPool:
    """The block ids of a cache with `num_blocks` blocks, and which full-block hash each one holds."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.on_evict: Callable[[int, int], None] | None = None  # told each evicted block's hash and id
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, oldest first
        self._by_hash: dict[int, int] = {}  # hash -> block id (referenced or cached)
        self.num_evictions = 0

    # ---- counts ---------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Unreferenced blocks that hold nothing cached."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their cached KV (reclaimable: allocate evicts them)."""
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out: free, then cached ones evicted."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Referenced blocks (what a leak check counts: cached blocks are not held by anyone)."""
        return self.num_blocks - self.num_available

    # ---- the prefix index ----------------------------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)

    def register(self, block_id: int, block_hash: int) -> bool:
        """Records that referenced block `block_id` holds the full block `block_hash`. False (nothing
        recorded) when another block already holds that hash: the first one stays the cached copy."""
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not referenced")
        if block_hash in self._by_hash or self.block_hash[block_id] is not None:
            return False
        self._by_hash[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True

    # ---- references ----------------------------------------------------------------------------------
    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds a reference to blocks found by lookup (cached ones leave the LRU set)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._lru[b]
            self.ref_counts[b] += 1

    def allocate(self, num: int) -> list[int]:
        """`num` blocks with one reference each: free ones first, then the least recently used cached."""
        if num > self.num_available:
            raise OutOfBlocksError(f"asked for {num} blocks, {self.num_available} available")
        blocks = []
        for _ in range(num):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._by_hash[self.block_hash[b]]
                if self.on_evict is not None:
                    self.on_evict(self.block_hash[b], b)
                self.block_hash[b] = None
                self.num_evictions += 1
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def release(self, block_ids: Sequence[int]) -> None:
        """Drops one reference from each block. Unreferenced blocks that hold a hash become cached, most
        recently used last: give the blocks in the order they should be evicted (a request's tail first)."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is None:
                    self._free.append(b)
                else:
                    self._lru[b] = None

    def check(self) -> None:
        """Asserts the invariants (tests): each block referenced, cached or free, exactly once."""
        free, cached = set(self._free), set(self._lru)
        assert len(free) == len(self._free) and not free & cached
        for b in range(self.num_blocks):
            referenced = self.ref_counts[b] > 0
            assert self.ref_counts[b] >= 0
            assert referenced + (b in free) + (b in cached) == 1, b
            assert b not in cached or self.block_hash[b] is not None, b
            assert b not in free or self.block_hash[b] is None, b
        for h, b in self._by_hash.items():
            assert self.block_hash[b] == h
        assert sum(h is not None for h in self.block_hash) == len(self._by_hash)
