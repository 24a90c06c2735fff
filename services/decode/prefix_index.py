"""What each prefill replica's prefix cache holds, as its KV events tell (kv_events_zmq): the index
a decode server routes on.

`ReplicaCache` is one replica's set of cached block hashes and where its event stream stands. `follow()`
keeps it current from the replica's PUB socket, and resynchronises from the replica's replay socket:
  * on the first batch, and every `resync_s` without one: replay from the last sequence applied; when
    that batch comes back unchanged the rest is applied, otherwise the replica restarted (its sequence
    started over) or batches were lost beyond its buffer, so the entries are dropped and rebuilt from
    what the replay holds (from sequence 0, the replica's whole history: exact);
  * a batch that skips sequence numbers (a gap) or goes backwards to one not seen: the same.
A broken or silent stream only makes the index stale: routing degrades, requests stay correct (the
prefill server computes what it lacks; the actual hit is reported and the index corrected by it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import zlib
from collections.abc import Callable

import zmq
import zmq.asyncio

from pdserve.engine.core.kv_events import DEVICE, HOST, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.services.kv_events_zmq import END_OF_REPLAY, MAX_BATCH_BYTES, ReaderCredentials, decode_batch

log = logging.getLogger(__name__)

_REMEMBERED = 1024  # batches whose digest is kept, to tell a duplicate from a restart
EXPECTED_TTL_S = 30.0  # how long blocks of a prompt routed to a replica count as held without an event


class ReplicaCache:
    """The block hashes one replica's prefix cache holds, per its events (in device memory, `hashes`, or in
    its host tier, `host_hashes`: either is a hit, the replica copies a host block back before using it),
    and those it is about to hold:
    the blocks of prompts just routed to it (`expect`), counted until its events confirm them or
    EXPECTED_TTL_S passes, so that a burst of requests sharing a new prefix goes to one replica."""

    def __init__(self, name: str):
        self.name = name
        self.hashes: set[int] = set()
        self.host_hashes: set[int] = set()
        self._expected: collections.OrderedDict[int, float] = collections.OrderedDict()  # -> deadline
        self.last_seq: int | None = None  # the last batch applied
        self._digests: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.num_batches = 0
        self.num_resyncs = 0  # entries dropped and rebuilt (restart, lost batches)

    def matched_blocks(self, hashes: list[int]) -> int:
        """How many of the leading `hashes` (a prompt's chained block hashes) the replica holds (or is
        expected to)."""
        now = time.monotonic()
        while self._expected and next(iter(self._expected.values())) <= now:  # oldest first (one TTL)
            self._expected.popitem(last=False)
        n = 0
        for h in hashes:
            held = h in self.hashes or h in self.host_hashes
            if not held and self._expected.get(h, 0.0) <= now:
                break
            n += 1
        return n

    def expect(self, hashes: list[int], ttl_s: float = EXPECTED_TTL_S) -> None:
        """The replica is computing a prompt with these block hashes: count them as held for a while."""
        deadline = time.monotonic() + ttl_s
        for h in hashes:
            if h not in self.hashes:
                self._expected.pop(h, None)
                self._expected[h] = deadline  # insertion order is deadline order for one TTL

    def forget(self, hashes: list[int] = None) -> None:
        """Drops `hashes` (all when None): the replica was found not to hold them (a smaller actual hit,
        a replica that went down)."""
        if hashes is None:
            self.hashes.clear()
            self.host_hashes.clear()
            self._expected.clear()
        else:
            self.hashes.difference_update(hashes)
            self.host_hashes.difference_update(hashes)
            for h in hashes:
                self._expected.pop(h, None)

    def is_next(self, seq: int, payload: bytes) -> bool | None:
        """True: `seq` is the next batch; None: a batch already applied (a duplicate); False: the stream
        and this index disagree (a gap, a restart): resynchronise."""
        if self.last_seq is None:
            return False
        if seq == self.last_seq + 1:
            return True
        if seq <= self.last_seq and self._digests.get(seq) == zlib.crc32(payload):
            return None
        return False

    def apply(self, seq: int, payload: bytes, events: list[KVEvent]) -> None:
        for event in events:
            held = self.host_hashes if getattr(event, "medium", DEVICE) == HOST else self.hashes
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
                for h in event.block_hashes:
                    self._expected.pop(h, None)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
                for h in event.block_hashes:
                    self._expected.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                self.hashes.clear()
                self.host_hashes.clear()
                self._expected.clear()
        self.last_seq = seq
        self._digests[seq] = zlib.crc32(payload)
        while len(self._digests) > _REMEMBERED:
            self._digests.popitem(last=False)
        self.num_batches += 1

    def rebuild(self, batches: list[tuple[int, bytes, list[KVEvent]]]) -> None:
        """Applies a replay: the batches from `last_seq` on when it starts with the very batch applied
        last, else (a restart, batches lost) the entries are dropped and rebuilt from the replay alone."""
        continues = (
            batches
            and self.last_seq is not None
            and batches[0][0] == self.last_seq
            and self._digests.get(self.last_seq) == zlib.crc32(batches[0][1])
        )
        if continues:
            batches = batches[1:]
        else:
            if self.last_seq is not None:
                self.num_resyncs += 1
                log.info("KV events of %s: resynchronised (restart or lost batches)", self.name)
            self.hashes.clear()
            self.host_hashes.clear()
            self._expected.clear()
            self._digests.clear()
            self.last_seq = None
        for seq, payload, events in batches:
            self.apply(seq, payload, events)


def _reader_socket(kind: int, credentials: ReaderCredentials | None) -> zmq.asyncio.Socket:
    socket = zmq.asyncio.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)  # a replica sending more is disconnected
    socket.setsockopt(zmq.IPV6, 1)  # replicas behind dns:/// may have IPv6 addresses
    if credentials is not None:
        credentials.secure(socket)
    return socket


async def replay(
    endpoint: str, start: int, timeout_s: float = 2.0, credentials: ReaderCredentials | None = None
) -> list[tuple[int, bytes, list[KVEvent]]]:
    """The batches a replica's replay socket holds from sequence `start` on (`credentials`: a CURVE
    publisher's; None: a plain one). Raises TimeoutError, ValueError (a bad batch) or zmq.ZMQError."""
    socket = _reader_socket(zmq.DEALER, credentials)
    try:
        socket.connect(endpoint)
        batches = []
        async with asyncio.timeout(timeout_s):
            await socket.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    raise ValueError(f"replay reply of {len(frames)} frames")
                if frames[1] == END_OF_REPLAY:
                    return batches
                batches.append((int.from_bytes(frames[1], "big"), frames[2], decode_batch(frames[2])[1]))
    finally:
        socket.close()


async def follow(
    cache: ReplicaCache,
    endpoint: str,
    replay_endpoint: str,
    topic: str,
    resync_s: float = 5.0,
    credentials: ReaderCredentials | None = None,
    on_lost: Callable[[], None] | None = None,
) -> None:
    """Keeps `cache` current from a replica's event stream until cancelled (never raises otherwise).
    `credentials`: the replica's CURVE publisher key and this reader's registered keys (None: plain).
    `on_lost` is called after each failed replay (the replica down, or restarted elsewhere or with
    another key: the caller may find out and follow anew)."""
    socket = _reader_socket(zmq.SUB, credentials)
    socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2_000)
    socket.connect(endpoint)

    replaying = True  # the last replay worked (a failing one is logged once, until one works again)

    async def resync() -> None:
        nonlocal replaying
        try:
            cache.rebuild(await replay(replay_endpoint, cache.last_seq or 0, credentials=credentials))
            replaying = True
        except (TimeoutError, ValueError, zmq.ZMQError) as e:
            if replaying:
                log.info("KV events of %s: replay failed: %s %s", cache.name, type(e).__name__, e)
            replaying = False
            if on_lost is not None:
                on_lost()

    try:
        await resync()
        while True:
            try:
                async with asyncio.timeout(resync_s):
                    frames = await socket.recv_multipart()
            except TimeoutError:
                await resync()  # quiet: a restart that published nothing yet, or batches lost
                continue
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("KV events of %s: malformed message of %d frames", cache.name, len(frames))
                continue
            seq, payload = int.from_bytes(frames[1], "big"), frames[2]
            state = cache.is_next(seq, payload)
            if state is None:
                continue
            if not state:
                await resync()
                continue
            try:
                events = decode_batch(payload)[1]
            except ValueError as e:
                log.warning("KV events of %s: %s", cache.name, e)
                await resync()
                continue
            cache.apply(seq, payload, events)
    finally:
        with contextlib.suppress(zmq.ZMQError):
            socket.close()
