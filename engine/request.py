"""A request's state inside one engine: tokens, blocks, progress, outcome. No device code."""

from __future__ import annotations

import dataclasses
import enum
import time

from engine.block_manager import BlockTable
from engine.lora.adapter import LoraAdapter
from engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # prompt (or part of it) not yet in the cache
    RUNNING = "running"  # decoding
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's length
    ABORT = "abort"  # cancelled


@dataclasses.dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class Request:
    """Invariant: `num_computed` tokens of `all_ids` have their KV in `blocks`; the rest are fed next."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # resolved seed (params.seed or a random one drawn at arrival)
    blocks: BlockTable
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    lora: LoraAdapter | None = None  # None: the base model
    lora_slot: int = -1  # device slot pinned for `lora` from admission to the end; -1: none
    retain_kv: bool = False  # prefill role: keep the blocks after finishing, until released
    incoming: bool = False  # decode role: holds blocks while its KV arrives from a prefill server
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def prefilling(self) -> bool:
        """More than one token lacks KV: the next step for it is a prefill chunk."""
        return self.num_uncomputed > 1
