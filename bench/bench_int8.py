"""Weight-only int8 (`--quantization int8`: per output channel, symmetric) against float32 and bfloat16
weights: accuracy, decode speed, and what XLA makes of the int8 matmul on this machine.

    .venv/bin/python bench/bench_int8.py [--layers 8] [--steps 16] [--json OUT] [--smoke]

1. The default model (its whole 30 layers), one engine per weight format (float32; bfloat16 weights and
   cache; int8 projections with float32 activations and cache), on the reference fixtures' prompts (the
   parity prompts of tests/engine/test_reference.py): greedy agreement with float32 over 32 tokens, and
   the largest difference of the last position's log probabilities over float32's 10 likeliest tokens;
   the weights' bytes on the devices; decode tokens/s at batch 1 and 32, against float32's.
2. What XLA does: a stack of `--layers` MLP layers of TinyLlama-1.1B's shapes (hidden 2048, intermediate
   5632) scanned as engine.model.forward scans its layers, compiled three ways: float32 weights,
   bfloat16 weights (computed in float32, as on CPU), and int8 weights with their scales, dequantized in
   the matmul (engine.model.projection.project). For each: the weights' bytes, XLA's temporary bytes for a
   step (its memory analysis), whether a convert of the whole stack appears in the compiled module, and
   steps per second at 1 and 32 tokens. Temporaries near one layer's expanded weights mean the int8 path
   expands a layer at a time inside the loop; near the whole stack, that XLA expands every layer at once.

--smoke: the test model, float32 and int8 only, 2 short prompts, 4 tokens, batches 1 and 2, 2 steps; a
2-layer MLP stack of hidden size 64 timed for a tenth of a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from pdserve.bench.common import ratio, report
from pdserve.bench.engine_timing import decode_step_times

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures/reference_smollm2.npz"  # the reference prompts (data, not code)


def engines_compared(steps: int, smoke: bool = False) -> dict:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model
    from pdserve.engine.model.weights import weight_bytes
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.testing.models import bench_model

    data = np.load(FIXTURES)
    prompts = [data[k].tolist() for k in sorted(data.files) if k.startswith("prompt_")]
    model = load_model(str(bench_model(smoke))).in_memory()
    batches = (1, 2) if smoke else (1, 32)
    base = EngineConfig(
        num_blocks=128 if smoke else 512,
        max_model_len=1024,
        max_num_seqs=max(batches),
        max_num_batched_tokens=512,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=4 if smoke else 32, ignore_eos=True)
    formats = {
        "float32": base,
        "bfloat16": dataclasses.replace(base, dtype="bfloat16"),
        "int8": dataclasses.replace(base, quantization="int8"),
    }
    if smoke:
        prompts = sorted(prompts, key=len)[:2]
        del formats["bfloat16"]
    out, reference = {}, None
    for name, config in formats.items():
        engine = LLMEngine(model, config)
        tokens = [r.token_ids for r in engine.generate(prompts, greedy)]
        logprobs = [x - np.logaddexp.reduce(x) for x in (engine.prompt_logits(p) for p in prompts)]
        row = {"weights_bytes": weight_bytes(engine.runner.weights)}
        for batch in batches:
            times = decode_step_times(engine, batch, steps)
            row[f"decode_tokens_per_s_b{batch}"] = batch * len(times) / sum(times[1:] + times[:1])
        if reference is None:
            reference = tokens, logprobs
        else:
            row["greedy_tokens_equal_before_first_difference"] = [
                next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                for x, y in zip(reference[0], tokens, strict=True)
            ]
            top = [np.argsort(x)[-10:] for x in reference[1]]
            row["max_top10_logprob_diff"] = max(
                float(np.max(np.abs(a[t] - b[t])))
                for a, b, t in zip(reference[1], logprobs, top, strict=True)
            )
        out[name] = row
        del engine
    for row in out.values():
        row["weights_vs_float32"] = ratio(row["weights_bytes"], out["float32"]["weights_bytes"])
        for batch in batches:
            key = f"decode_tokens_per_s_b{batch}"
            row[f"decode_b{batch}_vs_float32"] = ratio(row[key], out["float32"][key])
    return out


def xla(layers: int, hidden: int = 2048, inter: int = 5632, seconds: float = 2.0) -> dict:
    import jax
    import jax.numpy as jnp

    from pdserve.engine.model.projection import project
    from pdserve.engine.model.quantized import Int8Weight, quantize

    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((layers, hidden, 2 * inter), np.float32) * 0.02
    down = rng.standard_normal((layers, inter, hidden), np.float32) * 0.02

    def mlp(dequantize):
        def step(x, stack):
            def layer(h, w):
                g, u = jnp.split(dequantize(h, w, "gate_up"), 2, axis=-1)
                return h + dequantize(jax.nn.silu(g) * u, w, "down"), None

            return jax.lax.scan(layer, x, stack)[0]

        return jax.jit(step)

    def plain(h, w, name):
        return h @ w[name].astype(jnp.float32)

    def int8(h, w, name):
        return project("td,di->ti", h, w[name])

    variants = {
        "float32": (plain, {"gate_up": gate_up, "down": down}),
        "bfloat16": (plain, {"gate_up": gate_up.astype(jnp.bfloat16), "down": down.astype(jnp.bfloat16)}),
        "int8": (int8, {"gate_up": Int8Weight(*quantize(gate_up)), "down": Int8Weight(*quantize(down))}),
    }
    out = {}
    for name, (dequantize, stack) in variants.items():
        stack = jax.device_put(stack)
        fn = mlp(dequantize)
        row = {"weights_bytes": sum(a.nbytes for a in jax.tree.leaves(stack))}
        for tokens in (1, 32):
            x = jnp.ones((tokens, hidden), jnp.float32)
            compiled = fn.lower(x, stack).compile()
            if tokens == 32:
                row["step_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
                row["converts_hoisted_out_of_the_loop"] = _hoisted(compiled.as_text(), layers)
            compiled(x, stack).block_until_ready()
            runs, start = 0, time.perf_counter()
            while runs < 5 or time.perf_counter() - start < seconds:
                compiled(x, stack).block_until_ready()
                runs += 1
            row[f"steps_per_s_t{tokens}"] = runs / (time.perf_counter() - start)
        out[name] = row
        del stack
    f32 = out["float32"]
    for row in out.values():
        row["weights_vs_float32"] = ratio(row["weights_bytes"], f32["weights_bytes"])
        row["temp_vs_float32_weights"] = ratio(row["step_temp_bytes"], f32["weights_bytes"])
        for tokens in (1, 32):
            row[f"speed_vs_float32_t{tokens}"] = ratio(
                row[f"steps_per_s_t{tokens}"], f32[f"steps_per_s_t{tokens}"]
            )
    return out


def _hoisted(hlo: str, layers: int) -> bool:
    """Whether the compiled module converts a whole stack (a leading dimension of `layers`) to f32: the
    expanded weights of every layer exist at once."""
    return any(f"f32[{layers}," in line and "convert" in line for line in hlo.splitlines())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="the test model and tiny sizes")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.steps = 2, 2
    mlp = dict(hidden=64, inter=128, seconds=0.1) if args.smoke else {}
    result = {"default_model": engines_compared(args.steps, args.smoke), "xla_cpu": xla(args.layers, **mlp)}
    report(result, args.json)


if __name__ == "__main__":
    main()
