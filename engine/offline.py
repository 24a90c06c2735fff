"""The engine's Python API for offline use (scripts, tests, benchmarks): prompts in, whole results out.

`LLMEngine.generate` runs prompts to completion together and returns each sequence whole;
`LLMEngine.prompt_logits` gives the logits after a prompt. Both drive the engine's own step loop on the
calling thread, so neither may run while a daemon's engine thread steps the same engine. (vLLM keeps the
same split: its `LLM` class over the engine core.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pdserve.engine.core.request import TokenLogprobs
from pdserve.engine.core.scheduler import Row
from pdserve.engine.sampling_params import SamplingParams


@dataclasses.dataclass
class FinishedSequence:
    """One prompt's whole result from `LLMEngine.generate` (the client's is services.client.Completion)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with SamplingParams.prompt_logprobs
    index: int = 0  # which of the prompt's n sequences


class OfflineAPI:
    """LLMEngine's offline methods (mixed into it; they use only its public interface and, for
    prompt_logits, its scheduler's scratch blocks)."""

    def prompt_logits(self, prompt_ids: Sequence[int], lora: str | None = None) -> np.ndarray:
        """float32 logits [vocab] after the prompt, prefilled in the engine's chunks; holds no blocks after.

        Must not be called while requests are in flight (it runs steps of its own).
        """
        request = self.make_request(list(prompt_ids), SamplingParams(max_tokens=1), lora=lora)
        kv, rid = self.scheduler.kv, request.request_id  # scratch blocks, outside the scheduler's requests
        if not kv.allocate(rid, len(prompt_ids)):
            raise RuntimeError("not enough free KV blocks")
        try:
            if not self.scheduler.pin_adapter(request):
                raise RuntimeError("every adapter slot is pinned")
            if self.host_tier is not None:  # (the allocation may have evicted a block the tier reads)
                self.host_tier.start_copies()
            step = self.config.max_num_batched_tokens
            for start in range(0, len(prompt_ids), step):
                chunk = list(prompt_ids[start : start + step])
                logits = self.runner.forward([Row(chunk, start, kv.block_tables(rid), request.lora_slot)])
            return np.asarray(logits)[0]
        finally:
            kv.free(rid)
            self.scheduler.unpin_adapter(request)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        lora: str | Sequence[str | None] | None = None,
        cache_salt: str | None = None,
    ) -> list[FinishedSequence]:
        """Runs prompts to completion together (continuous batching); results in prompt order, and a
        prompt's n sequences (SamplingParams.n) in index order.

        `lora`: one adapter name for all prompts, or one per prompt (None: the base model). `cache_salt`:
        the tenant's prefix-cache salt for all of them (None: unsalted)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if lora is None or isinstance(lora, str):
            lora = [lora] * len(prompts)
        requests = [
            self.make_request(p, sp, lora=name, cache_salt=cache_salt)
            for p, sp, name in zip(prompts, params, lora, strict=True)
        ]
        done: dict[tuple[str, int], FinishedSequence] = {}
        for request in requests:
            self.add_prepared_request(request)
            for index in range(request.params.n):
                rid = request.request_id
                done[rid, index] = FinishedSequence(rid, request.prompt_ids, [], "", None, index=index)
        while any(c.finish_reason is None for c in done.values()):
            for output in self.step().tokens:
                completion = done.get((output.request_id, output.index))
                if completion is None:
                    continue
                completion.token_ids += output.new_token_ids
                completion.text += output.text
                completion.logprobs += output.logprobs
                completion.num_cached_tokens = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    completion.prompt_logprobs = output.prompt_logprobs
                if output.finished:
                    completion.finish_reason = output.finish_reason.value
        return list(done.values())
