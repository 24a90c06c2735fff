"""Block allocation for the paged KV cache: a free list and check/do pairs. No device code.

Invariant: a block id is either in the free list or owned by exactly one holder; `free` of a block that
is already free raises, so double frees surface as bugs instead of silent corruption.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class OutOfBlocksError(RuntimeError):
    """allocate() was called without a successful can_allocate()."""


class BlockAllocator:
    """Hands out block ids of a cache with `num_blocks` blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        if not self.can_allocate(num):
            raise OutOfBlocksError(f"asked for {num} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise ValueError(f"block {b} freed twice")
            self._is_free[b] = True
            self._free.append(b)


class BlockTable:
    """The blocks of one request, in token order, growing as tokens are appended."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self.block_ids: list[int] = []

    def blocks_needed(self, num_tokens: int) -> int:
        """Extra blocks required to hold `num_tokens` tokens in total."""
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - len(self.block_ids))

    def can_reserve(self, num_tokens: int) -> bool:
        return self.allocator.can_allocate(self.blocks_needed(num_tokens))

    def reserve(self, num_tokens: int) -> None:
        self.block_ids.extend(self.allocator.allocate(self.blocks_needed(num_tokens)))

    def release(self) -> None:
        self.allocator.free(self.block_ids)
        self.block_ids = []
