"""Which prefill replica computes a prompt: the pool of replicas (targets resolved, dns:/// names
re-resolved), the choice per `Routing` (services.decode.config: by the prompt blocks each replica holds, per
its KV events, against the work queued on it; or the replica an endpoint picker named), and each replica's
accounting while a prefill runs on it (its requests and prompt tokens in flight, the blocks it is about to
hold, what it held less than its events said), which the next choice reads."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import Iterator

from pdserve.kvtransfer import KVLayout
from pdserve.services.decode.config import Routing
from pdserve.services.decode.prefillers import Prefiller
from pdserve.services.decode.remote_prefiller import RemotePrefiller
from pdserve.services.security import PLAINTEXT, ChannelSecurity


@dataclasses.dataclass
class Route:
    replica: Prefiller
    expected_hit_tokens: int  # prompt tokens the replica holds, per its events
    reason: str  # "prefix": for what it holds; "load": nothing held anywhere, the least busy; "hint": named
    # by the request's endpoint picker (services.decode.config.PREFILL_HINT_HEADER)

    @contextlib.contextmanager
    def dispatched(self, num_tokens: int, hashes: list[int]) -> Iterator[None]:
        """While a prefill of a prompt of `num_tokens` tokens whose full blocks hash to `hashes` runs on the
        replica: its requests in flight and the prompt tokens it is expected to compute (those it does not
        hold) count against it in `pick`, and the blocks it is about to hold are expected in its cache (the
        next such prompt goes there)."""
        replica = self.replica
        work = num_tokens - self.expected_hit_tokens
        if replica.cache is not None:
            replica.cache.expect(hashes)
        replica.outstanding += 1
        replica.pending_tokens += work
        try:
            yield
        finally:
            replica.outstanding -= 1
            replica.pending_tokens -= work

    def found(self, actual: int, hashes: list[int], block_size: int) -> None:
        """The replica found `actual` prompt tokens in its cache: one that held less than its events said
        is corrected, and greeted again before its next prefill (it may have restarted with other event
        ports)."""
        expected = self.expected_hit_tokens
        if actual < expected:
            self.replica.held_less(hashes[actual // block_size : expected // block_size])


class PrefillPool:
    """Prefill replicas; `pick()` chooses one per `routing`.

    Targets are host:port, or dns:///name:port (a Kubernetes headless service): every address the name
    resolves to becomes a replica, re-resolved by `refresh()`. `security`: TLS / mutual TLS to the replicas.
    """

    def __init__(
        self,
        targets: list[str],
        dst: KVLayout,
        security: ChannelSecurity = PLAINTEXT,
        routing: Routing = Routing(),
    ):
        self.targets = targets
        self.dst = dst
        self.security = security
        self.routing = routing
        self.replicas: dict[str, Prefiller] = {}
        self._turn = 0
        self.on_layout = None  # given to each remote replica (RemotePrefiller.on_layout)

    @classmethod
    def of(cls, replica: Prefiller, dst: KVLayout) -> PrefillPool:
        """A pool of one given replica (the local prefill engine of `pdserve serve`): nothing to resolve."""
        pool = cls([], dst)
        pool.replicas[replica.name] = replica
        return pool

    @staticmethod
    def resolve(target: str) -> list[str]:
        if not target.startswith("dns:///"):
            return [target]
        host, _, port = target[len("dns:///") :].rpartition(":")
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        addresses = {info[4][0] for info in infos}
        return sorted(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses)

    async def refresh(self) -> None:
        wanted = {addr for target in self.targets for addr in self.resolve(target)}
        for addr in wanted - self.replicas.keys():
            self.replicas[addr] = RemotePrefiller(
                addr,
                self.dst,
                security=self.security,
                events_resync_s=self.routing.events_resync_s,
                on_layout=self.on_layout,
            )
        for addr in self.replicas.keys() - wanted:
            await self.replicas.pop(addr).close()

    def pick(
        self,
        exclude: set[str] = frozenset(),
        block_hashes: list[int] = (),
        num_tokens: int = 0,
        prefer: str | None = None,
    ) -> Route | None:
        """The replica for a prompt of `num_tokens` tokens whose full blocks hash to `block_hashes`
        (kv_cache_manager.hash_blocks), among the healthy ones not in `exclude` (all not excluded when
        none is healthy); None when there is none.

        `prefer`: HOST:PORT an endpoint picker chose (reason "hint"): the candidate of that address, else
        the only candidate on that host (the picker names a pod by its IP and the InferencePool's target
        port, not the Prefill port). Anything else is not one of our replicas and is ignored: a hint never
        adds a target, so TLS and peer names stay those of the pool."""
        candidates = [r for r in self.replicas.values() if r.healthy and r.name not in exclude]
        if not candidates:
            candidates = [r for r in self.replicas.values() if r.name not in exclude]
        if not candidates:
            return None
        hits = {r.name: 0 for r in candidates}
        if self.routing.policy == "prefix" and block_hashes:
            for r in candidates:
                if r.cache is not None:
                    hits[r.name] = r.cache.matched_blocks(block_hashes) * self.dst.block_size
        hinted = _hinted(candidates, prefer) if prefer else None
        if hinted is not None:
            return Route(hinted, hits[hinted.name], "hint")
        if not any(hits.values()):
            least = min(r.outstanding for r in candidates)
            tied = [r for r in candidates if r.outstanding == least]
            self._turn += 1
            return Route(tied[self._turn % len(tied)], 0, "load")
        cost = self.routing.cost
        best = min(
            candidates, key=lambda r: (cost(num_tokens, hits[r.name], r.pending_tokens), r.outstanding)
        )
        return Route(best, hits[best.name], "prefix" if hits[best.name] else "load")

    async def close(self) -> None:
        for replica in self.replicas.values():
            await replica.close()


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def _hinted(candidates: list[Prefiller], address: str) -> Prefiller | None:
    """The candidate at `address` (HOST:PORT), else the only one on its host; None: not one of them."""
    exact = [r for r in candidates if r.name == address]
    same_host = [r for r in candidates if _host(r.name) == _host(address)]
    if exact:
        return exact[0]
    return same_host[0] if len(same_host) == 1 else None
