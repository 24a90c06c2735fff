"""Random Llama checkpoints at a chosen size, and a probe of what loading one costs the host.

`write_random_llama(folder, ...)` writes a Llama-architecture Hugging Face folder of random bfloat16 weights
in several safetensors shards with an index, as large checkpoints come (no tokenizer: callers feed token
ids). `python -m pdserve.testing.load_probe FOLDER` loads it into an engine in a fresh process and prints
one JSON line of what that cost (tests/engine/test_streaming_load.py, bench/bench_load.py):

  rss_before      resident bytes once JAX is up, before the checkpoint is opened (/proc/self/status VmRSS)
  rss_peak        the process's high-water mark of resident bytes, after the load (VmHWM)
  rss_loaded      resident bytes once the engine is built
  rss_serving     resident bytes after the engine has run a prefill
  step_temp_bytes the largest step's temporaries (XLA's memory analysis; engine.memory)
  traced_peak     the largest amount of Python/numpy memory held at once during the load (tracemalloc:
                  numpy reports its allocations to it; XLA's device buffers are not traced)
  traced_after    Python/numpy memory allocated during the load and still held once the engine is built (a
                  host copy of the weights left behind shows here)
  load_seconds    building the engine (weights streamed to the devices, the cache allocated)
  checkpoint_bytes, weight_bytes (on the devices), kv_bytes; first_token and logits_finite: of a fixed
                  prompt's prefill through the compiled step
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

PROBE_PROMPT = [1, 5, 9, 2, 7, 3, 11, 4]


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }


def write_random_llama(folder: Path, shards: int = 3, seed: int = 0, **sizes: int) -> int:
    """Writes config.json, `shards` bfloat16 safetensors files and their index; returns the tensors'
    bytes. `sizes`: llama_config's (hidden, intermediate, layers, heads, kv_heads, vocab)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    config = llama_config(**sizes)
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (config["intermediate_size"], hidden),
                p + "mlp.up_proj.weight": (config["intermediate_size"], hidden),
                p + "mlp.down_proj.weight": (hidden, config["intermediate_size"]),
            }
        )
    shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    names = list(shapes)
    per_shard = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for name in names[s * per_shard : (s + 1) * per_shard]:
            shape = shapes[name]
            if name.endswith("norm.weight"):
                w = 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
            else:
                w = rng.standard_normal(shape, np.float32) * (0.5 / math.sqrt(shape[-1]))
            tensors[name] = w.astype(ml_dtypes.bfloat16)
            weight_map[name] = file
            total += tensors[name].nbytes
        save_file(tensors, str(folder / file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def probe(folder: Path, dtype: str, num_blocks: int) -> dict:
    """Loads `folder` into an engine of `dtype` and `num_blocks` KV blocks and prefills a prompt; what it
    cost (the module's docstring)."""
    import gc
    import time
    import tracemalloc

    import jax

    from pdserve.engine.compilation import step_temp_bytes
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.checkpoints import SafetensorsCheckpoint
    from pdserve.engine.loading.sources import LoadedModel
    from pdserve.engine.memory import resident_bytes
    from pdserve.engine.model.weights import weight_bytes

    jax.devices()
    rss_before = resident_bytes("VmRSS")
    tracemalloc.start()
    start = time.perf_counter()
    checkpoint = SafetensorsCheckpoint(folder)
    model = LoadedModel(checkpoint.config, checkpoint, None, folder)
    config = EngineConfig(
        num_blocks=num_blocks, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, dtype=dtype
    )
    engine = LLMEngine(model, config)
    load_seconds = time.perf_counter() - start
    rss_peak = resident_bytes("VmHWM")
    gc.collect()
    traced_after, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()  # (tracing slows the steps; the load is what it watches)
    rss_loaded = resident_bytes("VmRSS")
    runner = engine.runner
    temp = step_temp_bytes(runner.model, runner.config, runner.mesh, runner.weights, None, runner.attention)
    logits = engine.prompt_logits(PROBE_PROMPT)  # a prefill through the compiled step
    return {
        "rss_before": rss_before,
        "rss_peak": rss_peak,
        "rss_loaded": rss_loaded,
        "step_temp_bytes": temp,
        "rss_serving": resident_bytes("VmRSS"),
        "traced_peak": traced_peak,
        "traced_after": traced_after,
        "load_seconds": load_seconds,
        "checkpoint_bytes": checkpoint.nbytes,
        "weight_bytes": weight_bytes(engine.runner.weights),
        "kv_bytes": engine.runner.cache.nbytes,
        "first_token": int(np.argmax(logits)),
        "logits_finite": bool(np.all(np.isfinite(logits))),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--compile-cache", action="store_true", help="pdserve's, as its daemons use it")
    args = parser.parse_args(argv)
    if args.compile_cache:
        from pdserve.engine.compile_cache import configure_jax

        configure_jax()
    print(json.dumps(probe(args.folder, args.dtype, args.num_blocks)), file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
