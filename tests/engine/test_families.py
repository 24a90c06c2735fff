"""Model families beyond Llama against transformers, each on a tiny random-weight checkpoint that
transformers itself writes in the test set-up (its own config class, save_pretrained) over the SmolLM2
vocabulary: last-position log-probabilities within 1e-3 in float32, and 32 identical greedy tokens,
batched, with chunked prefill. And each family's GGUF, converted as llama.cpp does, loads as its folder."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdserve.testing.families import _TINY, engine_of, hf_greedy, write_family

pytestmark = pytest.mark.model

PROMPT_LENGTHS = (7, 45, 150)  # the longest is prefilled in three chunks (64-token steps)
TOP = 8  # log-probabilities compared
SMALL = dict(num_blocks=96, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64)


def _engine(path, tokenizer, **overrides):
    from pdserve.engine.config import EngineConfig

    return engine_of(path, tokenizer, dataclasses.replace(EngineConfig(**SMALL), **overrides))


# What each family adds to Llama's forward pass (pdserve/testing/families.py writes them)
FAMILIES = {
    "qwen3": "q/k norm per head",
    "mistral": "every layer sliding (blocks out of the window given back as requests advance)",
    "gemma3": "sliding and full layers with their own rope (linear scaling on full ones), GeGLU, sandwich "
    "and q/k norms of weight 1 + w, scaled embeddings, query_pre_attn_scalar",
    "gemma2": "softcapped attention scores and logits, alternating sliding layers",
    "qwen3_moe": "8 experts, top 2 of the softmax as they are, q/k norm",
    "mixtral": "8 experts, top 2 renormalized",
    "deepseek_v2": "multi-head latent attention: a 40-dim latent cache, up-projections absorbed",
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, tmp_path, loaded_model):
    """Prompts of 7, 45 and 150 tokens (the sliding window is 24), batched with chunked prefill: 32 greedy
    tokens, and the last prompt position's top log-probabilities (the logits less their log-sum-exp, from
    the raw logits) within 1e-3. TP 2: tests/services/test_families_disaggregated.py."""
    import torch

    from pdserve.engine.sampling_params import SamplingParams

    pytest.importorskip("transformers")
    model = write_family(family, tmp_path, loaded_model.config.vocab_size)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, loaded_model.config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    expected = [hf_greedy(model, p, 32) for p in prompts]
    engine = _engine(tmp_path, loaded_model.tokenizer)
    assert engine.model.config.head_dim == 32 and engine.model.config.architecture == family
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=TOP)
    completions = engine.generate(prompts, greedy)  # batched, chunked prefill
    assert [c.token_ids for c in completions] == [tokens for _, tokens in expected]
    for completion, (logits, _) in zip(completions, expected, strict=True):  # the last prompt position's
        logprobs = torch.log_softmax(torch.from_numpy(logits), -1).numpy()
        top = completion.logprobs[0].top
        assert [t for t, _ in top] == list(np.argsort(-logprobs)[:TOP])
        assert max(abs(lp - logprobs[t]) for t, lp in top) <= 1e-3
    assert engine.scheduler.release_window == (24 if family == "mistral" else 0)
    if family == "gemma3":  # sliding layers [S, F, S]: two rings of 7 blocks (23 + 64 tokens), reused
        assert engine.scheduler.kv.ring_blocks == (7, 7) and max(PROMPT_LENGTHS) + 32 > 7 * 16


# llama.cpp's fixed choices where GGUF has no key (loading/gguf_config.py), against the tiny checkpoints'
# config.json: Gemma's attention scale is head_dim's (the checkpoints say 24), Qwen3-MoE renormalizes
_LLAMA_CPP_CHOICES = {
    "gemma2": dict(query_pre_attn_scalar=32),
    "gemma3": dict(query_pre_attn_scalar=32),
    "qwen3_moe": dict(norm_topk_prob=True),
    "mixtral": {},
    "deepseek_v2": {},
}
# what llama.cpp cannot read: group-limited routing (it sums each group's top two), two YaRN mscales
_GGUF_CHECKPOINTS = {
    "deepseek_v2": dict(
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        rope_parameters={
            **_TINY["deepseek_v2"][2]["rope_parameters"],
            "mscale": 0.707,
        },
    )
}


@pytest.mark.parametrize("family", list(_LLAMA_CPP_CHOICES))
def test_gguf_of_a_family_loads_as_its_safetensors_folder(family, tmp_path):
    """A tiny transformers checkpoint converted as llama.cpp does (testing.families.write_gguf) loads to
    the folder's config and weights: tensor names, stacked experts, Gemma's 1 + w norms, Mixtral's
    permuted q/k, sliding windows and their rope bases, soft caps, linear rope scaling, DeepSeek-V2's split
    kv_b and its YaRN."""
    from pdserve.engine.loading.checkpoints import load_gguf, load_hf_folder
    from pdserve.testing.families import write_gguf

    pytest.importorskip("transformers")
    write_family(family, tmp_path / "hf", 256, **_GGUF_CHECKPOINTS.get(family, {}))
    write_gguf(family, tmp_path / "hf", tmp_path / "m.gguf")
    cfg, host = load_hf_folder(tmp_path / "hf", name="m")
    gguf_cfg, gguf_host, _ = load_gguf(tmp_path / "m.gguf", name="m")
    float32s = {k: getattr(gguf_cfg, k) for k in ("rms_norm_eps", "attention_scale_factor")}  # in GGUF
    assert float32s == pytest.approx({k: getattr(cfg, k) for k in float32s}, rel=1e-6)
    digest = {"weights_digest": gguf_cfg.weights_digest}  # (the two formats' bytes differ)
    assert gguf_cfg == dataclasses.replace(cfg, **float32s, **_LLAMA_CPP_CHOICES[family], **digest)
    assert host.keys() == gguf_host.keys()
    for key in host:
        np.testing.assert_allclose(gguf_host[key], host[key], rtol=1e-6, atol=1e-7, err_msg=key)
