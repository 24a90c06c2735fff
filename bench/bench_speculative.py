"""n-gram speculative decoding (`--speculative-config '{"method": "ngram", ...}'`) against decoding without
it, in one run, on the default model (its whole 30 layers, float32 weights on this CPU).

    .venv/bin/python bench/bench_speculative.py [--k 4] [--tokens 128] [--json OUT]

Four workloads, each a chat prompt to the instruct model, greedy:
- quote: repeat a paragraph word for word (a summary that quotes its source);
- code: a function with one variable renamed, printed whole (a code edit);
- json: a table turned into a JSON list (repetitive structure);
- story: a story from a one-line premise (little to look up: where speculation should not win).
At batch 1 and batch 8 (8 variants of the prompt decoding together), for each workload: output tokens per
second over the decode (first token to last), TPOT (the mean gap between a request's tokens), the ratio
of each with speculation to without, the mean accepted length (tokens a verifying row emits) and the
share of drafts accepted. Both engines warm up on the workload first (every shape compiled), and the
outputs are checked equal token for token (greedy: speculation changes no token).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
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
    base = EngineConfig(num_blocks=512, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256)
    engines = {
        "off": LLMEngine(model, base),
        "ngram": LLMEngine(model, dataclasses.replace(base, speculative_config=json.dumps(spec))),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    out = {"speculative_config": spec, "max_tokens": args.tokens, "runs": []}
    for batch in args.batches:
        for name, text in WORKLOADS.items():
            prompts = chat_prompts(model.tokenizer, text, batch)
            row = {"workload": name, "batch": batch}
            results = {}
            for label, engine in engines.items():
                timed(engine, prompts, params)  # warm-up: every shape of this workload compiled
                stats = engine.scheduler.speculation.snapshot()
                results[label] = timed(engine, prompts, params)
                now = engine.scheduler.speculation
                if label == "ngram":
                    rows = now.num_drafts - stats.num_drafts
                    accepted = now.num_accepted_tokens - stats.num_accepted_tokens
                    row["mean_accepted_length"] = 1 + accepted / rows if rows else 1.0
                    drafted = now.num_draft_tokens - stats.num_draft_tokens
                    row["draft_acceptance_rate"] = accepted / drafted if drafted else 0.0
            assert results["ngram"]["tokens"] == results["off"]["tokens"], f"{name}: outputs differ"
            row["output_tokens"] = sum(len(t) for t in results["off"]["tokens"])
            for label in engines:
                row[f"tokens_per_s_{label}"] = results[label]["tokens_per_s"]
                row[f"tpot_ms_{label}"] = results[label]["tpot_ms"]
            row["tokens_per_s_ratio"] = row["tokens_per_s_ngram"] / row["tokens_per_s_off"]
            row["tpot_ratio"] = row["tpot_ms_ngram"] / row["tpot_ms_off"]
            print(json.dumps(row), flush=True)
            out["runs"].append(row)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
