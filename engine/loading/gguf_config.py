"""GGUF metadata -> the config.json of the same model, which `ModelConfig.from_hf_config` reads (one reader of
a model's fields for both formats).

GGUF keys are llama.cpp's (`{arch}.block_count`, ...). Where GGUF has no key, llama.cpp fixes the value
per architecture, and so does this module (read from llama.cpp at ggml-org/llama.cpp@0c1e57098,
src/llama-model.cpp and src/models/*.cpp):
  * Gemma 2 and 3: the layer pattern (Gemma 2: every second layer full; Gemma 3: every sixth, when the
    file has a sliding window), unless the file has `attention.sliding_window_pattern` (true: sliding);
    the attention scale, head_dim ** -0.5, or (hidden / heads) ** -0.5 for the 27B models (46 and 62
    layers) whatever `query_pre_attn_scalar` the checkpoint had; Gemma 2's soft caps default to 50 / 30;
    Gemma 3's sliding layers rotate with base 10000 unless `rope.freq_base_swa` says;
  * mixtures of experts (Qwen3-MoE; Mixtral, whose GGUF architecture is `llama` with `expert_count`):
    the top k routing weights are always renormalized (Qwen3-MoE's `norm_topk_prob` is not stored);
  * DeepSeek-V2 (`deepseek2`): YaRN's mscale is `rope.scaling.yarn_log_multiplier` / 0.1 for both of
    DeepSeek's mscales, its betas are 32 and 1; its KV head count is stored as 1 (the latent's).
llama.cpp's converter also stores Gemma's norm weights as 1 + w, and Llama's and Mixtral's q/k rows
permuted for its rope: engine.loading.checkpoints reads them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.config import GEMMA_FULL_EVERY, UnsupportedModelError

# GGUF general.architecture -> the transformers class of its config.json
_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
}
GGUF_ARCHITECTURES = tuple(_CLASSES)
ROPE_PERMUTED = ("llama", "mistral")  # q/k rows stored permuted by llama.cpp's converter (Mixtral too)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # scaled by (hidden / heads) ** -0.5 in llama.cpp


def hf_config(meta: Mapping[str, Any], tie_word_embeddings: bool) -> dict[str, Any]:
    """The config.json fields of the GGUF file's model. GGUF says nothing about tied embeddings; the caller
    knows from the tensor list (no `output.weight`)."""
    arch = meta.get("general.architecture")
    if arch not in _CLASSES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {GGUF_ARCHITECTURES})"
        )

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads, layers = (int(get(k)) for k in ("embedding_length", "attention.head_count", "block_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    config: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if arch == "llama" and experts else _CLASSES[arch]],
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": tie_word_embeddings,
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none") and (arch, scaling) != ("deepseek2", "yarn"):  # YaRN: _deepseek2
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
    if experts and arch != "deepseek2":
        config["num_local_experts" if arch == "llama" else "num_experts"] = experts
        config["num_experts_per_tok"] = int(get("expert_used_count"))
        config["moe_intermediate_size"] = int(get("expert_feed_forward_length", config["intermediate_size"]))
        config["norm_topk_prob"] = True
    if arch in GEMMA_FULL_EVERY:
        config.update(_gemma(arch, meta, layers, hidden // heads, head_dim))
    if arch == "deepseek2":
        config.update(_deepseek2(meta, heads, get))
    return config


def _gemma(arch: str, meta: Mapping[str, Any], layers: int, width: int, head_dim: int) -> dict[str, Any]:
    window = int(meta.get(f"{arch}.attention.sliding_window") or (4096 if arch == "gemma2" else 0))
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if not window:
        sliding = [False] * layers
    elif pattern is None or isinstance(pattern, int):
        every = pattern or GEMMA_FULL_EVERY[arch]
        sliding = [(i + 1) % every != 0 for i in range(layers)]
    else:
        sliding = [bool(s) for s in pattern]
    fields = {
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": width if layers == _GEMMA_27B_LAYERS[arch] else head_dim,
        "final_logit_softcapping": meta.get(
            f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else None
        ),
    }
    if arch == "gemma2":
        fields["attn_logit_softcapping"] = meta.get(f"{arch}.attn_logit_softcapping", 50.0)
    swa_theta = meta.get(f"{arch}.rope.freq_base_swa", 10000.0 if arch == "gemma3" else None)
    if swa_theta is not None:
        fields["rope_local_base_freq"] = float(swa_theta)
    return fields


def _deepseek2(meta: Mapping[str, Any], heads: int, get) -> dict[str, Any]:
    """DeepSeek-V2's MLA and experts. Older conversions have no `*_length_mla` keys: their key and value
    lengths are then the heads' own."""
    rope_dims, rank = int(get("rope.dimension_count")), int(get("attention.kv_lora_rank"))
    if int(meta.get("deepseek2.expert_group_count") or 1) > 1:
        raise UnsupportedModelError(
            "GGUF deepseek2.expert_group_count > 1: llama.cpp's choice of groups (each group's top two "
            "summed) is not implemented"
        )
    if int(meta.get("deepseek2.expert_gating_func") or 1) != 1:
        raise UnsupportedModelError("GGUF deepseek2.expert_gating_func: only softmax routing is supported")
    key, value = (meta.get(f"deepseek2.attention.{k}_length_mla") for k in ("key", "value"))
    if key is None:
        key, value = get("attention.key_length"), get("attention.value_length")
    fields: dict[str, Any] = {
        "num_key_value_heads": heads,
        "kv_lora_rank": rank,
        "q_lora_rank": meta.get("deepseek2.attention.q_lora_rank"),
        "qk_rope_head_dim": rope_dims,
        "qk_nope_head_dim": int(key) - rope_dims,
        "v_head_dim": int(value),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "n_routed_experts": int(get("expert_count", 0)),
        "num_experts_per_tok": int(get("expert_used_count", 0)),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "moe_intermediate_size": int(get("expert_feed_forward_length", 0)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "topk_method": "greedy",
    }
    if meta.get("deepseek2.rope.scaling.type") == "yarn":
        mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        fields["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "mscale": mscale,
            "mscale_all_dim": mscale,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        }
    return fields
