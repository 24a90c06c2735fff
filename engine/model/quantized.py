"""Weight-only int8 (`--quantization int8`): the attention and MLP projections held as int8 with one scale
per output channel (symmetric, round to nearest), about a quarter of float32's bytes and half of
bfloat16's; activations, the KV cache, embeddings and norms keep the serving dtype.

A projection multiplies by the int8 values converted to the activations' dtype, then scales its output
(engine.model.projection.project). Inside the layer scan XLA converts one layer's weights at a time: on CPU
the step's temporaries hold one layer's expanded projections, never the whole stack (bench/bench_int8.py
measures it). Mixture-of-experts and MLA models are not quantized (their expert and latent arrays would need
their own scales): engines refuse the flag for them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

QUANTIZED = ("w_qkv", "wo", "w_gate_up", "w_down")  # LayerWeights fields held as Int8Weight under int8
INPUT_AXIS = 1  # of a stacked projection [layers, input, outputs...]: the axis its matmul contracts


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight:
    """A stacked projection as int8 values and the scale of each output channel: the weight is
    `values * scale[:, None]` (the scale broadcast over the input axis)."""

    values: jax.Array  # int8 [layers, input, outputs...]
    scale: jax.Array  # the serving dtype [layers, outputs...]


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 values and float32 scales of a stacked projection `w` [layers, input, outputs...], one scale per
    output channel: the largest magnitude of the channel maps to 127 (an all-zero channel gets scale 1)."""
    scale = np.abs(w).max(axis=INPUT_AXIS, keepdims=True).astype(np.float32) / 127.0
    scale[scale == 0] = 1.0
    values = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return values, np.squeeze(scale, axis=INPUT_AXIS)


def dequantize(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weight that int8 `values` and their `scale` stand for."""
    return values.astype(np.float32) * np.expand_dims(scale, INPUT_AXIS)


def scale_axes(axes: tuple[str | None, ...]) -> tuple[str | None, ...]:
    """The logical axes of a projection's scale: the projection's without its input axis."""
    return axes[:INPUT_AXIS] + axes[INPUT_AXIS + 1 :]
