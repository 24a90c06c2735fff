"""Multi-LoRA: PEFT adapters read from disk (adapter), device slots with LRU eviction (slots), and the
batched low-rank deltas the forward step adds to its projections (apply)."""

from engine.lora.adapter import (
    TARGET_MODULES,
    AdapterExistsError,
    AdapterMismatchError,
    LoraAdapter,
    LoraLoadError,
    UnknownAdapterError,
    load_peft_adapter,
)
from engine.lora.slots import LoraSlots, LoraWeights

__all__ = [
    "TARGET_MODULES",
    "AdapterExistsError",
    "AdapterMismatchError",
    "LoraAdapter",
    "LoraLoadError",
    "LoraSlots",
    "LoraWeights",
    "UnknownAdapterError",
    "load_peft_adapter",
]
