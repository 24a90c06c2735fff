"""Building blocks of the forward pass shared by its attention variants: RMSNorm and rotary embeddings."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.engine.config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * weight


ACTIVATION_FNS = {  # ModelConfig.hidden_act -> the gated MLP's activation
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def _inverse_frequencies(theta: float, head_dim: int) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def _yarn(
    inv: np.ndarray,
    base: float,
    dim: int,
    factor: float,
    original: int,
    fast: float,
    slow: float,
    truncate: bool,
) -> np.ndarray:
    """YaRN: interpolated (divided by factor) low frequencies, extrapolated high ones, a linear ramp between
    the dims that turn `fast` and `slow` times over the original context."""

    def dim_of(rotations: float) -> float:
        return dim * np.log(original / (rotations * 2 * np.pi)) / (2 * np.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / ((high - low) or 0.001), 0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


@functools.lru_cache(maxsize=8)
def rope_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[2, rope_dim // 2] inverse frequencies: of full-attention layers (with Llama 3's long-context,
    linear or YaRN scaling when configured), and of sliding-window layers (their own base, unscaled, if
    any)."""
    inv = _inverse_frequencies(cfg.rope_theta, cfg.rope_dim) / cfg.rope_linear_factor
    if cfg.rope_llama3_scaling is not None:
        factor, low_ff, high_ff, original = cfg.rope_llama3_scaling
        wavelen = 2 * np.pi / inv
        low_wavelen, high_wavelen = original / low_ff, original / high_ff
        smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    if cfg.rope_yarn is not None:
        inv = _yarn(inv, cfg.rope_theta, cfg.rope_dim, *cfg.rope_yarn)
    sliding = (
        inv if cfg.sliding_rope_theta is None else _inverse_frequencies(cfg.sliding_rope_theta, cfg.rope_dim)
    )
    return np.stack([inv, sliding]).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotary embedding, halves layout (HF's rotate_half). x: [T, ..., head_dim], positions [T]; cos and
    sin times `scale` (YaRN's attention factor)."""
    angles = positions[:, None].astype(jnp.float32) * inv_freq  # [T, head_dim // 2]
    angles = angles.reshape(angles.shape[0], *([1] * (x.ndim - 2)), angles.shape[-1])
    cos, sin = (jnp.cos(angles) * scale).astype(x.dtype), (jnp.sin(angles) * scale).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
