"""Where a decode server gets its prompts prefilled: the interface every prefill replica's client has
(`Prefiller`: remote_prefiller.RemotePrefiller over gRPC, local_prefiller.LocalPrefiller in this process),
what it yields, and the checks the first token it ends with passes before this server uses it.

`Prefiller.prefill(request, dst_layout, dst_sharding, PrefillCall(held=...))` yields, in order: KVChunks
already placed on the decode mesh in the decode layout, carrying the prompt's tokens from block len(held) on
(the blocks before are the `held` ones, which the decode side has), each as soon as the replica has computed
and sent it, then the FirstToken, which confirms them all. Any failure raises PrefillError and nothing yielded
so far may be used: the caller rewrites the same blocks from another replica, or prefills them itself. Which
replica prefills a prompt is routing's choice (services.decode.routing).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np

from pdserve.engine.core.request import Request, TokenLogprobs
from pdserve.kvtransfer import KVChunk, KVLayout
from pdserve.services.decode.prefix_index import ReplicaCache


class PrefillError(RuntimeError):
    """A prefill failed (unreachable, died mid-stream, bad frame, layout mismatch, adapter not there).

    `replica_down`: the replica itself failed (avoid it for a while, forget what it was known to cache),
    rather than refused this request. `retry_after_ms`: the replica is busy (RESOURCE_EXHAUSTED, or too
    slow for the deadline): it is up, what it caches is still known, and it may take the request after
    that long."""

    def __init__(self, message: str, replica_down: bool = True, retry_after_ms: int | None = None):
        super().__init__(message)
        self.replica_down = replica_down and retry_after_ms is None
        self.retry_after_ms = retry_after_ms


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """How a prompt is to be prefilled: `timeout`: seconds left of the client's deadline (None: none);
    `held`: hashes of the prompt's leading blocks the decode side holds (their KV is not sent);
    `traceparent`: the request's span, the parent of the replica's (services.tracing)."""

    timeout: float | None = None
    held: Sequence[int] = ()
    traceparent: str | None = None


@dataclasses.dataclass
class FirstToken:
    """What a prefill ends with: the first token sampled from the prompt (and what came with it), which
    confirms every KV chunk yielded before it; check_first_token checks it."""

    token: int
    logprobs: TokenLogprobs | None
    num_cached_tokens: int = 0  # prompt tokens the replica found in its prefix cache
    prompt_logprobs: list[TokenLogprobs] | None = None  # one per prompt position after the first, if asked
    # n > 1: the first tokens (and logprobs, if asked) of sequences 1..n-1
    forks: tuple[tuple[int, TokenLogprobs | None], ...] = ()
    # An EAGLE-3 head's input at the last prompt position (float32 [aux width]); None: none sent
    draft_aux: np.ndarray | None = None


class Prefiller(abc.ABC):
    """The client of one prefill replica. Its health, cache view and work in flight are what routing
    reads and keeps (services.decode.routing)."""

    name: str
    outstanding: int = 0  # requests in flight from this decode server
    pending_tokens: int = 0  # of those, the prompt tokens it is expected to compute (not cached there)
    down_until: float = 0.0  # after a failure the replica is avoided until then (monotonic seconds)
    cache: ReplicaCache | None = None  # what its prefix cache holds, per its KV events (None: unknown)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_failed(self, backoff_s: float = 2.0) -> None:
        """The replica failed (unreachable, died): avoided for a while; what it cached may be gone."""
        self.down_until = time.monotonic() + backoff_s
        if self.cache is not None:
            self.cache.forget()

    def held_less(self, missing: list[int]) -> None:
        """A prefill here found the blocks `missing` uncached although the events said they were."""
        if self.cache is not None:
            self.cache.forget(missing)

    @abc.abstractmethod
    def prefill(
        self, request: Request, dst: KVLayout, sharding, call: PrefillCall
    ) -> AsyncIterator[FirstToken | KVChunk]:
        """The prompt of `request` prefilled as `call` says (see the module)."""

    async def close(self) -> None:
        return None


def check_first_token(
    first: FirstToken, request: Request, vocab_size: int, replica: str, draft_aux_width: int = 0
) -> None:
    """A replica's trailer, range-checked like a client's request (PrefillError, the replica at fault):
    the first token in the vocabulary, the cached tokens within the prompt, the logprobs only as asked
    (the sampled token's first, at most the top-n asked for, each id in the vocabulary, each logprob a
    finite number <= 0), one more first token for each sequence after the first (n > 1), checked alike,
    the prompt logprobs as asked (one per prompt token after the first, for that token, its rank in the
    vocabulary), and a draft head's input exactly where this server has a head (`draft_aux_width` finite
    values; 0: no head, none sent)."""

    def refuse(what: str):
        raise PrefillError(f"{replica}: trailer {what}")

    aux = first.draft_aux
    if (aux is not None) != bool(draft_aux_width):
        refuse(f"draft_aux {'sent' if aux is not None else 'missing'}: this server's draft head reads "
               f"{draft_aux_width} values")  # fmt: skip
    if aux is not None and (aux.shape != (draft_aux_width,) or not np.isfinite(aux).all()):
        refuse(f"draft_aux of {aux.size} values, not {draft_aux_width} finite ones")

    if not 0 <= first.num_cached_tokens <= len(request.prompt_ids):
        refuse(f"num_cached_tokens {first.num_cached_tokens} outside [0, {len(request.prompt_ids)}]")
    if len(first.forks) != request.params.n - 1:
        refuse(f"has {len(first.forks) + 1} first tokens for a request of n={request.params.n}")
    for token, lp in [(first.token, first.logprobs), *first.forks]:
        _check_sampled(token, lp, request.params.logprobs, vocab_size, refuse)
    asked, prompt = request.params.prompt_logprobs, request.prompt_ids
    if asked is None:
        return
    entries = first.prompt_logprobs or []
    if [e.token_id for e in entries] != prompt[1:]:
        refuse(f"prompt_logprobs are not those of the prompt's {len(prompt) - 1} tokens after the first")
    for entry in entries:
        if len(entry.top) > asked or not 1 <= entry.rank <= vocab_size:
            refuse(f"prompt_logprobs entry of token {entry.token_id} differs from what was asked")
        _check_entry(entry, vocab_size, refuse, "prompt_logprobs")


def _check_sampled(token: int, lp: TokenLogprobs | None, asked: int | None, vocab_size: int, refuse) -> None:
    """A sampled first token in the vocabulary, with its logprobs exactly as asked."""
    if not 0 <= token < vocab_size:
        refuse(f"first_token {token} outside the vocabulary [0, {vocab_size})")
    if lp is None:
        if asked is not None:
            refuse("lacks the first token's logprobs")
    elif asked is None or lp.token_id != token or len(lp.top) > asked:
        refuse(f"first_logprobs differ from what was asked ({asked} for token {token})")
    else:
        _check_entry(lp, vocab_size, refuse, "first_logprobs")


def _check_entry(lp: TokenLogprobs, vocab_size: int, refuse, field: str) -> None:
    """Each id of a logprobs entry in the vocabulary, each logprob a finite number <= 0."""
    for token, value in [(lp.token_id, lp.logprob), *lp.top]:
        if not 0 <= token < vocab_size or not math.isfinite(value) or value > 1e-3:
            refuse(f"{field} entry ({token}, {value}) out of range")
