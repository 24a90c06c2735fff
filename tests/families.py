"""Tiny random-weight checkpoints of model families, written by transformers itself (its own config class,
save_pretrained) over the SmolLM2 vocabulary, and what transformers generates from them: the references of
tests/engine/test_families.py and tests/services/test_families_disaggregated.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_qwen3(path: Path, vocab_size: int):
    """A Qwen3ForCausalLM of 2 layers, 4 query heads on 1 KV head (padded to 2 at TP 2), head_dim 32 (not
    hidden / heads), random q/k norm weights, saved in `path`; returns the transformers model."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:  # wide logits: greedy choices are far from ties
                p.normal_(0, 0.3 if name == "lm_head.weight" else 0.08)
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


def engine_of(path: Path, tokenizer, config, devices=None):
    """An LLMEngine over the folder's weights with `tokenizer` (the SmolLM2 one: the folder has none)."""
    from engine.engine import LLMEngine
    from engine.loader import load_hf_folder
    from engine.models import LoadedModel

    cfg, host = load_hf_folder(path)
    return LLMEngine(LoadedModel(cfg, host, tokenizer, path), config, devices)
