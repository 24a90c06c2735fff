"""PEFT LoRA adapters on the host: `adapter_config.json` + `adapter_model.safetensors` -> LoraAdapter.

An adapter adds `x @ A @ B * scaling` to a projection `x @ W`. pdserve keeps A as [L, in, r] and B as
[L, r, out] (math layout, layers stacked like the base weights) with the scaling folded into B; layers
and projections the adapter does not touch are zeros. Everything here is numpy: device placement and
slots are engine.lora_slots.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np

from pdserve.engine.config import ModelConfig
from pdserve.engine.sampling_params import InvalidRequestError

# PEFT module names of the Llama family's projections, in the order pdserve stores them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (the adapter name is not in saved keys)
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class LoraLoadError(ValueError):
    """An adapter folder that pdserve cannot serve: missing files, another format, unsupported options,
    a rank above the configured maximum, shapes that do not fit the base model."""

    status = "INVALID_ARGUMENT"


class LoraDisabledError(LoraLoadError):
    """The engine has no adapter slots (max_loras == 0)."""

    status = "FAILED_PRECONDITION"


class AdapterExistsError(LoraLoadError):
    """The name is taken by an adapter with other weights."""

    status = "ALREADY_EXISTS"


class TooManyAdaptersError(LoraLoadError):
    """As many adapters as the engine holds (max_cpu_loras) are loaded already."""

    status = "RESOURCE_EXHAUSTED"


class UnknownAdapterError(InvalidRequestError):
    """A request names an adapter that is not loaded here."""

    status = "NOT_FOUND"


class AdapterMismatchError(InvalidRequestError):
    """A request's adapter is loaded here under its name but with other weights (another fingerprint)."""

    status = "FAILED_PRECONDITION"


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module in the unpadded base model."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, i),
        "up_proj": (d, i),
        "down_proj": (i, d),
    }


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter's weights for every target module (zeros where it has none), scaling folded into B.

    `fingerprint` hashes the files: two servers holding the same name and fingerprint hold the same
    adapter, which is what the prefill and decode sides check before sharing a request's KV cache.
    """

    name: str
    path: str
    rank: int
    scaling: float
    targets: tuple[str, ...]  # the target modules the adapter trains
    fingerprint: str
    a: dict[str, np.ndarray]  # module -> [L, in, rank] float32
    b: dict[str, np.ndarray]  # module -> [L, rank, out] float32, times scaling

    @property
    def key(self) -> str:
        """Identity of the weights (a name reloaded with other files is another adapter)."""
        return f"{self.name}@{self.fingerprint}"

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.a.values(), *self.b.values()))


def _read_config(folder: Path) -> dict:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise LoraLoadError(f"{folder}: no adapter_config.json (expected a PEFT LoRA adapter folder)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoraLoadError(f"{config_file}: {e}") from e
    if not isinstance(config, dict):
        raise LoraLoadError(f"{config_file}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraLoadError(f"{folder}: peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "bias": config.get("bias", "none") not in ("none", None),
    }
    refused = [k for k, bad in unsupported.items() if bad]
    if refused:
        raise LoraLoadError(f"{folder}: adapter options not supported: {', '.join(refused)}")
    return config


def _fingerprint(*files: Path) -> str:
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def load_peft_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Reads and checks a PEFT adapter folder against the base model; raises LoraLoadError."""
    from safetensors import SafetensorError, safe_open

    folder = Path(path)
    if not folder.is_dir():
        raise LoraLoadError(f"{folder}: not a directory")
    config = _read_config(folder)
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoraLoadError(f"{folder}: no adapter_model.safetensors")
    try:
        rank = int(config.get("r", 0))
        alpha = float(config.get("lora_alpha", rank))
    except (TypeError, ValueError):
        raise LoraLoadError(f"{folder}: adapter_config.json r and lora_alpha must be numbers") from None
    if not 0 < rank <= max_rank or not math.isfinite(alpha):
        raise LoraLoadError(
            f"{folder}: rank {rank} is outside 1..{max_rank} (the configured --max-lora-rank)"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    shapes = projection_shapes(cfg)
    a = {m: np.zeros((cfg.num_layers, n_in, rank), np.float32) for m, (n_in, _) in shapes.items()}
    b = {m: np.zeros((cfg.num_layers, rank, n_out), np.float32) for m, (_, n_out) in shapes.items()}
    seen: set[tuple[int, str, str]] = set()
    try:
        with safe_open(str(weights_file), framework="flax") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                match = _KEY.match(key)
                if match is None:
                    raise LoraLoadError(
                        f"{folder}: tensor {key!r} is not a LoRA weight of q/k/v/o or the MLP"
                    )
                layer, module, which = int(match[1]), match[2], match[3]
                if module not in shapes or layer >= cfg.num_layers:
                    raise LoraLoadError(f"{folder}: tensor {key!r} does not fit the base model")
                tensor = np.asarray(f.get_tensor(key), np.float32)
                n_in, n_out = shapes[module]
                want = (rank, n_in) if which == "A" else (n_out, rank)
                if tensor.shape != want:
                    raise LoraLoadError(f"{folder}: {key} has shape {tensor.shape}, expected {want}")
                if which == "A":
                    a[module][layer] = tensor.T
                else:
                    b[module][layer] = tensor.T * scaling
                seen.add((layer, module, which))
    except (OSError, ValueError, SafetensorError) as e:  # damaged or truncated files
        if isinstance(e, LoraLoadError):
            raise
        raise LoraLoadError(f"{weights_file}: {e}") from e
    halves = collections.Counter((layer, module) for layer, module, _ in seen)  # 2: both A and B
    unpaired = [f"layer {layer} {module}" for (layer, module), n in sorted(halves.items()) if n != 2]
    if unpaired:
        raise LoraLoadError(f"{folder}: lora_A without lora_B (or the reverse) at {', '.join(unpaired[:4])}")
    if not halves:
        raise LoraLoadError(f"{folder}: adapter_model.safetensors holds no LoRA weights")
    targets = tuple(m for m in TARGET_MODULES if any(module == m for _, module in halves))
    return LoraAdapter(
        name=name,
        path=str(folder),
        rank=rank,
        scaling=scaling,
        targets=targets,
        fingerprint=_fingerprint(folder / "adapter_config.json", weights_file),
        a=a,
        b=b,
    )
