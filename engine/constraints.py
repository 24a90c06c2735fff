"""Constrained decoding with llguidance: a request's `Constraint` (sampling_params) -> a token matcher that
fills the request's allowed-token bitmask before each sample and advances with each sampled token.

llguidance was chosen by measurement (BENCHMARKS.md, bench/bench_grammar.py): no dependencies, JSON
schemas, regexes and Lark grammars compiled in well under a millisecond, masks written straight into a
numpy int32 bitmask (the layout engine.model.sampler applies on device), a batch's masks computed in parallel
off the GIL, and compile work bounded by fuel limits rather than wall-clock time.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.numpy as llnp
import numpy as np

from pdserve.engine.model.sampler import mask_words
from pdserve.engine.sampling_params import Constraint, InvalidRequestError
from pdserve.engine.tokenizer import Tokenizer

# JSON: whitespace between tokens allowed, but at most a few characters at a time (a small model left to
# itself may emit newlines forever)
_JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,8}"}
# Bounds on the work of compiling a grammar and of one token's mask (llguidance's fuel, a deterministic
# measure of time: about 50k a millisecond to compile, 14k for a mask step)
_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, verbose_errors=False)


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of `constraint` (not yet checked)."""
    kind, value = constraint.kind, constraint.value
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(value)
    choices = " | ".join(json.dumps(c) for c in constraint.choices)  # kind == "choice"
    return llguidance.LLMatcher.grammar_from_lark(f"start: {choices}")


class ConstraintCompiler:
    """Compiles constraints for one model's tokenizer (built once: about 0.3 s for a 49k vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        """`vocab_size`: the model's (the logits' width; the tokenizer's may be smaller)."""
        self.vocab_size = vocab_size
        eos = sorted(tokenizer.eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos or None
        )
        self.limits = llguidance.LLParserLimits(**_LIMITS)
        self.executor = llguidance.LLExecutor()

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `constraint`'s language; InvalidRequestError (field
        "constraint") with llguidance's message when the schema, regex or grammar is invalid or too large
        for the limits."""
        try:
            grammar = grammar_of(constraint)
        except ValueError as e:
            raise InvalidRequestError("constraint", f"invalid {constraint.kind}: {e}") from None
        # compiled once: the matcher's own error is validate_grammar's (a second compile doubles the cost)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise InvalidRequestError("constraint", f"invalid {constraint.kind}: {matcher.get_error()}")
        return matcher

    def fill(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), mask words] int32: each matcher's allowed next tokens (in parallel)."""
        mask = np.zeros((len(matchers), mask_words(self.vocab_size)), np.int32)
        if matchers:
            llnp.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)
        return mask
