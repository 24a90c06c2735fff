"""A step's cost model: the seconds of one engine step as a function of its rows, fitted to measured steps
and stored, with what it was measured on, as one versioned JSON profile (`pdserve profile` writes it,
`pdserve simulate` reads it).

A step's time is linear in five kinds of work, each a column of the fit:
- `fixed_s`: the step itself (launch, host bookkeeping, the sampler's fixed part);
- `per_token_s`: each token the step computes (the weights' matmuls: prefill chunks and decode tokens
  alike), counted as the engine pads them: up to its token bucket (EngineConfig.token_buckets);
- `per_row_s`: each sequence slot (sampling, logits): as the engine pads them, min(bucket, max_num_seqs);
- `per_kv_read_s`: each token of KV a row attends to (its past plus its new tokens), read once per row:
  what a decode step's attention costs;
- `per_pair_s`: each (query, key) pair of a row's new tokens (tokens x (past + tokens / 2)): what a
  prefill chunk's attention computes.
Non-negative least squares over measured (rows -> seconds) points gives the coefficients; then each
compiled token bucket with enough steps gets a factor of its own (the median of measured over predicted
among its steps): a shape's cost is not always linear in its rows (on a CPU, a step of 2 rows costs far
more than a lone row's, which runs another kernel). A measured point can also be a Chain of steps timed
together (a served engine does not wait for a step that only computes prompt chunks: engine.step_log):
its work is theirs summed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

PROFILE_VERSION = 2  # 2: each measured point's steps (a Chain's several); 1: one step's rows
TERMS = ("fixed_s", "per_token_s", "per_row_s", "per_kv_read_s", "per_pair_s")
MIN_BUCKET_STEPS = 3  # steps of a token bucket that give it a factor of its own


@dataclasses.dataclass(frozen=True)
class RowShape:
    """What a step row costs by: the tokens it feeds and the tokens of KV before them."""

    num_tokens: int
    num_past: int


@dataclasses.dataclass(frozen=True)
class Padding:
    """How the engine pads a step (its EngineConfig's token_buckets and max_num_seqs); none: exact."""

    token_buckets: tuple[int, ...] = ()
    max_num_seqs: int = 0

    def tokens(self, num_tokens: int) -> int:
        return next((b for b in self.token_buckets if b >= num_tokens), num_tokens)

    def bucket(self, rows: Iterable[RowShape]) -> int:
        """The token bucket a step of `rows` runs in."""
        return self.tokens(sum(r.num_tokens for r in rows))

    def rows(self, num_tokens: int, num_rows: int) -> int:
        return min(self.tokens(num_tokens), self.max_num_seqs) if self.max_num_seqs else num_rows


class Chain(tuple):
    """Steps timed together, each a tuple of its RowShapes: a measured point's rows when one time covers
    several steps (StepCosts gives it their seconds summed)."""


def logged_rows(steps: Sequence[Sequence[tuple[int, int]]]) -> tuple[RowShape, ...] | Chain:
    """A step log entry's steps (engine.step_log.read_step_log) as a measured point's rows."""
    shaped = [tuple(RowShape(t, p) for t, p in step) for step in steps]
    return shaped[0] if len(shaped) == 1 else Chain(shaped)


def work_of(rows: Iterable[RowShape] | Chain, padding: Padding = Padding()) -> np.ndarray:
    """The step's work in TERMS' order (the fit's columns); a Chain's, its steps' summed."""
    if isinstance(rows, Chain):
        return sum((work_of(step, padding) for step in rows), np.zeros(len(TERMS)))
    rows = list(rows)
    tokens = sum(r.num_tokens for r in rows)
    kv_read = sum(r.num_past + r.num_tokens for r in rows)
    pairs = sum(r.num_tokens * (r.num_past + (r.num_tokens + 1) / 2) for r in rows)
    return np.array([1.0, padding.tokens(tokens), padding.rows(tokens, len(rows)), kv_read, pairs])


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Coefficients of TERMS (seconds per unit of work; see the module)."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0
    per_row_s: float = 0.0
    per_kv_read_s: float = 0.0
    per_pair_s: float = 0.0
    padding: Padding = Padding()
    # (token bucket, factor): each compiled step shape's cost against the linear terms' (fit: the median
    # of measured / predicted over its steps); a bucket not listed: 1
    bucket_factors: tuple[tuple[int, float], ...] = ()

    def seconds(self, rows: Iterable[RowShape] | Chain) -> float:
        """The predicted seconds of a step of `rows` (a Chain: of its steps together)."""
        if isinstance(rows, Chain):
            return sum(self.seconds(step) for step in rows)
        rows = list(rows)
        linear = float(work_of(rows, self.padding) @ self.vector())
        if not self.bucket_factors:
            return linear
        return linear * dict(self.bucket_factors).get(self.padding.bucket(rows), 1.0)

    def vector(self) -> np.ndarray:
        return np.array([getattr(self, term) for term in TERMS])

    @classmethod
    def fit(
        cls, steps: Sequence[tuple[Sequence[RowShape], float]], padding: Padding = Padding()
    ) -> StepCosts:
        """Non-negative least squares over measured steps (rows, seconds), in relative error (each step
        weighted by 1 / its time, so short decode steps count as much as long prefills)."""
        from scipy.optimize import nnls

        if len(steps) < len(TERMS):
            raise ValueError(f"a fit of {len(TERMS)} terms needs at least as many steps, got {len(steps)}")
        work = np.stack([work_of(rows, padding) for rows, _ in steps])
        seconds = np.array([s for _, s in steps])
        if (seconds <= 0).any():
            raise ValueError("every measured step takes a positive time")
        scale = work.max(axis=0)  # (columns of comparable size for the solver)
        scale[scale == 0] = 1.0
        coef, _ = nnls(work / scale / seconds[:, None], np.ones(len(seconds)))
        linear = cls(*(coef / scale), padding=padding)
        if not padding.token_buckets:
            return linear
        # each compiled shape's own cost: a step of 2 rows can cost far more than twice a lone one's share
        # (a lone row runs another kernel), which no linear term in the rows gives
        ratios: dict[int, list[float]] = {}
        for rows, measured in steps:
            if not isinstance(rows, Chain):  # (a chain's time is several buckets')
                ratios.setdefault(padding.bucket(rows), []).append(measured / linear.seconds(rows))
        factors = tuple(
            (b, float(np.median(r))) for b, r in sorted(ratios.items()) if len(r) >= MIN_BUCKET_STEPS
        )
        return dataclasses.replace(linear, bucket_factors=factors)

    def relative_errors(self, steps: Sequence[tuple[Sequence[RowShape], float]]) -> np.ndarray:
        """(predicted - measured) / measured of each step."""
        return np.array([(self.seconds(rows) - s) / s for rows, s in steps])


@dataclasses.dataclass(frozen=True)
class Profile:
    """A profile file: the step costs of one engine configuration and what it was measured on
    (`engine_info`: the engine's summary, e.g. model, dtype, TP, platform; `fit`: the fit's errors;
    `projection`: set when the costs were scaled from published chip figures, not measured; `transfer`:
    the KV transfer's time fitted to a decode server's requests: profile.transfer_from_request_log;
    `startup`: what a replica of this configuration took to start where it was measured, `load_s` (weights
    read and placed, the cache allocated) and, when measured, `warmup_s` (every shape compiled, from the
    persistent compilation cache where it held them) with `compiled_variants`)."""

    costs: StepCosts
    engine_info: dict = dataclasses.field(default_factory=dict)
    fit: dict = dataclasses.field(default_factory=dict)
    projection: str = ""
    steps: tuple = ()  # the measured steps: ((num_tokens, num_past) of each row, seconds), for a refit
    transfer: dict = dataclasses.field(default_factory=dict)  # the KV transfer's fit (latency_s, ...)
    startup: dict = dataclasses.field(default_factory=dict)  # load_s, warmup_s, compiled_variants

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": PROFILE_VERSION,
                "step_costs": {term: getattr(self.costs, term) for term in TERMS},
                "padding": dataclasses.asdict(self.costs.padding),
                "bucket_factors": [list(bf) for bf in self.costs.bucket_factors],
                "engine": self.engine_info,
                "fit": self.fit,
                "projection": self.projection,
                "steps": [[_steps_json(rows), s] for rows, s in self.steps],
                "transfer": self.transfer,
                "startup": self.startup,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        version = data.get("version")
        if version not in (1, PROFILE_VERSION):
            raise ValueError(f"profile version {version!r}; this pdserve reads 1 to {PROFILE_VERSION}")
        unknown = set(data["step_costs"]) - set(TERMS)
        if unknown:
            raise ValueError(f"step_costs: unknown terms {sorted(unknown)}")
        padding = data.get("padding", {})
        padding = Padding(tuple(padding.get("token_buckets", ())), int(padding.get("max_num_seqs", 0)))
        steps = tuple(
            (logged_rows(timed if version > 1 else [timed]), float(s)) for timed, s in data.get("steps", ())
        )
        factors = tuple((int(b), float(f)) for b, f in data.get("bucket_factors", ()))
        return cls(
            StepCosts(**data["step_costs"], padding=padding, bucket_factors=factors),
            data.get("engine", {}),
            data.get("fit", {}),
            data.get("projection", ""),
            steps,
            data.get("transfer", {}),
            data.get("startup", {}),
        )

    @classmethod
    def read(cls, path: str | Path) -> Profile:
        return cls.from_json(Path(path).read_text())


def _steps_json(rows: Sequence[RowShape] | Chain) -> list:
    """A measured point's rows as a step log entry's steps: [[[tokens, past], ...], ...]."""
    steps = rows if isinstance(rows, Chain) else [rows]
    return [[[r.num_tokens, r.num_past] for r in step] for step in steps]
