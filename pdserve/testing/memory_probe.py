"""Does an engine's memory plan hold? `python -m pdserve.testing.memory_probe FOLDER` builds an engine on a
model folder in a fresh process, sized from memory as a daemon is (no --num-blocks; with
`--gpu-memory-utilization F` or the CPU default; PDSERVE_AVAILABLE_RAM gives the RAM to size from), runs
its largest work (a prompt past the step's token budget with prompt logprobs, n sequences, decodes), and
prints one JSON line: the plan (engine.memory.MemoryPlan: its summary and planned bytes) and what the
process took beyond what it held before the engine (its resident high-water mark, /proc/self/status;
on an accelerator also the fullest device's peak bytes in use).
tests/services/test_memory_plan.py and bench/bench_memory_plan.py read it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def probe(
    folder: Path,
    fraction: float,
    dtype: str,
    n: int,
    step_tokens: int,
    max_num_seqs: int,
    kv_dtype: str = "auto",
) -> dict:
    import jax

    from pdserve.engine.config import EngineConfig, SizingError
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model
    from pdserve.engine.memory import resident_bytes
    from pdserve.engine.sampling_params import SamplingParams

    jax.devices()
    model = load_model(str(folder))
    rss_before = resident_bytes("VmRSS")
    try:
        config = EngineConfig(
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            gpu_memory_utilization=fraction,
            max_num_batched_tokens=step_tokens,
            max_num_seqs=max_num_seqs,
        )
        engine = LLMEngine(model, config)
    except SizingError as e:
        return {"refused": str(e)}
    plan = engine.runner.memory
    budget = engine.config.max_num_batched_tokens
    prompt = [(7 * i) % 1000 + 3 for i in range(min(budget + budget // 2, engine.config.max_model_len - 8))]
    params = SamplingParams(n=n, max_tokens=4, temperature=1.0, seed=0, ignore_eos=True, prompt_logprobs=2)
    (first, *_) = engine.generate([prompt], params)
    device = {}
    if plan.platform != "cpu":  # the devices' own accounting: the fullest device's peak and limit
        stats = [d.memory_stats() or {} for d in engine.mesh.devices.flat]
        device = {
            "device_peak_bytes": max(s.get("peak_bytes_in_use", 0) for s in stats),
            "device_limit_bytes": min(s.get("bytes_limit", 0) for s in stats),
        }
    return {
        **device,
        "summary": plan.summary(),
        "planned_bytes": plan.planned_bytes,
        "budget_bytes": plan.budget_bytes,
        "rss_before": rss_before,
        "peak_growth": resident_bytes("VmHWM") - rss_before,
        "finish_reason": first.finish_reason,
        "num_tokens": len(first.token_ids),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="the largest step's tokens")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args(argv)
    result = probe(
        args.folder,
        args.gpu_memory_utilization,
        args.dtype,
        args.n,
        args.max_num_batched_tokens,
        args.max_num_seqs,
        args.kv_cache_dtype,
    )
    print(json.dumps(result), file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
