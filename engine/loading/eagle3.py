"""EAGLE-3 draft heads, read from the format they are published in (a Hugging Face folder: config.json and
safetensors), checked against the target model they draft for.

A head is one Llama decoder layer whose attention takes twice the hidden size (the token's embedding and a
hidden state, each normed, side by side), `fc` [hidden, 3 x hidden] that fuses three of the target's
hidden states into one, a final norm and its own LM head over a reduced draft vocabulary, with `d2t`
mapping a draft id to the target's (target id = draft id + d2t[draft id]). Tensor names as published:
`fc.weight`, `midlayer.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
mlp.{gate,up,down}_proj}.weight` (or `layers.0.` for `midlayer.`), `norm.weight`, `lm_head.weight`, `d2t`,
and optionally `t2d` (unused) and `embed_tokens.weight` (absent: the target's embeddings). Heads
published as pytorch_model.bin pickles are refused: convert them to safetensors first.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from pdserve.engine.config import ModelConfig, UnsupportedModelError
from pdserve.engine.loading.checkpoints import CheckpointError, edge_rows, weights_digest

_LAYER_PREFIXES = ("midlayer.", "layers.0.")  # the published spellings of the one layer's tensors
_LAYER_TENSORS = (
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)  # fmt: skip


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs an EAGLE-3 head reads when its config names none (as EAGLE-3 and
    vLLM pick them): an early, a middle and a late one."""
    return 2, num_layers // 2, num_layers - 3


@dataclasses.dataclass(frozen=True)
class Eagle3Head:
    """A loaded head: its layer's config (a one-layer Llama), the target layers whose inputs it reads,
    its draft vocabulary, and its tensors on the host by their published names (`midlayer.` spelling)."""

    config: ModelConfig
    aux_layers: tuple[int, ...]
    draft_vocab_size: int
    norm_before_residual: bool  # the hidden state's residual is taken after its norm (a config option)
    digest: str  # of the tensors (engine.loading.checkpoints.weights_digest)
    tensors: dict[str, np.ndarray] = dataclasses.field(repr=False)

    @property
    def name(self) -> str:
        """The draft layer's name in the KV layout (ModelConfig.draft_layer)."""
        return f"eagle3@{self.digest}"


def load_eagle3_head(path: str | Path, target: ModelConfig) -> Eagle3Head:
    """The head in folder `path`, checked against `target`: its hidden size and vocabulary, and (its KV
    sits in the target's cache as one more layer) its KV heads and head size must be the target's;
    UnsupportedModelError naming the field otherwise, CheckpointError for a missing file or tensor."""
    from safetensors.numpy import load_file

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"EAGLE-3 head {path}: no config.json")
    raw = json.loads(config_file.read_text())
    layers = raw.get("num_hidden_layers", 1)
    if layers != 1:
        raise UnsupportedModelError(f"EAGLE-3 head {path}: num_hidden_layers {layers}: one layer is read")
    cfg = ModelConfig.from_hf_config({**raw, "architectures": ["LlamaForCausalLM"]}, name=f"{path.name}")
    for field in ("hidden_size", "num_kv_heads", "head_dim", "vocab_size"):
        if getattr(cfg, field) != getattr(target, field):
            raise UnsupportedModelError(
                f"EAGLE-3 head {path}: {field} {getattr(cfg, field)} differs from the target's "
                f"{getattr(target, field)}"
            )
    eagle = raw.get("eagle_config") or {}
    aux = tuple(eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers))
    if not all(0 <= a < target.num_layers for a in aux):
        raise UnsupportedModelError(f"EAGLE-3 head {path}: aux layers {aux} outside the target's layers")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = (
            "pytorch_model.bin (convert it to safetensors)" if (path / "pytorch_model.bin").exists() else ""
        )
        raise CheckpointError(f"EAGLE-3 head {path}: no *.safetensors files {found}".rstrip())
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        for key, value in load_file(str(file)).items():
            key = key.removeprefix("model.")
            for prefix in _LAYER_PREFIXES[1:]:
                if key.startswith(prefix):
                    key = _LAYER_PREFIXES[0] + key[len(prefix) :]
            tensors[key] = value
    required = [
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        *(_LAYER_PREFIXES[0] + t for t in _LAYER_TENSORS),
    ]
    missing = [k for k in required if k not in tensors]
    if missing:
        raise CheckpointError(f"EAGLE-3 head {path}: no tensor {missing[0]}")
    hidden = cfg.hidden_size
    if tensors["fc.weight"].shape != (hidden, len(aux) * hidden):
        raise UnsupportedModelError(
            f"EAGLE-3 head {path}: fc.weight {tensors['fc.weight'].shape}: ({hidden}, {len(aux) * hidden}) "
            f"fuses the {len(aux)} aux layers' hidden states"
        )
    draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
    if tensors["lm_head.weight"].shape != (draft_vocab, hidden):
        raise UnsupportedModelError(
            f"EAGLE-3 head {path}: lm_head.weight {tensors['lm_head.weight'].shape} is not "
            f"(draft_vocab_size {draft_vocab}, {hidden})"
        )
    d2t = tensors.get("d2t")
    if d2t is None and draft_vocab != cfg.vocab_size:
        raise CheckpointError(f"EAGLE-3 head {path}: no tensor d2t (draft_vocab_size {draft_vocab})")
    if d2t is not None:
        targets = np.arange(draft_vocab) + d2t.astype(np.int64)
        if d2t.shape != (draft_vocab,) or targets.min() < 0 or targets.max() >= cfg.vocab_size:
            raise UnsupportedModelError(f"EAGLE-3 head {path}: d2t maps draft ids outside the vocabulary")
    entries = [(k, str(v.dtype), v.shape, edge_rows(v) if v.size else b"") for k, v in tensors.items()]
    return Eagle3Head(
        config=cfg,
        aux_layers=aux,
        draft_vocab_size=draft_vocab,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        digest=weights_digest(iter(entries)),
        tensors=tensors,
    )
