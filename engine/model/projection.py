"""A layer's projections: the weight forms a projection takes, and `project`, the one function that
multiplies by any of them.

A projection's weight is a plain array, an Int8Weight (engine.model.quantized), or one layer of a PerLayer.
PerLayer holds a run of layers' projection as one array per layer instead of one array stacked over the
layers. On XLA:CPU a dot cannot read its operand from a slice of a larger array: inside the layer `lax.scan`
over stacked [layers, in, out] weights, the compiled step copies each layer's slice of every matrix into a
buffer of its own before its dot (a dynamic-slice fusion per matrix and layer, every step), and at a decode
step's few rows those copies cost about as much as the products. Held per layer, the scan body picks its
layer's array with `lax.switch` on the layer index (`hold_apart`, `at_layer`): each branch's dot reads its own
array where it lies. On a TPU or a GPU the weights stay stacked (`held_per_layer`): their compilers fuse a
slice into the dot that reads it, and neither is measured here. bench/bench_engine.py's `products` and
docs/benchmark-history.md have the measurements.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pdserve.engine.model.quantized import Int8Weight

# The platforms whose dots copy a slice of a stacked weight before reading it: their projections are held
# per layer (measured on XLA:CPU; the TPU's and GPU's are not measured here).
PER_LAYER_PLATFORMS = ("cpu",)


def held_per_layer(mesh: Mesh) -> bool:
    """Whether the projections of weights on `mesh` are held per layer (PerLayer) rather than stacked."""
    return mesh.devices.flat[0].platform in PER_LAYER_PLATFORMS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PerLayer:
    """A run of layers' projection as one array (or Int8Weight) per layer, each with a leading layer axis of
    1, sharded as the stacked array would be: layer i's weight is `arrays[i]`."""

    arrays: tuple[jax.Array | Int8Weight, ...]

    @property
    def _first(self) -> jax.Array:  # layer 0's array (its values, for int8)
        first = self.arrays[0]
        return first.values if isinstance(first, Int8Weight) else first

    @property
    def shape(self) -> tuple[int, ...]:
        """The stacked array's shape: [layers, input, outputs...] (of the values, for int8)."""
        return (len(self.arrays), *self._first.shape[1:])

    @property
    def dtype(self):
        return self._first.dtype


def stack_layers(w: jax.Array | Int8Weight | PerLayer) -> jax.Array | Int8Weight:
    """A projection's layers stacked on the leading axis, whichever way it is held."""
    if not isinstance(w, PerLayer):
        return w
    return jax.tree.map(lambda *layers: jnp.concatenate(layers), *w.arrays)


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One layer of a PerLayer, chosen by a traced index (inside the layer scan): `project` switches on it."""

    held: PerLayer
    index: jax.Array  # int32 scalar, the layer within the run


def hold_apart(layers):
    """(`layers` (a LayerWeights) with its PerLayer fields set to None: what the layer scan slices, those
    PerLayer fields by name: what it switches on)."""
    fields = {f.name: getattr(layers, f.name) for f in dataclasses.fields(layers)}
    held = {name: w for name, w in fields.items() if isinstance(w, PerLayer)}
    return dataclasses.replace(layers, **dict.fromkeys(held)), held


def at_layer(w, held: dict[str, PerLayer], index: jax.Array):
    """Inside the layer scan, one layer's weights `w` (the scan's slice of hold_apart's first) with each of
    `held` chosen at `index` (the layer within its run) as a LayerChoice, which `project` switches on."""
    return dataclasses.replace(w, **{name: LayerChoice(p, index) for name, p in held.items()})


def project(subscripts: str, x: jax.Array, w: jax.Array | Int8Weight | LayerChoice) -> jax.Array:
    """`jnp.einsum(subscripts, x, w)` for one layer's projection `w` (its layer axis scanned away): an array,
    an Int8Weight (multiplied by its int8 values converted to x's dtype, then scaled per output channel) or
    a LayerChoice (a switch over its layers, each branch multiplying by its own array). The output axes
    come last in `subscripts`' result."""
    if isinstance(w, LayerChoice):
        branches = [
            lambda x, layer=layer: project(subscripts, x, jax.tree.map(lambda a: a[0], layer))
            for layer in w.held.arrays
        ]
        return jax.lax.switch(w.index, branches, x)
    if isinstance(w, Int8Weight):
        return jnp.einsum(subscripts, x, w.values.astype(x.dtype)) * w.scale.astype(x.dtype)
    return jnp.einsum(subscripts, x, w)
