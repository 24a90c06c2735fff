"""What the prefix cache of an engine gained and lost: the KV cache events a router indexes.

The KV cache manager records them (when asked to, `KVCacheManager.record_events`) as blocks are
registered and evicted; the daemons publish them (services/kv_events_zmq.py: vLLM's ZMQ wire format, which
llm-d's router reads). Hashes are the manager's own chained block hashes (engine/core/kv_cache_manager.py),
so a reader that hashes a prompt with `hash_blocks` finds them. No I/O here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks now in the cache: `block_hashes[0]` chains on `parent_hash` (None: the
    prompt's first block); `token_ids` are the blocks' tokens, block after block."""

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the cache (their hashes no longer find anything)."""

    block_hashes: list[int]


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache is empty (an engine that starts, or a reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
