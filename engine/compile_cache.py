"""The persistent XLA compilation cache under pdserve's cache folder, and the sizes a start keeps in it."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from pdserve.engine.loading.sources import cache_dir

log = logging.getLogger(__name__)

# jax.monitoring's duration event around every compile-or-load of an XLA program: an executable loaded
# from the persistent compilation cache counts too (a new executable in this process all the same)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


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
    count = sum(1 for p in path.iterdir() if p.name != SIZES_FILE) if path.is_dir() else 0
    return f"{count} executables in {path}"


# What a start remembers beside the executables: the shape-deciding sizes it chose (engine.memory's CPU
# cache size), so that the next start with the same layout takes the same and finds its executables
SIZES_FILE = "sizes.json"
MAX_SIZES = 64


def remembered_size(key: str) -> int | None:
    """The size a previous start stored under `key` beside the compilation cache (None: none, or no cache)."""
    path = _sizes_path()
    value = None if path is None else _stored_sizes(path).get(key)
    return value if isinstance(value, int) else None


def remember_size(key: str, value: int) -> None:
    """Stores `value` under `key` for the next start (atomically: a concurrent start keeps one of the two
    files, and at worst compiles once more); nothing without a compilation cache."""
    path = _sizes_path()
    if path is None:
        return
    sizes = _stored_sizes(path)
    sizes.pop(key, None)
    sizes[key] = int(value)  # last: the file keeps the MAX_SIZES most recently stored
    sizes = dict(list(sizes.items())[-MAX_SIZES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(sizes, f, indent=0)
        os.replace(f.name, path)
    except OSError as e:  # a read-only cache folder: every start sizes afresh
        log.debug("could not remember %s=%d in %s: %s", key, value, path, e)


def _sizes_path() -> Path | None:
    import jax

    folder = jax.config.jax_compilation_cache_dir
    return Path(folder) / SIZES_FILE if folder else None


def _stored_sizes(path: Path) -> dict:
    """The sizes file's entries ({}: none, unreadable, or not a JSON object)."""
    try:
        sizes = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return sizes if isinstance(sizes, dict) else {}
