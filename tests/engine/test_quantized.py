"""Weight-only int8 (engine.model.quantized, `--quantization int8`): the quantization's rounding, the
projection that scales its int8 product, and an engine that serves what the quantized weights mean."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pdserve.engine.model.projection import project, stack_layers
from pdserve.engine.model.quantized import Int8Weight, dequantize, quantize


@pytest.mark.fast
def test_each_output_channel_rounds_to_its_own_scale():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 16, 3, 5)).astype(np.float32) * rng.uniform(0.01, 10, (2, 1, 3, 5))
    w[1, :, 2, 4] = 0.0  # an all-zero channel
    values, scale = quantize(w)
    assert values.dtype == np.int8 and values.shape == w.shape and scale.shape == (2, 3, 5)
    assert np.abs(values).max() == 127 and scale[1, 2, 4] == 1.0 and not values[1, :, 2, 4].any()
    # the largest magnitude of each channel maps to 127, every value is off by at most half a step
    np.testing.assert_allclose(np.abs(w).max(axis=1), scale * 127 * (scale != 1), rtol=1e-6)
    assert np.all(np.abs(dequantize(values, scale) - w) <= scale[:, None] / 2 * (1 + 1e-6))


@pytest.mark.fast
def test_a_projection_scales_its_int8_product():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    values, scale = quantize(rng.standard_normal((1, 16, 3, 5)).astype(np.float32))
    w = Int8Weight(jnp.asarray(values[0]), jnp.asarray(scale[0]))
    expected = jnp.einsum("td,dkx->tkx", x, dequantize(values, scale)[0])
    np.testing.assert_allclose(project("td,dkx->tkx", x, w), expected, rtol=1e-5, atol=1e-5)
    plain = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    np.testing.assert_array_equal(project("ti,id->td", x, plain), x @ plain)


@pytest.mark.model
def test_an_int8_engine_serves_its_quantized_weights_on_any_tp(loaded_model, small_config):
    """The int8 engine's logits equal a float32 engine's over the dequantized weights (the same model up
    to float rounding), on one device and split over two; its projections are int8 on the devices, and
    its KV layout names the quantization (a float32 replica's KV does not fit it)."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.checkpoints import HostCheckpoint
    from pdserve.engine.model.quantized import QUANTIZED

    host = dict(loaded_model.checkpoint.host)
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        host[name] = dequantize(*quantize(host[name]))
    dequantized = dataclasses.replace(
        loaded_model, checkpoint=HostCheckpoint(loaded_model.config, host, loaded_model.path)
    )
    int8 = dataclasses.replace(small_config, quantization="int8")
    reference = LLMEngine(dequantized, small_config)
    engines = [LLMEngine(loaded_model, int8), LLMEngine(loaded_model, dataclasses.replace(int8, tp=2))]
    prompt = loaded_model.tokenizer.encode("The three primary colours are red, yellow and")
    expected = reference.prompt_logits(prompt)
    for engine in engines:
        np.testing.assert_allclose(engine.prompt_logits(prompt), expected, atol=2e-4)
        layers = engine.runner.weights.layers[0]
        for name in QUANTIZED:
            w = stack_layers(getattr(layers, name))  # held per layer on a CPU
            assert isinstance(w, Int8Weight) and w.values.dtype == jnp.int8, name
        for layer in layers.w_gate_up.arrays:  # each layer's array split over the mesh as the stack would be
            shard = layer.values.addressable_shards[0].data
            assert shard.shape[-1] * engine.config.tp == layer.values.shape[-1]
        assert engine.kv_layout.model.endswith("+int8") and engine.summary()["quantization"] == "int8"
    assert reference.kv_layout.model + "+int8" == engines[0].kv_layout.model


@pytest.mark.model
def test_int8_weights_are_sized_at_a_byte_a_projection_parameter(loaded_model, monkeypatch):
    """The check before loading counts the projections at one byte: a budget between the int8 and the
    float32 estimate refuses float32 weights and admits int8 ones."""
    from pdserve.engine import memory
    from pdserve.engine.config import EngineConfig, SizingError
    from pdserve.engine.model.sharding import make_mesh

    cfg, params = loaded_model.config, loaded_model.checkpoint.num_params
    outside = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    budget = (params * 4 + outside * 4 + params - outside) // 2
    monkeypatch.setattr(memory, "available_ram", lambda held=0: 10 * budget - held)
    config, mesh = EngineConfig(gpu_memory_utilization=0.1, dtype="float32"), make_mesh(1)
    with pytest.raises(SizingError, match="parameters in float32 over TP 1"):
        memory.check_weights_fit(cfg, config, mesh, params)
    memory.check_weights_fit(cfg, dataclasses.replace(config, quantization="int8"), mesh, params)
    with pytest.raises(SizingError, match="float32, projections int8 over TP 1"):
        memory.check_weights_fit(cfg, dataclasses.replace(config, quantization="int8"), mesh, params * 4)


@pytest.mark.model
def test_int8_is_refused_for_mixture_of_experts_before_any_weight_is_read(small_config):
    from pdserve.engine.config import ModelConfig, UnsupportedModelError
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.checkpoints import HostCheckpoint
    from pdserve.engine.loading.sources import LoadedModel

    config = ModelConfig.from_hf_config(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            **dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2),
            **dict(num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=128),
            **dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
        }
    )
    model = LoadedModel(config, HostCheckpoint(config, {}), None, None)
    with pytest.raises(UnsupportedModelError, match="--quantization int8"):
        LLMEngine(model, dataclasses.replace(small_config, quantization="int8"))
