"""Checkpoint loading: GGUF files (dequantized at load) and Hugging Face safetensors folders.

Both produce a `ModelConfig` and host numpy arrays in math layout (`x @ W`), layers stacked on a leading
axis, ready for `engine.model.weights.build_weights`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pdserve.engine.config import GEMMA, ModelConfig
from pdserve.engine.loading import gguf_config
from pdserve.engine.tokenizer import read_gguf_metadata

log = logging.getLogger(__name__)

# per-layer weight name -> (GGUF tensor suffix, HF tensor suffix)
_LAYER_TENSORS = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "wq": ("attn_q.weight", "self_attn.q_proj.weight"),
    "wk": ("attn_k.weight", "self_attn.k_proj.weight"),
    "wv": ("attn_v.weight", "self_attn.v_proj.weight"),
    "bq": ("attn_q.bias", "self_attn.q_proj.bias"),
    "bk": ("attn_k.bias", "self_attn.k_proj.bias"),
    "bv": ("attn_v.bias", "self_attn.v_proj.bias"),
    "wo": ("attn_output.weight", "self_attn.o_proj.weight"),
    "mlp_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "w_up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "w_down": ("ffn_down.weight", "mlp.down_proj.weight"),
    "experts_gate": ("ffn_gate_exps.weight", "mlp.experts.{e}.gate_proj.weight"),  # {e}: each expert
    "experts_up": ("ffn_up_exps.weight", "mlp.experts.{e}.up_proj.weight"),
    "experts_down": ("ffn_down_exps.weight", "mlp.experts.{e}.down_proj.weight"),
    "shared_gate": ("ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight"),
    "shared_up": ("ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight"),
    "shared_down": ("ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight"),
    "q_norm": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "k_norm": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    "post_attn_norm": ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    "post_mlp_norm": ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
    "w_router": ("ffn_gate_inp.weight", "mlp.gate.weight"),
    "w_q_a": ("attn_q_a.weight", "self_attn.q_a_proj.weight"),
    "q_a_norm": ("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
    "w_q_b": ("attn_q_b.weight", "self_attn.q_b_proj.weight"),
    "w_kv_a": ("attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    "kv_a_norm": ("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
    "w_kv_b": ("attn_kv_b.weight", "self_attn.kv_b_proj.weight"),
}
# Gemma's checkpoints name the norm before the MLP differently (its post_attention_layernorm normalizes
# the attention's output, see post_attn_norm)
_GEMMA_HF_TENSORS = {"mlp_norm": "pre_feedforward_layernorm.weight"}
# Mixtral's names for its router and experts
_MIXTRAL_HF_TENSORS = {
    "w_router": "block_sparse_moe.gate.weight",
    "experts_gate": "block_sparse_moe.experts.{e}.w1.weight",
    "experts_up": "block_sparse_moe.experts.{e}.w3.weight",
    "experts_down": "block_sparse_moe.experts.{e}.w2.weight",
}
_BIASES = ("bq", "bk", "bv")
_MLA = ("w_kv_a", "kv_a_norm", "w_kv_b")  # multi-head latent attention's, in place of wk, wv
_Q_LORA = ("w_q_a", "q_a_norm", "w_q_b")  # MLA's low-rank queries, in place of wq
_DENSE_MLP = ("w_gate", "w_up", "w_down")
_EXPERTS = ("w_router", "experts_gate", "experts_up", "experts_down")
_SHARED = ("shared_gate", "shared_up", "shared_down")


def _layers_with(cfg: ModelConfig, name: str) -> range:
    """The layers that have weight `name` (empty: the model has none)."""
    every, none = range(cfg.num_layers), range(0)
    dense_end = cfg.dense_layers  # expert layers after
    has = {
        "q_norm": cfg.qk_norm,
        "k_norm": cfg.qk_norm,
        "post_attn_norm": cfg.sandwich_norms,
        "post_mlp_norm": cfg.sandwich_norms,
        "wq": not cfg.q_lora_rank,
        **{n: not cfg.is_mla for n in ("wk", "wv", *_BIASES)},
        **{n: cfg.is_mla for n in _MLA},
        **{n: cfg.q_lora_rank > 0 for n in _Q_LORA},
    }
    if name in _DENSE_MLP:
        return range(dense_end)
    if name in _EXPERTS or name in _SHARED:
        return range(dense_end, cfg.num_layers) if name not in _SHARED or cfg.shared_experts else none
    return every if has.get(name, True) else none


def _halves_from_interleaved_rope(w: np.ndarray, head_size: int, rope_dim: int) -> np.ndarray:
    """DeepSeek rotates pairs of adjacent dims (complex numbers); pdserve's rope rotates dim i with
    i + rope_dim / 2. Reorders the last rope_dim of each head_size-wide head of w's last axis to match;
    q.k is unchanged when queries and keys are reordered alike."""
    heads = w.reshape(*w.shape[:-1], -1, head_size)
    order = np.r_[np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)] + head_size - rope_dim
    heads = np.concatenate([heads[..., : head_size - rope_dim], heads[..., order]], axis=-1)
    return heads.reshape(w.shape)


def _mla_rope_in_halves(cfg: ModelConfig, host: dict[str, np.ndarray]) -> None:
    """MLA's query and latent projections with their rope dims in halves (both formats keep DeepSeek's
    interleaved order: llama.cpp rotates adjacent pairs too)."""
    if cfg.is_mla:
        q = "w_q_b" if cfg.q_lora_rank else "wq"
        host[q] = _halves_from_interleaved_rope(host[q], cfg.head_dim, cfg.rope_dim)
        host["w_kv_a"] = _halves_from_interleaved_rope(host["w_kv_a"], host["w_kv_a"].shape[-1], cfg.rope_dim)


class CheckpointError(FileNotFoundError):
    """A checkpoint file or tensor is missing."""


def _undo_gguf_rope_permutation(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each q/k head's rows from halves to interleaved pairs; undo it.

    `w` is [out, ...] with out = num_heads * head_dim (a weight or a bias).
    """
    out = w.shape[0]
    return w.reshape(num_heads, out // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stack_layers(cfg: ModelConfig, fetch: Callable[[int, str], np.ndarray | None]) -> dict[str, np.ndarray]:
    """Stacks per-layer tensors ([out, in] as stored, [experts, out, in] for experts) into [L, in, out]
    (or [L, experts, in, out]) math layout, over the layers that have them (DeepSeek: its dense MLPs over
    the first layers, its experts over the rest)."""
    stacked = {}
    for name in _LAYER_TENSORS:
        layers = _layers_with(cfg, name)
        if not layers:
            continue
        per_layer = []
        for i in layers:
            w = fetch(i, name)
            if w is None:
                if name in _BIASES and not cfg.qkv_bias:
                    out = cfg.num_heads if name == "bq" else cfg.num_kv_heads
                    w = np.zeros(out * cfg.head_dim, np.float32)
                else:
                    raise CheckpointError(f"layer {i} lacks tensor {name} ({_LAYER_TENSORS[name]})")
            per_layer.append(np.swapaxes(w, -1, -2) if w.ndim >= 2 else w)  # [(experts,) out, in] -> in, out
        stacked[name] = np.stack(per_layer).astype(np.float32, copy=False)
    return stacked


def load_gguf(path: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """Reads a GGUF file: (config, host weights, metadata). Quantized tensors are dequantized to float32."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    reader = gguf.GGUFReader(str(path))
    meta = read_gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_config.hf_config(meta, tie_word_embeddings="output.weight" not in tensors)
    cfg = ModelConfig.from_hf_config(config, name=name or path.stem)

    def tensor(key: str) -> np.ndarray | None:
        t = tensors.get(key)
        if t is None:
            return None
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(arr, dtype=np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))

    permute = meta["general.architecture"] in gguf_config.ROPE_PERMUTED

    def fetch(i: int, weight: str) -> np.ndarray | None:
        w = tensor(f"blk.{i}.{_LAYER_TENSORS[weight][0]}")
        # llama.cpp splits DeepSeek's kv_b: k_b [heads, rank, nope], v_b [heads, v, rank]
        if w is None and weight == "w_kv_b":
            k_b, v_b = tensor(f"blk.{i}.attn_k_b.weight"), tensor(f"blk.{i}.attn_v_b.weight")
            if k_b is not None and v_b is not None:
                w = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
        if w is not None and permute and weight in ("wq", "bq"):
            w = _undo_gguf_rope_permutation(w, cfg.num_heads)
        if w is not None and permute and weight in ("wk", "bk"):
            w = _undo_gguf_rope_permutation(w, cfg.num_kv_heads)
        return w

    host = _stack_layers(cfg, fetch)
    for key, target in (("token_embd.weight", "embed"), ("output_norm.weight", "final_norm")):
        w = tensor(key)
        if w is None:
            raise CheckpointError(f"{path} lacks tensor {key}")
        host[target] = w
    if not cfg.tie_word_embeddings:
        host["lm_head"] = tensor("output.weight").T
    _mla_rope_in_halves(cfg, host)
    return cfg, host, meta


def load_hf_folder(path: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Reads a Hugging Face folder: config.json and one or several *.safetensors files."""
    from safetensors import safe_open

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    cfg = ModelConfig.from_hf_config(json.loads(config_file.read_text()), name=name or path.name)
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors files")
    where: dict[str, Path] = {}
    for file in files:
        if not (path / file).is_file():
            raise CheckpointError(f"{path / file} (named in the index) is missing")
        with safe_open(str(path / file), framework="flax") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                where[key] = path / file

    def tensor(key: str) -> np.ndarray | None:
        file = where.get(key)
        if file is None:
            return None
        with safe_open(str(file), framework="flax") as f:
            return np.asarray(f.get_tensor(key), dtype=np.float32)

    names = {w: hf for w, (_, hf) in _LAYER_TENSORS.items()}
    if cfg.architecture in GEMMA:
        names.update(_GEMMA_HF_TENSORS)
    if cfg.architecture == "mixtral":
        names.update(_MIXTRAL_HF_TENSORS)

    def fetch(i: int, weight: str) -> np.ndarray | None:
        name = f"model.layers.{i}.{names[weight]}"
        if "{e}" not in name:
            return tensor(name)
        experts = [tensor(name.format(e=e)) for e in range(cfg.num_experts)]
        missing = [e for e, w in enumerate(experts) if w is None]
        if missing:
            raise CheckpointError(f"{path} lacks {name} of experts {missing}")
        return np.stack(experts)

    host = _stack_layers(cfg, fetch)
    for key, target in (("model.embed_tokens.weight", "embed"), ("model.norm.weight", "final_norm")):
        w = tensor(key)
        if w is None:
            raise CheckpointError(f"{path} lacks tensor {key}")
        host[target] = w
    _mla_rope_in_halves(cfg, host)
    if cfg.architecture in GEMMA:  # Gemma's RMSNorm scales by (1 + weight): folded in here, as llama.cpp does
        for key in [k for k in host if k.endswith("_norm")]:  # q/k, layers' and final norms
            host[key] = host[key] + 1.0
    lm_head = tensor("lm_head.weight")
    if not cfg.tie_word_embeddings:
        if lm_head is None:
            raise CheckpointError(f"{path} lacks lm_head.weight and embeddings are not tied")
        host["lm_head"] = lm_head.T
    return cfg, host
