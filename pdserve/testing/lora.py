"""Random PEFT LoRA adapters for a model, written in PEFT's on-disk format with numpy (tests, benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from pdserve.engine.config import ModelConfig
from pdserve.engine.lora import TARGET_MODULES
from pdserve.engine.lora.adapter import projection_shapes


def write_random_adapter(
    folder: Path,
    cfg: ModelConfig,
    rank: int = 8,
    seed: int = 0,
    targets: tuple[str, ...] = TARGET_MODULES,
    alpha: float = 16.0,
    scale: float = 0.15,
    **config_overrides,
) -> Path:
    """An adapter whose deltas are large enough to change greedy tokens (PEFT's zero-init B would not)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in targets:
            n_in, n_out = projection_shapes(cfg)[module]
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(
                np.float32
            )
            tensors[f"{prefix}.lora_B.weight"] = (scale * rng.standard_normal((n_out, rank))).astype(
                np.float32
            )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        **config_overrides,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
