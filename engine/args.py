"""The engine's command-line flags and what they build: one place for `pdserve generate` and every daemon.

`add_engine_args` declares the flags, `engine_config` turns them into an `EngineConfig`, `load_adapters`
loads the `--lora` adapters into a built engine, `configure_jax` points XLA at the persistent
compilation cache. The command line (pdserve/cli.py) and the daemons (pdserve/daemons.py) both call
down into this module; nothing here imports either of them.
"""

from __future__ import annotations

import argparse

from pdserve.engine.config import DTYPES, EngineConfig
from pdserve.engine.loading.sources import DEFAULT_MODEL, cache_dir


def configure_jax() -> None:
    """Persistent XLA compilation cache under the cache folder: later start-ups load every executable
    instead of compiling it. Every one is kept, however fast it compiled (the default model's 140 take
    about 6 MB): with JAX's 0.5 s threshold a restart still compiled 55 of them (warmup 58.5 s instead
    of 46 s, BENCHMARKS.md)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file, HF folder or known name")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--max-num-batched-tokens",
        "--max-prefill-tokens",  # its name before steps mixed decode tokens and prefill chunks
        type=int,
        default=512,
        help="token budget of one step: every running request's decode token, then prefill chunks; a "
        "smaller budget bounds how long a long prompt delays running requests, a larger one prefills faster",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights and KV cache (auto: bfloat16 on TPUs and GPUs, float32 on CPUs)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt in full (default: reuse the KV of cached prompt prefixes)",
    )
    lora = parser.add_argument_group(
        "LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors)"
    )
    lora.add_argument(
        "--lora",
        action="append",
        default=[],
        type=lora_spec,
        metavar="NAME=PATH",
        help="load at start (repeatable)",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="adapter slots in device memory (default: 4 with --lora, else 0: off)",
    )
    lora.add_argument("--max-lora-rank", type=int, default=16, help="highest adapter rank served")


def lora_spec(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
    return name, path


def engine_config(args: argparse.Namespace) -> EngineConfig:
    max_loras = args.max_loras if args.max_loras is not None else (4 if args.lora else 0)
    return EngineConfig(
        tp=args.tp,
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_loras=max_loras,
        max_lora_rank=args.max_lora_rank,
        enable_prefix_caching=args.prefix_caching,
        dtype=args.dtype,
    )


def load_adapters(engine, specs: list[tuple[str, str]]) -> None:
    """Loads the --lora adapters into `engine`; exits naming the one that cannot be served."""
    from pdserve.engine.lora import LoraLoadError

    for name, path in specs:
        try:
            engine.loras.load(name, path)
        except LoraLoadError as e:
            raise SystemExit(f"error: --lora {name}: {e}") from e
