"""The host tier's bytes: slots of the device KV cache's blocks in host memory, and the copies both ways.

engine/core/host_pool.py decides which slot holds which block; this module moves them. A slot holds a
whole block, every row of the cache and every head (on a multi-device mesh, every device's shards: one
host's view). The slots are one anonymous memory map, committed in the background after start
(`madvise(MADV_POPULATE_WRITE)` in 64 MiB pieces on a thread, which leaves their bytes alone): the first
write of a page not yet backed costs a page fault, which on a virtual machine can cost more than the
copy itself (measured on this machine's VM: 16 blocks written into fresh pages 450-620 ms, into
committed ones 1.3 ms). As vLLM's offloading tier, the tier holds its whole size once committed.

  offload(cache, [(block, slot)])   a jitted read of the blocks from the cache (ordered before any later
                                    write of the cache, which may reuse them), copied to the host
                                    asynchronously; `landed()` writes finished copies into their slots
  start_load([(slot, block)])       the slots' bytes copied out (a slot may be reused right after) and put
                                    on the cache's devices, asynchronously: a HostLoad
  finish_load(cache, load)          once `load.ready` (or waiting for it), the bytes written into the
                                    blocks (the cache donated: in place)

Every copy goes in padded batches of BATCH_BUCKETS blocks (compiled by `warmup`): steady serving compiles
nothing. On a CPU the device and the host are the same memory; on a TPU a copy crosses the host link.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import math
import mmap
import threading
from collections.abc import Sequence

import jax
import numpy as np

from pdserve.engine.config import bucket_for

BATCH_BUCKETS = (4, 16, 64)  # blocks a copy moves at once (larger lists go in pieces)
COMMIT_PIECE_BYTES = 64 << 20  # the background commit's step
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: back pages as written, without writing them

log = logging.getLogger(__name__)


@jax.jit
def _read_blocks(cache: jax.Array, ids: jax.Array) -> jax.Array:
    return cache[:, ids]


@functools.partial(jax.jit, donate_argnames=("cache",))
def _write_blocks(cache: jax.Array, ids: jax.Array, blocks: jax.Array) -> jax.Array:
    """Padding repeats a (block, data) pair: the same write twice."""
    return cache.at[:, ids].set(blocks)


def padded_pair_batches(pairs: Sequence[tuple[int, int]], buckets: tuple[int, ...] = BATCH_BUCKETS):
    """Pairs of ids in pieces of at most the largest bucket, each padded to its bucket by repeating its
    first pair (the device op then does one thing twice): (first column, second column, as int32 arrays,
    and how many pairs are real). Also the runner's block copies (ModelRunner.copy_blocks)."""
    for start in range(0, len(pairs), buckets[-1]):
        part = list(pairs[start : start + buckets[-1]])
        n = len(part)
        part += [part[0]] * (bucket_for(n, buckets) - n)
        first, second = (np.asarray(column, np.int32) for column in zip(*part, strict=True))
        yield first, second, n


@dataclasses.dataclass
class HostLoad:
    """Blocks on their way from host slots to the devices: (blocks, their bytes on the devices, how many
    are real) per padded batch."""

    batches: list[tuple[np.ndarray, jax.Array, int]]

    @property
    def ready(self) -> bool:
        """The bytes are on the devices (writing them waits for nothing)."""
        return all(data.is_ready() for _, data, _ in self.batches)


class HostKVStore:
    """`num_slots` host slots shaped as blocks of `cache` (its rows and token shape, its dtype)."""

    def __init__(self, cache: jax.Array, num_slots: int):
        rows, _, *token_shape = cache.shape
        shape = (rows, num_slots, *token_shape)
        self._memory = mmap.mmap(-1, math.prod(shape) * cache.dtype.itemsize)
        self.slots = np.frombuffer(self._memory, cache.dtype).reshape(shape)
        self._committer = threading.Thread(
            target=_commit, args=(self._memory, self.slots.ctypes.data), name="host-kv-commit", daemon=True
        )
        self._committer.start()
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
        for blocks, slots, n in padded_pair_batches(pairs):
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

    def start_load(self, pairs: Sequence[tuple[int, int]]) -> HostLoad:
        """Starts copying each (host slot, device block): the slots read now, their bytes on their way to
        the devices; finish_load writes them."""
        batches = []
        for slots, blocks, n in padded_pair_batches(pairs):
            batches.append((blocks, jax.device_put(self.slots[:, slots], self.sharding), n))
        return HostLoad(batches)

    def finish_load(self, cache: jax.Array, load: HostLoad) -> jax.Array:
        """Writes a started load into its blocks; returns the cache (the input is donated)."""
        for blocks, data, n in load.batches:
            cache = _write_blocks(cache, blocks, data)
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


def _commit(memory: mmap.mmap, address: int) -> None:
    """Backs the map's pages, a piece at a time (ctypes releases the GIL for the call); where the kernel
    cannot, pages are backed as they are first written."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return
    size = len(memory)
    for start in range(0, size, COMMIT_PIECE_BYTES):
        if madvise(address + start, min(COMMIT_PIECE_BYTES, size - start), _MADV_POPULATE_WRITE):
            log.info("host KV tier: pages backed as first written (madvise errno %d)", ctypes.get_errno())
            return
