"""The decode server's configuration: how it takes requests and picks prefill replicas. Its `flag` fields
are decode-server's flags (pdserve/flags.py); this module stays light (no JAX) so that building the
command line imports nothing heavy."""

from __future__ import annotations

import dataclasses

from pdserve.engine.config import flag
from pdserve.services.sampling import Limits

# Set by an endpoint picker that chose a prefill pod for the request (llm-d's disagg-profile-handler):
# HOST:PORT of that pod. Honoured with DecodeConfig.accept_prefill_hint (`--accept-prefill-hint`) when it
# names one of this server's own prefill replicas (PrefillPool.pick), ignored otherwise.
PREFILL_HINT_HEADER = "x-prefiller-host-port"
ROUTING_POLICIES = ("prefix", "least-outstanding")  # --prefill-routing (Routing.policy)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How the decode server takes requests and gets them prefilled; `flag` fields are decode-server's
    flags (pdserve/flags.py)."""

    local_prefill_below: int = flag(
        0, "prefill here the prompts with fewer tokens than this beyond what this server has cached"
    )  # 0: none (all of them with no pool)
    max_queue: int = flag(256, "requests waiting for blocks before RESOURCE_EXHAUSTED")
    max_attempts: int = 3  # prefill replicas tried per request
    fallback_local: bool = flag(
        True, "prefill here when every replica failed (--no-fallback-local: UNAVAILABLE instead)"
    )
    accept_prefill_hint: bool = flag(
        False,
        f"prefill where a request's {PREFILL_HINT_HEADER} header says (llm-d's P/D), when that is one of "
        "the --prefill replicas; otherwise the header is ignored",
    )
    limits: Limits = Limits()  # what one request may carry (services.sampling.Limits)
    max_preparing: int = 64  # requests being rendered / tokenized at once before RESOURCE_EXHAUSTED


@dataclasses.dataclass(frozen=True)
class Routing:
    """How the pool picks a replica for a prompt (`--prefill-routing`, `--prefill-routing-load-weight`).

    "prefix": each healthy replica's cost is the prompt tokens it would compute plus `load_weight` times
    the prompt tokens it is already computing for this decode server:
        cost = (prompt tokens - tokens of the leading prompt blocks it holds) + load_weight * pending
    (with load_weight 1: the tokens of prefill work ahead of this prompt's last one on that replica); the
    cheapest wins, fewer requests in flight breaking ties. When no replica holds any of the prompt:
    the one with the fewest requests in flight, in turns among equals (so that prefixes seen for the
    first time spread over the replicas). "least-outstanding": always the latter.
    """

    policy: str = flag(
        "prefix",
        "prefix: by the prompt blocks each replica holds (its KV events) against its queued work; "
        "least-outstanding: the replica with the fewest requests in flight",
        flag="--prefill-routing",
        choices=ROUTING_POLICIES,
    )
    load_weight: float = flag(
        1.0,
        "prefix routing: weight of a replica's queued prompt tokens against the tokens it lacks",
        flag="--prefill-routing-load-weight",
    )
    events_resync_s: float = 2.0  # a quiet event stream is checked against the replay socket this often

    def cost(self, num_tokens: int, hit_tokens: int, pending_tokens: float) -> float:
        """ "prefix": a replica's cost for a prompt of `num_tokens` tokens of which it holds the leading
        `hit_tokens`, with `pending_tokens` prompt tokens already queued on it (the cheapest wins)."""
        return num_tokens - hit_tokens + self.load_weight * pending_tokens

    def __post_init__(self):
        if self.policy not in ("prefix", "least-outstanding"):
            raise ValueError(f"prefill routing {self.policy!r}: prefix or least-outstanding")
        if self.load_weight < 0:
            raise ValueError(f"prefill routing load weight {self.load_weight} < 0")
