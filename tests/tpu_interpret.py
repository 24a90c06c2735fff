"""Two fixes to jax 0.10.2's TPU interpret mode so that jax's ragged paged attention Pallas kernel runs,
unchanged, on CPU (tests only; nothing in pdserve imports this).

1. The interpreter's ref reads (`interpret_pallas_call.get`) turn the ref's transforms into one index
   range (`interpret_utils.to_range`) and fail on any other transform: "'ReshapeTransform' object has no
   attribute 'indices'". The kernel reads its KV buffers through `.reshape(...)` (kernel.py:616) and, for
   packed dtypes such as bfloat16, `.bitcast(jnp.uint32)` (kernel.py:370). The fix reads the leading run of
   plain indexers with the interpreter's own code (bounds checks, race detection) and applies the rest on
   the value read, as jax's discharge rule does (`jax._src.state.discharge.transform_array`): a reshape
   is a row-major reshape, a bitcast `jax._src.state.utils.bitcast` (TPU packing on the second-minor
   axis, the first row in the low bits). The kernel never writes through such a ref.
2. `shared_memory.SharedMemory.swap_buffer_content` marks out-of-bounds elements of a masked store with
   `in_bounds_mask[in_bounds_shape[i] :] = False` for every axis i, which slices axis 0 each time: the
   kernel's in-bounds masked store (`pltpu.store(..., mask=...)`) is refused as "Out-of-bounds masked
   swap". The fix recompiles the method from its source with that line slicing axis i; a jax without the
   line is left alone.

Install before the kernel is first traced (`jax.clear_caches()` after); `patch()` returns its undo.
"""

from __future__ import annotations
import __future__

import inspect
import textwrap

import jax
import numpy as np
from jax._src import dtypes
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc
from jax._src.pallas.mosaic.interpret import shared_memory as _shm
from jax._src.pallas.mosaic.interpret import utils as _iutils
from jax._src.state import indexing as _indexing
from jax._src.state import types as _state_types

_BUGGY_LINE = "in_bounds_mask[in_bounds_shape[i] :] = False"
_FIXED_LINE = "in_bounds_mask[(slice(None),) * i + (slice(in_bounds_shape[i], None),)] = False"


def _fixed_swap_buffer_content(original):
    source = textwrap.dedent(inspect.getsource(original))
    if _BUGGY_LINE not in source:  # fixed in this jax
        return original
    code = compile(
        source.replace(_BUGGY_LINE, _FIXED_LINE),
        _shm.__file__,
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    namespace: dict = {}
    exec(code, _shm.__dict__, namespace)
    return namespace[original.__name__]


def _bitcast(x: np.ndarray, dtype) -> np.ndarray:
    """numpy's twin of jax._src.state.utils.bitcast (a TPU ref's bitcast)."""
    dtype = np.dtype(dtype)
    x_bits, y_bits = dtypes.itemsize_bits(x.dtype), dtypes.itemsize_bits(dtype)
    if x_bits == y_bits:
        return np.ascontiguousarray(x).view(dtype)
    *lead, m, n = x.shape
    if x_bits < y_bits:  # rows packed into wider words
        r = y_bits // x_bits
        x = x.reshape(*lead, m // r, r, n).swapaxes(-1, -2)
        return np.ascontiguousarray(x).view(dtype)[..., 0]
    r = x_bits // y_bits
    y = np.ascontiguousarray(x).view(dtype).reshape(*lead, m, n, r)
    return y.swapaxes(-1, -2).reshape(*lead, m * r, n)


def _apply(x: np.ndarray, transforms) -> np.ndarray:
    for t in transforms:
        if isinstance(t, _indexing.NDIndexer):
            x = x[_iutils.to_range([t])]
        elif isinstance(t, _state_types.ReshapeTransform):
            x = x.reshape(t.shape)
        elif isinstance(t, _state_types.BitcastTransform):
            x = _bitcast(x, t.dtype)
        else:
            raise NotImplementedError(f"interpret mode: ref transform {t}")
    return x


def patch():
    """Installs both fixes (idempotent); returns a function that undoes them."""
    original_get, original_swap = _ipc.get, _shm.SharedMemory.swap_buffer_content
    if getattr(original_get, "_pdserve_patch", False):
        return lambda: None
    read = original_get.__wrapped__

    def get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs):
        transforms = tuple(transforms or ())
        n = 0
        while n < len(transforms) and isinstance(transforms[n], _indexing.NDIndexer):
            n += 1
        if n == len(transforms):
            return read(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs)
        head, tail = (jax.tree.map(int, t) for t in (transforms[:n], transforms[n:]))
        token, value = read(token, device_id, local_core_id, memory_space, buffer_id, head, *args, **kwargs)
        return token, _apply(np.asarray(value), tail)

    # the interpreter's DMAs call get.__wrapped__: the decorated function must wrap this one
    _ipc.get = _ipc.fail_on_exception(get)
    _ipc.get._pdserve_patch = True
    _shm.SharedMemory.swap_buffer_content = _fixed_swap_buffer_content(original_swap)

    def undo():
        _ipc.get, _shm.SharedMemory.swap_buffer_content = original_get, original_swap

    return undo
