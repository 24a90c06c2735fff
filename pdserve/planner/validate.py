"""The simulator held against real daemons started here (`pdserve simulate --validate`,
bench/bench_planner.py): workload runs served by a colocated decode server (`--prefill local`) or by a
prefill server and a decode server (each on its own CPUs where given), both logging every step they take
(--step-log) and every request's TTFT phases; then each run simulated on a fleet of profiles fitted to the
steps of the *other* runs of its servers (leave one out: what an operator has from yesterday's logs), with
the KV transfer fitted to the other runs' request lines; and each figure's error, per run and as a mean
absolute percentage error over the runs, never averaged across figures. Each run is also simulated with
profiles fitted to its *own* steps: that error is the simulator's alone (given the step costs the run had),
and the difference between the two is how far one run's step costs carry to another's.

Before the measured runs the servers serve a first pass that writes as many prompt tokens as the decode
server's KV cache holds, so every run meets a cache in its steady state (full, evicting, its blocks spread
over the cache), not only the runs after the first: a fresh cache hands out contiguous blocks."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.processes import decode_server, prefill_server, scrape
from pdserve.bench.serve import bench
from pdserve.bench.stats import compute_stats
from pdserve.bench.workload import LengthDist, SharedPrefix
from pdserve.engine.step_log import read_step_log
from pdserve.planner.plan import pool
from pdserve.planner.profile import TRANSFER_FIELDS, fit_profile, fit_transfer, measured_steps_of
from pdserve.planner.replay import ended_requests
from pdserve.planner.simulator import Arrival, Fleet, Transfer, synthetic_workload

MODES = ("colocated", "disaggregated")
# the figures predicted, each held to its own goal (the planner issue's: TTFT 15%, TPOT 10%, goodput 10%)
FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"), ("goodput", None))
GOALS = {"ttft_ms": 0.15, "tpot_ms": 0.10, "goodput": 0.10}
MIN_STEPS = 10  # a role's steps, over the other runs, below which a run is not predicted (too few to fit)
METRICS = ["--metrics-port", "0"]  # (each run's compilations read from the daemons' counters)


@dataclasses.dataclass(frozen=True)
class Load:
    """A workload as the load generator sends it (pdserve.bench.serve.bench's arguments) and as the simulator
    replays it: the same seed gives the same prompts, lengths and arrival gaps on both sides."""

    prompt_len: str  # a LengthDist ("uniform:64:256")
    output_len: str
    num_requests: int  # (turns > 1: conversations)
    seed: int
    shared_prefix: str = ""  # TOKENS:COUNT
    turns: int = 1
    think_time_s: float = 0.0
    burstiness: float = 1.0

    def arrivals(self, rate: float) -> list[Arrival]:
        return synthetic_workload(
            rate,
            self.num_requests,
            LengthDist.parse(self.prompt_len),
            LengthDist.parse(self.output_len),
            self.seed,
            SharedPrefix.parse(self.shared_prefix) if self.shared_prefix else None,
            self.burstiness,
            self.turns,
            self.think_time_s,
        )


@dataclasses.dataclass
class Run:
    """One load at one rate, served: the client's figures and where its steps and request lines are."""

    name: str  # the workload's name
    rate: float  # requests/s (conversations/s with turns > 1)
    load: Load
    measured: dict = dataclasses.field(default_factory=dict)  # pdserve.bench.stats.compute_stats
    spans: dict = dataclasses.field(default_factory=dict)  # role -> (first, end) of its step log's steps
    # the decode server's request lines (TTFT phases); the programs the servers compiled while serving it
    transfers: list = dataclasses.field(default_factory=list)
    compilations: float = 0


@dataclasses.dataclass
class Served:
    """A mode's runs and the step logs of its servers: role -> (engine description, every step)."""

    mode: str
    runs: list[Run]
    steps: dict


def serve(
    model: str | Path,
    mode: str,
    runs: Sequence[Run],
    engine_args: Sequence[str] = (),
    cpus: dict[str, str] | None = None,
    slo: dict | None = None,
    warmup: bool = True,
    log_dir: Path | None = None,
    echo=print,
) -> Served:
    """Serves each of `runs` in turn (filling in what was measured) on `mode`'s servers of `model`, started
    here with `engine_args` (`cpus`: the disaggregated servers' taskset CPU lists by role, e.g. {"prefill":
    "0", "decode": "1"}; a colocated server has every CPU;
    `warmup`: every shape compiled before serving). `slo`: slo_ttft_ms, slo_tpot_ms for goodput."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    logs = Path(log_dir or tempfile.mkdtemp(prefix="pdserve-validate-"))
    cpus, slo = cpus or {}, slo or {}
    step_logs = {"decode": logs / f"{mode}-decode-steps.jsonl"}
    echo(f"{mode}: the servers' logs and step logs go to {logs} (kept: `pdserve profile --from-step-log`)")
    servers = []
    try:
        if mode == "disaggregated":
            step_logs["prefill"] = logs / f"{mode}-prefill-steps.jsonl"
            servers.append(
                prefill_server(
                    model,
                    logs,
                    name=f"{mode}-prefill",
                    extra=["--step-log", str(step_logs["prefill"]), *METRICS],
                    engine_args=engine_args,
                    cpus=cpus.get("prefill"),
                    warmup=warmup,
                    timeout=1800,
                )
            )
        decode = decode_server(
            model,
            servers[0].address if servers else "local",
            logs,
            name=f"{mode}-decode",
            engine_args=engine_args,
            extra=["--step-log", str(step_logs["decode"]), "--log-format", "json", *METRICS],
            cpus=cpus.get("decode") if servers else None,  # (colocated: every CPU)
            warmup=warmup,
            timeout=1800,
        )
        servers.append(decode)
        # a first pass, not measured: a server's first requests pay one-off costs (allocation, caches),
        # and its prompts fill the KV cache once: a fresh cache hands out contiguous blocks, a full one
        # blocks spread by its evictions, and decode steps reading spread blocks took up to 1.2x as long
        first = runs[0].load
        bench(
            decode.address,
            num_requests=_filling_requests(step_logs["decode"], first.prompt_len),
            prompt_len=first.prompt_len,
            output_len="fixed:8",
            seed=first.seed + 1000,
            progress=False,
        )
        # (each run's start is the previous one's end: nothing runs between them)
        logged = {role: len(read_step_log(path)[1]) for role, path in step_logs.items()}
        compiled = _compilations(servers)
        for run in runs:
            sent_at = time.time()
            load = dataclasses.asdict(run.load)
            run.measured = bench(decode.address, rate=run.rate, progress=False, **load, **slo)["stats"]
            before, logged = logged, {role: len(read_step_log(path)[1]) for role, path in step_logs.items()}
            run.spans = {role: (before[role], logged[role]) for role in step_logs}
            if mode == "disaggregated":
                lines = ended_requests(decode.log_path, (*TRANSFER_FIELDS, "arrival"))
                run.transfers = [r for r in lines if r["arrival"] >= sent_at]
            before_compiled, compiled = compiled, _compilations(servers)
            run.compilations = compiled - before_compiled
            stalled = (
                f" (the servers compiled {run.compilations:g} XLA program(s) during it)"
                if run.compilations
                else ""
            )
            echo(f"{mode} {run.name} {run.rate:g}/s: measured {_figures(run.measured)}{stalled}")
    finally:
        for server in reversed(servers):
            server.terminate()
    steps = {}
    for role, path in step_logs.items():
        info, logged = read_step_log(path)
        steps[role] = (info, measured_steps_of(logged))
    return Served(mode, list(runs), steps)


def predict(served: Served, slo: dict | None = None, echo=print) -> list[dict]:
    """Each run of `served` simulated with profiles fitted to its servers' steps during the *other* runs:
    [{mode, workload, rate, figures: {figure: {measured, predicted, error}}, own_steps: the same figures
    simulated with profiles fitted to the run's own steps}] (a run whose other runs left a role fewer than
    MIN_STEPS steps is left out; `own_steps` is absent where its own steps were too few)."""
    slo = slo or {}
    out = []
    for i, run in enumerate(served.runs):
        others = _fleet(served, [r for j, r in enumerate(served.runs) if j != i])
        if others is None:
            continue
        figures = _errors(run, others, slo)
        entry = {
            "mode": served.mode,
            "workload": run.name,
            "rate": run.rate,
            "compilations": run.compilations,
            "figures": figures,
        }
        own = _fleet(served, [run])
        if own is not None:
            entry["own_steps"] = _errors(run, own, slo)
        out.append(entry)
        echo(f"{served.mode} {run.name} {run.rate:g}/s: measured/predicted (error) {_line(figures)}")
    return out


def _fleet(served: Served, runs: Sequence[Run]) -> Fleet | None:
    """A fleet of `served`'s mode (one replica a role) with profiles fitted to its servers' steps during
    `runs` and the KV transfer to their request lines; None where a role has fewer than MIN_STEPS steps."""
    profiles = {}
    for role, (info, steps) in served.steps.items():
        mine = [step for r in runs for step in steps[slice(*r.spans[role])] if step[0]]
        if len(mine) < MIN_STEPS:
            return None
        profiles[role] = fit_profile(info, mine)
    budget = {role: int(p.engine_info["max_num_batched_tokens"]) for role, p in profiles.items()}
    decode = pool(profiles["decode"], budget["decode"], 1)
    if "prefill" not in profiles:
        return Fleet(decode)
    transfer = Transfer.fitted(fit_transfer([t for r in runs for t in r.transfers], budget["prefill"]))
    return Fleet(decode, pool(profiles["prefill"], budget["prefill"], 1), transfer)


def _errors(run: Run, fleet: Fleet, slo: dict) -> dict:
    """{figure: {measured, predicted, error}} of `run` simulated on `fleet`."""
    predicted = compute_stats(fleet.run(run.load.arrivals(run.rate)).records, None, **slo)
    errors = {}
    for name, p in FIGURES:
        m, s = figure(run.measured, name, p), figure(predicted, name, p)
        errors[figure_key(name, p)] = {"measured": m, "predicted": s, "error": (s - m) / m if m else None}
    return errors


def mean_errors(predictions: list[dict], part: str = "figures") -> dict:
    """Each figure's mean absolute percentage error over the runs (those where it was measured as 0 left
    out), its worst run, the goal it is held to, and the mean absolute error in the figure's own unit over
    every run (ms, requests/s: a percentage of a figure near 0, goodput in an overloaded run, reads large
    where the figure is off by little). `part`: "figures" (predicted from the other runs' steps) or
    "own_steps" (from each run's own: the simulator's error alone)."""
    out = {}
    for name, p in FIGURES:
        key = figure_key(name, p)
        figures = [r[part][key] for r in predictions if part in r]
        errors = [abs(f["error"]) for f in figures if f["error"] is not None]
        if errors:
            value = sum(errors) / len(errors)
            out[key] = {
                "mape": value,
                "worst": max(errors),
                "runs": len(errors),
                "goal": GOALS[name],
                "met": value <= GOALS[name],
                "mean_abs": sum(abs(f["predicted"] - f["measured"]) for f in figures) / len(figures),
            }
    return out


def format_errors(errors: dict, label: str = "") -> str:
    """mean_errors as lines (each after `label`): a figure's MAPE, worst run, goal and mean absolute error."""
    return "\n".join(
        f"{label}{key:<12} MAPE {e['mape']:6.1%} over {e['runs']} runs (worst {e['worst']:.1%}); goal "
        f"{e['goal']:.0%} {'met' if e['met'] else 'NOT met'}; mean |error| {e['mean_abs']:.3g}"
        for key, e in errors.items()
    )


def summarise(predictions: list[dict], echo=print) -> tuple[dict, dict]:
    """mean_errors of the predictions from the other runs' steps and of those from each run's own steps,
    both echoed (format_errors, the second labelled "own steps")."""
    errors, own = mean_errors(predictions), mean_errors(predictions, "own_steps")
    echo(format_errors(errors))
    echo(format_errors(own, "own steps: "))
    return errors, own


def _filling_requests(step_log: Path, prompt_len: str) -> int:
    """How many prompts of `prompt_len` write as many tokens as the KV cache of the engine that writes
    `step_log` holds (its description's kv_tokens), at least 8."""
    info, _ = read_step_log(step_log)
    lengths = LengthDist.parse(prompt_len)
    return max(8, -(-int(info["kv_tokens"]) * 2 // (lengths.low + lengths.high)))


def _compilations(servers) -> float:
    """XLA programs the servers compiled since their metrics ports opened (pdserve_xla_compilations)."""
    return sum(scrape(s.addresses["metrics"]).get("pdserve_xla_compilations_total", 0.0) for s in servers)


def figure(stats: dict, name: str, p: str | None) -> float:
    """A figure of compute_stats' result: a percentile of a distribution, or a scalar (goodput)."""
    return float(stats[name][p] if p else stats.get(name) or 0.0)


def figure_key(name: str, p: str | None) -> str:
    return f"{name}_{p}" if p else name


def _figures(stats: dict) -> str:
    return ", ".join(f"{figure_key(n, p)} {figure(stats, n, p):.3g}" for n, p in FIGURES)


def _line(errors: dict) -> str:
    return ", ".join(
        f"{k} {v['measured']:.3g}/{v['predicted']:.3g}"
        + ("" if v["error"] is None else f" ({v['error']:+.0%})")
        for k, v in errors.items()
    )
