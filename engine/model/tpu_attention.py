"""jax's ragged paged attention Pallas kernel behind the attention seam, chosen by LLMEngine on TPUs.

`jax.experimental.pallas.ops.tpu.ragged_paged_attention` takes pdserve's cache layout as it is (pages
[pages, page_size, 2 * kv_heads, head_dim], K of head h at 2h, V at 2h + 1), mixed decode and prefill
rows, a sliding window and a soft cap. What this adapter maps:
  * the stacked cache [rows, blocks, ...] (a row per layer, or per layer of a group: engine.core.kv_groups)
    becomes one page array (a merge of the leading axes, no copy), and a layer's pages are its block ids
    plus its row * blocks;
  * queries [T, kv_heads, group, d] become [T, heads, d] (query head i reads KV head i // group, the
    kernel's order too); `sm_scale` defaults to head_dim ** -0.5 as pdserve's reference does (the
    kernel's own default is 1);
  * `num_seqs` counts the real rows, which the runner puts first (padding rows have no context);
  * a per-layer window is a run-time value inside the layer scan while the kernel takes a static one:
    `lax.switch` over the model's distinct windows (Gemma: none, or its one window);
  * at TP > 1, a `shard_map` over the heads (a Pallas call has no partitioning rule): each chip attends
    with its own query and KV heads.
The kernel reads the step's new K/V from the cache (`reads_new_kv_from_cache`): the model writes them
layer by layer first (engine.model.forward). MLA's latent cache is not the kernel's layout: those layers keep
the reference.

Checked without a TPU (tests/engine/test_tpu_attention.py): the mapping, against jax's reference of the
kernel (`ref_ragged_paged_attention`), and the Pallas kernel itself in TPU interpret mode on CPU (with two
fixes to jax 0.10.2's interpreter, tests/tpu_interpret.py). Models the kernel cannot serve
(`kernel_unsupported`) keep the reference on TPUs too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pdserve.engine.config import ModelConfig
from pdserve.engine.model.attention import AttentionFn, ragged_paged_attention_reference
from pdserve.engine.model.sharding import MODEL_AXIS
from pdserve.kvtransfer import scale_scheme


def kernel_unsupported(cfg: ModelConfig, tp: int, dtype: str, cache_dtype: str | None = None) -> str | None:
    """Why jax's kernel cannot attend for this model on a mesh of TP `tp` (None: it can). Its rules, as
    found running it in TPU interpret mode (tests/engine/test_tpu_attention.py): head_dim a multiple of 128
    (the lanes; it asserts otherwise, e.g. SmolLM2's 64), and each chip's K and V heads tiled whole
    (its own check, for the queries' and the cache's packing: `cache_dtype`, default `dtype`; an fp8 cache
    is read with the kernel's default scale of 1.0, pdserve's static one). MLA's latent cache is not its
    layout, nor an int8 cache with its scales in each row (the kernel's k_scale and v_scale are scalars)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

    if cfg.is_mla:
        return "MLA's latent cache is not the kernel's layout"
    if scale_scheme(cache_dtype or dtype) != "none":
        return f"a {cache_dtype} cache's scales are per token and head; the kernel takes one per tensor"
    if cfg.head_dim % 128:
        return f"head_dim {cfg.head_dim} is not a multiple of 128"
    kv_heads = cfg.padded_num_kv_heads(tp) // tp
    group = cfg.num_heads // cfg.num_kv_heads
    try:
        get_min_heads_per_blk(kv_heads * group, 2 * kv_heads, dtype, cache_dtype or dtype)
    except ValueError as e:
        return str(e)
    return None


def _pallas_kernel() -> Callable:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    return ragged_paged_attention


def kernel_attention(
    cfg: ModelConfig,
    mesh: Mesh | None = None,
    kernel: Callable | None = None,
    block_sizes: dict | None = None,
) -> AttentionFn:
    """An attention function for the seam that calls `kernel` (default: jax's Pallas kernel) with
    `ragged_paged_attention_reference`'s arguments. `block_sizes`: the kernel's num_kv_pages_per_block and
    num_queries_per_block (None: its tuned table, which needs a TPU)."""
    kernel = kernel or _pallas_kernel()
    windows = (0, *sorted({w for w in cfg.layer_windows if w}))
    tp = 1 if mesh is None else mesh.shape[MODEL_AXIS]

    def attend(*args, sm_scale=None, sliding_window=None, soft_cap=None, latent=False):
        """`args`: q, k_new, v_new, cache, layer, kv_lens, block_tables, cu_q_lens (the reference's)."""
        if latent:
            return ragged_paged_attention_reference(*args, sm_scale=sm_scale, latent=True, flat_rows=False)
        q, _, _, cache, layer, kv_lens, block_tables, cu_q_lens = args
        t, kv_heads, group, d = q.shape
        rows, num_blocks = cache.shape[:2]  # a row per layer (hybrid models: per layer of a group)
        pages = cache.reshape(rows * num_blocks, *cache.shape[2:])
        page_indices = block_tables + layer * num_blocks
        num_seqs = jnp.count_nonzero(kv_lens).astype(jnp.int32).reshape(1)
        call = functools.partial(
            kernel,
            sm_scale=d**-0.5 if sm_scale is None else sm_scale,
            soft_cap=soft_cap,
            **(block_sizes or {}),
        )
        branches = [functools.partial(call, sliding_window=w or None) for w in windows]

        def run(q, pages, *rest):
            if sliding_window is None or len(branches) == 1:
                return branches[0](q, pages, *rest)
            if isinstance(sliding_window, int):  # known now: that kernel alone
                return branches[windows.index(sliding_window)](q, pages, *rest)
            which = jnp.searchsorted(jnp.asarray(windows), sliding_window)  # 0: full attention
            return jax.lax.switch(which, branches, q, pages, *rest)

        if tp > 1:
            heads = P(None, MODEL_AXIS, None)
            run = jax.shard_map(
                run,
                mesh=mesh,
                in_specs=(heads, P(None, None, MODEL_AXIS, None), P(), P(), P(), P()),
                out_specs=heads,
                check_vma=False,
            )
        out = run(q.reshape(t, kv_heads * group, d), pages, kv_lens, page_indices, cu_q_lens, num_seqs)
        return out.reshape(t, kv_heads, group, d)

    attend.reads_new_kv_from_cache = True
    return attend
