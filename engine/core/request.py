"""A request's state inside one engine: tokens, blocks, progress, outcome. No device code."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from pdserve.engine.core.kv_cache_manager import hash_blocks
from pdserve.engine.lora.adapter import LoraAdapter
from pdserve.engine.sampling_params import SamplingParams, child_seed


class Status(enum.Enum):
    """Where a request is in the scheduler (engine.core.scheduler changes it; nothing else does)."""

    WAITING = "waiting"  # queued: no blocks yet
    WAITING_FOR_REMOTE_KV = (
        "waiting_for_remote_kv"  # decode role: holds blocks, its KV arrives from elsewhere
    )
    RUNNING = "running"  # holds blocks: its prompt is being computed (in chunks), then it decodes
    PREEMPTED = "preempted"  # gave its blocks back under block pressure; queued first, recomputed
    FINISHED_SENDING = "finished_sending"  # prefill role: finished, its KV is being handed to a sender
    # decode role: a decoding request taken out of the steps, its blocks held, while it moves to a peer
    # (a drain's migration); it ends here once it has moved (Abort), or decodes here again (reattach)
    DETACHED = "detached"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's length
    ABORT = "abort"  # cancelled
    # the constraint allowed no next token, or its matcher failed (a work limit): nothing invalid was shown
    DEAD_END = "constraint_dead_end"
    # the engine failed on this request (Request.error says how): it ended, the others go on
    ERROR = "error"


@dataclasses.dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int = 0  # of token_id among the vocabulary by logprob, from 1 (0: not computed)


@dataclasses.dataclass
class Request:
    """Invariant: `num_computed` tokens of `all_ids` have their KV in the request's blocks (held by the
    scheduler's KV cache manager); the rest are fed next."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # resolved seed (params.seed or a random one drawn at arrival)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # Resumed (a stream that broke elsewhere, continued here): its first `num_resumed` output tokens were
    # generated elsewhere and already shown to its client; they are computed with the prompt, never shown
    # again, and it samples on at the position they reach (engine.input_processor.InputProcessor.make_request)
    num_resumed: int = 0
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt position, None at the first (and where not yet
    # computed); the first output carries them
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV was found in the prefix cache at admission
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    lora: LoraAdapter | None = None  # None: the base model
    # A tenant's salt (vLLM's cache_salt): blocks hashed with another salt, or none, are never shared with
    # it, so one tenant's prompts cannot be probed through another's cache hits. None: unsalted.
    cache_salt: str | None = None
    lora_slot: int = -1  # device slot pinned for `lora` from admission to the end; -1: none
    # Its full blocks may enter the prefix cache. False once KV that fills only some layers' blocks arrived
    # by transfer (sliding-window layers get only the window's blocks): no later request may hit them.
    cacheable: bool = True
    # The constraint's matcher (engine.constraints), where its language stands after the output so far
    matcher: Any = None
    # The output is still the model's reasoning (params.reasoning_end not yet generated): the constraint waits
    reasoning: bool = False
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admitted (blocks allocated): its queue time ends there
    error: str = ""  # with FinishReason.ERROR: what failed
    # The tokens that end it: its params' stop_token_ids and, unless ignore_eos, the model's EOS tokens
    stop_token_ids: frozenset[int] = frozenset()
    # Hashes of its full blocks so far, chained, with its adapter's key (extend_block_hashes): computed
    # once each, for the prefix cache's lookups and registrations, routing and a peer's held blocks
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    # params.bad_words in the model's tokens (each word as given and after a space), from make_request
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # params.allowed_token_ids as a bitmask of the vocabulary (uint32 words), built once by make_request and
    # shared by the request's forks; None: any token
    allowed_mask: Any = None
    # With params.n > 1: sequence `index` of the request `parent_id` (None: the request itself, sequence 0).
    # Its outputs go out under the parent's id (RequestOutput.index says which sequence).
    parent_id: str | None = None
    index: int = 0
    # With n > 1, before its first token: the sequence slots its forks were given at admission (the
    # scheduler admits n sequences in parts: the forks past these wait in the queue)
    fork_slots: int = 0
    # Speculation: its drafts verified so far and of those accepted (how much its next drafts are worth)
    num_drafted: int = 0
    num_draft_accepted: int = 0
    # A draft head's drafts to follow its tokens, proposed after its last step (engine.draft_runner); the
    # scheduler takes them once
    proposed: list[int] = dataclasses.field(default_factory=list)
    # A draft head's input at its last prompt position (the target's aux states there, on the host): what a
    # prefill server sends with the first token (engine.draft_runner); None: none kept
    draft_aux: Any = None

    @property
    def output_id(self) -> str:
        """The id its outputs carry: its own, or its parent's for a forked sequence."""
        return self.parent_id or self.request_id

    @property
    def forks_pending(self) -> bool:
        """Its next token is its first and it asks for n > 1 sequences: that sampling forks it."""
        return self.params.n > 1 and self.parent_id is None and not self.output_ids

    def fork(self, index: int, matcher: Any = None) -> Request:
        """Sequence `index` (1..n-1) of this request, before its first token: the same prompt, adapter,
        salt and stop tokens, its own seed (child_seed) and `matcher` (a fresh one of the constraint).
        Its blocks and its place in the queues are the scheduler's to give (Scheduler adopts it)."""
        return dataclasses.replace(
            self,
            request_id=f"{self.request_id}#{index}",
            seed=child_seed(self.seed, index),
            output_ids=[],
            logprobs=[],
            status=Status.WAITING,
            lora_slot=-1,
            matcher=matcher,
            block_hashes=list(self.block_hashes),
            parent_id=self.request_id,
            index=index,
            fork_slots=0,
            num_drafted=0,
            num_draft_accepted=0,
        )

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_transfer_tokens(self) -> int:
        """Tokens whose KV a transfer brings it: its prompt (a prefill server samples the first token after
        it), or for a resumed request every token but its last output, which it feeds next."""
        return self.num_tokens - 1 if self.num_resumed else len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def extend_block_hashes(self, block_size: int) -> list[int]:
        """`block_hashes`, extended over the blocks filled since (prompt, then output tokens)."""
        if len(self.block_hashes) < self.num_tokens // block_size:
            self.block_hashes = hash_blocks(self.all_ids, block_size, self.cache_key, self.block_hashes)
        return self.block_hashes

    def prefix_hashes(self, block_size: int) -> list[int]:
        """The hashes of the blocks a prefix cache may serve it: every full block before its last token
        (whose logits must be computed to sample the next one); none when it asks for prompt logprobs,
        which every prompt position's logits give (vLLM reads no cache for them either)."""
        if self.params.prompt_logprobs is not None:
            return []
        return self.extend_block_hashes(block_size)[: (self.num_tokens - 1) // block_size]

    @property
    def cache_key(self) -> str | None:
        """What else besides the tokens its blocks' hashes depend on: the adapter's weights (the KV
        depends on them) and the cache salt (who may share them)."""
        adapter = None if self.lora is None else self.lora.fingerprint
        if self.cache_salt is None:
            return adapter
        return f"{adapter or ''}\x00salt\x00{self.cache_salt}"
