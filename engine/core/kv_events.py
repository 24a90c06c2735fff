"""What the prefix cache of an engine gained and lost: the KV cache events a router indexes.

The KV cache manager records them (when asked to, `KVCacheManager.record_events`) as blocks are
registered and evicted; the daemons publish them (services/kv_events_zmq.py: vLLM's ZMQ wire format, which
llm-d's router reads). Hashes are the manager's own chained block hashes (engine/core/kv_cache_manager.py),
so a reader that hashes a prompt with `hash_blocks` finds them. Each names its medium (the llm-d format's
field): DEVICE for the device block pool, HOST for the host-memory tier under it (engine/core/host_pool.py),
which a router may weigh below a device hit (the blocks are copied back before they are used). No I/O here.
"""

from __future__ import annotations

import dataclasses

DEVICE = "GPU"  # vLLM's name for accelerator memory (TPU HBM too), which routers weigh as the fastest tier
HOST = "CPU"  # host DRAM: vLLM's offloading tier's name


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks now in the cache: `block_hashes[0]` chains on `parent_hash` (None: the
    prompt's first block); `token_ids` are the blocks' tokens, block after block."""

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str = DEVICE


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the cache's `medium` (there, their hashes no longer find anything)."""

    block_hashes: list[int]
    medium: str = DEVICE


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache is empty (an engine that starts, or a reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
