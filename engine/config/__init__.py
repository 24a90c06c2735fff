"""Frozen configuration dataclasses, one module per job; importers name them from here
(`from pdserve.engine.config import EngineConfig`), as they did when this was one module:

- engine.config.hf: Hugging Face config.json parsing, the supported architectures, UnsupportedModelError;
- engine.config.model: ModelConfig, the decoder's architecture;
- engine.config.speculative: SpeculativeConfig, --speculative-config parsed;
- engine.config.engine: EngineConfig (the engine's sizes and flags, `flag`), the shape buckets
  (`bucket_for`), SizingError.
"""

from pdserve.engine.config.engine import (
    CPU_DTYPE_ENV,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineConfig,
    SizingError,
    bucket_for,
    cpu_auto_dtype,
    flag,
)
from pdserve.engine.config.hf import (
    ACTIVATIONS,
    GEMMA,
    GEMMA_FULL_EVERY,
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
)
from pdserve.engine.config.model import ModelConfig
from pdserve.engine.config.speculative import (
    DRAFT_POLICIES,
    MAX_SPECULATIVE_TOKENS,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
)

__all__ = [
    "ACTIVATIONS",
    "CPU_DTYPE_ENV",
    "DRAFT_POLICIES",
    "DTYPES",
    "GEMMA",
    "GEMMA_FULL_EVERY",
    "KV_CACHE_DTYPES",
    "MAX_SPECULATIVE_TOKENS",
    "QUANTIZATIONS",
    "SPECULATIVE_METHODS",
    "SUPPORTED_ARCHITECTURES",
    "EngineConfig",
    "ModelConfig",
    "SizingError",
    "SpeculativeConfig",
    "UnsupportedModelError",
    "bucket_for",
    "cpu_auto_dtype",
    "flag",
]
