"""The `pdserve` command line, run as a real process."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from pdserve.engine import memory
from pdserve.flags import config_argv
from pdserve.testing.launch import ENGINE_ARGS, TEST_ENGINE

pytestmark = pytest.mark.daemon


def run_cli(
    *args: str,
    model_path,
    engine_args=ENGINE_ARGS,
    env: dict[str, str] | None = None,
    entry: tuple[str, ...] = ("-m", "pdserve.cli"),
) -> subprocess.CompletedProcess:
    """`pdserve ARGS --model model_path`, with the tests' engine sizes (what they compile is shared) or
    `engine_args`, `env` over this process's environment, and `entry` (Python's arguments that run main)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, *entry, *args, "--model", str(model_path), *engine_args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_generate_json_chat_locally_and_with_server(model_path, decode, capsys):
    """`pdserve generate --json`: one record with the same fields and values, local or --server."""
    from pdserve.cli import main

    args = ["generate", "--json", "--chat", "--max-tokens", "32", "What is the capital of France?"]
    proc = run_cli(*args, model_path=model_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["prompt_ids"][:2] == [1, 9690] and record["text"]
    ended_by_eos = record["finish_reason"] == "stop" and record["token_ids"][-1] == 2
    assert ended_by_eos or (record["finish_reason"] == "length" and len(record["token_ids"]) == 32)
    assert record["prompt_tokens"] == len(record["prompt_ids"])
    assert record["timings"]["ttft_s"] > 0 and record["timings"]["startup_s"] > 0
    assert main([*args, "--server", decode.address]) == 0
    remote = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert remote.keys() == record.keys() and remote["timings"].keys() == record["timings"].keys()
    for field in ("prompt_ids", "prompt_tokens", "token_ids", "text", "finish_reason"):
        assert remote[field] == record[field], field


def test_generate_streams_text_and_rejects_bad_input(model_path, decode, capsys):
    """Streaming (the same code for both modes; here through --server) and bad flags refused with the
    field named: locally before any model is loaded, remotely as the server's INVALID_ARGUMENT."""
    from pdserve.cli import main

    args = ["generate", "--max-tokens", "5", "--temperature", "0.8", "--seed", "3", "Once upon a time"]
    assert main([*args, "--server", decode.address]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["generate", "--server", decode.address, "--top-p", "0", "hello"]) == 2
    assert "INVALID_ARGUMENT: top_p" in capsys.readouterr().err
    bad = run_cli("generate", "--top-p", "0", "hello", model_path=model_path)
    assert bad.returncode == 2 and "top_p" in bad.stderr


def test_models_list():
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "models", "list"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "smollm2-135m-instruct" in proc.stdout


def test_generate_with_a_lora_adapter(model_path, loaded_model, make_engine, tmp_path):
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.testing.lora import write_random_adapter

    folder = write_random_adapter(tmp_path / "sql", loaded_model.config, rank=4, seed=5)
    lora = ("--lora", f"sql={folder}", "--max-loras", "2", "--adapter", "sql")
    args = ("generate", "--json", "--max-tokens", "8", *lora, "Hello")
    proc = run_cli(*args, model_path=model_path)
    assert proc.returncode == 0, proc.stderr
    engine = make_engine(max_loras=2)
    engine.loras.load("sql", str(folder))
    expected = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8), lora="sql")[0]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"] == expected.token_ids
    engine.loras.remove("sql")
    bad = run_cli("generate", "--lora", "no-equals-sign", "hi", model_path=model_path)
    assert bad.returncode == 2 and "expected NAME=PATH" in bad.stderr
    missing = run_cli("generate", "--lora", f"x={tmp_path / 'none'}", "hi", model_path=model_path)
    assert missing.returncode != 0 and "--lora x" in missing.stderr and "not a directory" in missing.stderr


@pytest.mark.standalone
def test_a_second_one_shot_generate_compiles_nothing(model_path, tmp_path):
    """`pdserve generate` with n-gram speculation and its KV cache sized from the RAM available, twice: the
    second finds every executable the first used (its prefill, decode and verification steps) in the
    persistent compilation cache. The cache's size, a dimension of every step, holds from one start to the
    next (engine.memory.steady_num_blocks), though the budget moves: the RAM reading is pinned here (other
    tests move it), but what the runtime took before sizing still varies by tens of blocks."""
    sized_from_memory = config_argv(dataclasses.replace(TEST_ENGINE, num_blocks=0))
    quote = "Repeat: one two three four five six. one two three four five six. one two three"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    watched = (
        "import sys; from pdserve.testing import compile_watch; from pdserve.cli import main; "
        "rc = main(sys.argv[1:]); print('misses', compile_watch.persistent_cache_misses()); sys.exit(rc)"
    )
    misses, texts = [], []
    for _ in range(2):
        done = run_cli(
            "generate",
            *("--json", "--max-tokens", "16", "--speculative-config", spec, quote),
            model_path=model_path,
            engine_args=sized_from_memory,
            # a compilation cache of its own (the first run fills it); the RAM reading pinned
            env={"PDSERVE_CACHE_DIR": str(tmp_path), memory.AVAILABLE_RAM_ENV: str(4 * 2**30)},
            entry=("-c", watched),
        )
        assert done.returncode == 0, done.stderr[-3000:]
        record, last = done.stdout.strip().splitlines()[-2:]
        misses.append(int(last.split()[1]))
        texts.append(json.loads(record)["text"])
    assert misses[0] > 0 and misses[1] == 0, misses
    assert texts[0] == texts[1]
