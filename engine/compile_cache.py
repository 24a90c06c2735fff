"""The persistent XLA compilation cache under pdserve's cache folder."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.loading.sources import cache_dir


def configure_jax() -> None:
    """Persistent XLA compilation cache under the cache folder: later start-ups load every executable
    instead of compiling it. Every one is kept, however fast it compiled (the default model's 140 take
    about 6 MB): with JAX's 0.5 s threshold a restart still compiled 55 of them (warmup 58.5 s instead
    of 46 s, docs/benchmark-history.md)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def cache_state() -> str:
    """The persistent compilation cache as the start-up summary names it: off, or its executables."""
    import jax

    folder = jax.config.jax_compilation_cache_dir
    if not folder:
        return "off"
    path = Path(folder)
    count = sum(1 for _ in path.iterdir()) if path.is_dir() else 0
    return f"{count} executables in {path}"
