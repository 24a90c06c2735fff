"""The request record the decode side registers once a request's KV is inserted and verified."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.plan import cdiv


@dataclass(frozen=True)
class RequestRecord:
    """State handed from prefill to decode for one request.

    Invariants (checked at construction): prompt_ids is non-empty; 0 < num_computed_tokens <=
    len(prompt_ids) (the first token is sampled but its KV not yet computed); block ids are distinct and
    non-negative. check_blocks(block_size) also checks that the blocks hold exactly the computed tokens.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    first_token: int
    block_ids: tuple[int, ...]  # decode-side blocks holding the request's KV, in token order
    num_computed_tokens: int
    sampling_params: Any = field(default_factory=dict)  # a dict or the engine's own (opaque) object
    lora_adapter: str | None = None  # None: the base model

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty")
        if not 0 < self.num_computed_tokens <= len(self.prompt_ids):
            raise ValueError(
                f"num_computed_tokens {self.num_computed_tokens} outside (0, {len(self.prompt_ids)}]"
            )
        if self.first_token < 0:
            raise ValueError(f"first_token {self.first_token} is negative")
        if len(set(self.block_ids)) != len(self.block_ids) or any(b < 0 for b in self.block_ids):
            raise ValueError(f"block_ids must be distinct and non-negative: {self.block_ids}")

    def check_blocks(self, block_size: int) -> None:
        needed = cdiv(self.num_computed_tokens, block_size)
        if len(self.block_ids) != needed:
            raise ValueError(
                f"{len(self.block_ids)} blocks for {self.num_computed_tokens} tokens, need {needed}"
            )

    def with_blocks(self, block_ids: Sequence[int]) -> RequestRecord:
        """The same request on another server's blocks (prefill ids -> decode ids)."""
        return RequestRecord(
            self.request_id,
            self.prompt_ids,
            self.first_token,
            tuple(block_ids),
            self.num_computed_tokens,
            self.sampling_params,
            self.lora_adapter,
        )
