"""What every benchmark script shares: timing a call, the best of several runs, the ratio of two figures
measured in the same run, and the JSON report (printed, and written where `--json` asks).

Light on purpose (the standard library only): bench/bench_vs_commit.py's workers load it from this tree
while importing the `pdserve` of another commit.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path


def timed(fn: Callable, *args, **kwargs) -> float:
    """Seconds one call of `fn(*args, **kwargs)` takes (wall clock)."""
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, in seconds (the figure least disturbed by the machine)."""
    return min(timed(fn) for _ in range(repeats))


def ratio(value: float | None, reference: float | None) -> float | None:
    """`value / reference` of two figures measured in the same run (so the machine's speed cancels out);
    None when either is missing or the reference is zero."""
    if value is None or not reference:
        return None
    return value / reference


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, GiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write_json(result: dict, path: str | Path | None) -> None:
    """Writes `result` as indented JSON to `path` (nothing when None)."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2))


def report(result: dict, json_path: str | Path | None, echo: bool = True) -> None:
    """A benchmark's result: printed as JSON (with `echo`), and written to `json_path` when given."""
    if echo:
        print(json.dumps(result, indent=2))
        sys.stdout.flush()
    write_json(result, json_path)


def emit(row: dict) -> None:
    """One line of progress as compact JSON, flushed (rows printed while a long benchmark runs)."""
    print(json.dumps(row), flush=True)
