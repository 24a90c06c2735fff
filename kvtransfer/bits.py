"""Move KV as raw bits inside kernels.

XLA's CPU backend has no bfloat16 arithmetic, so it upcasts bfloat16 data movement (slices, gathers,
scatters, dynamic_update_slice) to float32 around the op, which copies a whole donated cache on every
insert. Kernels therefore bitcast KV to the unsigned integer of the same width (free: a bitcast) and move
bits, which is exact for every dtype and keeps updates in place.
"""

import jax
import jax.numpy as jnp

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def as_bits(x):
    return jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])


def from_bits(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype)
