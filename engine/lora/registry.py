"""The adapters an engine serves, by name, in host memory; resolving a request's adapter name."""

from __future__ import annotations

import dataclasses

from pdserve.engine.config import ModelConfig
from pdserve.engine.lora.adapter import (
    AdapterExistsError,
    AdapterMismatchError,
    LoraAdapter,
    LoraDisabledError,
    TooManyAdaptersError,
    UnknownAdapterError,
    load_peft_adapter,
)


class AdapterRegistry:
    """Loaded adapters by name. `adapters` is replaced, never mutated, so other threads may read it while
    the engine thread loads and unloads. Device slots are engine.lora_slots' business: an adapter enters
    one only when a request needs it."""

    def __init__(self, cfg: ModelConfig, max_rank: int, enabled: bool, max_adapters: int = 32):
        """`max_adapters`: how many may be loaded at once (each holds float32 A and B of every projection
        in host memory)."""
        self.cfg, self.max_rank, self.enabled, self.max_adapters = cfg, max_rank, enabled, max_adapters
        self.adapters: dict[str, LoraAdapter] = {}

    def resolve(self, name: str, fingerprint: str | None = None) -> LoraAdapter:
        """The adapter a request names; with `fingerprint` (a peer's copy) the weights must be the same."""
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise UnknownAdapterError(
                "lora_adapter", f"adapter {name!r} is not loaded here (loaded: {loaded})"
            )
        if fingerprint and fingerprint != adapter.fingerprint:
            raise AdapterMismatchError(
                "lora_adapter",
                f"adapter {name!r} here has fingerprint {adapter.fingerprint}, the request's {fingerprint}",
            )
        return adapter

    def read(self, name: str, path: str) -> LoraAdapter:
        """Reads and checks a PEFT adapter folder (slow: file I/O; safe off the engine thread)."""
        if not self.enabled:
            raise LoraDisabledError("LoRA is off: start the engine with max_loras > 0 (--max-loras)")
        return load_peft_adapter(name, path, self.cfg, self.max_rank)

    def add(self, adapter: LoraAdapter) -> LoraAdapter:
        """Makes an adapter available to new requests. The same files again under the same name: a no-op;
        other files under a loaded name: AdapterExistsError (unload it first)."""
        current = self.adapters.get(adapter.name)
        if current is not None and current.fingerprint != adapter.fingerprint:
            raise AdapterExistsError(
                f"adapter {adapter.name!r} is loaded with other weights: unload it first"
            )
        if current is None:
            if len(self.adapters) >= self.max_adapters:
                raise TooManyAdaptersError(
                    f"{self.max_adapters} adapters are loaded (--max-cpu-loras): unload one first"
                )
            same = next((a for a in self.adapters.values() if a.fingerprint == adapter.fingerprint), None)
            if same is not None:  # the same files under another name: one copy of the weights
                adapter = dataclasses.replace(adapter, a=same.a, b=same.b)
            self.adapters = {**self.adapters, adapter.name: adapter}
        return self.adapters[adapter.name]

    def load(self, name: str, path: str) -> LoraAdapter:
        return self.add(self.read(name, path))

    def remove(self, name: str) -> bool:
        """New requests can no longer name the adapter; requests already holding it finish with it."""
        if name not in self.adapters:
            return False
        self.adapters = {k: v for k, v in self.adapters.items() if k != name}
        return True
