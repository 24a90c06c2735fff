"""A client's prompt and sampling parameters -> a validated, tokenized Request, off the engine thread.

`InputProcessor.make_request` is the one place a request is built: it validates the parameters against
the model and the engine's limits (raising InvalidRequestError naming the field), tokenizes, resolves the
adapter, compiles the constraint's matcher, and precomputes what every step would otherwise redo (the
allowed-token mask, the bad words' tokens, the stop tokens, the prefix-cache block hashes). It is safe to
call from any thread while the engine steps: it reads the adapter registry's current snapshot (replaced,
never changed in place, when adapters come and go) and keeps no state of its own besides a counter.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from collections.abc import Sequence

import numpy as np

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.output import OutputStream
from pdserve.engine.core.request import Request
from pdserve.engine.lora import AdapterRegistry
from pdserve.engine.model.sampler import token_mask
from pdserve.engine.sampling_params import MAX_PROMPT_LOGPROB_ENTRIES, InvalidRequestError, SamplingParams
from pdserve.engine.token_masks import TokenMasks
from pdserve.engine.tokenizer import Tokenizer

MAX_CACHE_SALT_CHARS = 256  # vLLM's cache_salt is a short opaque string


class InputProcessor:
    """Builds the requests of one engine (its model, limits, adapters and token masks)."""

    def __init__(
        self,
        model: ModelConfig,
        tokenizer: Tokenizer | None,
        config: EngineConfig,
        adapters: AdapterRegistry,
        masks: TokenMasks,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.adapters = adapters
        self.masks = masks
        self._ids = itertools.count()

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: str | None = None,
        lora_fingerprint: str | None = None,
        seed: int | None = None,
        cache_salt: str | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> Request:
        """Validates and tokenizes (a text prompt gets the model's special tokens, its BOS, as vLLM and
        transformers add them; token ids are taken as they are); raises InvalidRequestError naming the bad
        field.

        `lora`: the adapter's name (None: the base model); with `lora_fingerprint` (a peer's copy of the
        adapter) the adapter loaded here must have the same weights (AdapterMismatchError otherwise).
        `seed`: the resolved seed a peer drew (default: params.seed, else a random one).
        `cache_salt`: the tenant's salt (Request.cache_salt; None or empty: unsalted).
        `resume_token_ids`: the output a client already received of this request from a server that went
        away (Request.num_resumed): it continues at the position after them, with their KV computed here;
        with the same seed it draws the tokens the uninterrupted run would have (the sampler's key depends on
        the seed and the position only). One sequence at a time (n == 1); prompt logprobs, which the first
        output carried, are not scored again.
        """
        if cache_salt is not None and len(cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters")
        vocab, config = self.model.vocab_size, self.config
        params.validate(vocab, config.max_logprobs)
        prompt_ids = self._prompt_ids(prompt)
        if params.prompt_logprobs is not None:  # (each of the n sequences' first output carries them)
            entries = len(prompt_ids) * (params.prompt_logprobs + 1) * params.n
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                raise InvalidRequestError(
                    "prompt_logprobs",
                    f"{len(prompt_ids)} prompt tokens x {params.prompt_logprobs + 1} logprobs x "
                    f"n={params.n}: the limit is {MAX_PROMPT_LOGPROB_ENTRIES} entries",
                )
        if resume_token_ids:
            params = self._resumable(params, prompt_ids, resume_token_ids)
        if params.n > config.max_num_seqs:
            raise InvalidRequestError(
                "n", f"{params.n} sequences: max_num_seqs ({config.max_num_seqs}) decode together"
            )
        if len(prompt_ids) + params.max_tokens > config.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model length {config.max_model_len}",
            )
        if seed is None:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
        allowed_mask = None
        if params.allowed_token_ids:  # once a request (its forks share it), its ids sorted without repeats
            unique = np.unique(np.asarray(params.allowed_token_ids, np.int64))
            params = dataclasses.replace(params, allowed_token_ids=tuple(unique.tolist()))
            allowed_mask = token_mask(unique, vocab).view(np.uint32)
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer is not None:  # (a bare model in tests has none)
            stop_ids |= self.tokenizer.eos_token_ids
        request = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=prompt_ids,
            params=params,
            seed=seed,
            lora=None if lora is None else self.adapters.resolve(lora, lora_fingerprint),
            stop_token_ids=stop_ids,
            cache_salt=cache_salt or None,
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(prompt_ids),
            bad_word_ids=self._bad_word_ids(params.bad_words),
            allowed_mask=allowed_mask,
            reasoning=bool(params.reasoning_end) and params.constraint is not None,
        )
        request.matcher = self.masks.matcher(request)
        if resume_token_ids:
            self._resume(request, resume_token_ids)
        if config.enable_prefix_caching:  # (the engine thread would otherwise hash at admission)
            request.extend_block_hashes(config.block_size)
        return request

    def _resumable(
        self, params: SamplingParams, prompt_ids: list[int], resumed: Sequence[int]
    ) -> SamplingParams:
        """The checks of a resumption that need no request yet; `params` without prompt logprobs."""
        field, vocab = "resume_token_ids", self.model.vocab_size
        if params.n != 1:
            raise InvalidRequestError(field, f"n={params.n}: a request resumes one sequence at a time")
        if any(not 0 <= int(t) < vocab for t in resumed):
            raise InvalidRequestError(field, f"token ids must be in [0, {vocab})")
        if len(resumed) >= params.max_tokens:
            raise InvalidRequestError(field, f"{len(resumed)} tokens: the output was complete at max_tokens")
        if len(prompt_ids) + len(resumed) >= self.config.max_model_len:
            raise InvalidRequestError(field, "the output was complete at the model length")
        return dataclasses.replace(params, prompt_logprobs=None)

    def _resume(self, request: Request, resumed: Sequence[int]) -> None:
        """Takes the resumed output in (Request.num_resumed): the constraint's matcher and the reasoning
        flag stand where they stood after it, as the scheduler left them; refused when the output had
        ended there (a stop token, a stop string) or its constraint refuses it."""
        field = "resume_token_ids"
        request.output_ids = [int(t) for t in resumed]
        request.num_resumed = len(request.output_ids)
        if set(request.output_ids) & request.stop_token_ids:
            raise InvalidRequestError(field, "the output was complete at a stop token")
        end = list(request.params.reasoning_end)
        for i, token in enumerate(request.output_ids):
            if request.reasoning:
                request.reasoning = request.output_ids[max(0, i + 1 - len(end)) : i + 1] != end
            elif request.matcher is not None and not request.matcher.consume_token(token):
                raise InvalidRequestError(field, f"token {i} ({token}) is not allowed by the constraint")
        stops = self.tokenizer is not None and request.params.stop
        if stops and OutputStream(request, self.tokenizer).stopped:
            raise InvalidRequestError(field, "the output was complete at a stop string")

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids: a text tokenized (refused past max_prompt_chars before any work), ids
        checked against the vocabulary."""
        vocab, max_chars = self.model.vocab_size, self.config.max_prompt_chars
        if isinstance(prompt, str):
            if len(prompt) > max_chars:  # refuse before spending CPU on tokenizing it
                raise InvalidRequestError("prompt", f"longer than {max_chars} characters")
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)  # its BOS, as vLLM's
        else:
            prompt_ids = [int(t) for t in prompt]
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise InvalidRequestError("prompt_token_ids", f"token ids must be in [0, {vocab})")
        if not prompt_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        return prompt_ids

    def _bad_word_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens, as given (its leading spaces dropped) and after a space (vLLM's two
        spellings of a word at a text's start and inside it), without repeats."""
        spellings = {
            tuple(self.tokenizer.encode(text)) for w in words for text in (w.lstrip(), " " + w.lstrip())
        }
        return tuple(sorted(s for s in spellings if s))
