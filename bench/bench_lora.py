"""Decode throughput with 0, 1 and 4 LoRA adapters in the batch, against the same engine without LoRA.

    .venv/bin/python bench/bench_lora.py [--batch 32] [--rank 16] [--rounds 3] [--json OUT] [--smoke]

Two engines over the default model, measured in the same run and interleaved round by round (this
machine is shared and noisy; each figure is the best round): one with LoRA off (`max_loras=0`, the
reference), one with 4 adapter slots of the given rank holding 4 random rank-`rank` adapters on every
target module. Prints tokens/s and each LoRA figure as a ratio to the reference, plus prefill of 512
tokens with and without an adapter. --smoke: the test model, batch 2, rank 4, one round of 2 steps.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from pdserve.bench.common import best_of, ratio, report
from pdserve.bench.engine_timing import pdserve_decode_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="the test model, tiny sizes, one round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.rank, args.steps, args.rounds = 2, 4, 2, 1

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model
    from pdserve.testing.lora import write_random_adapter
    from pdserve.testing.models import small_model

    model = load_model(str(small_model()) if args.smoke else None)
    prompt_len = 64 if args.smoke else 512
    base = EngineConfig(
        num_blocks=128 if args.smoke else 1024,
        max_model_len=1024,
        max_num_seqs=args.batch,
        max_num_batched_tokens=prompt_len,
    )
    off = LLMEngine(model, base)
    lora = LLMEngine(model, EngineConfig(**{**base.__dict__, "max_loras": 4, "max_lora_rank": args.rank}))
    names = [f"adapter{i}" for i in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            lora.loras.load(
                name, str(write_random_adapter(Path(tmp) / name, model.config, rank=args.rank, seed=i))
            )
    cases = {
        "lora_off": (off, None),
        "0_adapters": (lora, None),
        "1_adapter": (lora, names[:1]),
        "4_adapters": (lora, names),
    }
    for engine, adapters in cases.values():  # compile the decode and prefill shapes used below
        pdserve_decode_step(engine, args.batch, 2, adapters)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for case, (engine, adapters) in cases.items():
            step = pdserve_decode_step(engine, args.batch, args.steps, adapters)
            best[case] = min(best.get(case, step), step)
    tokens_s = {case: args.batch / s for case, s in best.items()}
    prompt = np.random.default_rng(0).integers(100, 40000, prompt_len).tolist()
    prefill = {
        "lora_off": best_of(lambda: off.prompt_logits(prompt), args.rounds + 1),
        "with_adapter": best_of(lambda: lora.prompt_logits(prompt, names[0]), args.rounds + 1),
    }
    result = {
        "batch": args.batch,
        "rank": args.rank,
        "slots": 4,
        "decode_tokens_s": tokens_s,
        "decode_vs_lora_off": {
            c: ratio(t, tokens_s["lora_off"]) for c, t in tokens_s.items() if c != "lora_off"
        },
        f"prefill_{prompt_len}_s": prefill,
        "prefill_with_adapter_vs_lora_off": ratio(prefill["lora_off"], prefill["with_adapter"]),
        "slot_bytes": sum(x.nbytes for x in lora.lora_slots.weights.__dict__.values()),
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
