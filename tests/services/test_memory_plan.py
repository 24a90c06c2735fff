"""The memory plan holds, and a model that fits serves with no sizing flag (engine/memory.py), on a
1.2B-parameter random Llama in bfloat16 safetensors shards (2.2 GB, its config the one bench/bench_load.py
measures) served from a fresh process (pdserve.testing.memory_probe) as a daemon sizes its engine: the RAM
it sizes from is given (PDSERVE_AVAILABLE_RAM), so nothing depends on this box. Its largest step (the
largest token bucket, prompt logprobs, n sequences) must stay within the plan: on a CPU a bfloat16 cache is
converted and copied inside the step, temporaries that an estimate against one small cache missed (the
issue's decode-server was killed at its first request, 10 GB past its plan)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.daemon, pytest.mark.standalone]  # starts the processes it measures

GIB = 2**30
# the largest step of the probe's engine: a 128-token bucket (the plan is per configuration)
PROBE_ARGS = ["--max-num-batched-tokens", "128", "--max-num-seqs", "8", "-n", "4"]


@pytest.fixture(scope="module")
def random_1b(tmp_path_factory, model_path):
    from pdserve.testing.load_probe import write_random_llama

    folder = tmp_path_factory.mktemp("random-1b")
    nbytes = write_random_llama(
        folder, shards=4, hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):  # (the probe's text path; ids below 32000)
        shutil.copy(model_path / name, folder / name)
    yield folder, nbytes
    shutil.rmtree(folder, ignore_errors=True)


def _probe(folder, available: int, *extra: str) -> dict:
    env = {**os.environ, "PDSERVE_AVAILABLE_RAM": str(available)}
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.testing.memory_probe", str(folder), *PROBE_ARGS, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_model_that_fits_serves_with_no_sizing_flag_within_its_plan(random_1b):
    """4x the checkpoint's bytes of RAM: the default rule gives the cache a tenth of what the weights and
    the step leave; the engine serves its largest step and its peak stays within the plan."""
    folder, nbytes = random_1b
    result = _probe(folder, 4 * nbytes)
    assert "refused" not in result, result
    summary = result["summary"]
    assert summary["sized_by"] == "0.1 of the RAM left after the weights and step"
    assert int(summary["max_model_len"]) >= 128 and result["num_tokens"] == 4
    assert result["peak_growth"] <= result["planned_bytes"], result


def test_a_daemon_sized_by_the_fraction_survives_its_largest_step_within_the_plan(random_1b):
    """--gpu-memory-utilization 0.7 of 12 GiB: a cache of hundreds of MiB, whose in-step copies are
    counted; the peak stays within the plan, and the plan within the fraction's budget."""
    folder, _ = random_1b
    available = 12 * GIB
    result = _probe(folder, available, "--gpu-memory-utilization", "0.7")
    summary = result["summary"]
    assert summary["sized_by"] == "gpu_memory_utilization=0.7" and float(summary["kv_gib"]) > 0.2
    assert result["peak_growth"] <= result["planned_bytes"] <= 0.7 * available, result
