"""A quantized KV cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`, static scale 1.0; `int8`, a bfloat16
scale per token and head), and bfloat16 weights and cache (`--dtype bfloat16`: what `auto` serves on a CPU
with bfloat16 dot instructions), against float32 weights and cache, in one run, on the default model (its
whole 30 layers).

    .venv/bin/python bench/bench_kv_dtype.py [--variants float32,bfloat16,...] [--json OUT] [--smoke]

For each variant (VARIANTS; the first, float32, is the reference):
- KV bytes per token (every layer, scales included) and the transfer bytes of a 2,048-token prompt (the
  frames' payload);
- greedy agreement with the float32 cache over 128 tokens on the parity prompts (tests/fixtures/
  reference_smollm2.npz): free-running, the tokens equal before the first difference and the share of
  equal positions (one flipped near-tie sends the rest down another path); teacher-forced, the share of
  float32's greedy tokens that are also this cache's greedy choice given the same prefix;
- |delta logprob| of the float32 cache's greedy tokens, scored teacher-forced (prompt logprobs over the
  prompt and its float32 continuation): mean and max;
- the perplexity of the model over about 4,000 tokens of English text (this repository's README and
  docs/architecture.md, in windows of 1,024 tokens prefilled in chunks of 256, so later chunks read the
  earlier ones' KV from the cache), against float32's;
- decode tokens/s at batch 32 against float32's (the dequantize cost on this CPU).
A disaggregated run reads exactly what the colocated engine wrote (tests/services/test_disaggregated.py
checks it token for token), so these figures hold for both. --smoke: the test model, float32, int8 and
bfloat16, two
short prompts, 4 tokens, one window of 128 tokens, batch 2 for 2 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import numpy as np

from pdserve.bench.common import ratio, report
from pdserve.bench.engine_timing import decode_step_times

ROOT = Path(__file__).resolve().parents[1]
WINDOW, CHUNK, GREEDY_TOKENS = 1024, 256, 128
FIXTURES = ROOT / "tests/fixtures/reference_smollm2.npz"  # the reference prompts (data, not code)
VARIANTS = {  # name -> EngineConfig fields over float32 weights and cache
    "float32": {},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "int8": {"kv_cache_dtype": "int8"},
    "bfloat16": {"dtype": "bfloat16"},
}


def text_windows(tokenizer, window: int = WINDOW, count: int = 4) -> list[list[int]]:
    text = (ROOT / "README.md").read_text() + "\n" + (ROOT / "docs/architecture.md").read_text()
    ids = tokenizer.encode(text)
    return [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)][:count]


def scored(engine, prompts, params, ranks=None) -> list[list[float]]:
    """Each prompt's logprob of every token after the first (prompt logprobs, teacher-forced); `ranks`, a
    list, gets each prompt's ranks of those tokens (1: the model's greedy choice there)."""
    results = engine.generate(prompts, params)
    if ranks is not None:
        ranks.extend([lp.rank for lp in r.prompt_logprobs[1:]] for r in results)
    return [[lp.logprob for lp in r.prompt_logprobs[1:]] for r in results]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of VARIANTS, float32 first")
    parser.add_argument("--smoke", action="store_true", help="the test model, three variants, tiny sizes")
    args = parser.parse_args(argv)

    from pdserve import kvtransfer
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.testing.models import bench_model

    data = np.load(FIXTURES)
    prompts = [data[k].tolist() for k in sorted(data.files) if k.startswith("prompt_")]
    model = load_model(str(bench_model(args.smoke))).in_memory()
    windows = text_windows(model.tokenizer, 128, 1) if args.smoke else text_windows(model.tokenizer)
    batch, steps = (2, 2) if args.smoke else (32, 16)
    base = EngineConfig(
        dtype="float32",
        num_blocks=128 if args.smoke else 1024,
        max_model_len=2048,
        max_num_seqs=batch,
        max_num_batched_tokens=CHUNK,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=4 if args.smoke else GREEDY_TOKENS, ignore_eos=True)
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    names = ("float32", "int8", "bfloat16") if args.smoke else tuple(args.variants.split(","))
    if args.smoke:
        prompts = sorted(prompts, key=len)[:2]
    out, reference = {}, None
    for name in names:
        engine = LLMEngine(model, dataclasses.replace(base, **VARIANTS[name]))
        layout = engine.kv_layout
        layer_token_bytes = layout.block_bytes // layout.block_size  # one token of one layer
        plan = kvtransfer.plan_frames(layout, 2048, kvtransfer.MAX_FRAME_BYTES)
        tokens = [r.token_ids for r in engine.generate(prompts, greedy)]
        window_lps = scored(engine, windows, score)
        perplexity = math.exp(-np.mean(np.concatenate(window_lps)))
        row = {
            "cache_dtype": layout.dtype,
            "kv_bytes_per_token": layer_token_bytes * layout.num_cache_layers,
            "transfer_bytes_2048_tokens": layer_token_bytes * sum(p.num_tokens * p.num_layers for p in plan),
            "perplexity": perplexity,
        }
        times = decode_step_times(engine, batch, steps)
        row[f"decode_tokens_per_s_b{batch}"] = batch * len(times) / sum(times)
        if reference is None:
            reference = {"tokens": tokens, "perplexity": perplexity, "row": row}
            continuations = [p + t for p, t in zip(prompts, tokens, strict=True)]
            reference["scores"] = scored(engine, continuations, score)
        else:
            ref_tokens = reference["tokens"]
            row["greedy_equal_before_first_difference"] = [
                next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                for x, y in zip(ref_tokens, tokens, strict=True)
            ]
            equal = sum(
                a == b for x, y in zip(ref_tokens, tokens, strict=True) for a, b in zip(x, y, strict=True)
            )
            row["greedy_position_agreement"] = equal / sum(len(x) for x in ref_tokens)
            continuations = [p + t for p, t in zip(prompts, ref_tokens, strict=True)]
            ranks = []
            mine = scored(engine, continuations, score, ranks)
            chosen_ranks = np.concatenate([r[len(p) - 1 :] for r, p in zip(ranks, prompts, strict=True)])
            row["teacher_forced_greedy_agreement"] = float(np.mean(chosen_ranks == 1))
            deltas = np.concatenate(
                [
                    np.abs(np.asarray(a[len(p) - 1 :]) - np.asarray(b[len(p) - 1 :]))
                    for a, b, p in zip(mine, reference["scores"], prompts, strict=True)
                ]
            )
            row["chosen_logprob_delta_mean"] = float(deltas.mean())
            row["chosen_logprob_delta_max"] = float(deltas.max())
            row["perplexity_vs_float32"] = ratio(perplexity, reference["perplexity"])
            for key in ("kv_bytes_per_token", "transfer_bytes_2048_tokens", f"decode_tokens_per_s_b{batch}"):
                row[f"{key}_vs_float32"] = ratio(row[key], reference["row"][key])
        out[name] = row
        del engine
    out["text_tokens_scored"] = sum(len(w) - 1 for w in windows)
    report(out, args.json)


if __name__ == "__main__":
    main()
