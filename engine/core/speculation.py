"""Speculative decoding's host side: proposing draft tokens without a model (n-gram prompt lookup) and
deciding which drafts a verification step accepts.

Verification (issue 36): a decoding sequence schedules its last token and k drafts in one ragged step,
and the target samples every one of those k + 1 positions exactly as it would without speculation: the
same sampler, the same per-position random key (engine.model.sampler: key = fold_in(key(seed),
position)). `accept` keeps the drafts up to the first one that differs from the target's own sample
there, then that sample. Every emitted token is therefore the target's sample at its position, given
the tokens before it:
- greedy requests produce the tokens of decoding without speculation;
- sampled requests keep the target's distribution. For a deterministic draft (a point mass q on token
  d), rejection sampling accepts d with probability min(1, p(d) / q(d)) = p(d) and otherwise samples
  from p without d; the target's sample equals d with probability p(d), and otherwise is a sample of p
  without d. Seeded outputs are the same with and without speculation, whatever was drafted.
Both proposers here and EAGLE-style greedy drafting propose deterministic drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup (vLLM's `ngram` method): the context's last n tokens, for n from `max_n` down to
    `min_n`, are looked up earlier in the context (prompt and output); the `k` tokens that followed
    their latest earlier occurrence are the drafts. No match: no drafts."""

    k: int  # num_speculative_tokens
    min_n: int = 1  # prompt_lookup_min
    max_n: int = 4  # prompt_lookup_max

    def __post_init__(self):
        if self.k < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"ngram: num_speculative_tokens {self.k} must be >= 1 and 1 <= prompt_lookup_min "
                f"{self.min_n} <= prompt_lookup_max {self.max_n}"
            )

    def propose(self, context: Sequence[int], k: int | None = None) -> list[int]:
        """Up to `k` (default self.k) drafts to follow `context`; fewer when the match is near its end."""
        k = self.k if k is None else k
        ids = np.asarray(context, np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            # windows starting at 0 .. len - n - 1: every earlier occurrence, the suffix itself excluded
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return ids[start : start + k].tolist()
        return []


def accept(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verification step emits: `sampled` holds the target's samples at the k + 1 positions
    after the sequence's last token (drafts[i] was proposed for position i). The drafts that equal the
    target's samples, up to the first that does not, then the target's sample there (or after the last
    draft, when all were accepted): between 1 and k + 1 tokens."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(sampled)} samples for {len(drafts)} drafts: one more is needed")
    emitted = []
    for draft, token in zip(drafts, sampled, strict=False):
        emitted.append(int(token))
        if token != draft:
            return emitted
    emitted.append(int(sampled[-1]))
    return emitted
