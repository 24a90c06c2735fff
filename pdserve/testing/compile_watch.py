"""Counts XLA backend compilations, to show that steady-state serving compiles nothing new, and the
persistent compilation cache's misses, to show that a second start compiles nothing.

JAX records the event around compile-or-load: an executable loaded from the persistent compilation cache
counts too (it is still a new executable in this process, and costs a load at run time)."""

from __future__ import annotations

import contextlib
import threading

import jax

from pdserve.engine.compile_cache import COMPILE_EVENT

_CACHE_WRITE = "/jax/compilation_cache/cache_misses"  # recorded as a compiled executable is stored
_lock = threading.Lock()
_count = 0
_cache_writes = 0


def _on_event(event: str, duration: float, **_) -> None:
    global _count
    if event == COMPILE_EVENT:
        with _lock:
            _count += 1


def _on_cache_event(event: str, **_) -> None:
    global _cache_writes
    if event == _CACHE_WRITE:
        with _lock:
            _cache_writes += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)
jax.monitoring.register_event_listener(_on_cache_event)


def compilations() -> int:
    """Backend compilations in this process since the module was imported."""
    return _count


def persistent_cache_misses() -> int:
    """Executables this process compiled (not found in the persistent compilation cache) and stored there."""
    return _cache_writes


@contextlib.contextmanager
def count_compilations():
    """`with count_compilations() as counted: ...; counted()` -> compilations inside the block."""
    start = _count
    yield lambda: _count - start
