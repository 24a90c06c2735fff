"""A KV events subscriber and prefix index written from llm-d's router documentation, not from pdserve's code
(shared/reference/gie-llmd-contract.md; llm-d-router pkg/kvevents, pkg/kvcache at v0.10.0), to check that
what a daemon publishes means to the router what it means to pdserve.

Frames: [topic `kv@<pod>@<model>`, sequence (8 bytes big-endian), msgpack `[ts, [event, ...], dp_rank?]`].
Events are tagged arrays: ["BlockStored", hashes, parent or nil, token_ids, block_size, lora_id?, medium?,
lora_name?, ...], ["BlockRemoved", hashes, medium?, ...], ["AllBlocksCleared"]. Hashes are integers or bytes
(the last 8, big-endian). The router ignores the server's hashes except to find parents and removals: it
keys every block itself, FNV-64a over canonical CBOR of [parent key, block tokens, extra], the chain seeded
by the model name (the event's lora_name for an adapter), and indexes key -> pods. A stored run whose parent
it does not know is dropped; a sequence number lower than the last one means the pod restarted: its
entries are cleared.
"""

from __future__ import annotations

import collections

import cbor2
import msgpack

FNV_OFFSET, FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


def fnv64a(data: bytes) -> int:
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def block_key(parent: int | None, tokens, extra=None) -> int:
    return fnv64a(cbor2.dumps([parent, list(tokens), extra], canonical=True))


def chain_seed(model: str, hash_seed: str = "") -> int:
    return fnv64a(cbor2.dumps([fnv64a(hash_seed.encode()), None, model], canonical=True))


def _hash(h) -> int:
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    if isinstance(h, int) and not isinstance(h, bool):
        return h & 0xFFFFFFFFFFFFFFFF
    raise TypeError(f"a block hash must be bytes or an integer, not {type(h).__name__}")


class RouterIndex:
    """Which pods hold which blocks, from their event frames (`add_frames`), at the router's block size."""

    def __init__(self, block_size: int = 16):
        self.block_size = block_size
        self.pods: dict[str, set[int]] = collections.defaultdict(set)  # pod -> keys it holds
        self.keys: dict[str, dict[int, list[int]]] = collections.defaultdict(
            dict
        )  # pod -> server hash -> keys
        self.last_seq: dict[str, int] = {}
        self.num_events = self.num_dropped = self.num_restarts = 0

    def add_frames(self, frames: list[bytes], pod: str | None = None) -> None:
        """One message of a pod's PUB socket (`pod`: its identity; default: the topic's pod part)."""
        topic, seq, payload = frames
        parts = topic.decode().split("@")
        assert len(parts) == 3 and parts[0] == "kv", topic
        pod, model = pod or parts[1], parts[2]
        seq = int.from_bytes(seq, "big", signed=True)
        last = self.last_seq.get(pod)
        if last is not None and seq <= last:  # backwards: the pod restarted (a replay would follow)
            self.clear(pod)
            self.num_restarts += 1
        elif last is not None:
            assert seq == last + 1, f"{pod}: sequence {seq} after {last}"
        self.last_seq[pod] = seq
        batch = msgpack.unpackb(payload, raw=False)
        assert isinstance(batch[0], float) and isinstance(batch[1], list)
        for event in batch[1]:
            self.num_events += 1
            self.apply(pod, model, event)

    def clear(self, pod: str) -> None:
        self.pods.pop(pod, None)
        self.keys.pop(pod, None)

    def apply(self, pod: str, model: str, event: list) -> None:
        tag = event[0]
        if tag == "AllBlocksCleared":
            self.clear(pod)
        elif tag == "BlockRemoved":
            for h in event[1]:
                for key in self.keys[pod].pop(_hash(h), []):
                    self.pods[pod].discard(key)
        elif tag == "BlockStored":
            hashes, parent, tokens, block_size = event[1], event[2], event[3], event[4]
            lora_name = event[7] if len(event) > 7 else None
            assert block_size == self.block_size and len(tokens) == len(hashes) * block_size, event
            if parent is None:
                key = chain_seed(lora_name or model)
            elif _hash(parent) in self.keys[pod]:
                key = self.keys[pod][_hash(parent)][-1]
            else:
                self.num_dropped += 1
                return
            for i, h in enumerate(hashes):
                key = block_key(key, tokens[i * block_size : (i + 1) * block_size])
                self.keys[pod][_hash(h)] = [key]
                self.pods[pod].add(key)
        else:
            raise ValueError(f"unknown event {tag!r}")

    def matched_blocks(self, pod: str, token_ids, model: str) -> int:
        """Leading full blocks of `token_ids` the pod holds, as the router's scorer counts them."""
        key, held, bs = chain_seed(model), self.pods.get(pod, set()), self.block_size
        for i in range(len(token_ids) // bs):
            key = block_key(key, token_ids[i * bs : (i + 1) * bs])
            if key not in held:
                return i
        return len(token_ids) // bs
