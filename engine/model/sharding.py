"""All sharding in one table: logical axis names -> mesh axes, and the mesh itself.

Tensor parallelism uses one mesh axis, `model`: attention heads, KV heads, the MLP's intermediate axis and
the vocabulary are split over it; everything else is replicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MODEL_AXIS = "model"

# logical axis -> mesh axis (None: replicated)
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "layers": None,
    "embed": None,
    "heads": MODEL_AXIS,  # query heads * head_dim, fused
    "kv_heads": MODEL_AXIS,  # KV heads * head_dim, fused; 2 * KV heads in the cache
    "head_dim": None,
    "mlp": MODEL_AXIS,
    "vocab": MODEL_AXIS,
    "blocks": None,
    "block_slots": None,
    "batch": None,
    "tokens": None,
}


def _check_rules(rules: dict[str, str | None]) -> None:
    """No two logical axes of one array may map to the same mesh axis; checked per spec in `spec`."""
    unknown = {v for v in rules.values() if v not in (None, MODEL_AXIS)}
    if unknown:
        raise ValueError(f"unknown mesh axes in sharding rules: {unknown}")


_check_rules(LOGICAL_AXIS_RULES)


def spec(*logical_axes: str | None) -> PartitionSpec:
    """PartitionSpec for an array whose axes have the given logical names; rejects collisions."""
    mesh_axes = [LOGICAL_AXIS_RULES[a] if a is not None else None for a in logical_axes]
    used = [a for a in mesh_axes if a is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"logical axes {logical_axes} map two axes onto one mesh axis")
    return PartitionSpec(*mesh_axes)


def make_mesh(tp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over `tp` devices (the first `tp` of `devices`, default all local devices)."""
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < tp:
        raise ValueError(f"TP {tp} needs {tp} devices, only {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (MODEL_AXIS,))


def named(mesh: Mesh, *logical_axes: str | None) -> NamedSharding:
    return NamedSharding(mesh, spec(*logical_axes))
