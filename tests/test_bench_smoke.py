"""Every script in bench/ runs its `--smoke` mode (tiny sizes, one round, the test model or a tiny random
model), so that a refactor cannot break a benchmark silently. The figures of a smoke run mean nothing; what is
checked is that the script runs to its end and writes its JSON report.

Model-free smokes run in this process in the fast tier. The others run as a user runs them, `python
bench/NAME.py --smoke`, each in a process of its own (so a crash or a leak stays with its run): real
processes, in the daemon tier, marked standalone (none uses the session's daemons), which scripts/test.sh
runs beside the model tier. bench/README.md says which part of each script its smoke leaves out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
FAST = ["bench_kvtransfer", "bench_lm_eval"]
MODEL = [
    "bench_engine",
    "bench_eagle3",
    "bench_families",
    "bench_gateway",
    "bench_grammar",
    "bench_host_tier",
    "bench_int8",
    "bench_kv_dtype",
    "bench_load",
    "bench_lora",
    "bench_memory_plan",
    "bench_multihost",
    "bench_prefix_cache",
    "bench_speculative",
    "bench_step_host",
    "bench_vs_commit",
    "distill_eagle3",
]
DAEMON = [
    "bench_clients",
    "bench_disagg",
    "bench_goodput",
    "bench_hostile",
    "bench_migration",
    "bench_routing",
    "bench_planner",
    "bench_startup",
    "bench_vs_vllm",
]


def script(name: str):
    """bench/`name`.py imported from its path (as `python bench/NAME.py` runs it, without __main__)."""
    spec = importlib.util.spec_from_file_location(f"bench_smoke_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_report(path: Path) -> dict:
    result = json.loads(path.read_text())
    assert isinstance(result, dict) and result, f"{path}: an empty report"
    return result


def run_in_process(name: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{name}.json"
    script(name).main(["--smoke", "--json", str(out)])
    return check_report(out)


@pytest.mark.fast
def test_every_script_has_a_smoke_mode_a_test_and_a_line_in_the_index():
    scripts = sorted(p.stem for p in BENCH.glob("*.py"))
    assert sorted(FAST + MODEL + DAEMON) == scripts
    index = (BENCH / "README.md").read_text()
    for name in scripts:
        source = (BENCH / f"{name}.py").read_text()
        assert '"--smoke"' in source, f"{name}: no --smoke flag"
        assert re.search(rf"^\| `{name}\.py` \|", index, re.M), f"{name}: no line in bench/README.md"
        assert "sys.path" not in source and "from tests" not in source, name
        assert not re.search(r"^\s*(from|import) (bench_|distill_)", source, re.M), f"{name} imports a script"


@pytest.mark.fast
@pytest.mark.parametrize("name", FAST)
def test_model_free_smoke(name, tmp_path):
    run_in_process(name, tmp_path)


def run_script(name: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python bench/NAME.py --smoke ARGS` in a process of its own (the tests' JAX settings inherited).

    It shares the tests' persistent XLA cache (JAX reads its config from JAX_* variables): most of a smoke's
    time is compiling the test model's steps, and the smokes build many of the same engines."""
    import jax

    config = jax.config
    cache = {
        "JAX_COMPILATION_CACHE_DIR": config.jax_compilation_cache_dir,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(config.jax_persistent_cache_min_compile_time_secs),
    }
    return subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **cache},
    )


@pytest.mark.daemon
@pytest.mark.standalone
@pytest.mark.parametrize("name", [n for n in MODEL if n != "distill_eagle3"] + DAEMON)
def test_smoke_run(name, tmp_path, model_path):
    out = tmp_path / f"{name}.json"
    done = run_script(name, tmp_path, "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_report(out)


@pytest.mark.daemon
@pytest.mark.standalone
def test_distill_smoke(tmp_path, model_path):
    """Trains 2 steps and writes a head; without optax (the `distill` extra), it says what to install."""
    done = run_script("distill_eagle3", tmp_path, "--out", str(tmp_path / "head"))
    if importlib.util.find_spec("optax") is None:
        assert done.returncode != 0 and "needs optax" in done.stderr, done.stderr[-3000:]
        return
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "head").iterdir()}
