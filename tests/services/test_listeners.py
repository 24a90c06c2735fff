"""The listener inventory (docs/security.md, "Listeners"): what each role's process listens on, read from
the kernel's socket tables, is exactly the table's ports, all on the default loopback address."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import pytest

pytestmark = pytest.mark.daemon


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (Linux: /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            if family == socket.AF_INET:
                raw = raw[::-1]  # one little-endian 32-bit word
            else:
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
            ip = ipaddress.ip_address(raw)
            ip = getattr(ip, "ipv4_mapped", None) or ip  # (gRPC listens on 127.0.0.1 from an IPv6 socket)
            found.add((str(ip), int(port, 16)))
    return found


def expected(daemon, *names: str) -> set[tuple[str, int]]:
    ports = {int(daemon.address.rsplit(":", 1)[1])} | {
        int(daemon.addresses[n].rsplit(":", 1)[1]) for n in names
    }
    return {("127.0.0.1", port) for port in ports}


def test_each_role_listens_on_its_table_only(prefill, decode):
    """prefill-server: its gRPC port, /metrics (asked for here), KV events and their replay (on by default,
    for its decode servers). decode-server: its gRPC port, /metrics and the OpenAI HTTP port (its KV events
    are opt-in). Nothing else (no JAX or gRPC side port), nothing off loopback."""
    assert listening(prefill.proc.pid) == expected(prefill, "metrics", "kv-events", "kv-events-replay")
    assert listening(decode.proc.pid) == expected(decode, "metrics", "http")
