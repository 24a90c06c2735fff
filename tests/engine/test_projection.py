"""Projections held per layer (engine.model.projection): the same products as the stacked weights', with
no copy of a layer's matrix in the compiled scan, and an engine on a CPU serving from them."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdserve.engine.model import projection
from pdserve.engine.model.projection import LayerChoice, PerLayer, project, stack_layers
from pdserve.engine.model.quantized import QUANTIZED, Int8Weight, quantize

LAYERS, IN, OUT = 3, 48, 48  # square: the products chain through a residual


def _scan(w, x: jax.Array) -> jax.Array:
    """x through LAYERS chained products (a residual), the weights scanned as the engine's layer scan does:
    a stacked weight sliced by the scan, a PerLayer switched on the layer index."""
    held = isinstance(w, PerLayer)

    def layer(h, xs):
        w_i, index = xs
        return h + jnp.tanh(project("td,dx->tx", h, LayerChoice(w, index) if held else w_i)), None

    return jax.lax.scan(layer, x, (None if held else w, jnp.arange(LAYERS)))[0]


def _per_layer(stacked) -> PerLayer:
    return PerLayer(tuple(jax.tree.map(lambda a, i=i: a[i : i + 1], stacked) for i in range(LAYERS)))


def _weights(rng, int8: bool):
    w = rng.standard_normal((LAYERS, IN, OUT)).astype(np.float32) / IN**0.5
    if int8:
        values, scale = quantize(w)
        return Int8Weight(jnp.asarray(values), jnp.asarray(scale))
    return jnp.asarray(w)


@pytest.mark.fast
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_a_projection_held_per_layer_multiplies_as_the_stacked_one(int8):
    rng = np.random.default_rng(0)
    stacked = _weights(rng, int8)
    x = jnp.asarray(rng.standard_normal((5, IN)), jnp.float32)
    per_layer = _per_layer(stacked)
    assert len(per_layer.arrays) == LAYERS and per_layer.shape == (LAYERS, IN, OUT)
    jax.tree.map(np.testing.assert_array_equal, stack_layers(per_layer), stacked)
    scan = jax.jit(_scan)
    np.testing.assert_array_equal(scan(per_layer, x), scan(stacked, x))


def _dynamic_slices_of_a_layer(w) -> int:
    """The compiled scan's dynamic slices shaped as one layer's matrix: copies of a layer's weight."""
    x = jnp.zeros((4, IN), jnp.float32)
    hlo = jax.jit(_scan).lower(w, x).compile().as_text()
    return len(re.findall(rf"f32\[{IN},{OUT}\]\S* (?:dynamic-slice|fusion)\([^)]*\).*dynamic.slice", hlo))


@pytest.mark.fast
def test_the_compiled_scan_copies_no_layer_of_a_projection_held_per_layer():
    """What holding them per layer is for (XLA:CPU): over stacked weights the step copies each layer's
    matrix out of the stack before its dot; over a PerLayer each dot reads its own array."""
    stacked = _weights(np.random.default_rng(2), False)
    assert _dynamic_slices_of_a_layer(stacked) >= 1  # the copy exists, so the check below can see one
    assert _dynamic_slices_of_a_layer(_per_layer(stacked)) == 0


@pytest.mark.model
def test_an_engine_on_a_cpu_serves_from_projections_held_per_layer(make_engine, loaded_model, monkeypatch):
    """The CPU's engine holds its projections per layer; an engine holding them stacked (the TPU's way)
    computes the same logits (up to float rounding: its step has other shapes)."""
    from pdserve.engine.llm_engine import LLMEngine

    per_layer = make_engine()
    layers = per_layer.runner.weights.layers[0]
    for name in QUANTIZED:  # the projections
        assert isinstance(getattr(layers, name), PerLayer), name
    monkeypatch.setattr(projection, "PER_LAYER_PLATFORMS", ())
    config = dataclasses.replace(per_layer.config, max_num_seqs=1)  # one step shape is enough
    stacked = LLMEngine(loaded_model, config)
    assert isinstance(stacked.runner.weights.layers[0].wo, jax.Array)
    prompt = loaded_model.tokenizer.encode("The three primary colours are red, yellow and")
    np.testing.assert_allclose(per_layer.prompt_logits(prompt), stacked.prompt_logits(prompt), atol=1e-4)


@pytest.mark.model
def test_the_loader_compiles_the_same_writes_for_any_number_of_layers():
    """Each layer's projections held per layer are arrays of their own (`w_qkv#3`), yet written by the same
    compiled programs as every other layer's: a 4-layer model's load compiles what a 2-layer one's does."""
    from pdserve.engine.loading.sources import load_model
    from pdserve.engine.model.sharding import make_mesh
    from pdserve.engine.model.weights import build_weights
    from pdserve.testing.compile_watch import count_compilations
    from pdserve.testing.models import small_model

    counts = []
    for layers in (2, 4):
        model = load_model(small_model(layers))
        jax.clear_caches()  # (compile-or-load events: the persistent cache's loads count too)
        with count_compilations() as counted:
            weights = build_weights(model.config, model.checkpoint, make_mesh(1))
        assert (
            isinstance(weights.layers[0].w_down, PerLayer) and len(weights.layers[0].w_down.arrays) == layers
        )
        counts.append(counted())
    assert counts[0] == counts[1], counts
