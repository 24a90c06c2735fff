"""Model families beyond Llama against transformers, each on a tiny random-weight checkpoint that
transformers itself writes in the test set-up (its own config class, save_pretrained) over the SmolLM2
vocabulary: last-position logits within 1e-3 in float32, and 32 identical greedy tokens, batched, with
chunked prefill, and at TP 2 with padded heads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytestmark = pytest.mark.model

PROMPT_LENGTHS = (7, 45, 150)  # the longest is prefilled in three chunks (64-token steps)
SMALL = dict(num_blocks=96, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, loaded_model):
    """(transformers model, folder): 2 layers, 4 query heads on 1 KV head (padded to 2 at TP 2), head_dim
    32 (not hidden / heads), random q/k norm weights."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=loaded_model.config.vocab_size,
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
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return model, path


def _engine(path, tokenizer, **overrides):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.loader import load_hf_folder
    from engine.models import LoadedModel

    cfg, host = load_hf_folder(path)
    return LLMEngine(
        LoadedModel(cfg, host, tokenizer, path), dataclasses.replace(EngineConfig(**SMALL), **overrides)
    )


def _hf_greedy(model, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
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


def test_qwen3_matches_transformers(qwen3, loaded_model):
    import jax

    from engine.sampling_params import SamplingParams

    model, path = qwen3
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, loaded_model.config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    expected = [_hf_greedy(model, p, 32) for p in prompts]
    engine = _engine(path, loaded_model.tokenizer)
    assert engine.model.config.qk_norm and engine.model.config.head_dim == 32
    for prompt, (logits, _) in zip(prompts, expected, strict=True):
        assert np.max(np.abs(engine.prompt_logits(prompt) - logits)) <= 1e-3
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = [tokens for _, tokens in expected]
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == tokens  # batched, chunked prefill
    tp2 = _engine(path, loaded_model.tokenizer, tp=2)
    assert len(jax.devices()) >= 2 and tp2.config.tp == 2
    assert [c.token_ids for c in tp2.generate(prompts, greedy)] == tokens
