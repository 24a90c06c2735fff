"""Multi-LoRA: PEFT adapters read from disk (adapter), the adapters an engine serves (registry), device
slots with LRU eviction (slots), and the batched low-rank deltas the forward step adds (apply)."""

from engine.lora.adapter import (
    TARGET_MODULES,
    AdapterExistsError,
    AdapterMismatchError,
    LoraAdapter,
    LoraDisabledError,
    LoraLoadError,
    UnknownAdapterError,
    load_peft_adapter,
)
from engine.lora.registry import AdapterRegistry
from engine.lora.slots import LoraSlots, LoraWeights

__all__ = [
    "TARGET_MODULES",
    "AdapterExistsError",
    "AdapterMismatchError",
    "AdapterRegistry",
    "LoraAdapter",
    "LoraDisabledError",
    "LoraLoadError",
    "LoraSlots",
    "LoraWeights",
    "UnknownAdapterError",
    "load_peft_adapter",
]
