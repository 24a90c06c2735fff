"""Speculation's planning, beside the proposers (engine.core.speculation): how many drafts each decode row
of a step verifies, weighed against what steps cost.

`DraftPlanner.plan` asks the proposer for each decode row's drafts (at most `draft_limit`: k, and one fewer
than the tokens the request may still produce) and keeps as many as plan_drafts finds worth the step's
cost: each token bucket's measured time (`observe_step_time`, a moving average) under draft_policy
"cost", every draft under "all", and every draft once in EXPLORE_EVERY steps whatever the costs say (so
the costs of larger steps are measured again). The scheduler gives the kept drafts their blocks and
records what was accepted (`observe`). No device code; no request state is written here.
"""

from __future__ import annotations

from pdserve.engine.config import EngineConfig, bucket_for
from pdserve.engine.core.request import Request
from pdserve.engine.core.speculation import SpeculationStats, acceptance_estimate, plan_drafts, proposer_for

STEP_COST_WEIGHT = 0.2  # of a step's time in its bucket's moving average (speculation weighs drafts by it)
EXPLORE_EVERY = 16  # speculation verifies every draft once in this many steps, whatever the costs say


class DraftPlanner:
    """The drafts of one engine's steps (`proposer` None: speculation off, and nothing is planned)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.proposer = proposer_for(config.speculation)
        self.stats = SpeculationStats(config.speculation.num_speculative_tokens)
        # Seconds of a step by token bucket, a moving average of the steps run (observe_step_time): what
        # drafts are weighed against (draft_policy "cost")
        self.step_costs: dict[int, float] = {}
        self._steps_planned = 0

    def plan(self, requests: list[Request], num_tokens: int, budget: int) -> list[list[int]]:
        """The drafts each request (a decode row of a step of `num_tokens` tokens) feeds, at most `budget`
        in all: the proposer's, as many as are worth the step's cost."""
        if self.proposer is None or not requests:
            return [[] for _ in requests]
        proposed = [self._propose(r) for r in requests]
        estimates = [acceptance_estimate(r.num_draft_accepted, r.num_drafted, self.stats) for r in requests]
        self._steps_planned += 1
        costs = self.step_costs if self.config.speculation.draft_policy == "cost" else None
        if self._steps_planned % EXPLORE_EVERY == 0:
            costs = None  # every draft now and then: the costs of larger steps are measured again
        counts = plan_drafts(
            num_tokens,
            len(requests),
            list(zip(estimates, map(len, proposed), strict=True)),
            budget,
            self.config.token_buckets,
            costs,
        )
        return [drafts[:count] for drafts, count in zip(proposed, counts, strict=True)]

    def _propose(self, request: Request) -> list[int]:
        """The drafts the proposer finds after the request's tokens (draft_limit of them at most)."""
        k = self.draft_limit(request)
        return self.proposer.propose_for(request, k) if k > 0 else []

    def draft_limit(self, request: Request) -> int:
        """The drafts a running request may verify next: at most k and one fewer than the tokens it may
        still produce (its max_tokens, the model length); none while a constraint waits for the reasoning
        to end (the mask of a drafted position would depend on where it ends)."""
        if request.reasoning or self.proposer is None:
            return 0
        room = min(
            request.params.max_tokens - len(request.output_ids),
            self.config.max_model_len - request.num_tokens,
        )
        return max(0, min(self.proposer.k, room - 1))

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """A row verified `num_drafts` drafts, of which the first `num_accepted` were accepted."""
        self.stats.observe(num_drafts, num_accepted)

    def observe_step_time(self, num_tokens: int, seconds: float) -> None:
        """A step's wall time (its `num_tokens` rows computed and sampled): the moving average of its token
        bucket's cost, which drafts are weighed against (speculation off: not kept)."""
        if self.proposer is None:
            return
        bucket = bucket_for(num_tokens, self.config.token_buckets)
        cost = self.step_costs.get(bucket, seconds)
        self.step_costs[bucket] = cost + STEP_COST_WEIGHT * (seconds - cost)
