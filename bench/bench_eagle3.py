"""EAGLE-3 speculative decoding on the default model: what a head costs, and its acceptance colocated
against disaggregated (the regression metric P/D systems lack: a decode server that drafts from other
state than a colocated engine accepts less).

    .venv/bin/python bench/bench_eagle3.py [--head DIR] [--k 3] [--tokens 96] [--json OUT] [--smoke]

No trained EAGLE-3 head for the default model (SmolLM2-135M-Instruct) is reachable from this machine.
`--head` takes one (a folder as heads are published); without it the script writes a random head in the
published format: a 4096-token draft vocabulary drawn at random, with the four tokens the model writes
most on these workloads favoured (LM head rows four times as large), so that some drafts are accepted
and the colocated and disaggregated counts have something to agree on. Its speed-up is not a
trained head's: it measures the head's overhead.

1. Overhead, in one process: the engine without speculation, with the head under `draft_policy` "cost"
   (drafts verified where the step's measured cost says they pay) and "all", at batch 1 and 8 on two of
   bench_speculative's workloads (quote, story) and on `seen`, one of bench/distill_eagle3.py's training
   instructions (a distilled head fits its training answers: what a head that predicts well gives):
   decode tokens per second and TPOT, medians of `--rounds` interleaved runs, ratios to without, mean
   accepted length; outputs checked equal token for token.
2. Handoff: every workload's prompt and `seen` through a prefill-server and a decode-server (processes,
   the head given to both, `draft_policy` "all") and through a colocated engine of the same config, one
   request at a time: the spec-decode counters (verifying rows, drafts, accepted, accepted per position)
   and the tokens must be equal.

--smoke: the test model, `seen` only, policy "all" only, batch 1, 8 tokens, one round, no warmup, no
handoff (it needs the daemons).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import tempfile
from pathlib import Path

from pdserve.bench.common import emit, write_json
from pdserve.bench.engine_timing import compare
from pdserve.bench.prompts import TASKS, TOPICS, WORKLOADS, chat_prompts

# One of distill_eagle3's training instructions: what the engine does with a head that predicts well (a
# head fits its training answers), not how well a head generalizes
SEEN = TASKS[0].format(t=TOPICS[0])


def write_head(folder: Path, model, prompts, off_engine, params) -> Path:
    """A random head favouring the four tokens the model writes most on `prompts`."""
    from pdserve.testing.eagle3 import write_random_head

    counts = collections.Counter(t for c in off_engine.generate(prompts, params) for t in c.token_ids)
    favoured = tuple(t for t, _ in counts.most_common(4))
    return write_random_head(folder, model.config, 4096, seed=1, favoured=favoured)


def overhead(engines, model, args) -> list[dict]:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    rows = []
    for batch in args.batches:
        workloads = (("quote", WORKLOADS["quote"]), ("story", WORKLOADS["story"]), ("seen", SEEN))
        for name, text in workloads[-1:] if args.smoke else workloads:
            prompts = chat_prompts(model.tokenizer, text, batch)
            row = {"workload": name, "batch": batch, **compare(engines, prompts, params, args.rounds)}
            emit(row)
            rows.append(row)
    return rows


def handoff(model, model_path: Path, spec: str, args, log_dir: Path) -> dict:
    """The workloads through a prefill-server and a decode-server, and through a colocated engine."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.services.admin import speculation_fields
    from pdserve.services.client import Client, build_request
    from pdserve.services.sampling import params_from_request
    from pdserve.testing.launch import TEST_ENGINE, decode_server, prefill_server

    requests = [chat_prompts(model.tokenizer, text, 1)[0] for text in [*WORKLOADS.values(), SEEN]]
    keywords = dict(max_tokens=args.tokens, temperature=0.0)
    colocated = LLMEngine(model, dataclasses.replace(TEST_ENGINE, speculative_config=spec))
    expected = [
        colocated.generate([ids], params_from_request(build_request(ids, **keywords)))[0].token_ids
        for ids in requests
    ]
    local = speculation_fields(colocated.stats().speculation)  # (Admin stats' spec_decode_* fields)
    extra = ["--speculative-config", spec]
    prefill = prefill_server(model_path, log_dir, extra=extra)
    try:
        decode = decode_server(model_path, prefill.address, log_dir, extra=extra)
        try:
            client = Client(decode.address)
            got = [client.generate(ids, **keywords).token_ids for ids in requests]
            stats = client.stats()
            remote = {key: getattr(stats, key) for key in local}  # (the proto's, by the same names)
            remote["spec_decode_accepted_per_position_total"] = list(
                remote["spec_decode_accepted_per_position_total"]
            )
            transfers = stats.num_transfers_total
        finally:
            decode.terminate()
    finally:
        prefill.terminate()
    out = {
        "requests": len(requests),
        "transfers": transfers,
        "tokens_equal": got == expected,
        "colocated": local,
        "disaggregated": remote,
        "counters_equal": local == remote,
    }
    emit(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", type=Path, help="an EAGLE-3 head's folder (default: a random one)")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--tokens", type=int, default=96, help="max_tokens of every request")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-handoff", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="the test model, tiny sizes, no handoff")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.batches, args.rounds, args.skip_handoff = 8, [1], 1, True

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.testing.models import bench_model

    model_path = bench_model(args.smoke)
    model = load_model(str(model_path)).in_memory()
    base = EngineConfig(
        dtype="float32",  # every step shape computes alike: speculation changes no greedy token
        num_blocks=512,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    work = Path(tempfile.mkdtemp(prefix="bench_eagle3_"))
    engines = {"off": LLMEngine(model, base)}
    head = args.head
    if head is None:
        prompts = [p for text in WORKLOADS.values() for p in chat_prompts(model.tokenizer, text, 2)]
        head = write_head(
            work / "head",
            model,
            prompts,
            engines["off"],
            SamplingParams(temperature=0, max_tokens=args.tokens if args.smoke else 64),
        )
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": args.k}
    for policy in ("all",) if args.smoke else ("cost", "all"):
        config = dataclasses.replace(base, speculative_config=json.dumps({**spec, "draft_policy": policy}))
        engines[f"eagle3_{policy}"] = LLMEngine(model, config)
    for engine in engines.values() if not args.smoke else ():
        engine.runner.warmup(progress=False)
    out = {"speculative_config": spec, "head": "given" if args.head else "random", "max_tokens": args.tokens}
    out["overhead"] = overhead(engines, model, args)
    if not args.skip_handoff:
        engines.clear()
        out["handoff"] = handoff(model, model_path, json.dumps({**spec, "draft_policy": "all"}), args, work)
    write_json(out, args.json)


if __name__ == "__main__":
    main()
