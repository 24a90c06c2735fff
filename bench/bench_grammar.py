"""Constrained-decoding libraries compared on this machine, for the choice of issue 18: grammar compile time
and per-token mask time at batch 32, over the default model's vocabulary (SmolLM2, 49,152 tokens).

    .venv/bin/pip install outlines-core==0.2.14 xgrammar==0.2.8 apache-tvm-ffi   # the candidates not chosen
    .venv/bin/python bench/bench_grammar.py [--steps 64] [--json OUT] [--smoke]

Per library (each one that imports):
  * compile: each test schema (pdserve.testing) compiled cold, p50 / p99 / max, and the one-off
    tokenizer set-up;
  * mask at batch 32: 32 matchers (the schemas in turn) walk `--steps` tokens, each step filling all 32 rows'
    allowed-token bitmask and consuming one allowed token per row (a seeded choice among the allowed ones,
    so every row stays inside its grammar; a finished row restarts); ms per batch step, mean and p99;
  * what the bitmask is (a numpy int32 array, or a torch tensor), and what installing it pulls in.
And pdserve's decode step at batch 32 with half the rows constrained by a JSON schema against none, in
the same run (issue 18's target: >= 0.85x), and TTFT of 512-token prompts through a decode server on a
prefill server (real daemons) with a constraint and without. --smoke: the test model, 4 mask steps,
pdserve's decode at batch 2 for 2 steps once, no daemons (no TTFT).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from pdserve.bench.common import ratio, report
from pdserve.bench.engine_timing import decode_step_times
from pdserve.bench.prompts import random_prompt

BATCH = 32


def _allowed(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def _percentiles(times: list[float]) -> dict:
    ms = np.asarray(times) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
    }


def _timed(fn, items) -> tuple[list, list[float]]:
    """fn over items: the results and each call's seconds."""
    results, times = [], []
    for item in items:
        t0 = time.perf_counter()
        results.append(fn(item))
        times.append(time.perf_counter() - t0)
    return results, times


def _walk(fill, advance, vocab: int, steps: int, rng) -> list[float]:
    """`steps` batch steps: fill(mask) writes the 32 rows' masks (timed), then advance(row, token) takes a
    seeded choice among each row's allowed tokens (a finished row restarts inside `advance`)."""
    mask = np.zeros((BATCH, -(-vocab // 32)), np.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fill(mask)
        times.append(time.perf_counter() - t0)
        for row in range(BATCH):
            allowed = _allowed(mask[row], vocab)
            assert len(allowed), f"row {row}: no allowed token"
            advance(row, int(rng.choice(allowed)))
    return times


def _result(
    setup: float, compiles: list[float], masks: dict[str, list[float]], bitmask: str, deps: str
) -> dict:
    return {
        "tokenizer_setup_s": setup,
        "compile": _percentiles(compiles),
        **{f"mask_batch32_{name}": _percentiles(times) for name, times in masks.items()},
        "bitmask": bitmask,
        "dependencies": deps,
    }


def llguidance_case(tokenizer, schemas, steps, rng) -> dict:
    import llguidance
    import llguidance.numpy as llnp

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size)
    setup = time.perf_counter() - t0
    grammars = [llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s)) for s in schemas]
    _, compiles = _timed(lambda g: llguidance.LLMatcher(tok, g), grammars)
    matchers = [llguidance.LLMatcher(tok, grammars[i % len(grammars)]) for i in range(BATCH)]
    executor = llguidance.LLExecutor()

    def sequential(mask):
        for i, m in enumerate(matchers):
            llnp.fill_next_token_bitmask(m, mask, i)

    def parallel(mask):
        llnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def advance(row, token):
        assert matchers[row].consume_token(token), matchers[row].get_error()
        if matchers[row].is_stopped():
            matchers[row].reset()

    masks = {
        name: _walk(fill, advance, tok.vocab_size, steps, rng)
        for name, fill in [("sequential", sequential), ("parallel", parallel)]
    }
    return _result(setup, compiles, masks, "numpy int32 [batch, vocab / 32]", "none")


def outlines_case(tokenizer, schemas, steps, rng) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    from pdserve.engine.tokenizer import byte_alphabet

    t0 = time.perf_counter()
    eos = min(tokenizer.eos_token_ids)
    to_byte = {c: b for b, c in byte_alphabet().items()}  # SmolLM2 is byte-level BPE
    tokens: dict[bytes, list[int]] = {}
    for i in range(tokenizer.vocab_size):
        if i not in tokenizer.special_ids:
            tokens.setdefault(bytes(to_byte[c] for c in tokenizer.id_to_token(i)), []).append(i)
    vocabulary = Vocabulary(eos, tokens)
    setup = time.perf_counter() - t0
    regexes = [build_regex_from_schema(json.dumps(s)) for s in schemas]
    indexes, compiles = _timed(lambda r: Index(r, vocabulary), regexes)
    guides = [Guide(indexes[i % len(indexes)]) for i in range(BATCH)]
    words = -(-tokenizer.vocab_size // 32)

    def fill(mask):
        for i, g in enumerate(guides):
            g.write_mask_into(mask[i].ctypes.data, words, 4)

    def advance(row, token):
        if token == eos or guides[row].is_finished():
            guides[row] = Guide(indexes[row % len(indexes)])
        else:
            guides[row].advance(token)

    masks = {"sequential": _walk(fill, advance, tokenizer.vocab_size, steps, rng)}
    return _result(setup, compiles, masks, "numpy int32 (write_mask_into a pointer)", "none")


def xgrammar_case(tokenizer, schemas, steps, rng) -> dict:
    import transformers
    import xgrammar as xgr

    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size)
    setup = time.perf_counter() - t0
    compile_one = lambda s: xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(s))
    compiled, compiles = _timed(compile_one, schemas)
    matchers = [xgr.GrammarMatcher(compiled[i % len(compiled)]) for i in range(BATCH)]
    bitmask = xgr.allocate_token_bitmask(BATCH, tokenizer.vocab_size)  # a torch tensor

    def fill(mask):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        mask[:] = bitmask.numpy()

    def advance(row, token):
        assert matchers[row].accept_token(token)
        if matchers[row].is_terminated():
            matchers[row].reset()

    masks = {"sequential": _walk(fill, advance, tokenizer.vocab_size, steps, rng)}
    return _result(
        setup, compiles, masks, "torch int32 tensor", "torch, transformers, triton, apache-tvm-ffi, pydantic"
    )


def decode_with_constraints(steps: int, smoke: bool = False) -> dict:
    """pdserve's decode step at batch 32 with half the rows under a JSON schema (an array of strings of
    at least 200 characters: no row can finish within the steps) against none, alternated 3 times; the
    ratio of tokens/s (best of each). `smoke`: the test model at batch 2, once, no warmup."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import Constraint, SamplingParams
    from pdserve.testing.models import bench_model

    batch, rounds = (2, 1) if smoke else (BATCH, 3)
    config = EngineConfig(
        num_blocks=128 if smoke else 1024, max_model_len=1024, max_num_seqs=batch, max_num_batched_tokens=512
    )
    engine = LLMEngine.from_model(str(bench_model(smoke)), config, warmup=not smoke, progress=False)
    schema = {"type": "array", "items": {"type": "string", "minLength": 200}}
    free = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=steps + 8, constraint=Constraint("json_schema", json.dumps(schema))
    )
    best = {"none": float("inf"), "half": float("inf")}
    for _ in range(rounds):
        for name, params in (("none", [free]), ("half", [free, constrained])):
            times = decode_step_times(engine, batch, steps, params=params)
            best[name] = min(best[name], sum(times) / len(times))
    return {
        "step_ms": {k: v * 1e3 for k, v in best.items()},
        "tokens_per_s": {k: batch / v for k, v in best.items()},
        "ratio_half_constrained_vs_none": ratio(best["none"], best["half"]),
    }


def disaggregated_ttft(runs: int, length: int = 512) -> dict:
    """TTFT through a decode server on a prefill server (real daemons) for `length`-token prompts with a
    JSON-schema constraint and without, alternated, median of `runs` each: the prefill server compiles the
    constraint and samples the first token under it; the decode server compiles it too, at the door."""
    import statistics
    import tempfile

    from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch
    from pdserve.engine.sampling_params import Constraint
    from pdserve.services.client import Client
    from pdserve.testing.constraint_schemas import SCHEMAS
    from pdserve.testing.launch import decode_server, prefill_server

    gguf = fetch(DEFAULT_MODEL, progress=False)
    logs = Path(tempfile.mkdtemp())
    pf = prefill_server(gguf, logs)
    dc = decode_server(gguf, pf.address, logs)
    try:
        client = Client(dc.address)
        constraint = Constraint("json_schema", json.dumps(SCHEMAS[3]))  # nested objects
        for kw in ({}, {"constraint": constraint}):  # compile every shape once
            client.generate(random_prompt(length, 0), max_tokens=2, **kw)
        ttft = {"none": [], "json_schema": []}
        for run in range(runs):
            ttft["none"].append(client.generate(random_prompt(length, 2 * run + 1), max_tokens=1).ttft_s)
            constrained = client.generate(
                random_prompt(length, 2 * run + 2), max_tokens=1, constraint=constraint
            )
            ttft["json_schema"].append(constrained.ttft_s)
        medians = {k: statistics.median(v) for k, v in ttft.items()}
        return {
            "prompt_tokens": length,
            "ttft_s": medians,
            "ratio": ratio(medians["json_schema"], medians["none"]),
        }
    finally:
        dc.terminate()
        pf.terminate()


CASES = {"llguidance": llguidance_case, "outlines-core": outlines_case, "xgrammar": xgrammar_case}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="the test model, 4 steps, no daemons")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps = 4

    from pdserve.engine.loading.sources import load_model
    from pdserve.testing.constraint_schemas import SCHEMAS
    from pdserve.testing.models import bench_model

    tokenizer = load_model(str(bench_model(args.smoke))).tokenizer
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = case(tokenizer, SCHEMAS, args.steps, np.random.default_rng(0))
        except ImportError as e:
            results[name] = {"not installed": str(e)}
    results["pdserve_decode_batch32"] = decode_with_constraints(args.steps // 2, args.smoke)
    if not args.smoke:
        results["disaggregated_ttft"] = disaggregated_ttft(runs=5)
    report(results, args.json)


if __name__ == "__main__":
    main()
