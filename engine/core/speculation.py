"""Speculative decoding's host side: proposing draft tokens without a model (n-gram prompt lookup),
choosing how many a step verifies (`plan_drafts`), deciding which it accepts (`accept`), and counting.

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
The n-gram proposer here, like EAGLE-style greedy drafting, proposes deterministic drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pdserve.engine.config import SpeculativeConfig, bucket_for


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

    def propose_for(self, request, k: int) -> list[int]:
        """Up to `k` drafts after an engine.core.request.Request's tokens."""
        return self.propose(request.all_ids, k)

    def propose(self, context: Sequence[int], k: int | None = None) -> list[int]:
        """Up to `k` (default self.k) drafts to follow `context`; fewer when the match is near its end."""
        k = self.k if k is None else k
        ids = np.asarray(context, np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            # windows starting at 0 .. len - n - 1: every earlier occurrence, the suffix itself excluded
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                whole = hits[hits + n + k <= len(ids)]  # occurrences followed by k tokens
                start = int(whole[-1] if len(whole) else hits[0]) + n
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


@dataclasses.dataclass(frozen=True)
class DraftHeadProposer:
    """A draft head's proposals (method "eagle3"): the engine runs the head after each step
    (engine.draft_runner) and the scheduler keeps each request's drafts in Request.proposed
    (Scheduler.drafted); they are taken once."""

    k: int

    def propose_for(self, request, k: int) -> list[int]:
        """Up to `k` of the drafts proposed after the request's last step (then none until the next)."""
        drafts, request.proposed = request.proposed[:k], []
        return drafts


def proposer_for(config: SpeculativeConfig) -> NgramProposer | DraftHeadProposer | None:
    """The proposer of --speculative-config (None: off)."""
    if not config.num_speculative_tokens:
        return None
    if config.method == "eagle3":
        return DraftHeadProposer(config.num_speculative_tokens)
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)


@dataclasses.dataclass
class SpeculationStats:
    """Counts of the verification steps so far (vLLM's spec-decode counters): `num_drafts` rows that
    verified drafts, `num_draft_tokens` drafts verified, `num_accepted_tokens` accepted, and
    `accepted_per_position[i]`: rows whose draft i was accepted (all before it too). The mean accepted
    length is 1 + accepted / drafts rows: the tokens a verifying row emits."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.k

    def snapshot(self) -> SpeculationStats:
        """A copy (EngineStats carries one out of the engine thread)."""
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position))

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One row verified `num_drafts` drafts and accepted the first `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


PRIOR_DRAFTS = 4  # a request's acceptance estimate starts as this many drafts at the engine's rate


def acceptance_estimate(accepted: int, drafted: int, stats: SpeculationStats) -> float:
    """The chance that a request's next draft is accepted (given those before it were): its own
    accepted / drafted so far, pulled toward the engine's rate (0.5 before any) by PRIOR_DRAFTS drafts."""
    rate = stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.5
    return (accepted + PRIOR_DRAFTS * rate) / (drafted + PRIOR_DRAFTS)


def plan_drafts(
    num_tokens: int,
    num_decodes: int,
    proposals: Sequence[tuple[float, int]],
    budget: int,
    buckets: tuple[int, ...],
    step_costs: Mapping[int, float] | None,
) -> list[int]:
    """How many of its proposed drafts each decode row verifies in a step of `num_tokens` tokens (decode
    tokens and prefill chunks) with `num_decodes` decode rows; proposals[i]: row i's acceptance estimate
    and drafts proposed. At most `budget` drafts in all.

    Draft j of a row (from 0) adds a token accepted with probability a^(j + 1): the drafts are taken in
    the order of that worth, and the step's size chosen to maximize the expected tokens emitted per second
    of step, a step costing its token bucket's measured time (`step_costs`, Scheduler.observe_step_time).
    Drafts that fit the bucket the step has anyway are free; on hardware whose step costs grow with its
    tokens (a CPU, or a batch past the accelerator's memory-bound regime) fewer or none are verified.
    `step_costs` None: every proposed draft within the budget is."""
    worth = sorted(
        (
            (accept_rate ** (j + 1), j, row)
            for row, (accept_rate, n) in enumerate(proposals)
            for j in range(n)
        ),
        key=lambda w: (-w[0], w[1]),
    )[:budget]
    if step_costs is None:
        return _counts(proposals, worth)
    if bucket_for(num_tokens, buckets) not in step_costs:
        return [0] * len(proposals)  # what a step without drafts costs is measured first
    best, gain, take = -1.0, 0.0, 0
    for m in range(len(worth) + 1):
        gain += worth[m - 1][0] if m else 0.0
        bucket = bucket_for(num_tokens + m, buckets)
        # a bucket not measured yet costs what the largest measured one below it does (optimism: it is
        # tried, then measured)
        cost = step_costs.get(bucket) or max(c for b, c in step_costs.items() if b < bucket)
        rate = (num_decodes + gain) / cost
        if rate >= best:  # (ties: more drafts, which cost nothing more)
            best, take = rate, m
    return _counts(proposals, worth[:take])


def _counts(proposals: Sequence[tuple[float, int]], taken: Sequence[tuple[float, int, int]]) -> list[int]:
    """Drafts taken per row."""
    counts = [0] * len(proposals)
    for _, _, row in taken:
        counts[row] += 1
    return counts
