"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral, DeepSeek-V2): top-k routing, then each routed (token, expert)
pair through its expert, at a cost that follows the pairs routed, not the number of experts.

Routing: the router's softmax over experts in float32, the k largest kept (renormalized to sum to 1 where
the model says so, `ModelConfig.norm_topk_prob`).

The experts' computation is a grouped matmul written with a loop: the step's T * k pairs are sorted by
expert, and the loop walks tiles of `tile` consecutive pairs of one expert each, reading that expert's
weights once per tile. An expert no token chose is never read; padding tokens route to no expert. The
number of tiles is a run-time value, so one compiled step serves any routing (shapes stay those of the
token buckets). On a TPU this loop is what a grouped-matmul kernel (megablox `gmm`) does in one call;
`jax.lax.ragged_dot` is not used because off TPU it lowers to a dense product over every expert.

Sharding: tensor-parallel experts. Each expert's intermediate axis is split over the mesh axis `model`
like the dense MLP's, so every chip takes part in every routed pair and no all-to-all moves tokens;
expert parallelism (whole experts per chip) would read less per chip only when pairs spread evenly.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pdserve.engine.config import ModelConfig


def route(h: jax.Array, w_router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] in h's dtype, experts [T, k] int32) of each token's k chosen experts: the largest
    of the router's softmax (DeepSeek: among the experts of the best `router_groups` groups), renormalized
    or scaled as the model says."""
    probs = jax.nn.softmax((h @ w_router).astype(jnp.float32), axis=-1)
    chosen = probs
    if cfg.router_groups is not None:  # keep the groups whose best expert is among the best groups'
        groups, kept = cfg.router_groups
        best = jnp.max(probs.reshape(probs.shape[0], groups, -1), axis=-1)  # [T, groups]
        kept_groups = jnp.any(jax.nn.one_hot(jax.lax.top_k(best, kept)[1], groups, dtype=bool), axis=1)
        keep = jnp.repeat(kept_groups, probs.shape[-1] // groups, axis=-1)
        chosen = jnp.where(keep, probs, 0.0)
    top, experts = jax.lax.top_k(chosen, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return (top * cfg.routed_scaling_factor).astype(h.dtype), experts.astype(jnp.int32)


def gated_mlp(h: jax.Array, gate_up: jax.Array, down: jax.Array, act: Callable[[jax.Array], jax.Array]):
    """A dense gated MLP: h [T, hidden], gate_up [hidden, 2, intermediate], down [intermediate, hidden]."""
    gu = jnp.einsum("td,dci->tci", h, gate_up)
    return (act(gu[:, 0]) * gu[:, 1]) @ down


def pair_tile(num_pairs: int, num_experts: int) -> int:
    """Pairs per tile of the grouped matmul: about the pairs per expert, a power of two in [8, 128]."""
    per_expert = max(1, num_pairs // num_experts)
    return min(128, max(8, 1 << (per_expert - 1).bit_length()))


def experts_mlp(
    h: jax.Array,  # [T, hidden]
    weights: jax.Array,  # [T, k] routing weights
    experts: jax.Array,  # [T, k] chosen experts
    valid: jax.Array,  # [T] real tokens (padding routes nowhere)
    gate_up: jax.Array,  # [E, hidden, 2, intermediate]
    down: jax.Array,  # [E, intermediate, hidden]
    act: Callable[[jax.Array], jax.Array],
) -> jax.Array:  # [T, hidden]: sum over each token's experts of weight * expert(h)
    t, k = experts.shape
    num_experts, num_pairs = gate_up.shape[0], t * k
    tile = pair_tile(num_pairs, num_experts)
    pair_expert = jnp.where(valid[:, None], experts, num_experts).reshape(-1)  # padding: past the last
    order = jnp.argsort(pair_expert, stable=True)  # pairs grouped by expert
    x = jnp.pad(h[order // k], ((0, tile), (0, 0)))  # [pairs + tile, hidden] in expert order
    counts = jnp.bincount(pair_expert, length=num_experts + 1)[:num_experts]
    starts = jnp.cumsum(counts) - counts  # first sorted pair of each expert
    tiles = -(-counts // tile)
    tile_ends = jnp.cumsum(tiles)

    def one_tile(i, out):
        e = jnp.searchsorted(tile_ends, i, side="right")  # the expert whose tiles include tile i
        start = starts[e] + (i - (tile_ends[e] - tiles[e])) * tile
        xt = jax.lax.dynamic_slice_in_dim(x, start, tile)
        y = gated_mlp(xt, gate_up[e], down[e], act)
        old = jax.lax.dynamic_slice_in_dim(out, start, tile)
        mine = (start + jnp.arange(tile) < starts[e] + counts[e])[:, None]  # rows past e's pairs: keep
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, old), start, axis=0)

    out = jax.lax.fori_loop(0, tile_ends[-1], one_tile, jnp.zeros_like(x))[:num_pairs]
    per_pair = jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)  # back in (token, choice) order
    return jnp.einsum("tk,tkd->td", weights, per_pair)
