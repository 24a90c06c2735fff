"""A step's cost model: the seconds of one engine step as a function of its rows, fitted to measured steps
and stored, with what it was measured on, as one versioned JSON profile (`pdserve profile` writes it,
`pdserve simulate` reads it).

A step's time is linear in four kinds of work, each a column of the fit:
- `fixed_s`: the step itself (launch, host bookkeeping, the sampler's fixed part);
- `per_token_s`: each token fed (the weights' matmuls: prefill chunks and decode tokens alike);
- `per_row_s`: each sequence in the step (sampling, its block table);
- `per_kv_read_s`: each token of KV a row attends to (its past plus its new tokens), read once per row:
  what a decode step's attention costs;
- `per_pair_s`: each (query, key) pair of a row's new tokens (tokens x (past + tokens / 2)): what a
  prefill chunk's attention computes.
Non-negative least squares over measured (rows -> seconds) points gives the coefficients.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

PROFILE_VERSION = 1
TERMS = ("fixed_s", "per_token_s", "per_row_s", "per_kv_read_s", "per_pair_s")


@dataclasses.dataclass(frozen=True)
class RowShape:
    """What a step row costs by: the tokens it feeds and the tokens of KV before them."""

    num_tokens: int
    num_past: int


def work_of(rows: Iterable[RowShape]) -> np.ndarray:
    """The step's work in TERMS' order (the fit's columns)."""
    rows = list(rows)
    tokens = sum(r.num_tokens for r in rows)
    kv_read = sum(r.num_past + r.num_tokens for r in rows)
    pairs = sum(r.num_tokens * (r.num_past + (r.num_tokens + 1) / 2) for r in rows)
    return np.array([1.0, tokens, len(rows), kv_read, pairs])


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Coefficients of TERMS (seconds per unit of work; see the module)."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0
    per_row_s: float = 0.0
    per_kv_read_s: float = 0.0
    per_pair_s: float = 0.0

    def seconds(self, rows: Iterable[RowShape]) -> float:
        """The predicted seconds of a step of `rows`."""
        return float(work_of(rows) @ self.vector())

    def vector(self) -> np.ndarray:
        return np.array([getattr(self, term) for term in TERMS])

    @classmethod
    def fit(cls, steps: Sequence[tuple[Sequence[RowShape], float]]) -> StepCosts:
        """Non-negative least squares over measured steps (rows, seconds), in relative error (each step
        weighted by 1 / its time, so short decode steps count as much as long prefills)."""
        from scipy.optimize import nnls

        if len(steps) < len(TERMS):
            raise ValueError(f"a fit of {len(TERMS)} terms needs at least as many steps, got {len(steps)}")
        work = np.stack([work_of(rows) for rows, _ in steps])
        seconds = np.array([s for _, s in steps])
        if (seconds <= 0).any():
            raise ValueError("every measured step takes a positive time")
        scale = work.max(axis=0)  # (columns of comparable size for the solver)
        scale[scale == 0] = 1.0
        coef, _ = nnls(work / scale / seconds[:, None], np.ones(len(seconds)))
        return cls(*(coef / scale))

    def relative_errors(self, steps: Sequence[tuple[Sequence[RowShape], float]]) -> np.ndarray:
        """(predicted - measured) / measured of each step."""
        return np.array([(self.seconds(rows) - s) / s for rows, s in steps])


@dataclasses.dataclass(frozen=True)
class Profile:
    """A profile file: the step costs of one engine configuration and what it was measured on
    (`engine`: the engine's summary, e.g. model, dtype, TP, platform; `fit`: the fit's errors;
    `projection`: set when the costs were scaled from published chip figures, not measured)."""

    costs: StepCosts
    engine: dict = dataclasses.field(default_factory=dict)
    fit: dict = dataclasses.field(default_factory=dict)
    projection: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": PROFILE_VERSION,
                "step_costs": dataclasses.asdict(self.costs),
                "engine": self.engine,
                "fit": self.fit,
                "projection": self.projection,
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r}; this pdserve reads {PROFILE_VERSION}")
        unknown = set(data["step_costs"]) - set(TERMS)
        if unknown:
            raise ValueError(f"step_costs: unknown terms {sorted(unknown)}")
        return cls(
            StepCosts(**data["step_costs"]),
            data.get("engine", {}),
            data.get("fit", {}),
            data.get("projection", ""),
        )

    @classmethod
    def read(cls, path: str | Path) -> Profile:
        return cls.from_json(Path(path).read_text())
