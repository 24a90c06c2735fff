"""Hugging Face `config.json` parsing: the architectures pdserve implements, and a checkpoint's
config.json turned into ModelConfig's fields (engine.config.model.ModelConfig.from_hf_config), refusing what
the forward pass lacks with UnsupportedModelError."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "qwen3_moe",
    "mixtral",
    "deepseek_v2",
)
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
}
_MODEL_TYPES = {"gemma3_text": "gemma3"}  # config.json model_type -> architecture, where they differ
# config.json activation names -> the gated MLP's activation (engine.model.forward)
_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ACTIVATIONS = tuple(sorted(set(_HF_ACTIVATIONS.values())))
_QK_NORM = ("qwen3", "gemma3", "qwen3_moe")  # RMSNorm of each query and key head before rope
GEMMA = ("gemma2", "gemma3")  # scaled embeddings, GeGLU, norms around attention and MLP, norm weights 1 + w
_MOE = ("qwen3_moe", "mixtral")  # every layer's MLP is a mixture of experts
# config.json's default layer pattern where it has no `layer_types`: every n-th layer is a full one
GEMMA_FULL_EVERY = {"gemma2": 2, "gemma3": 6}


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or feature pdserve does not implement."""


def hf_fields(config: Mapping[str, Any] | Path, name: str = "model") -> dict[str, Any]:
    """ModelConfig's fields from a Hugging Face `config.json` (a dict or its path); UnsupportedModelError
    naming the field of what pdserve does not implement."""
    if isinstance(config, Path):
        config = json.loads(config.read_text())
    archs = config.get("architectures") or []
    arch = next((_HF_ARCHITECTURES[a] for a in archs if a in _HF_ARCHITECTURES), None)
    model_type = _MODEL_TYPES.get(config.get("model_type"), config.get("model_type"))
    if arch is None and not archs and model_type in SUPPORTED_ARCHITECTURES:
        arch = model_type  # folders written without `architectures`
    if arch is None:
        raise UnsupportedModelError(
            f"config.json architectures {archs} not supported (supported: {sorted(_HF_ARCHITECTURES)})"
        )
    num_heads = config["num_attention_heads"]
    # transformers >= 5 writes `rope_parameters` (theta inside; Gemma 3: one per layer type); older ones
    # `rope_theta`, `rope_scaling` (and Gemma 3 `rope_local_base_freq`)
    rope_parameters = config.get("rope_parameters") or {}
    full_rope = rope_parameters.get("full_attention", rope_parameters)
    rope_theta = full_rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope = _rope_scaling(config.get("rope_scaling") or full_rope)
    sliding_rope = rope_parameters.get("sliding_attention") or {}
    sliding_theta = sliding_rope.get("rope_theta", config.get("rope_local_base_freq"))
    if _rope_scaling(sliding_rope):
        raise UnsupportedModelError("config.json rope_parameters.sliding_attention: scaling is not supported")
    _refuse_unsupported_features(config)
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    mla = arch == "deepseek_v2"
    deepseek = _deepseek_fields(config, rope) if mla else {}
    if mla:
        num_experts = deepseek.pop("num_experts")
    if arch in _MOE and not num_experts:
        raise UnsupportedModelError(f"config.json of {arch} names no num_experts")
    return dict(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"]
        if num_experts
        else config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads", num_heads),
        head_dim=config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        if mla
        else config.get("head_dim") or config["hidden_size"] // num_heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=arch in _QK_NORM,
        **rope,
        layer_windows=_layer_windows(arch, config),
        sliding_rope_theta=None if sliding_theta is None else float(sliding_theta),
        hidden_act=_HF_ACTIVATIONS[_activation(arch, config)],
        query_pre_attn_scalar=config.get("query_pre_attn_scalar") if arch in GEMMA else None,
        attn_logit_softcap=config.get("attn_logit_softcapping"),
        final_logit_softcap=config.get("final_logit_softcapping"),
        scale_embeddings=arch in GEMMA,
        sandwich_norms=arch in GEMMA,
        num_experts=num_experts,
        num_experts_per_tok=config.get("num_experts_per_tok", 0) if num_experts else 0,
        norm_topk_prob=arch == "mixtral" or bool(config.get("norm_topk_prob")),
        kv_lora_rank=config["kv_lora_rank"] if mla else 0,
        q_lora_rank=(config.get("q_lora_rank") or 0) if mla else 0,
        qk_rope_head_dim=config["qk_rope_head_dim"] if mla else 0,
        v_head_dim=config["v_head_dim"] if mla else 0,
        **deepseek,
        name=name,
    )


def _rope_scaling(params: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig rope fields of one rope_scaling / rope_parameters dict ({}: no scaling)."""
    kind = params.get("rope_type") or params.get("type")
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return {"rope_llama3_scaling": (*(float(params[k]) for k in keys[:3]), int(params[keys[3]]))}
    if kind == "linear":
        return {"rope_linear_factor": float(params["factor"])}
    if kind == "yarn":
        if "original_max_position_embeddings" not in params:
            raise UnsupportedModelError("rope_scaling yarn without original_max_position_embeddings")
        factor = float(params["factor"])
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            ratio = mscale and mscale_all_dim
            attention_factor = (
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                if ratio
                else _yarn_mscale(factor)
            )
        yarn = (
            factor,
            int(params["original_max_position_embeddings"]),
            float(params.get("beta_fast") or 32),
            float(params.get("beta_slow") or 1),
            bool(params.get("truncate", True)),
        )
        return {"rope_yarn": yarn, "rope_attention_factor": float(attention_factor)}
    if kind not in (None, "default"):
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported")
    return {}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


_DEEPSEEK_ROUTERS = ("greedy", "group_limited_greedy")


def _deepseek_fields(config: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2's mixture of experts (after first_k_dense_replace dense layers, with shared experts)
    and the softmax scale its YaRN adds."""
    fields: dict[str, Any] = {"num_experts": 0}
    rope_parameters = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_yarn") and rope_parameters.get("mscale_all_dim"):
        fields["attention_scale_factor"] = (
            _yarn_mscale(rope["rope_yarn"][0], rope_parameters["mscale_all_dim"]) ** 2
        )
    dense = config.get("first_k_dense_replace", 0)
    if not config.get("n_routed_experts") or dense >= config["num_hidden_layers"]:
        return fields  # every MLP dense
    if config.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModelError(
            "config.json moe_layer_freq != 1: dense layers among expert ones unsupported"
        )
    method = config.get("topk_method", "greedy")
    if method not in _DEEPSEEK_ROUTERS:
        raise UnsupportedModelError(f"config.json topk_method={method!r}: one of {_DEEPSEEK_ROUTERS}")
    groups = (config["n_group"], config["topk_group"]) if method == "group_limited_greedy" else None
    return {
        **fields,
        "num_experts": config["n_routed_experts"],
        "first_dense_layers": dense,
        "shared_experts": bool(config.get("n_shared_experts")),
        "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        "router_groups": groups,
    }


def _activation(arch: str, config: Mapping[str, Any]) -> str:
    if arch in GEMMA:  # Gemma's config names it hidden_activation (hidden_act is Gemma 1's, ignored)
        return config.get("hidden_activation") or "gelu_pytorch_tanh"
    return config.get("hidden_act", "silu")


def _layer_windows(arch: str, config: Mapping[str, Any]) -> tuple[int, ...]:
    """Per layer the sliding window (0: full attention), from `layer_types` where config.json has them."""
    n, window = config["num_hidden_layers"], config.get("sliding_window") or 0
    types = config.get("layer_types")
    if types is None and arch in GEMMA_FULL_EVERY:
        every = config.get("sliding_window_pattern", GEMMA_FULL_EVERY[arch])
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    elif types is None and arch in ("mistral", "mixtral") and window:
        types = ["sliding_attention"] * n
    elif types is None and config.get("use_sliding_window"):  # Qwen2/3 before layer_types
        first = config.get("max_window_layers", n)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    types = types or ["full_attention"] * n
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModelError(f"config.json layer_types {unknown}: not supported")
    if "sliding_attention" in types and not window:
        raise UnsupportedModelError("config.json layer_types has sliding layers but no sliding_window")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _refuse_unsupported_features(config: Mapping[str, Any]) -> None:
    """UnsupportedModelError naming the config.json field of a feature the forward pass lacks."""
    quantization = config.get("quantization_config") or config.get("compression_config")
    if quantization:
        method = quantization.get("quant_method") or quantization.get("format") or "unnamed"
        raise UnsupportedModelError(
            f"config.json quantization_config (quant_method={method!r}): quantized checkpoints are not "
            "supported; serve the unquantized (bf16) checkpoint"
        )
    act = config.get("hidden_activation") or config.get("hidden_act", "silu")
    if act not in _HF_ACTIVATIONS:
        raise UnsupportedModelError(
            f"config.json hidden_act={act!r}: one of {sorted(_HF_ACTIVATIONS)} (SwiGLU, GeGLU)"
        )
    if config.get("mlp_bias"):
        raise UnsupportedModelError("config.json mlp_bias=true: MLP biases are not supported")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(
            "config.json mlp_only_layers / decoder_sparse_step: dense layers among expert ones unsupported"
        )
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("config.json shared experts are not supported")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModelError("config.json use_bidirectional_attention=true: decoders only")
