"""The process group of a multi-host daemon: the leader streams its engine's device operations to workers.

A prefill-server or decode-server spanning several hosts is one process per host, joined in one JAX job
(engine.distributed) with one global mesh. Process 0, the leader, runs the gRPC servers, the scheduler and
the tokenizer. Every device operation of its engine (engine.multihost: steps, sampling, KV reads and
writes, adapter loads) is sent, before it runs, to each worker over a `ProcessGroup.Follow` stream on the
leader's group port: a side channel beside JAX's coordination service, one message per operation, in
order. Workers build the same engine, warm it up the same way, then apply each operation
(engine.multihost.Follower) until the leader's `stop`.

Why a gRPC stream rather than the JAX job's own collectives: an idle collective times out (gloo on CPU),
the operations' sizes vary (a broadcast would need a size round and a compilation per size), and a stream's
end tells each side at once that the other is gone (keepalive covers a vanished host).

Failure (processes share fate; the LeaderWorkerSet recreates the whole group):
  - a worker's stream ends before `stop`: the leader reports NOT_SERVING and exits with EXIT_GROUP_LOST,
    without waiting for its engine (which may be blocked in a collective with the dead worker); its
    in-flight Prefill streams break, and decode servers retry another replica or prefill locally;
  - the leader's stream ends before `stop`: the worker exits with EXIT_GROUP_LOST;
  - SIGTERM: the leader drains, then sends `stop`; workers ignore SIGTERM and follow the leader.
With `--group-secret-file` a worker presents the group's shared secret before the leader gives it a slot
(else UNAUTHENTICATED: no slot, no operation). The leader accepts requests of at most 64 KiB; workers
accept operations of at most engine.multihost.max_op_bytes of their engine. The stream itself is
plaintext, and JAX's coordinator and gloo's ports carry no authentication: they must be reachable from the
group's own pods only (deploy/: NetworkPolicy).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import queue
import signal
import threading
from collections.abc import Awaitable

import grpc
import numpy as np

from pdserve.engine.distributed import ProcessGroup
from pdserve.engine.multihost import DeviceOp, Follower, engine_fingerprint, max_op_bytes
from pdserve.services.grpc_server import (
    KEEPALIVE_OPTIONS,
    channel_options,
    method_path,
    server_options,
    service_handler,
)
from pdserve.services.security import bearer_metadata, read_tokens, token_ok
from pdserve.v1 import group_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["ProcessGroup"]
EXIT_GROUP_LOST = 3  # a process of the group is gone: the group must be recreated
# An operation's arrays (a KV chunk, an adapter) travel in one message: at most engine.multihost.max_op_bytes
# of the group's engine (this default: a group without an engine, in tests). A worker's request is small.
MAX_OP_BYTES = 64 << 20
MAX_FOLLOW_REQUEST_BYTES = 64 << 10
LOST_GRACE_S = 1.0  # the leader's NOT_SERVING is visible this long before it exits


def group_secret(group: ProcessGroup) -> str | None:
    """The group's shared secret from its file (None without one)."""
    return read_tokens(group.secret_file)[0] if group.secret_file else None


# ---- DeviceOp <-> message ------------------------------------------------------------------------------
def to_message(op: DeviceOp, seq: int) -> pb.DeviceOp:
    arrays = [
        pb.HostArray(name=name, dtype=a.dtype.name, shape=a.shape, data=np.ascontiguousarray(a).tobytes())
        for name, a in op.arrays.items()
    ]
    return pb.DeviceOp(seq=seq, kind=op.kind, arrays=arrays, args_json=json.dumps(op.args))


def from_message(message: pb.DeviceOp) -> DeviceOp:
    arrays = {
        a.name: np.frombuffer(a.data, np.dtype(a.dtype)).reshape(tuple(a.shape)) for a in message.arrays
    }
    return DeviceOp(message.kind, arrays, json.loads(message.args_json or "{}"))


# ---- the leader ------------------------------------------------------------------------------------------
class Leader:
    """Process 0's side: serves Follow to the workers and publishes each device operation to all of them."""

    def __init__(self, group: ProcessGroup, fingerprint: str, host: str, max_op_bytes: int = MAX_OP_BYTES):
        self.group = group
        self.fingerprint = fingerprint
        self.secret = group_secret(group)
        if self.secret is None:
            log.warning("process group: the group port is unauthenticated (no --group-secret-file)")
        self._cond = threading.Condition()
        self._streams: dict[int, queue.Queue] = {}  # process id -> its stream's messages (None: the end)
        self._seq = 0
        self._stopping = False
        self.lost = threading.Event()
        self.lost_reason = ""
        self._on_lost: list = []
        workers = group.num_processes - 1
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=workers + 1, thread_name_prefix="group"),
            options=server_options(MAX_FOLLOW_REQUEST_BYTES, max_send_bytes=max_op_bytes),
        )
        self._server.add_generic_rpc_handlers((service_handler(SERVICE, self),))
        self.port = self._server.add_insecure_port(f"{host}:{group.group_port}")
        self._server.start()
        log.info("process group: leader of %d processes, group port %d", group.num_processes, self.port)

    def Follow(self, request: pb.FollowRequest, context: grpc.ServicerContext):  # noqa: N802 - the RPC's name
        if self.secret and not token_ok(context.invocation_metadata(), (self.secret,)):
            context.abort(  # before anything else: no slot, no operation, nothing about the group
                grpc.StatusCode.UNAUTHENTICATED,
                "a worker must present the group's secret (--group-secret-file)",
            )
        pid = request.process_id
        if not 0 < pid < self.group.num_processes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"process id {pid} is not a worker of this group")
        if request.engine_fingerprint != self.fingerprint:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {pid}'s engine {request.engine_fingerprint} differs from the leader's "
                f"{self.fingerprint} (model, engine flags, device count or JAX version)",
            )
        with self._cond:
            if pid in self._streams or self._seq:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"worker {pid} already follows, or the group runs"
                )
            stream: queue.Queue = queue.Queue()
            self._streams[pid] = stream
            self._cond.notify_all()
        context.add_callback(lambda: self._ended(pid))
        log.info("process group: worker %d follows", pid)
        while context.is_active():
            try:
                message = stream.get(timeout=1.0)
            except queue.Empty:
                continue
            if message is None:
                return
            yield message

    def _ended(self, pid: int) -> None:
        with self._cond:
            if self._stopping:
                return
            self.lost_reason = f"worker {pid}'s stream ended"
            callbacks = list(self._on_lost)
        log.error("process group: %s", self.lost_reason)
        self.lost.set()
        for callback in callbacks:
            callback()

    def on_lost(self, callback) -> None:
        """`callback()` runs (on a gRPC thread) when a worker is gone; at once if one is already."""
        with self._cond:
            self._on_lost.append(callback)
        if self.lost.is_set():
            callback()

    def wait_for_workers(self, timeout_s: float) -> None:
        """Returns once every worker follows; RuntimeError after `timeout_s`."""
        with self._cond:
            ready = self._cond.wait_for(
                lambda: len(self._streams) == self.group.num_processes - 1, timeout=timeout_s
            )
        if not ready:
            missing = sorted(set(range(1, self.group.num_processes)) - set(self._streams))
            raise RuntimeError(f"workers {missing} did not join within {timeout_s:.0f} s")

    def publish(self, op: DeviceOp) -> None:
        """Sends `op` to every worker (the engine thread, just before running it)."""
        if self.lost.is_set():
            raise RuntimeError(f"the process group is broken: {self.lost_reason}")
        with self._cond:
            message = to_message(op, self._seq)
            self._seq += 1
            for stream in self._streams.values():
                stream.put(message)

    def stop(self, timeout_s: float = 30.0) -> None:
        """After the engine stopped: sends `stop`, lets the workers read it, closes the port."""
        with self._cond:
            self._stopping = True
        if not self.lost.is_set():
            self.publish(DeviceOp("stop"))
        for stream in self._streams.values():
            stream.put(None)
        self._server.stop(timeout_s).wait(timeout_s)


async def supervised(leader: Leader | None, stop: asyncio.Event, serving: Awaitable[None]) -> None:
    """Runs a daemon's `serving` coroutine; when a worker is gone: NOT_SERVING (`stop` starts the drain),
    then the process exits with EXIT_GROUP_LOST (its engine may be blocked in a collective forever)."""
    if leader is None:
        await serving
        return
    loop = asyncio.get_running_loop()
    lost = asyncio.Event()
    leader.on_lost(lambda: loop.call_soon_threadsafe(lost.set))
    serve_task = asyncio.ensure_future(serving)
    lost_task = asyncio.ensure_future(lost.wait())
    done, _ = await asyncio.wait({serve_task, lost_task}, return_when=asyncio.FIRST_COMPLETED)
    if lost_task in done:
        log.error("process group broken (%s): exiting for the group to be recreated", leader.lost_reason)
        stop.set()
        await asyncio.sleep(LOST_GRACE_S)
        os._exit(EXIT_GROUP_LOST)
    lost_task.cancel()
    await serve_task


def lead(engine, group: ProcessGroup, host: str, timeout_s: float = 600.0) -> Leader:
    """Process 0, its engine warmed up: opens the group port, waits for every worker, then publishes each
    of the engine's device operations (`engine`: an engine.llm_engine.LLMEngine)."""
    leader = Leader(group, engine_fingerprint(engine), host, max_op_bytes(engine))
    leader.wait_for_workers(timeout_s)
    engine.publish_device_ops(leader.publish)
    return leader


# ---- a worker --------------------------------------------------------------------------------------------
def follow(engine, layout, group: ProcessGroup) -> int:
    """A worker process, its engine warmed up like the leader's: applies the leader's operations until
    `stop`, then returns 0 (`engine`: an engine.llm_engine.LLMEngine; `layout`: its KV layout)."""
    signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: the leader stops this worker"))
    follower = Follower(engine, layout)
    ops = operations(group, engine_fingerprint(engine), max_op_bytes(engine))
    log.info("process group: worker %d follows %s", group.process_id, group.group_address)
    while follower.apply(ops.get()):
        pass
    log.info("process group: the leader stopped; %d operations applied", follower.applied)
    return 0


def operations(group: ProcessGroup, fingerprint: str, max_bytes: int = MAX_OP_BYTES) -> queue.Queue[DeviceOp]:
    """Follows the leader: its operations arrive in order in the returned queue, `stop` last. When the
    stream ends otherwise (the leader is gone, or refused this worker) the process exits EXIT_GROUP_LOST
    at once: its main thread may be blocked in a collective with the dead leader."""
    channel = grpc.insecure_channel(
        group.group_address, options=[*channel_options(max_bytes), *KEEPALIVE_OPTIONS]
    )
    call = channel.unary_stream(
        method_path(SERVICE, "Follow"),
        request_serializer=pb.FollowRequest.SerializeToString,
        response_deserializer=pb.DeviceOp.FromString,
    )(
        pb.FollowRequest(process_id=group.process_id, engine_fingerprint=fingerprint),
        wait_for_ready=True,
        metadata=bearer_metadata(group_secret(group)),
    )
    ops: queue.Queue[DeviceOp] = queue.Queue()

    def read() -> None:
        expected = 0
        try:
            for message in call:
                if message.seq != expected:
                    raise ValueError(f"operation {message.seq} where {expected} was due")
                expected += 1
                op = from_message(message)
                ops.put(op)
                if op.kind == "stop":
                    channel.close()
                    return
            reason = "the leader's stream ended without `stop`"
        except grpc.RpcError as e:
            reason = f"the leader's stream failed: {e.code().name}: {e.details()}"
        except Exception as e:  # noqa: BLE001 - any broken stream ends the worker
            reason = f"bad operation stream: {e}"
        log.error("process group: %s; exiting", reason)
        os._exit(EXIT_GROUP_LOST)

    threading.Thread(target=read, name="group-reader", daemon=True).start()
    return ops
