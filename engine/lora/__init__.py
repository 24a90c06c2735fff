"""Multi-LoRA on the host: PEFT adapters read from disk (adapter) and the adapters an engine serves
(registry). On the device: the slots with LRU eviction (engine/lora_slots.py) and the batched low-rank
deltas the forward step adds (engine/model/lora.py)."""

from pdserve.engine.lora.adapter import (
    TARGET_MODULES,
    AdapterExistsError,
    AdapterMismatchError,
    LoraAdapter,
    LoraDisabledError,
    LoraLoadError,
    TooManyAdaptersError,
    UnknownAdapterError,
    load_peft_adapter,
)
from pdserve.engine.lora.registry import AdapterRegistry

__all__ = [
    "TARGET_MODULES",
    "AdapterExistsError",
    "AdapterMismatchError",
    "AdapterRegistry",
    "LoraAdapter",
    "LoraDisabledError",
    "LoraLoadError",
    "TooManyAdaptersError",
    "UnknownAdapterError",
    "load_peft_adapter",
]
