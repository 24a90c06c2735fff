"""Reshard: arrays from the source mesh onto the destination mesh's NamedSharding.

jax.device_put moves arrays between meshes (jit out_shardings and jax.sharding.reshard do not cross
meshes). Under Pathways (JAX_PLATFORMS contains "proxy") pathwaysutils' reshard does it instead; it has no
CPU fallback, so pathwaysutils is imported only then: this function is the one seam for Pathways.
"""

from __future__ import annotations

import os

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdserve.kvtransfer.layout import KVLayout


def on_pathways() -> bool:
    return "proxy" in os.environ.get("JAX_PLATFORMS", "")


def reshard(tree, dst_sharding):
    """Places every array of `tree` with dst_sharding (one sharding, or a matching pytree of them).

    Asynchronous; the source arrays stay valid. Host numpy arrays are simply put on the mesh.
    """
    if on_pathways():
        from pathwaysutils.experimental import reshard as pathways_reshard

        if isinstance(dst_sharding, jax.sharding.Sharding):
            dst_sharding = jax.tree.map(lambda _: dst_sharding, tree)
        return pathways_reshard.reshard(tree, dst_sharding, donate=False)
    return jax.device_put(tree, dst_sharding)


def chunk_sharding(mesh: Mesh, layout: KVLayout) -> NamedSharding:
    """Sharding of a chunk [layers, tokens, slots, dim]: heads over "model" (MLA: replicated)."""
    return NamedSharding(mesh, P(None, None, layout.heads_mesh_axis, None))


def cache_sharding(mesh: Mesh, layout: KVLayout, *, stacked: bool = True) -> NamedSharding:
    """Sharding of a cache leaf: [layers, num_blocks, bs, slots, dim] if stacked, else per layer."""
    spec = (None, None, layout.heads_mesh_axis, None)
    return NamedSharding(mesh, P(None, *spec) if stacked else P(*spec))
