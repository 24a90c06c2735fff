"""Engine speed against HF transformers and against the machine, measured in one run.

    .venv/bin/python bench/bench_engine.py [--quick] [--no-hf] [--json OUT] [--smoke]

Prints absolute figures and the ratios the serving-core issue sets targets for:
  prefill of 512 tokens vs HF (>= 1.3x), decode batch 1 vs HF batch 1 (>= 2x), decode batch 32 tokens/s
  vs HF batch 1 (>= 20x); prefill FLOP/s vs a large float32 matmul (aim >= 80%); decode batch-1 weight
  bytes/s vs measured memory bandwidth (aim >= 70%); start-up time and peak memory; and each batch's decode
  step against its matrix products alone, in XLA and in torch on the same weights (where XLA:CPU is the
  wall: step_products). --smoke: the test
model, no transformers, no warmup, batches 1 and 2, 2 steps, a 64-token prompt, small machine probes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pdserve.bench.common import best_of, peak_rss_gib, ratio, report
from pdserve.bench.engine_timing import pdserve_decode_step


def machine_matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    return 2 * n**3 / best_of(lambda: f(a).block_until_ready(), repeats)


def machine_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by np.copyto of `mib` MiB."""
    src = np.ones(mib << 18, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return 2 * src.nbytes / best_of(lambda: np.copyto(dst, src), repeats)


def hf_figures(gguf, prompt_len: int, decode_steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.randint(100, 40000, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :16])
        prefill = best_of(lambda: model(ids), 3)
        out = model(ids[:, :32], use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode = (time.perf_counter() - t0) / decode_steps
    return {"prefill_s": prefill, "decode_step_s": decode}


def step_products(engine, decode: dict[int, float], rounds: int) -> dict:
    """Each batch's decode step against its matrix products alone, in XLA (as the step computes them) and
    in torch (oneDNN: vLLM's CPU kernels) on the same weights and dtype: the products' share of the step,
    XLA's time over torch's, the step as it would be with torch's products, and XLA's products with the
    weights as the engine holds them (per layer on a CPU) over the same products on stacked weights
    (pdserve.bench.products)."""
    import importlib.util
    import os

    from pdserve.bench.products import torch_products, xla_products
    from pdserve.engine.config import bucket_for

    weights, cfg = engine.runner.weights, engine.model.config
    if engine.config.quantization == "int8" or importlib.util.find_spec("torch") is None:
        return {"skipped": "int8 weights, or torch (the reference extra) not installed"}
    out = {}
    for b, step in decode.items():
        rows = bucket_for(b, engine.config.token_buckets)  # the step's rows: its batch padded to a bucket
        xla = xla_products(weights, cfg, rows, rounds)  # as the step holds them: per layer on a CPU
        stacked = xla_products(weights, cfg, rows, rounds, stacked=True)
        torch_s = torch_products(weights, cfg, rows, rounds, threads=os.cpu_count() or 1)
        out[str(b)] = {
            "rows": rows,
            "step_s": step,
            "xla_products_s": xla,
            "xla_stacked_products_s": stacked,  # each layer's slice of a stacked matrix copied before its dot
            "torch_products_s": torch_s,
            "xla_products_share_of_step": ratio(xla, step),
            "as_held_over_stacked": ratio(xla, stacked),
            "xla_over_torch": ratio(xla, torch_s),
            "step_with_torch_products_s": step - xla + torch_s,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--smoke", action="store_true", help="the test model, tiny sizes, no transformers")
    args = parser.parse_args(argv)
    steps = 2 if args.smoke else 8 if args.quick else 24
    prompt_len = 64 if args.smoke else 512
    if args.smoke:
        args.no_hf, args.batches = True, "1,2"

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model.weights import weight_bytes
    from pdserve.testing.models import bench_model

    gguf = bench_model(args.smoke)
    batches = [int(b) for b in args.batches.split(",")]
    config = EngineConfig(
        num_blocks=128 if args.smoke else 1024,
        max_model_len=1024,
        max_num_seqs=max(batches),
        max_num_batched_tokens=prompt_len,
    )
    t0 = time.perf_counter()
    engine = LLMEngine.from_model(str(gguf), config, warmup=False)
    loaded = time.perf_counter()
    variants = None if args.smoke else engine.runner.warmup(progress=False)  # smoke: shapes on first use
    warm = time.perf_counter()
    result = {
        "startup": {"load_s": loaded - t0, "warmup_s": warm - loaded, "compiled_variants": variants},
        "machine": {
            "matmul_flops": machine_matmul_flops(256) if args.smoke else machine_matmul_flops(),
            "bandwidth_bytes_s": machine_bandwidth(16) if args.smoke else machine_bandwidth(),
        },
    }
    prompt = np.random.default_rng(0).integers(100, 40000, prompt_len).tolist()
    prefill_s = best_of(lambda: engine.prompt_logits(prompt), 3)
    cfg = engine.model.config
    matmul_params = cfg.num_layers * (
        cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    prefill_flops = 2 * matmul_params * prompt_len + 2 * cfg.hidden_size * cfg.vocab_size
    decode = {b: pdserve_decode_step(engine, b, steps) for b in batches}
    result["pdserve"] = {
        f"prefill_{prompt_len}_s": prefill_s,
        "prefill_flops": prefill_flops / prefill_s,
        "decode_step_s": {str(b): s for b, s in decode.items()},
        "decode_tokens_s": {str(b): b / s for b, s in decode.items()},
        "weight_bytes": weight_bytes(engine.runner.weights),
    }
    m, p = result["machine"], result["pdserve"]
    ratios = {
        "prefill_flops_vs_matmul": ratio(p["prefill_flops"], m["matmul_flops"]),
        "decode_b1_weight_bandwidth_vs_copy": ratio(p["weight_bytes"] / decode[1], m["bandwidth_bytes_s"])
        if 1 in decode
        else None,
    }
    if not args.no_hf:
        hf = hf_figures(gguf, 512, steps)
        result["hf"] = hf
        ratios["prefill_512_speedup_vs_hf"] = ratio(hf["prefill_s"], prefill_s)
        if 1 in decode:
            ratios["decode_b1_speedup_vs_hf_b1"] = ratio(hf["decode_step_s"], decode[1])
        for b in batches:
            ratios[f"decode_b{b}_tokens_s_vs_hf_b1"] = ratio(b / decode[b], 1 / hf["decode_step_s"])
    result["products"] = step_products(engine, decode, 1 if args.smoke else 5)
    result["ratios"] = ratios
    result["peak_rss_gib"] = peak_rss_gib()
    report(result, args.json)


if __name__ == "__main__":
    main()
