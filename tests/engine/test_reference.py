"""The JAX model against HF transformers on the same GGUF (scripts/make_reference_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.sampling_params import SamplingParams
from tests.conftest import requires_reference

pytestmark = pytest.mark.model

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "reference_smollm2.npz"
MAX_LOGIT_DIFF = 1e-3


def load_fixtures() -> list[tuple[list[int], np.ndarray, list[int]]]:
    data = np.load(FIXTURES)
    count = len([k for k in data.files if k.startswith("prompt_")])
    return [
        (data[f"prompt_{i}"].tolist(), data[f"logits_{i}"], data[f"greedy_{i}"].tolist())
        for i in range(count)
    ]


GREEDY_IGNORE_EOS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def test_fixtures_cover_a_long_prompt():
    lengths = [len(p) for p, _, _ in load_fixtures()]
    assert max(lengths) >= 600 and min(lengths) == 1


@pytest.mark.parametrize("index", range(5))
def test_last_logits_match_transformers(full_engine, index):
    prompt, expected, _ = load_fixtures()[index]
    engine = full_engine
    got = engine.prompt_logits(prompt)
    assert np.max(np.abs(got - expected)) <= MAX_LOGIT_DIFF


def test_greedy_tokens_match_transformers_batched(full_engine):
    """All fixture prompts decoded together (mixed lengths, the long one chunked) give HF's 32 tokens."""
    fixtures = load_fixtures()
    engine = full_engine
    results = engine.generate([p for p, _, _ in fixtures], GREEDY_IGNORE_EOS)
    for (_, _, expected), result in zip(fixtures, results, strict=True):
        assert result.token_ids == expected
    assert engine.scheduler.kv.pool.num_used == 0


@pytest.mark.reference
@requires_reference
def test_live_cross_check_and_hf_folder_loading(gguf_path, model_path, small_config, tmp_path):
    """transformers' conversion of the test model's GGUF file (the folder pdserve.testing.models has it
    write) is the reference: pdserve loads the GGUF file and a two-shard copy of the folder, and both match
    its logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    hf_tok = AutoTokenizer.from_pretrained(model_path)
    # the folder again in two shards and an index, as large checkpoints come
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / file)
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_tok.save_pretrained(tmp_path)
    prompt = "Disaggregated serving splits prefill and decode because"
    ids = hf_tok.encode(prompt)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0, -1].numpy()
    gguf_model, folder_model = load_model(gguf_path), load_model(tmp_path)
    assert folder_model.config.num_layers == gguf_model.config.num_layers
    assert folder_model.tokenizer.encode(prompt) == ids == gguf_model.tokenizer.encode(prompt)
    for model in (gguf_model, folder_model):
        engine = LLMEngine(model, small_config)
        assert np.max(np.abs(engine.prompt_logits(ids) - expected)) <= MAX_LOGIT_DIFF
