"""Joining a multi-process JAX job: one process per host of a multi-host slice, one global mesh.

A daemon spanning several hosts runs one process per host; every process calls `join()` before JAX
touches a device, and `jax.devices()` then lists every process's devices. Where the job's shape comes
from, first match wins:
  1. flags: `--coordinator-address HOST:PORT --num-processes N --process-id I`;
  2. LeaderWorkerSet's environment (`LWS_LEADER_ADDRESS`, `LWS_GROUP_SIZE`, `LWS_WORKER_INDEX`; the leader
     is index 0), the coordinator on the leader at `--coordinator-port`;
  3. nothing: a single-process job (on a TPU slice JAX's own cluster detection may still find the rest).
Process 0 hosts JAX's coordination service. On CPU the collectives go over gloo (TCP). Per JAX's fault
tolerance design, processes share fate: when one stops sending heartbeats the others terminate.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping

DEFAULT_COORDINATOR_PORT = 8476
DEFAULT_GROUP_PORT = 8477  # the leader's device operations to its workers (services/group.py)
# what the LeaderWorkerSet controller sets in every pod of a group (the leader is worker 0)
LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX = (
    "LWS_LEADER_ADDRESS",
    "LWS_GROUP_SIZE",
    "LWS_WORKER_INDEX",
)


def lws_environ(leader_address: str, group_size: int, worker_index: int) -> dict[str, str]:
    """The environment a LeaderWorkerSet gives worker `worker_index` of a group (tests start groups with
    it, as Kubernetes does)."""
    return {
        LWS_LEADER_ADDRESS: leader_address,
        LWS_GROUP_SIZE: str(group_size),
        LWS_WORKER_INDEX: str(worker_index),
    }


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    coordinator_address: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    group_port: int = DEFAULT_GROUP_PORT
    # a file holding the group's shared secret (services/group.py: a worker presents it before the leader
    # gives it a slot); None: the group port is open to anyone who reaches it
    secret_file: str | None = None

    def __post_init__(self):
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process id {self.process_id} out of range for {self.num_processes} processes")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def group_address(self) -> str:
        """host:port where workers reach the leader's operation stream (the coordinator's host)."""
        return f"{self.coordinator_address.rsplit(':', 1)[0]}:{self.group_port}"


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "multi-process job (one process per host; default: LeaderWorkerSet's env)"
    )
    group.add_argument("--coordinator-address", default=None, help="HOST:PORT of process 0")
    group.add_argument("--num-processes", type=int, default=None)
    group.add_argument("--process-id", type=int, default=None)
    group.add_argument(
        "--coordinator-port",
        type=int,
        default=DEFAULT_COORDINATOR_PORT,
        help="the coordinator's port when its host comes from LWS_LEADER_ADDRESS",
    )
    group.add_argument(
        "--group-port",
        type=int,
        default=DEFAULT_GROUP_PORT,
        help="the leader's port streaming device operations to the workers",
    )
    group.add_argument(
        "--group-secret-file",
        metavar="FILE",
        help="the group's shared secret (the file's first line, the same for every process; deploy/: a "
        "Secret): a worker presents it before the leader gives it a slot (default: the port is open)",
    )


def process_group(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ProcessGroup | None:
    """The job this process belongs to (None: single-process); ValueError on a partial set of flags."""
    flags = (args.coordinator_address, args.num_processes, args.process_id)
    if any(value is not None for value in flags):
        if any(value is None for value in flags):
            raise ValueError("--coordinator-address, --num-processes and --process-id go together")
        return ProcessGroup(
            args.coordinator_address,
            args.num_processes,
            args.process_id,
            args.group_port,
            args.group_secret_file,
        )
    if LWS_LEADER_ADDRESS in environ and LWS_GROUP_SIZE in environ:
        size = int(environ[LWS_GROUP_SIZE])
        if size == 1:
            return None
        address = f"{environ[LWS_LEADER_ADDRESS]}:{args.coordinator_port}"
        worker = int(environ.get(LWS_WORKER_INDEX, "0"))
        return ProcessGroup(address, size, worker, args.group_port, args.group_secret_file)
    return None


def join(group: ProcessGroup | None) -> None:
    """Joins the job (before any device is touched); a no-op for a single-process job."""
    if group is None:
        return
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(group.coordinator_address, group.num_processes, group.process_id)
