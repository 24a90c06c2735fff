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
    and 64-bit integers; a small msgpack integer would make it drop the batch). medium is "GPU" (vLLM's
    name for accelerator memory, which routers weigh as the fastest tier) or "CPU" (the host tier,
    --kv-offloading-size: a block evicted from the device and kept in host memory is stored there, and
    removed there when the host tier evicts it; engine/core/kv_events.py).
  * ROUTER replay socket: a DEALER sends [b"", start sequence (8 bytes)]; it is answered with
    [b"", seq, payload] for each buffered batch from there on, then [b"", -1 (8 bytes), b""]. Replays go
    out in slices between live batches, at most MAX_REPLAYS at once (a request past them goes unanswered:
    the reader times out and asks again); a reader that lets REPLAY_HWM messages pile up loses the rest of
    its replay.
A daemon's first batch (sequence 0) is ["AllBlocksCleared"]: a reader that sees the sequence start over
knows the daemon restarted with an empty cache.

Who may read (`KVEventsConfig.plain`): the batches carry the token ids of every cached block, prompts and
answers alike. By default both sockets speak ZMQ CURVE (encrypted; the publisher's key pair is made at
start): a reader connects with its own CURVE key pair and the publisher's public key, and gets through only
when its public key was registered with `allow` (a prefill server registers the key a decode server sends
in its Handshake, which the gRPC port's mTLS and tokens authenticate); any other reader is refused before
a byte. The plain stream (what llm-d's router reads) has no authentication at all and is opt-in.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import itertools
import logging
import os
import queue
import struct
import threading
import time

import msgpack
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from pdserve.engine.core.kv_events import DEVICE, HOST, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.services.engine_loop import EngineLoop

log = logging.getLogger(__name__)

DEFAULT_PORT = 5557
DEFAULT_REPLAY_PORT = 5558
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# Bounds (a reader is a peer on the pod network, not a trusted party):
MAX_QUEUED_BATCHES = 1024  # engine -> publisher; past it the oldest is dropped and counted
MAX_REPLAYS = 8  # replays under way at once; a request past them goes unanswered (the reader retries)
REPLAY_BATCHES_PER_TURN = 64  # a replay goes out in slices of this many, between live batches
REPLAY_HWM = 1024  # replay messages queued to one reader; a reader that lets more pile up is dropped
MAX_REQUEST_BYTES = 1024  # a replay request (an empty frame, 8 bytes), or a CURVE handshake command (< 400)
MAX_BATCH_BYTES = 16 << 20  # a batch a reader accepts (a step's events are kilobytes)
MAX_READER_KEYS = 1024  # CURVE public keys allowed at once; past it the least recently registered goes


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
            event.medium,
            event.lora_name,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [_hash_out(h) for h in event.block_hashes], event.medium]
    return ["AllBlocksCleared"]


def _medium(fields: list, index: int) -> str:
    """An event's medium field (absent or nil: the device, as vLLM's readers take it)."""
    medium = fields[index] if len(fields) > index else None
    if medium is None:
        return DEVICE
    if medium not in (DEVICE, HOST):
        raise ValueError(f"unknown KV event medium {medium!r}")
    return medium


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
            medium=_medium(fields, 6),
        )
    if tag == "BlockRemoved":
        return BlockRemoved([_hash_in(h) for h in fields[1]], _medium(fields, 2))
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


# ---- who may read -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair, Z85-encoded (40 characters each)."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE: run with --kv-events=plain or off")
        return cls(*zmq.curve_keypair())


def parse_reader_key(key: str) -> bytes:
    """A reader's CURVE public key as sent (Z85, 40 characters); ValueError when it is not one."""
    try:
        if len(key) == 40 and len(z85.decode(key.encode("ascii"))) == 32:
            return key.encode("ascii")
    except (UnicodeEncodeError, ValueError, KeyError, IndexError, struct.error):
        pass
    raise ValueError("not a Z85-encoded CURVE public key (40 characters)")


@dataclasses.dataclass(frozen=True)
class ReaderCredentials:
    """What a reader connects to a CURVE publisher with: its own key pair (registered with the publisher)
    and the publisher's public key."""

    keys: CurveKeys
    publisher_key: bytes

    def secure(self, socket: zmq.Socket) -> None:
        """Makes `socket` (before it connects) a CURVE client of the publisher."""
        socket.curve_serverkey = self.publisher_key
        socket.curve_publickey = self.keys.public
        socket.curve_secretkey = self.keys.secret


class _AllowedReaders:
    """The CURVE public keys let through (pyzmq's authenticator calls `callback` for each connection);
    at most MAX_READER_KEYS, the least recently registered dropped past it."""

    def __init__(self):
        self._keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_refused = 0

    def allow(self, key: bytes) -> None:
        with self._lock:
            self._keys.pop(key, None)
            self._keys[key] = None
            while len(self._keys) > MAX_READER_KEYS:
                self._keys.popitem(last=False)

    def callback(self, domain: str, key: bytes) -> bool:
        with self._lock:
            allowed = key in self._keys
        if not allowed:
            self.num_refused += 1
            if self.num_refused == 1 or self.num_refused % 1000 == 0:
                log.warning("KV events: %d connections refused (no registered CURVE key)", self.num_refused)
        return allowed


# ---- the publisher ---------------------------------------------------------------------------------------
class KVEventPublisher:
    """Binds the PUB and replay sockets and publishes batches from its own thread (ZMQ sockets belong to
    one thread): `publish(events)` is called by the engine thread and never blocks.

    `port` / `replay_port` 0: any free port; None: the default port, or any free port when another
    daemon of this host has it (see `.port`, `.replay_port` once bound). The last `buffer_batches`
    batches are kept for replay. `plain`: anyone who reaches the ports reads (llm-d's router); otherwise
    CURVE, and only readers whose keys were given to `allow` (`.public_key` is what they connect with).
    Raises zmq.ZMQError when a port given cannot be bound."""

    def __init__(
        self,
        topic: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        replay_port: int | None = None,
        buffer_batches: int = 10_000,
        plain: bool = False,
    ):
        self.topic = topic.encode()
        self._context = zmq.Context()
        self._readers = _AllowedReaders()
        self._authenticator: ThreadAuthenticator | None = None
        self.public_key = b""
        if not plain:
            keys = CurveKeys.generate()
            self.public_key = keys.public
            # the ZAP handler must run before the sockets bind: a CURVE server without one admits anyone
            self._authenticator = ThreadAuthenticator(self._context, log=log.getChild("zap"))
            self._authenticator.start()
            self._authenticator.configure_curve_callback(domain="*", credentials_provider=self._readers)
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._context.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
        self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reader at its high-water mark: EAGAIN, not loss
        for socket in (self._pub, self._replay) if not plain else ():
            socket.curve_secretkey = keys.secret
            socket.curve_publickey = keys.public
            socket.curve_server = True
        try:
            self.port = _bind(self._pub, host, port, DEFAULT_PORT)
            self.replay_port = _bind(self._replay, host, replay_port, DEFAULT_REPLAY_PORT)
        except zmq.ZMQError:
            self._stop_sockets()
            raise
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._queue = DropOldestQueue(MAX_QUEUED_BATCHES)
        self._replays: dict[bytes, int] = {}  # reader identity -> the next sequence number it is owed
        self._seq = 0
        self.num_batches = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def num_dropped(self) -> int:
        """Batches dropped before sending: the engine published faster than the sockets took them."""
        return self._queue.num_dropped

    @property
    def num_refused(self) -> int:
        """Connections refused: a CURVE key not registered."""
        return self._readers.num_refused

    def allow(self, key: bytes) -> None:
        """Lets the reader with this CURVE public key (Z85, see `parse_reader_key`) connect."""
        self._readers.allow(key)

    def publish(self, events: list[KVEvent]) -> None:
        self._queue.put(events)

    def close(self) -> None:
        """Publishes what is queued, then closes the sockets."""
        self._queue.put(None)
        self._thread.join(10)
        self._stop_sockets()

    def _stop_sockets(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while True:  # a turn: a live batch, new replay requests, one slice of each replay under way
            try:
                events = self._queue.get(timeout=0 if self._replays else 0.02)
            except queue.Empty:
                events = []
            if events is None:
                return
            if events:
                self._send(events)
            for _ in range(MAX_REPLAYS):
                if not poller.poll(0):
                    break
                self._answer_replay()
            self._serve_replays()

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
        if len(self._replays) >= MAX_REPLAYS and identity not in self._replays:
            return  # busy: no answer (the reader's request times out and it asks again; an empty replay
            # would tell it that the replica holds nothing)
        self._replays[identity] = start

    def _serve_replays(self) -> None:
        """One slice of each replay under way, from the buffer (which moves on meanwhile)."""
        for identity, start in list(self._replays.items()):
            first = self._buffer[0][0] if self._buffer else self._seq
            position = max(start - first, 0)
            batches = list(itertools.islice(self._buffer, position, position + REPLAY_BATCHES_PER_TURN))
            done = len(batches) < REPLAY_BATCHES_PER_TURN
            sent = all(self._reply(identity, seq.to_bytes(8, "big"), payload) for seq, payload in batches)
            if not sent or (done and not self._reply(identity, END_OF_REPLAY, b"")) or done:
                del self._replays[identity]
            else:
                self._replays[identity] = batches[-1][0] + 1

    def _reply(self, identity: bytes, seq: bytes, payload: bytes) -> bool:
        """False when the reader is gone or has let REPLAY_HWM messages pile up: its replay ends there."""
        try:
            self._replay.send_multipart((identity, b"", seq, payload), flags=zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False


class DropOldestQueue(queue.Queue):
    """A bounded queue whose `put` never blocks: when full it drops the oldest item, and counts it."""

    def __init__(self, maxsize: int):
        super().__init__(maxsize)
        self.num_dropped = 0

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        while True:
            try:
                super().put(item, block=False)
                return
            except queue.Full:
                try:
                    self.get_nowait()
                    self.num_dropped += 1
                    if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                        log.warning(
                            "KV events: %d batches dropped (the publisher fell behind)", self.num_dropped
                        )
                except queue.Empty:
                    pass


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
    5557 and 5558, or free ones when another daemon of the host has them), the pod name of its topic
    (`--kv-events-pod`; default: $POD_IP, else the listening host, and the serving port: what llm-d's
    router matches to the endpoint it scores), and who may read (`--kv-events`): `plain`, anyone (llm-d's
    router), or else only readers whose CURVE keys the daemon registered (a prefill server's decode
    servers, through the Handshake)."""

    port: int | None = None
    replay_port: int | None = None
    pod: str | None = None
    plain: bool = False


def start_publishing(
    loop: EngineLoop, config: KVEventsConfig, host: str, serving_port: int, model: str | None = None
) -> KVEventPublisher:
    """Binds the sockets and routes the engine's events to them; prints where (operators, launchers).
    `model`: the served model name of the topic (default: the model's own)."""
    pod = config.pod or f"{os.environ.get('POD_IP') or host}:{serving_port}"
    name = model or loop.engine.model.config.name
    publisher = KVEventPublisher(topic(pod, name), host, config.port, config.replay_port, plain=config.plain)
    loop.publish_kv_events(publisher.publish)
    readers = "plain: any reader" if config.plain else "CURVE: registered readers"
    print(f"kv-events on {host}:{publisher.port} (replay {publisher.replay_port}; {readers})", flush=True)
    return publisher
