"""The step log: what a serving engine's steps cost, as it ran them, one JSON object a line. A daemon writes
it with `--step-log FILE` (services.engine_loop.EngineLoop.log_steps); `pdserve profile --from-step-log
FILE` fits a step-cost profile to it (pdserve.planner), so the planner's costs can come from the served
engine itself, under its real traffic, rather than from a workload run for the purpose.

The first line describes the engine (`{"engine": {...}}`: engine_description's keys); every other line is
one step: `{"at": unix seconds at its end, "rows": [[tokens fed, tokens of KV before them], ...],
"seconds": its wall time}`, from the scheduler's decision to its sampled tokens on the host. A step that
only computes prompt chunks samples nothing and is not waited for: its time shows up in the next one's, so
it is written with the step that sampled after it, whose line lists it (in order, if several) under
`"before"` and whose seconds are theirs together.
"""

from __future__ import annotations

import json
import platform
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

Row = tuple[int, int]  # (tokens fed, tokens of KV before them)
Logged = tuple[list[list[Row]], float]  # steps timed together (the last one sampled), their seconds
# the model's sizes a roofline projection computes FLOPs from (pdserve.planner.roofline)
MODEL_DIMS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
)


def engine_description(engine) -> dict:
    """What a profile needs to know of `engine` besides its step times: the summary (model, dtype, TP,
    platform, cache), how the scheduler cuts and pads steps, and the host."""
    config = engine.config
    memory = getattr(engine.runner, "memory", None)  # (a scripted runner's: none)
    return {
        **engine.summary(),
        "kv_bytes_per_token": memory.block_bytes / config.block_size if memory is not None else 0,
        "weight_bytes": memory.weight_bytes if memory is not None else 0,
        "model_dims": {k: getattr(engine.model.config, k) for k in MODEL_DIMS},
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
        "token_buckets": list(config.token_buckets),
        "block_size": config.block_size,
        "host": platform.processor() or platform.machine(),
    }


class StepLogWriter:
    """Appends steps to a step log (line-buffered: a reader sees each step once written)."""

    def __init__(self, path: str | Path, engine_info: dict):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - held open for the daemon's life
        self._lock = threading.Lock()
        self._file.write(json.dumps({"engine": engine_info}) + "\n")

    def write(self, rows: Iterable[Row], seconds: float, before: Iterable[Iterable[Row]] = ()) -> None:
        """A step that sampled; `before`: the rows of the steps timed with it (none waited for)."""
        item = {"at": round(time.time(), 3), "rows": [list(r) for r in rows], "seconds": seconds}
        before = [[list(r) for r in step] for step in before]
        if before:
            item["before"] = before
        line = json.dumps(item)
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_step_log(path: str | Path) -> tuple[dict, list[Logged]]:
    """The engine description and each line's steps of a step log: (the rows of each step timed together,
    the last the one that sampled; their seconds); ValueError naming the line of a malformed one. A log
    appended to by several runs must be of one engine: the descriptions (but for the compile cache's
    state) must agree."""
    engine: dict | None = None
    steps: list[Logged] = []
    for number, item in _lines(path):
        if "engine" in item:
            described = {k: v for k, v in item["engine"].items() if k != "compile_cache"}
            if engine is not None and described != engine:
                raise ValueError(f"{path}:{number}: another engine's steps ({described} after {engine})")
            engine = described
            continue
        try:
            timed = [*item.get("before", ()), item["rows"]]
            rows = [[(int(t), int(p)) for t, p in step] for step in timed]
            seconds = float(item["seconds"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{number}: not a step ({e})") from None
        steps.append((rows, seconds))
    if engine is None:
        raise ValueError(f"{path}: no engine line (not a step log?)")
    return engine, steps


def _lines(path: str | Path) -> Iterator[tuple[int, dict]]:
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: {e}") from None
