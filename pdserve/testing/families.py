"""Tiny random-weight checkpoints of model families, written by transformers itself (its own config class,
save_pretrained) over the SmolLM2 vocabulary, and what transformers generates from them: the references of
tests/engine/test_families.py and tests/services/test_families_disaggregated.py."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import numpy as np

SLIDING_WINDOW = 24  # tokens (1.5 blocks of 16): the tests' prompts are several windows long

# Per family: its transformers config and model classes, and the config's fields. Small heads, head_dim
# not hidden / heads, KV heads that TP 2 must pad; Gemma with sliding and full layers mixed.
_TINY = {
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    "mistral": (  # every layer sliding: blocks out of the window are given back
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_hidden_layers=2, num_key_value_heads=1, sliding_window=SLIDING_WINDOW),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=1,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_hidden_layers=2, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    ),
    # MLA (a latent of 32 + 8 rope dims, V2-Lite's plain query projection) with YaRN, a dense layer then an
    # expert layer (8 experts in 4 groups, the best 2 groups' top 2 scaled, a shared expert)
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=24,
            qk_rope_head_dim=8,
            v_head_dim=16,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            routed_scaling_factor=1.5,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
}


def write_family(family: str, path: Path, vocab_size: int, **overrides):
    """A tiny random-weight checkpoint of `family` (a key of _TINY; `overrides`: config fields), 4 query
    heads of head_dim 32, saved in `path` by transformers; returns the transformers model."""
    import torch
    import transformers

    config_class, model_class, fields = _TINY[family]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=family != "qwen3",
    )
    config = getattr(transformers, config_class)(**{**common, **fields, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + weight: random weights both ways
                p.copy_((0 if family.startswith("gemma") else 1) + 0.3 * torch.randn_like(p))
            elif name.endswith(("lm_head.weight", "gate.weight")):  # wide logits, routers' too: no near ties
                p.normal_(0, 0.3 if name == "lm_head.weight" else 1.0)
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """transformers' last-position logits of the prompt, and its greedy continuation (with its KV cache)."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        first, tokens, past = out.logits[0, -1].numpy(), [], out.past_key_values
        logits = first
        for _ in range(steps):
            tokens.append(int(np.argmax(logits)))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            logits, past = out.logits[0, -1].numpy(), out.past_key_values
    return first, tokens


def engine_of(path: Path, tokenizer, config, devices=None, attention=None):
    """An LLMEngine over the folder's weights with `tokenizer` (the SmolLM2 one: the folder has none);
    `attention`: its attention implementation (default: the platform's)."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.checkpoints import SafetensorsCheckpoint
    from pdserve.engine.loading.sources import LoadedModel

    checkpoint = SafetensorsCheckpoint(path)
    return LLMEngine(LoadedModel(checkpoint.config, checkpoint, tokenizer, path), config, devices, attention)


GGUF_ARCHITECTURES = {
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "deepseek_v2": "deepseek2",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_KINDS = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


def write_gguf(family: str, folder: Path, out: Path) -> None:
    """The family's checkpoint in `folder` as llama.cpp's converter writes it (convert_hf_to_gguf at
    ggml-org/llama.cpp@0c1e57098): gguf's own tensor names, experts stacked [experts, out, in], Gemma's norm
    weights as 1 + w, Mixtral's q/k rows permuted for llama.cpp's rope (its GGUF architecture is `llama`),
    no lm_head for Gemma 2; its metadata keys. Gemma's sliding layers are named by
    `attention.sliding_window_pattern`, which llama.cpp reads (its converter leaves the fixed pattern)."""
    import gguf
    from safetensors.numpy import load_file

    from pdserve.engine.config import ModelConfig

    config = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(config)
    arch = GGUF_ARCHITECTURES[family]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_layers)
    tensors, experts = {}, collections.defaultdict(dict)
    for key, w in load_file(str(folder / "model.safetensors")).items():
        expert = _EXPERT.fullmatch(key)
        if expert:
            experts[int(expert[1]), _EXPERT_KINDS[expert[3]]][int(expert[2])] = w
            continue
        if family == "gemma2" and key == "lm_head.weight":
            continue
        if family.startswith("gemma") and key.endswith("norm.weight"):
            w = w + 1
        if key.endswith("kv_b_proj.weight"):  # split: k_b [heads, rank, nope], v_b [heads, v, rank]
            layer = key.split(".")[2]
            w = w.reshape(config["num_key_value_heads"], -1, w.shape[-1])
            nope = config["qk_nope_head_dim"]
            tensors[f"blk.{layer}.attn_k_b.weight"] = w[:, :nope].transpose(0, 2, 1)
            tensors[f"blk.{layer}.attn_v_b.weight"] = w[:, nope:]
            continue
        if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in key else cfg.num_kv_heads
            w = w.reshape(heads, 2, -1, w.shape[-1]).swapaxes(1, 2).reshape(w.shape)
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name, f"gguf has no name for {key}"
        tensors[name] = w
    for (layer, kind), by_expert in experts.items():
        tensors[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(cfg.num_heads)
    if cfg.is_mla:
        _deepseek2_metadata(writer, config, cfg)
    else:
        writer.add_head_count_kv(cfg.num_kv_heads)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if family != "gemma2":  # its converter writes no rope base (llama.cpp's default: 10000)
        writer.add_rope_freq_base(cfg.rope_theta)
    if cfg.num_experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if family in ("qwen3_moe", "deepseek_v2"):
            writer.add_expert_feed_forward_length(cfg.intermediate_size)
    if family.startswith("gemma"):
        writer.add_sliding_window(cfg.widest_window or max(cfg.layer_windows))
        writer.add_sliding_window_pattern([bool(cfg.window(i)) for i in range(cfg.num_layers)])
        if cfg.final_logit_softcap:
            writer.add_final_logit_softcapping(cfg.final_logit_softcap)
    if cfg.attn_logit_softcap:
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcap)
    if cfg.sliding_rope_theta:
        writer.add_rope_freq_base_swa(cfg.sliding_rope_theta)
    if cfg.rope_linear_factor != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_linear_factor)
    for name, w in tensors.items():
        writer.add_tensor(name, np.asarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _deepseek2_metadata(writer, config: dict, cfg) -> None:
    """DeepSeek-V2's keys as llama.cpp's converter writes them (one KV head: the latent's)."""
    import gguf

    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    writer.add_head_count_kv(1)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_leading_dense_block_count(cfg.first_dense_layers)
    writer.add_expert_shared_count(config.get("n_shared_experts") or 0)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_expert_group_count(config.get("n_group") or 1)
    writer.add_expert_group_used_count(config.get("topk_group") or 1)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
