"""n-gram speculative decoding (`--speculative-config '{"method": "ngram", ...}'`) against decoding without
it, in one run, on the default model (its whole 30 layers, float32 weights on this CPU).

    .venv/bin/python bench/bench_speculative.py [--k 4] [--tokens 128] [--json OUT]

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
speculation changes no token).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens and wound the clockwork that turned the light. Ships passing in the night never saw "
    "him, but they steered by the beam he kept burning until dawn."
)
CODE = """def mean_price(items):
    total = 0
    count = 0
    for item in items:
        if item.price is None:
            continue
        total += item.price
        count += 1
    if count == 0:
        return 0.0
    return total / count
"""
TABLE = "name age city\nAlice 30 Paris\nBob 25 Lyon\nCarol 41 Nice\nDave 35 Lille\nEve 28 Nantes\n"
WORKLOADS = {
    "quote": f"Repeat the following paragraph word for word.\n\n{PARAGRAPH}",
    "code": f"Rename the variable `total` to `acc` in this function and print the whole function.\n\n{CODE}",
    "json": f"Convert this table to a JSON list of objects with the keys name, age and city.\n\n{TABLE}",
    "story": "Write a short story about a dragon who learns to sing.",
}


def chat_prompts(tokenizer, text: str, batch: int) -> list[list[int]]:
    """`batch` variants of the workload's prompt (a request number first: the same decode work)."""
    return [
        tokenizer.encode_chat([{"role": "user", "content": f"Request {i + 1}. {text}"}]) for i in range(batch)
    ]


def timed(engine, prompts, params) -> dict:
    """Runs the prompts together; returns their tokens, the decode's output tokens per second (from the
    first token of any to the last of all) and the mean TPOT of the requests."""
    ids = [engine.add_request(p, params) for p in prompts]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    done = set()
    while len(done) < len(ids):
        outputs = engine.step().tokens
        now = time.perf_counter()
        for output in outputs:
            tokens[output.request_id] += output.new_token_ids
            times[output.request_id] += [now] * len(output.new_token_ids)
            if output.finished:
                done.add(output.request_id)
    first, last = min(t[0] for t in times.values()), max(t[-1] for t in times.values())
    generated = sum(len(t) - 1 for t in tokens.values())  # after each request's first token
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return {
        "tokens": [tokens[rid] for rid in ids],
        "tokens_per_s": generated / (last - first),
        "tpot_ms": 1000 * sum(tpot) / len(tpot),
    }


def compare(engines: dict, prompts, params, rounds: int) -> dict:
    """The engines (by label; "off": the reference) on the same prompts: each warmed up on them once, then
    `rounds` interleaved runs; outputs checked equal token for token. Per label the median tokens/s and
    TPOT, and with speculation their ratios to "off", the mean accepted length and the draft acceptance
    rate over the rounds."""
    for engine in engines.values():
        timed(engine, prompts, params)  # warm-up (the cost policy learns this workload's steps)
    before = {label: e.scheduler.speculation.snapshot() for label, e in engines.items()}
    results: dict[str, list[dict]] = {label: [] for label in engines}
    for _ in range(rounds):  # interleaved: the machine's drift touches every engine alike
        for label, engine in engines.items():
            results[label].append(timed(engine, prompts, params))
    tokens = results["off"][0]["tokens"]
    assert all(r["tokens"] == tokens for runs in results.values() for r in runs), "outputs differ"
    row = {"output_tokens": sum(len(t) for t in tokens)}
    for label, engine in engines.items():
        row[f"tokens_per_s_{label}"] = statistics.median(r["tokens_per_s"] for r in results[label])
        row[f"tpot_ms_{label}"] = statistics.median(r["tpot_ms"] for r in results[label])
        if label == "off":
            continue
        now, then = engine.scheduler.speculation, before[label]
        verifying = now.num_drafts - then.num_drafts
        accepted = now.num_accepted_tokens - then.num_accepted_tokens
        drafted = now.num_draft_tokens - then.num_draft_tokens
        row[f"mean_accepted_length_{label}"] = 1 + accepted / verifying if verifying else 1.0
        row[f"draft_acceptance_rate_{label}"] = accepted / drafted if drafted else 0.0
        row[f"tokens_per_s_ratio_{label}"] = row[f"tokens_per_s_{label}"] / row["tokens_per_s_off"]
        row[f"tpot_ratio_{label}"] = row[f"tpot_ms_{label}"] / row["tpot_ms_off"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each engine (medians)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch, load_model
    from pdserve.engine.sampling_params import SamplingParams

    model = load_model(str(fetch(DEFAULT_MODEL, progress=False))).in_memory()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    base = EngineConfig(
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
    for engine in engines.values():
        engine.runner.warmup(progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    out = {"speculative_config": spec, "max_tokens": args.tokens, "rounds": args.rounds, "runs": []}
    for batch in args.batches:
        for name, text in WORKLOADS.items():
            prompts = chat_prompts(model.tokenizer, text, batch)
            row = {"workload": name, "batch": batch, **compare(engines, prompts, params, args.rounds)}
            print(json.dumps(row), flush=True)
            out["runs"].append(row)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
