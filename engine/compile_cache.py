"""The persistent XLA compilation cache under pdserve's cache folder."""

from __future__ import annotations

from pdserve.engine.loading.sources import cache_dir


def configure_jax() -> None:
    """Persistent XLA compilation cache under the cache folder: later start-ups load every executable
    instead of compiling it. Every one is kept, however fast it compiled (the default model's 140 take
    about 6 MB): with JAX's 0.5 s threshold a restart still compiled 55 of them (warmup 58.5 s instead
    of 46 s, BENCHMARKS.md)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
