"""Model families against transformers on the same tiny random-weight checkpoints, and the KV bytes each
family's layout moves per token, measured in one run.

    .venv/bin/python bench/bench_families.py [--families qwen3,gemma3,...] [--steps 16] [--json OUT] [--smoke]

Per family (the checkpoints of testing.families, written by transformers: hidden 64, 2-3 layers, so the
figures measure each implementation's per-token overheads more than its arithmetic), in float32 on CPU:
  * prefill of 512 tokens, best of 3: pdserve (engine.prompt_logits) and transformers (one forward);
  * decode tokens/s at batch 1 and 32 (prompts of 32 tokens, greedy): pdserve's mean engine step and
    transformers' mean step with its KV cache (a batch of 32 prompts of equal length, no padding);
  * ratios pdserve / transformers of each;
  * KV bytes per token a prefill server sends for a 2048-token prompt (kvtransfer's frame plan of the
    family's layout, payload without bucket padding) against full attention with the same heads (the
    same model with every layer full; MLA: the K and V that its heads would hold expanded).
And, for Gemma 3 4B's layer pattern (34 layers, every sixth full, window 1024, block 16, the default
512-token budget), the layer-blocks of cache a request of 1k..32k tokens holds through pdserve's KV cache
manager: hybrid layer groups sharing rows (engine.core.kv_groups) against one table for every layer.
--smoke: qwen3 only, batches 1 and 2, 2 decode steps, no warmup.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from pdserve.bench.common import best_of, ratio, report
from pdserve.bench.engine_timing import pdserve_decode_step

PROMPT, TRANSFER_TOKENS = 512, 2048


def hf_decode_step(model, batch: int, steps: int, vocab: int) -> float:
    """Mean seconds per greedy step of transformers with its cache, `batch` prompts of 32 tokens."""
    import torch

    ids = torch.randint(0, vocab, (batch, 32), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / steps


def kv_bytes_per_token(engine, num_tokens: int) -> dict:
    """Payload bytes per prompt token of the family's transfer, and of full attention with its heads."""
    import dataclasses

    from pdserve.kvtransfer import KVLayout, LayerSpec, SpecKind, plan_frames

    layout = engine.kv_layout
    sent = sum(f.num_layers * f.num_blocks for f in plan_frames(layout, num_tokens)) * layout.block_bytes
    cfg = engine.model.config
    if layout.is_mla:  # K and V of every head, as a non-latent cache would hold them
        full = KVLayout(
            layout.model,
            (LayerSpec(),) * cfg.num_layers,
            cfg.num_heads,
            cfg.head_dim,
            layout.dtype,
            layout.block_size,
        )
    else:
        full = dataclasses.replace(layout, layer_specs=(LayerSpec(SpecKind.FULL),) * cfg.num_layers)
    full_bytes = -(-num_tokens // full.block_size) * full.num_cache_layers * full.block_bytes
    return {"bytes_per_token": sent / num_tokens, "full_attention_bytes_per_token": full_bytes / num_tokens}


def hybrid_cache_layer_blocks(lengths=(1024, 4096, 32768)) -> dict:
    """Gemma 3 4B's layer-blocks held per request length: (blocks in use x cache rows) with its layer
    groups, and (blocks x layers) with one table, as the KV cache manager allocates them."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.core.kv_cache_manager import KVCacheManager
    from pdserve.engine.core.kv_groups import KVGroups

    sizes = dict(vocab_size=8, hidden_size=8, intermediate_size=4, num_heads=8, num_kv_heads=4, head_dim=256)
    windows = tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34))
    model = ModelConfig(
        "gemma3", **sizes, num_layers=34, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=131072, tie_word_embeddings=True, layer_windows=windows,
    )  # fmt: skip
    groups = KVGroups.of(model)
    out = {}
    for n in lengths:
        hybrid = KVCacheManager(1 << 16, 16, ring_blocks=groups.ring_blocks(16, 512))
        one = KVCacheManager(1 << 16, 16)
        assert hybrid.allocate("r", n) and one.allocate("r", n)
        held, before = hybrid.pool.num_used * groups.num_rows, one.pool.num_used * model.num_layers
        out[n] = {"groups": held, "one_table": before, "ratio": ratio(before, held)}
    return out


def measure(family: str, steps: int, tokenizer, vocab: int, batches=(1, 32), warmup: bool = True) -> dict:
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.testing.families import engine_of, write_family

    with tempfile.TemporaryDirectory() as tmp:
        model = write_family(family, Path(tmp), vocab)
        config = EngineConfig(
            num_blocks=1024, max_model_len=1024, max_num_seqs=max(batches), max_num_batched_tokens=512
        )
        engine = engine_of(Path(tmp), tokenizer, config)
    if warmup:
        engine.runner.warmup(progress=False)
    prompt = np.random.default_rng(0).integers(0, vocab, PROMPT).tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf_prefill = best_of(lambda: model(ids), 3)
    pd_prefill = best_of(lambda: engine.prompt_logits(prompt), 3)
    result = {"prefill_512_s": {"pdserve": pd_prefill, "transformers": hf_prefill}}
    for batch in batches:
        pd = pdserve_decode_step(engine, batch, steps)
        hf = hf_decode_step(model, batch, steps, vocab)
        result[f"decode_b{batch}_tokens_s"] = {"pdserve": batch / pd, "transformers": batch / hf}
    result["ratios_pdserve_vs_transformers"] = {
        "prefill_512": ratio(hf_prefill, pd_prefill),
        **{
            f"decode_b{b}": ratio(
                result[f"decode_b{b}_tokens_s"]["pdserve"], result[f"decode_b{b}_tokens_s"]["transformers"]
            )
            for b in batches
        },
    }
    result["kv_transfer"] = kv_bytes_per_token(engine, TRANSFER_TOKENS)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="qwen3,gemma3,gemma2,qwen3_moe,mixtral,deepseek_v2")
    parser.add_argument("--steps", type=int, default=16, help="decode steps measured per batch size")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="qwen3, batches 1 and 2, 2 steps, no warmup")
    args = parser.parse_args(argv)
    batches = (1, 2) if args.smoke else (1, 32)
    if args.smoke:
        args.families, args.steps = "qwen3", 2

    from pdserve.engine.loading.sources import load_model
    from pdserve.testing.models import bench_model

    # its tokenizer and vocabulary (the tiny checkpoints have none); the test model has the same ones
    default = load_model(str(bench_model(args.smoke)))
    results = {
        family: measure(
            family, args.steps, default.tokenizer, default.config.vocab_size, batches, warmup=not args.smoke
        )
        for family in args.families.split(",")
    }
    results["gemma3_4b_cache_layer_blocks"] = hybrid_cache_layer_blocks()
    report(results, args.json)


if __name__ == "__main__":
    main()
