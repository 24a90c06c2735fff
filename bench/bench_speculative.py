"""n-gram speculative decoding (`--speculative-config '{"method": "ngram", ...}'`) against decoding without
it, in one run, on the default model (its whole 30 layers).

    .venv/bin/python bench/bench_speculative.py [--k 4] [--tokens 128] [--dtype float32] [--json OUT]
                                                [--smoke]

Four workloads, each a chat prompt to the instruct model, greedy:
- quote: repeat a paragraph word for word (a summary that quotes its source);
- code: a function with one variable renamed, printed whole (a code edit);
- json: a table turned into a JSON list (repetitive structure);
- story: a story from a one-line premise (little to look up: where speculation should not win).
Three engines: without speculation, with n-gram drafts under `draft_policy` "cost" (the default: drafts
verified where the step's measured cost says they pay) and "all" (every draft). At batch 1 and batch 8
(8 variants of the prompt decoding together), for each workload: output tokens per second over the
decode (first token to last) and TPOT (the mean gap between a request's tokens), medians of `--rounds`
interleaved runs, their ratios with speculation to without, the mean accepted length (tokens a
verifying row emits) and the share of drafts accepted. Every engine is warmed up (every shape compiled)
and runs the workload once before the rounds; the outputs are checked equal token for token (greedy:
speculation changes no token). That holds where every step shape computes alike: `--dtype float32`, the
default here. In bfloat16 (`--dtype auto` on a CPU with bfloat16 dot instructions) a verification step's
matmuls accumulate in another order than a one-token step's, so a near-tie can flip and a request go
down another path: with another dtype the share of outputs equal to the run without speculation is
reported instead (`outputs_equal_<engine>`). The workloads are pdserve.bench.prompts'; the timing is
pdserve.bench.engine_timing.compare. --smoke: the test model, batch 1, 8 tokens, one round, no warmup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from pdserve.bench.common import emit, write_json
from pdserve.bench.engine_timing import compare
from pdserve.bench.prompts import WORKLOADS, chat_prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each engine (medians)")
    parser.add_argument(
        "--dtype", default="float32", help="weights and cache (float32: outputs checked equal)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="the test model, batch 1, 8 tokens, 1 round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.batches, args.rounds = 8, [1], 1

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.testing.models import bench_model

    model = load_model(str(bench_model(args.smoke))).in_memory()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    base = EngineConfig(
        dtype=args.dtype,
        num_blocks=512,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,  # (every round computes the same)
    )
    engines = {"off": LLMEngine(model, base)}
    for policy in ("cost", "all"):
        config = dataclasses.replace(base, speculative_config=json.dumps({**spec, "draft_policy": policy}))
        engines[f"ngram_{policy}"] = LLMEngine(model, config)
    for engine in engines.values() if not args.smoke else ():
        engine.runner.warmup(progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    out = {
        "speculative_config": spec,
        "dtype": args.dtype,
        "max_tokens": args.tokens,
        "rounds": args.rounds,
        "runs": [],
    }
    exact = args.dtype == "float32"  # see the docstring: outputs checked equal, else their share reported
    for batch in args.batches:
        for name, text in WORKLOADS.items():
            prompts = chat_prompts(model.tokenizer, text, batch)
            row = {"workload": name, "batch": batch, **compare(engines, prompts, params, args.rounds, exact)}
            emit(row)
            out["runs"].append(row)
    write_json(out, args.json)


if __name__ == "__main__":
    main()
