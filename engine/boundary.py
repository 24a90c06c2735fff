"""What crosses between the daemons and the engine thread: typed commands in, plain outputs out.

A daemon drives its LLMEngine only through `LLMEngine.apply(command)` (services.engine_loop runs each on
the engine thread, between steps, in submission order) and reads only the EngineOutputs the engine hands
out: what commands produced (`take_outputs`, at once), what admission produced (between `schedule_step`
and `run_step`, so a transfer starts while the step computes), and each step's (`run_step`; `step()` is
both halves):

  commands in                                   outputs out (EngineOutputs)
    AddRequest(request, kv)   queue a request      tokens     RequestOutput per request that got a token
      kv=ReceiveKV(): its prompt's KV may           transfers  TransferReady: a ReceiveKV request holds its
        arrive from a prefill server (decode)                  blocks; how many prompt tokens to transfer
      kv=SendKV(...): its prompt's KV goes to a     kv         KVReady: chunks of a SendKV request's prompt,
        sender as it computes (prefill)                        gathered as they are computed
    Abort(request_id)         end it, free all     stats      EngineStats: blocks, queues, adapters
    InsertKV(...)             write an arriving    kv_events  the prefix cache's events (when recorded)
                              KV chunk
    RemoteKVDone(...)         its KV is in: start with the first token sampled elsewhere
    RemoteKVFailed(id)        no KV will arrive: prefill it here
    Detach(id)                a drain's migration: take a decoding request's sequences out of the steps,
                              blocks held (DetachedSequence each); ExportKV(...) gathers one's KV;
                              Reattach(ids) lets them decode here again (else Abort ends them)
    Utility(method, args)     adapters, stats, KV events (UTILITY_METHODS)

No callable crosses: every field is data, so the boundary can be logged, replayed and tested without a
model (tests/engine/test_boundary.py). A request's outputs of every kind reach its stream by the same
route, in order: a transfer before any token, the first token before the second.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.engine.core.kv_connector import KVReady, ReceiveKV, SendKV, TransferReady
from pdserve.engine.core.kv_events import KVEvent
from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import Request, TokenLogprobs
from pdserve.engine.core.speculation import SpeculationStats
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer import MAX_FRAME_BYTES, KVChunk

__all__ = [
    "Abort",
    "AdapterState",
    "AddRequest",
    "Command",
    "Detach",
    "DetachedSequence",
    "ExportKV",
    "Reattach",
    "EngineOutputs",
    "EngineStats",
    "InsertKV",
    "KVInsertError",
    "KVReady",
    "QueueFull",
    "ReceiveKV",
    "RemoteKVDone",
    "RemoteKVFailed",
    "SendKV",
    "TransferReady",
    "UTILITY_METHODS",
    "Utility",
]


# ---- commands in ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AddRequest:
    """Queues a request built by LLMEngine.make_request. `max_waiting`: refuse it (QueueFull) when that
    many requests already wait for blocks (None: no bound)."""

    request: Request
    kv: ReceiveKV | SendKV | None = None
    max_waiting: int | None = None


@dataclasses.dataclass(frozen=True)
class Abort:
    """Ends the request in any state, frees its blocks and forgets its transfer state; the result is
    whether it was still here."""

    request_id: str


@dataclasses.dataclass(frozen=True)
class InsertKV:
    """Writes one arriving chunk (verified, in this engine's layout; its tokens counted from block
    `first_block` of the prompt) into the request's blocks. A failure is kept for the transfer attempt
    `transfer`, whose RemoteKVDone then raises KVInsertError; nothing is written for a request that no
    longer waits for KV."""

    request_id: str
    chunk: KVChunk
    first_block: int
    transfer: int = 0


@dataclasses.dataclass(frozen=True)
class RemoteKVDone:
    """The request's prompt KV is in its blocks (every InsertKV of attempt `transfer` ran before) and
    `token` is its first token, sampled where the prompt was computed (`num_cached_tokens` of it found in
    that prefix cache): it starts decoding. Its token's output is among the engine's next outputs
    (take_outputs, which the engine loop hands out before its next step, or that step's). A resumed
    request moved here with its KV (Request.num_resumed: all but its last output's) has no token (None):
    it decodes on from its last output."""

    request_id: str
    token: int | None
    logprobs: TokenLogprobs | None = None
    num_cached_tokens: int = 0
    transfer: int = 0
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # one per prompt position after the first
    # With n > 1: the first tokens of sequences 1..n-1 (sampled from the same logits, each with its seed)
    forks: tuple[tuple[int, TokenLogprobs | None], ...] = ()
    # An EAGLE-3 head's input at the last prompt position (engine.draft_runner), from the prefill server
    draft_aux: Any = None


@dataclasses.dataclass(frozen=True)
class RemoteKVFailed:
    """No KV will arrive for the request: it is prefilled here, in the blocks it holds."""

    request_id: str


@dataclasses.dataclass(frozen=True)
class Detach:
    """Takes a decoding request's sequences (it and its forks) out of the steps, their blocks held, to move
    them to a peer. Result: a DetachedSequence per sequence still running, or () when one of them is not
    decoding now (its prompt still computing, its KV arriving): nothing is detached then. With `export_kv`,
    each carries its KV from block 0 (ExportKV's chunks), gathered at the same step boundary: a move that
    needs all of it waits for no second boundary."""

    request_id: str
    export_kv: bool = False


@dataclasses.dataclass(frozen=True)
class DetachedSequence:
    """A sequence Detach took out: what a peer needs to go on with it (make_request with these tokens as
    resume_token_ids, its seed, adapter and salt; then its KV, ExportKV)."""

    request_id: str  # this engine's key of the sequence (ExportKV, Reattach, Abort)
    index: int  # which of its request's n sequences
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    params: SamplingParams
    seed: int  # the sequence's own (a fork's: child_seed of the request's)
    lora_name: str | None
    lora_fingerprint: str | None
    cache_salt: str | None
    num_kv_tokens: int  # tokens whose KV it holds: all but its last output
    kv: tuple[KVChunk, ...] = ()  # its KV from block 0 when Detach exported it (device arrays)

    @property
    def transfer_digest_ids(self) -> tuple[int, ...]:
        """The tokens its KV was computed for (the prompt and every output but the last)."""
        return (*self.prompt_ids, *self.output_ids)[: self.num_kv_tokens]


@dataclasses.dataclass(frozen=True)
class ExportKV:
    """The KV of a detached sequence from block `first_block` on (the peer holds those before), gathered
    into kvtransfer chunks of this engine's layout in the frame plan of `max_frame_bytes`. Result: the
    chunks (device arrays: the caller moves them to the host)."""

    request_id: str
    first_block: int = 0
    max_frame_bytes: int = MAX_FRAME_BYTES


@dataclasses.dataclass(frozen=True)
class Reattach:
    """Detached sequences decode here again (their move failed); ids no longer detached are skipped."""

    request_ids: tuple[str, ...]


# LLMEngine's utility methods: adapters, the stats snapshot, the KV events switch
UTILITY_METHODS = ("add_adapter", "remove_adapter", "list_adapters", "stats", "record_kv_events")


@dataclasses.dataclass(frozen=True)
class Utility:
    """One of UTILITY_METHODS with its arguments; the result is the method's."""

    method: str
    args: tuple[Any, ...] = ()

    def __post_init__(self):
        if self.method not in UTILITY_METHODS:
            raise ValueError(f"unknown engine utility {self.method!r} (one of {UTILITY_METHODS})")


Command = (
    AddRequest | Abort | InsertKV | RemoteKVDone | RemoteKVFailed | Detach | ExportKV | Reattach | Utility
)


class QueueFull(RuntimeError):
    """AddRequest refused: `max_waiting` requests already wait for blocks."""


class KVInsertError(RuntimeError):
    """RemoteKVDone refused: an insert of that transfer failed here (the attempt is discarded)."""


# ---- outputs out ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AdapterState:
    """A loaded adapter and whether it sits in a device slot now."""

    adapter: Any  # engine.lora.LoraAdapter
    resident: bool


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine after a step: what Admin and /metrics report (no thread walks the
    scheduler). num_running: requests holding blocks (decoding, prompt being computed, KV arriving:
    `num_incoming` of them); num_waiting: queued for blocks."""

    num_running: int = 0
    num_waiting: int = 0
    num_incoming: int = 0
    num_blocks: int = 0
    num_used_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    block_size: int = 0
    cache_dtype: str = ""  # the KV cache's element type (kvtransfer.layout.DTYPES: int8 with its scales)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    num_preemptions: int = 0
    num_host_blocks: int = 0  # the host tier's slots (0: no tier)
    num_host_cached_blocks: int = 0  # of those, holding cached blocks
    num_host_staged_blocks: int = 0  # reserved by prefill streams' staged KV
    prefix_cache_host_hits: int = 0  # of prefix_cache_hits, tokens loaded from the host tier
    num_host_offloads: int = 0  # blocks copied to the host tier since start
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    num_adapters_loaded: int = 0
    num_lora_slots_used: int = 0
    num_lora_slot_loads: int = 0
    speculation: SpeculationStats | None = None  # its counters (a copy); None: speculation off

    @property
    def kv_usage(self) -> float:
        """Blocks held by requests / all blocks (0-1; blocks kept only by the prefix cache count free)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclasses.dataclass
class EngineOutputs:
    """What one step (with the commands before it) produced. `for_requests()` gives every per-request item
    in the order its stream must see them."""

    tokens: list[RequestOutput] = dataclasses.field(default_factory=list)
    transfers: list[TransferReady] = dataclasses.field(default_factory=list)
    kv: list[KVReady] = dataclasses.field(default_factory=list)
    stats: EngineStats = EngineStats()
    kv_events: list[KVEvent] = dataclasses.field(default_factory=list)

    def for_requests(self) -> list[TransferReady | KVReady | RequestOutput]:
        return [*self.transfers, *self.kv, *self.tokens]
