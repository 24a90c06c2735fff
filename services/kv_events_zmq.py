"""KV cache events on the wire: what every daemon's prefix cache gains and loses, published over ZMQ in the
format vLLM publishes and the Gateway API Inference Extension's endpoint picker (llm-d's router) reads.

Publisher (`KVEventPublisher`, one per daemon, bound):
  * PUB socket, default port 5557: one message per batch, three frames
    [topic `kv@<pod>@<model>`, sequence number (8 bytes, big-endian, from 0), msgpack payload];
  * payload `[timestamp, [event, ...], data_parallel_rank]`, each event a tagged array:
      ["BlockStored", [hash, ...], parent_hash or nil, [token_id, ...], block_size, lora_id (nil),
       medium, lora_name or nil]
      ["BlockRemoved", [hash, ...], medium]
      ["AllBlocksCleared"]
    Hashes are the engine's 64-bit chained block hashes, sent as 8 big-endian bytes (llm-d reads bytes
    and 64-bit integers; a small msgpack integer would make it drop the batch). medium is "GPU", vLLM's
    name for accelerator memory, which routers weigh as the fastest tier.
  * ROUTER replay socket: a DEALER sends [b"", start sequence (8 bytes)]; it is answered with
    [b"", seq, payload] for each buffered batch from there on, then [b"", -1 (8 bytes), b""].
A daemon's first batch (sequence 0) is ["AllBlocksCleared"]: a reader that sees the sequence start over
knows the daemon restarted with an empty cache.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import queue
import threading
import time

import msgpack
import zmq

from pdserve.engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.services.engine_loop import EngineLoop

log = logging.getLogger(__name__)

DEFAULT_PORT = 5557
DEFAULT_REPLAY_PORT = 5558
MEDIUM = "GPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def topic(pod: str, model: str) -> str:
    """`kv@<pod>@<model>`: llm-d matches <pod> to the endpoint it scores (address:port)."""
    if "@" in pod or "@" in model:
        raise ValueError(f"'@' in the pod {pod!r} or model {model!r} name of a KV events topic")
    return f"kv@{pod}@{model}"


# ---- the payload ----------------------------------------------------------------------------------------
def _hash_out(h: int) -> bytes:
    return h.to_bytes(8, "big")


def _hash_in(h) -> int:
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    if isinstance(h, int):
        return h & (2**64 - 1)
    raise ValueError(f"block hash {h!r} is neither bytes nor an integer")


def _event_out(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        parent = None if event.parent_hash is None else _hash_out(event.parent_hash)
        hashes = [_hash_out(h) for h in event.block_hashes]
        return [
            "BlockStored",
            hashes,
            parent,
            event.token_ids,
            event.block_size,
            None,
            MEDIUM,
            event.lora_name,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [_hash_out(h) for h in event.block_hashes], MEDIUM]
    return ["AllBlocksCleared"]


def _event_in(fields: list) -> KVEvent:
    tag = fields[0] if fields else None
    if tag == "BlockStored":
        parent = fields[2]
        return BlockStored(
            block_hashes=[_hash_in(h) for h in fields[1]],
            parent_hash=None if parent is None else _hash_in(parent),
            token_ids=list(fields[3]),
            block_size=int(fields[4]),
            lora_name=fields[7] if len(fields) > 7 else None,
        )
    if tag == "BlockRemoved":
        return BlockRemoved([_hash_in(h) for h in fields[1]])
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event {tag!r}")


def encode_batch(events: list[KVEvent], timestamp: float | None = None) -> bytes:
    payload = [time.time() if timestamp is None else timestamp, [_event_out(e) for e in events], 0]
    return msgpack.packb(payload, use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """(timestamp, events) of one batch (vLLM's older and newer field lists alike); ValueError when it
    is not one."""
    try:
        batch = msgpack.unpackb(payload, raw=False)
        return float(batch[0]), [_event_in(fields) for fields in batch[1]]
    except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException) as e:
        raise ValueError(f"bad KV event batch: {type(e).__name__}: {e}") from e


# ---- the publisher ---------------------------------------------------------------------------------------
class KVEventPublisher:
    """Binds the PUB and replay sockets and publishes batches from its own thread (ZMQ sockets belong to
    one thread): `publish(events)` is called by the engine thread and never blocks.

    `port` / `replay_port` 0: any free port; None: the default port, or any free port when another
    daemon of this host has it (see `.port`, `.replay_port` once bound). The last `buffer_batches`
    batches are kept for replay. Raises zmq.ZMQError when a port given cannot be bound."""

    def __init__(
        self,
        topic: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        replay_port: int | None = None,
        buffer_batches: int = 10_000,
    ):
        self.topic = topic.encode()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._context.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        try:
            self.port = _bind(self._pub, host, port, DEFAULT_PORT)
            self.replay_port = _bind(self._replay, host, replay_port, DEFAULT_REPLAY_PORT)
        except zmq.ZMQError:
            self._context.destroy(linger=0)
            raise
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue()
        self._seq = 0
        self.num_batches = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        self._queue.put(events)

    def close(self) -> None:
        """Publishes what is queued, then closes the sockets."""
        self._queue.put(None)
        self._thread.join(10)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                events = self._queue.get(timeout=0.02)
            except queue.Empty:
                events = []
            if events is None:
                return
            if events:
                self._send(events)
            while poller.poll(0):
                self._answer_replay()

    def _send(self, events: list[KVEvent]) -> None:
        payload = encode_batch(events)
        seq = self._seq.to_bytes(8, "big")
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self.num_batches += 1
        try:
            self._pub.send_multipart((self.topic, seq, payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: readers resynchronise from the replay buffer
            log.warning("KV events: a batch was dropped at the high-water mark")

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: malformed replay request of %d frames", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))


def _bind(socket: zmq.Socket, host: str, port: int | None, default: int) -> int:
    if ":" in host:  # an IPv6 address
        socket.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    if port == 0:
        return socket.bind_to_random_port(f"tcp://{host}")
    try:
        socket.bind(f"tcp://{host}:{port or default}")
    except zmq.ZMQError as e:
        if port is not None or e.errno != errno.EADDRINUSE:
            raise
        # the default port, taken by another daemon of this host (a prefill-server and a decode-server
        # side by side): any free one (decode servers learn it from the Handshake)
        bound = socket.bind_to_random_port(f"tcp://{host}")
        log.warning("KV events: port %d is taken on %s, publishing on %d", default, host, bound)
        return bound
    return port or default


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """Where a daemon publishes (`--kv-events-port`, `--kv-events-replay-port`; 0: any free port; None:
    5557 and 5558, or free ones when another daemon of the host has them) and the pod name of its topic
    (`--kv-events-pod`; default: $POD_IP, else the listening host, and the serving port: what llm-d's
    router matches to the endpoint it scores)."""

    port: int | None = None
    replay_port: int | None = None
    pod: str | None = None


def start_publishing(
    loop: EngineLoop, config: KVEventsConfig, host: str, serving_port: int
) -> KVEventPublisher:
    """Binds the sockets and routes the engine's events to them; prints where (operators, launchers)."""
    pod = config.pod or f"{os.environ.get('POD_IP') or host}:{serving_port}"
    publisher = KVEventPublisher(
        topic(pod, loop.engine.model.config.name), host, config.port, config.replay_port
    )
    loop.publish_kv_events(publisher.publish)
    print(f"kv-events on {host}:{publisher.port} (replay {publisher.replay_port})", flush=True)
    return publisher
