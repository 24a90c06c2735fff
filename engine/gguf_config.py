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
    the top k routing weights are always renormalized (Qwen3-MoE's `norm_topk_prob` is not stored).
llama.cpp's converter also stores Gemma's norm weights as 1 + w, and Llama's and Mixtral's q/k rows
permuted for its rope: engine.loader reads them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.config import GEMMA_FULL_EVERY, UnsupportedModelError

# GGUF general.architecture -> the transformers class of its config.json
_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
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
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
    if experts:
        config["num_local_experts" if arch == "llama" else "num_experts"] = experts
        config["num_experts_per_tok"] = int(get("expert_used_count"))
        config["moe_intermediate_size"] = int(get("expert_feed_forward_length", config["intermediate_size"]))
        config["norm_topk_prob"] = True
    if arch in GEMMA_FULL_EVERY:
        config.update(_gemma(arch, meta, layers, hidden // heads, head_dim))
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
