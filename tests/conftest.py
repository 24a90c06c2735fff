"""Shared test set-up: 8 fake CPU devices (before JAX is imported), the default model, small engines."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

HAS_REFERENCE = (
    importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
)
requires_reference = pytest.mark.skipif(
    not HAS_REFERENCE, reason="needs the reference extra (torch, transformers)"
)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The default model's GGUF file (fetched into the cache on first use); PDSERVE_TEST_GGUF overrides."""
    override = os.environ.get("PDSERVE_TEST_GGUF")
    if override:
        return Path(override)
    from engine.models import DEFAULT_MODEL, fetch

    return fetch(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def loaded_model(gguf_path):
    from engine.models import load_model

    return load_model(gguf_path)


@pytest.fixture(scope="session")
def small_config():
    """Engine sizes for tests: few buckets, chunked prefill past 256 tokens."""
    from engine.config import EngineConfig

    return EngineConfig(num_blocks=192, max_model_len=1024, max_num_seqs=8, max_prefill_tokens=256)


@pytest.fixture(scope="session")
def make_engine(loaded_model, small_config):
    """Builds engines over the session's model; same config and devices -> the same engine object."""
    import dataclasses

    from engine.engine import LLMEngine

    engines = {}

    def make(devices=None, **overrides):
        config = dataclasses.replace(small_config, **overrides)
        key = (config, tuple(d.id for d in devices) if devices else None)
        if key not in engines:
            engines[key] = LLMEngine(loaded_model, config, devices)
        engine = engines[key]
        assert not engine.has_unfinished and engine.allocator.num_used == 0, (
            "a test leaked requests or blocks"
        )
        return engine

    return make
