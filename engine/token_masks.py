"""Which tokens each sample may take, and what a sampled token does to its request's constraint.

Before a step samples, `TokenMasks.allowed` builds each sample's allowed-token bitmask (the layout
engine.model.sampler applies on the device): the request's constraint (engine.constraints; after drafted
tokens too, with speculation), narrowed to its allowed_token_ids, its bad words' next tokens banned, its
stop tokens held back until min_tokens. After sampling, `TokenMasks.advance` moves the constraint's matcher
by the token and says how that ends the request, if it does. The engine's other modules never touch a
matcher.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import numpy as np

from pdserve.engine.constraints import ConstraintCompiler
from pdserve.engine.core.request import FinishReason, Request
from pdserve.engine.model.sampler import mask_words
from pdserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class TokenMasks:
    """The token masks of one model's vocabulary and tokenizer (its constraint compiler built at the first
    constrained request)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: ConstraintCompiler | None = None
        self._compiler_lock = threading.Lock()  # built once, whichever thread asks first

    @property
    def constraints(self) -> ConstraintCompiler:
        """The constraint compiler for this model's tokenizer (safe from any thread: the input processor's
        preparers and the engine thread)."""
        if self._compiler is None:
            with self._compiler_lock:
                if self._compiler is None:
                    self._compiler = ConstraintCompiler(self.tokenizer, self.vocab_size)
        return self._compiler

    def matcher(self, request: Request):
        """A fresh matcher of the request's constraint (None: unconstrained)."""
        constraint = request.params.constraint
        return None if constraint is None else self.constraints.matcher(constraint)

    # ---- before sampling ------------------------------------------------------------------------------
    def allowed(self, samples: list[tuple[Request, list[int]]]) -> np.ndarray | None:
        """The samples' allowed-token bitmasks (all ones where unconstrained and not held); None: every
        token, every sample. A sample is a request's next token after `drafted` (its drafts before that
        position; none without speculation). A constraint's mask is narrowed to the request's
        allowed_token_ids, then its bad words' next tokens are banned; a sample short of its min_tokens has
        its stop tokens held back, unless that would leave nothing (a constraint that allows only EOS ends
        it as a dead end)."""
        outputs = [r.output_ids + drafted for r, drafted in samples]
        rows = [i for i, (r, _) in enumerate(samples) if r.matcher is not None and not r.reasoning]
        narrowed = [i for i, (r, _) in enumerate(samples) if r.allowed_mask is not None or r.bad_word_ids]
        held = [
            i
            for i, (r, _) in enumerate(samples)
            if len(outputs[i]) < r.params.min_tokens and r.stop_token_ids
        ]
        if not rows and not held and not narrowed:
            return None
        allowed = np.full((len(samples), mask_words(self.vocab_size)), -1, np.int32)
        first = [i for i in rows if not samples[i][1]]  # at the matcher's own position: filled together
        allowed[first] = self.constraints.fill([samples[i][0].matcher for i in first])
        for i in rows:
            if samples[i][1]:
                allowed[i] = self._drafted_mask(samples[i][0], samples[i][1], allowed[i - 1])
        for i in narrowed:
            request, row = samples[i][0], allowed[i].view(np.uint32)
            if request.allowed_mask is not None:
                row &= request.allowed_mask
            output = outputs[i]
            banned = [  # each bad word's last token, where the output ends with the rest of the word
                word[-1]
                for word in request.bad_word_ids
                if len(word) <= len(output) + 1 and output[len(output) + 1 - len(word) :] == list(word[:-1])
            ]
            row[:] = _without(row, banned)
        for i in held:
            allowed[i] = _without(allowed[i].view(np.uint32), samples[i][0].stop_token_ids).view(np.int32)
        return allowed

    def _drafted_mask(self, request: Request, drafted: list[int], previous: np.ndarray) -> np.ndarray:
        """The constraint's mask after the request's output and `drafted`, its drafts before this position
        (the mask before, `previous`, is the one after drafted[:-1]): the matcher advanced through the
        drafts, then rolled back. Where a draft is refused, `previous`: the sample there is then never
        accepted (it would have to equal the refused draft), so no later position's mask is used."""
        matcher = request.matcher
        consumed = matcher.try_consume_tokens(drafted)
        if consumed < len(drafted):
            matcher.rollback(consumed)
            return previous
        try:
            return self.constraints.fill([matcher])[0]
        finally:
            matcher.rollback(len(drafted))

    # ---- after sampling -------------------------------------------------------------------------------
    def advance(
        self, request: Request, token: int, allowed: np.ndarray | None = None
    ) -> tuple[int, FinishReason | None]:
        """A sampled token (`allowed`: the mask it was sampled under; None: it was sampled elsewhere) through
        the request's constraint, if it has one: the token and how it ends the request, if it does. An
        empty mask (the constraint allows nothing more) ends the request instead: its token becomes EOS,
        never shown. While the output is still the model's reasoning the constraint takes nothing (the
        scheduler sees params.reasoning_end complete it, Request.reasoning)."""
        if request.matcher is None or request.reasoning:
            return token, None
        if allowed is not None and not allowed.any():
            return min(self.tokenizer.eos_token_ids, default=0), FinishReason.DEAD_END
        return token, self._consume(request, token)

    def _consume(self, request: Request, token: int) -> FinishReason | None:
        """The request's matcher takes `token`; returns how that ends the request, if it does. One it
        refuses (a work limit reached inside the matcher, or the EOS a prefill server sends for a dead end
        at the first token) is a dead end: nothing after the last token the constraint took is shown."""
        if not request.matcher.consume_token(token):
            log.warning(
                "constraint failed at token %d: %s",
                token,
                request.matcher.get_error(),
                extra={"request_id": request.request_id},
            )
            return FinishReason.DEAD_END
        if request.matcher.is_stopped() and token in self.tokenizer.eos_token_ids:  # ignore_eos or not
            return FinishReason.STOP  # complete (a complete output allows only EOS next)
        return None


def _without(row: np.ndarray, tokens: Iterable[int]) -> np.ndarray:
    """A copy of the bitmask `row` (uint32 words) with `tokens` cleared; `row` itself when that would
    leave no token at all (what a ban or a hold-back must not do)."""
    out = row.copy()
    for token in tokens:
        out[token // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (token % 32)))
    return out if out.any() else row
