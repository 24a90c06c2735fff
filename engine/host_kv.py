"""The host tier's bytes: slots of the device KV cache's blocks in host memory, and the copies both ways.

engine/core/host_pool.py decides which slot holds which block; this module moves them. A slot holds a
whole block, every row of the cache and every head (on a multi-device mesh, every device's shards: one
host's view). The slots are one host array allocated empty: the operating system backs a slot's pages
when it is first written, so the tier costs what it holds, up to its size.

  offload(cache, [(block, slot)])   a jitted read of the blocks from the cache (ordered before any later
                                    write of the cache, which may reuse them), copied to the host
                                    asynchronously; `landed()` writes finished copies into their slots
  read([(slot, block)])             the slots' bytes (a copy: a slot may be reused right after)
  load(cache, blocks, data)         the bytes put on the cache's devices and written into the blocks
                                    (donated: in place)

Every copy goes in padded batches of BATCH_BUCKETS blocks (compiled by `warmup`): steady serving compiles
nothing. On a CPU the device and the host are the same memory; on a TPU a copy crosses the host link.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np

from pdserve.engine.config import bucket_for

BATCH_BUCKETS = (4, 16, 64)  # blocks a copy moves at once (larger lists go in pieces)


@jax.jit
def _read_blocks(cache: jax.Array, ids: jax.Array) -> jax.Array:
    return cache[:, ids]


@functools.partial(jax.jit, donate_argnames=("cache",))
def _write_blocks(cache: jax.Array, ids: jax.Array, blocks: jax.Array) -> jax.Array:
    """Padding repeats a (block, data) pair: the same write twice."""
    return cache.at[:, ids].set(blocks)


def _batches(pairs: Sequence[tuple[int, int]]):
    """The pairs in pieces of at most the largest bucket, each padded to its bucket by repeating its first
    pair: (first column padded, second column padded, how many are real)."""
    for start in range(0, len(pairs), BATCH_BUCKETS[-1]):
        part = list(pairs[start : start + BATCH_BUCKETS[-1]])
        n = len(part)
        part += [part[0]] * (bucket_for(n, BATCH_BUCKETS) - n)
        first, second = (np.asarray(column, np.int32) for column in zip(*part, strict=True))
        yield first, second, n


class HostKVStore:
    """`num_slots` host slots shaped as blocks of `cache` (its rows and token shape, its dtype)."""

    def __init__(self, cache: jax.Array, num_slots: int):
        rows, _, *token_shape = cache.shape
        self.slots = np.empty((rows, num_slots, *token_shape), cache.dtype)
        self.sharding = cache.sharding
        self._in_flight: list[tuple[jax.Array, np.ndarray]] = []  # (blocks read, their slots)
        self.num_offloaded = 0  # blocks copied out since start
        self.num_loaded = 0  # blocks copied in

    @property
    def num_in_flight(self) -> int:
        """Batches copied out whose copies have not landed."""
        return len(self._in_flight)

    @property
    def slot_bytes(self) -> int:
        return self.slots[:, 0].nbytes

    def offload(self, cache: jax.Array, pairs: Sequence[tuple[int, int]]) -> None:
        """Starts copying each (device block, host slot): dispatched now (before any later write of the
        block), landing in the slot when the copy is done (`landed`)."""
        for blocks, slots, n in _batches(pairs):
            data = _read_blocks(cache, blocks)
            data.copy_to_host_async()
            self._in_flight.append((data, slots[:n]))
            self.num_offloaded += n

    def landed(self, wait: bool = False) -> list[int]:
        """The slots whose copies finished since the last call (all of them with `wait`), now readable."""
        done, pending = [], []
        for data, slots in self._in_flight:
            if wait or data.is_ready():
                self.slots[:, slots] = np.asarray(data)[:, : len(slots)]
                done += slots.tolist()
            else:
                pending.append((data, slots))
        self._in_flight = pending
        return done

    def read(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """The bytes of each (host slot, device block), copied out of the slots: (blocks, data, real),
        padded batches for `load`."""
        return [(blocks, self.slots[:, slots], n) for slots, blocks, n in _batches(pairs)]

    def load(self, cache: jax.Array, batches: list[tuple[np.ndarray, np.ndarray, int]]) -> jax.Array:
        """Writes what `read` returned into the cache's blocks; returns the cache (the input is donated)."""
        for blocks, data, n in batches:
            cache = _write_blocks(cache, blocks, jax.device_put(data, self.sharding))
            self.num_loaded += n
        return cache

    def warmup(self, cache: jax.Array) -> int:
        """Compiles every batch size both ways (nothing runs); returns how many variants."""
        for size in BATCH_BUCKETS:
            ids = np.zeros(size, np.int32)
            blocks = jax.ShapeDtypeStruct(
                (cache.shape[0], size, *cache.shape[2:]), cache.dtype, sharding=self.sharding
            )
            _read_blocks.lower(cache, ids).compile()
            _write_blocks.lower(cache, ids, blocks).compile()
        return 2 * len(BATCH_BUCKETS)
