"""The engine's sizes: EngineConfig (the paged cache, the batches, dtypes, LoRA slots, the host tier,
speculation), whose `flag` fields are the engine's command-line flags (pdserve/flags.py derives them), the
compiled shape buckets (bucket_for), and SizingError for sizes that do not fit."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

from pdserve.engine.config.speculative import SpeculativeConfig


class SizingError(ValueError):
    """The asked sizes do not fit the model (a longer max_model_len than its context) or the devices'
    memory (engine.memory)."""


DTYPES = ("auto", "float32", "bfloat16")
# --kv-cache-dtype (vLLM's names) -> the cache's element type; "auto": the serving dtype. fp8 with a static
# scale of 1.0 per tensor (as tpu-inference serves it): K/V are saturated to the type's range when written.
# int8 with a scale per token and head, stored beside the values (kvtransfer.layout.SCALE_SCHEMES).
KV_CACHE_DTYPES = {
    "auto": "", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8"
}  # fmt: skip
QUANTIZATIONS = ("none", "int8")  # EngineConfig.quantization (engine.model.quantized)
# What --dtype auto means on a CPU, where set (float32 or bfloat16): the tests set float32, their references'
# dtype, so that no test's outcome depends on the CPU it runs on. Unset: cpu_auto_dtype().
CPU_DTYPE_ENV = "PDSERVE_CPU_DTYPE"
# /proc/cpuinfo flags of CPUs with bfloat16 dot-product instructions (x86: AVX512-BF16, AMX; Arm: BF16)
BFLOAT16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@functools.lru_cache(maxsize=1)
def cpu_has_bfloat16_dots() -> bool:
    """Whether this host's CPU has bfloat16 dot-product instructions (Linux /proc/cpuinfo's flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & BFLOAT16_CPU_FLAGS)


def cpu_auto_dtype() -> str:
    """--dtype auto on a CPU: $PDSERVE_CPU_DTYPE where set; else bfloat16 where the CPU has bfloat16 dot
    instructions and XLA:CPU uses them (jax 0.12 and newer: bfloat16 weights with float32 accumulation run
    the default model's decode step 1.5-1.6x faster than float32 there, BENCHMARKS.md), float32 elsewhere
    (jax 0.10's XLA:CPU converted bfloat16 weights to float32 in every step: 5-8x slower)."""
    given = os.environ.get(CPU_DTYPE_ENV)
    if given:
        if given not in DTYPES[1:]:
            raise ValueError(f"${CPU_DTYPE_ENV}={given!r}: one of {DTYPES[1:]}")
        return given
    import jax

    native = jax.__version_info__ >= (0, 12) and cpu_has_bfloat16_dots()
    return "bfloat16" if native else "float32"


# Steps of this many tokens and more also get a bucket halfway to the next power of two (384, 768, ...): a
# step pays for its bucket's tokens, and a mixed step of a 256-token chunk and a few decodes otherwise paid
# for 512 (a 300-token prefill: 0.82x the time with the 384 bucket, docs/benchmark-history.md). Not below:
# small steps cost little more than their fixed overhead, and each bucket is one more compiled shape.
HALF_STEPS_FROM = 256


def _step_buckets(start: int, stop: int) -> tuple[int, ...]:
    """start, 2*start, ... and from HALF_STEPS_FROM on 1.5 times each too, up to and including stop (stop
    itself is always the last bucket)."""
    out, value = [], start
    while value < stop:
        out.append(value)
        if value >= HALF_STEPS_FROM and value * 3 // 2 < stop:
            out.append(value * 3 // 2)
        value *= 2
    out.append(stop)
    return tuple(out)


def flag(default: Any, help: str, **argparse_options: Any) -> Any:  # noqa: A002 - argparse's word
    """A config field that is also a command-line flag (pdserve/flags.py derives it: --field-name, the
    field's type and this default, `help`); `argparse_options` adds e.g. `flag` (another name),
    `aliases`, `choices`, `metavar`."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_options})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the paged cache, the batches and the compiled shape buckets. Fields made with `flag` are
    the engine's command-line flags (the defaults live here only)."""

    block_size: int = 16
    num_blocks: int = flag(
        0, "KV cache blocks (of block_size tokens) in device memory (0: what --gpu-memory-utilization leaves)"
    )
    gpu_memory_utilization: float = flag(
        0.0,
        "fraction of each device's memory for the weights, the step's temporaries and the KV cache (0: "
        "0.9); on a CPU of the RAM available at start (0: the KV cache takes 0.1 of the RAM left after the "
        "weights and the step, so any model whose weights fit serves); unused with --num-blocks",
        aliases=("--memory-fraction",),
    )
    max_num_seqs: int = flag(32, "running requests decoded together")
    max_model_len: int = flag(
        0,
        "prompt + generated tokens of one request (0: the model's context, capped to what the KV cache "
        "holds)",
    )
    # The token budget of one step: every running request's decode token first, then prefill chunks up
    # to the budget. A long prompt delays running requests by at most one budget's compute per token.
    max_num_batched_tokens: int = flag(
        512,
        "token budget of one step: every running request's decode token, then prefill chunks; a smaller "
        "budget bounds how long a long prompt delays running requests, a larger one prefills faster",
        aliases=("--max-prefill-tokens",),  # its name before steps mixed decode tokens and prefill chunks
    )
    max_prefill_seqs: int = 4  # prompts being computed at once (chunks in one step)
    tp: int = flag(1, "tensor-parallel degree (devices)")
    dtype: str = flag(
        "auto",
        "weights and KV cache (auto: bfloat16 on TPUs and GPUs, and on CPUs with bfloat16 dot instructions; "
        "else float32)",
        choices=DTYPES,
    )
    kv_cache_dtype: str = flag(
        "auto",
        "the KV cache's element type, on both roles and on the wire (auto: --dtype's; fp8 = fp8_e4m3, "
        "fp8_e5m2: a quarter of float32's bytes and half of bfloat16's, with a static scale of 1.0; int8: "
        "the same plus a bfloat16 scale per token and KV head, the most accurate of the three)",
        choices=tuple(KV_CACHE_DTYPES),
    )
    quantization: str = flag(
        "none",
        "weight-only quantization of the attention and MLP projections (int8: one scale per output channel, "
        "half of bfloat16's bytes; not for mixture-of-experts or MLA models)",
        choices=QUANTIZATIONS,
    )
    max_logprobs: int = 20
    max_loras: int = flag(
        0, "LoRA adapter slots in device memory (0: LoRA off; default 4 with --lora)", group="lora"
    )
    max_lora_rank: int = flag(16, "highest adapter rank served (lower ranks are zero-padded)", group="lora")
    max_cpu_loras: int = flag(
        32, "adapters loaded at once, in host memory (more are refused: unload one first)", group="lora"
    )
    enable_prefix_caching: bool = flag(
        True,
        "reuse the KV of cached prompt prefixes (--no-prefix-caching: compute every prompt in full)",
        flag="--prefix-caching",
    )
    kv_offloading_size: float = flag(
        0.0,
        "GiB of host memory for a KV tier under the device cache (vLLM's flag): cached blocks evicted from "
        "the device are kept there and loaded back on a prefix hit; a prefill server also stages the KV "
        "its streams send there, freeing device memory while a decode server reads (0: off)",
        metavar="GIB",
    )
    # Host slots of that tier, one block each (engine.memory.plan resolves it from kv_offloading_size)
    num_host_blocks: int = 0
    # The fewest tokens a step is compiled for (on_platform resolves it): 2 for 16-bit weights
    # on a CPU, where XLA:CPU computes a one-row bfloat16 dot on a slow single-threaded path (the 49k-row
    # output projection: 34 ms at one row, 4 ms at two), so a lone request's step pads to two rows
    min_step_tokens: int = 1
    speculative_config: str = flag(
        "",
        "speculative decoding, a JSON object with vLLM's keys: method (ngram or eagle3), "
        "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max (ngram), model (eagle3: the head's "
        "folder) (empty: off)",
        metavar="JSON",
    )

    def __post_init__(self):
        if self.max_model_len % self.block_size or self.max_model_len < 0:
            raise ValueError("max_model_len must be a multiple of block_size (0: the model's context)")
        if not 0 <= self.gpu_memory_utilization <= 1 or self.num_blocks < 0:
            raise ValueError("gpu_memory_utilization must be in [0, 1] and num_blocks >= 0")
        if not self.kv_offloading_size >= 0 or self.num_host_blocks < 0:
            raise ValueError("kv_offloading_size must be >= 0 GiB")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every decode fits a step)")
        if self.max_loras < 0 or self.max_lora_rank < 1 or self.max_cpu_loras < max(self.max_loras, 1):
            raise ValueError(
                "max_loras must be >= 0, max_lora_rank >= 1 and max_cpu_loras >= max(max_loras, 1)"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: one of {DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r}: one of {tuple(KV_CACHE_DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r}: one of {QUANTIZATIONS}")
        SpeculativeConfig.parse(self.speculative_config)  # refused here, naming the key

    @property
    def speculation(self) -> SpeculativeConfig:
        """--speculative-config, parsed (num_speculative_tokens 0: off)."""
        return SpeculativeConfig.parse(self.speculative_config)

    def on_platform(self, platform: str) -> EngineConfig:
        """This config resolved for devices of `platform` (jax.Device.platform): "auto" dtype is bfloat16
        on TPUs and GPUs, on CPUs cpu_auto_dtype() (bfloat16 where the CPU computes it natively); and
        min_step_tokens."""
        dtype = self.dtype
        if dtype == "auto":
            dtype = cpu_auto_dtype() if platform == "cpu" else "bfloat16"
        min_step = 2 if platform == "cpu" and dtype != "float32" else 1
        return dataclasses.replace(self, dtype=dtype, min_step_tokens=max(self.min_step_tokens, min_step))

    @property
    def cache_dtype(self) -> str:
        """The KV cache's element type (a kvtransfer.layout.DTYPES name): --kv-cache-dtype's, else the serving
        dtype's (resolved by on_platform)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt text (or chat, before its template) taken: 16 characters a token of the
        model length, refused before any CPU is spent on tokenizing it."""
        return 16 * self.max_model_len

    @property
    def max_blocks_per_seq(self) -> int:
        return self.max_model_len // self.block_size

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Token counts a step is compiled for: one shape per bucket (engine.runner)."""
        return _step_buckets(
            min(self.min_step_tokens, self.max_num_batched_tokens), self.max_num_batched_tokens
        )

    def seq_bucket(self, num_tokens: int) -> int:
        """Sequence slots of the step of `num_tokens` tokens (a sequence has at least one token)."""
        return min(num_tokens, self.max_num_seqs)

    def logits_bucket(self, num_tokens: int) -> int:
        """Rows of logits the step of `num_tokens` tokens returns: one per sequence slot, and with
        speculation one more per draft a sequence verifies (never more than the step's tokens)."""
        return min(num_tokens, self.seq_bucket(num_tokens) * (1 + self.speculation.num_speculative_tokens))


def bucket_for(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value; ValueError past the largest."""
    for bucket in buckets:
        if value <= bucket:
            return bucket
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
