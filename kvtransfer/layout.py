"""KV cache layout: what a server's paged cache looks like, and whether two servers can exchange KV.

A cache layer is one array `[num_blocks, block_size, num_head_slots, padded_head_dim]` (or several such
layers stacked on a leading axis). The heads axis holds K and V interleaved: slot 2*h is K of physical kv
head h, slot 2*h+1 is its V. An MLA layer holds one latent "head" (no K/V pair): slot 0 is
[kv_lora_rank | rope dims], each part padded on its own.

A layout has two halves:
- the logical half (model, layers and their spec kinds, kv heads, head_dim, dtype, block size) which the
  fingerprint covers and which must be equal on both ends of a transfer;
- the physical half (TP size, head strategy, head_dim padding, data-parallel size) which each server picks
  for its own mesh; `head_map` converts between two physical halves of one logical layout.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),  # an fp8 cache (EngineConfig.kv_cache_dtype)
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int8": np.dtype(np.int8),  # an int8 cache: always with its scales (SCALE_SCHEMES)
}
# How a cache's values relate to the K/V they hold (KVLayout.scale_scheme, derived from the dtype):
# - "none": as they are (the serving dtype; fp8 at a static scale of 1.0, saturated to its range);
# - "token_head": int8, each head row of each token followed by its own scale, SCALE_DTYPE in the row's
#   last SCALE_BYTES bytes: value = int8 x scale (symmetric, scale = the row's max |x| / 127). The scales
#   travel with their values: gathered, sent, resharded and inserted as the row's bytes.
SCALE_SCHEMES = {"int8": "token_head"}  # dtype -> scheme; every other dtype: "none"
SCALE_DTYPE = np.dtype(ml_dtypes.bfloat16)
SCALE_BYTES = SCALE_DTYPE.itemsize


def scale_scheme(dtype: str) -> str:
    """The scale scheme of a cache of `dtype` (a DTYPES name): "none", or SCALE_SCHEMES' entry."""
    return SCALE_SCHEMES.get(dtype, "none")


HEAD_STRATEGIES = ("pad", "replicate")


class LayoutMismatchError(ValueError):
    """Two servers' layouts differ in a field that the fingerprint covers; `differences` names each."""

    def __init__(self, differences: list[str]):
        self.differences = differences
        super().__init__("KV layout mismatch: " + "; ".join(differences))


class SpecKind(enum.StrEnum):
    FULL = "full"  # full attention: every block of the request is transferred
    SLIDING = "sliding"  # sliding window: only blocks that reach into the last `sliding_window` tokens
    MLA = "mla"  # one latent head per token
    SHARED = "shared"  # reads the cache of layer `shared_with`: owns no cache, is not transferred


@dataclass(frozen=True)
class LayerSpec:
    kind: SpecKind = SpecKind.FULL
    sliding_window: int = 0  # tokens; SLIDING only
    shared_with: int = -1  # model layer index whose cache this layer reads; SHARED only

    def __post_init__(self):
        object.__setattr__(self, "kind", SpecKind(self.kind))
        if (self.kind == SpecKind.SLIDING) != (self.sliding_window > 0):
            raise ValueError(f"sliding_window must be > 0 exactly for sliding layers: {self}")
        if (self.kind == SpecKind.SHARED) != (self.shared_with >= 0):
            raise ValueError(f"shared_with must be set exactly for shared layers: {self}")

    def describe(self) -> str:
        if self.kind == SpecKind.SLIDING:
            return f"sliding({self.sliding_window})"
        if self.kind == SpecKind.SHARED:
            return f"shared({self.shared_with})"
        return self.kind.value


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class KVLayout:
    """One server's KV cache layout. Frozen; derived sizes are properties.

    Invariants (checked at construction): every cache-owning layer is MLA, or none is; a shared layer
    points at an earlier cache-owning layer; MLA layouts set kv_lora_rank and the rope dims, which add up to
    head_dim.
    """

    model: str
    layer_specs: tuple[LayerSpec, ...]  # one per model layer
    num_kv_heads: int  # real kv heads of the model (MLA: 1)
    head_dim: int  # real head_dim (MLA: kv_lora_rank + qk_rope_head_dim)
    dtype: str  # a key of DTYPES
    block_size: int  # tokens per block
    kv_lora_rank: int = 0  # MLA only
    qk_rope_head_dim: int = 0  # MLA only
    # Physical half: this server's choices, outside the fingerprint.
    tp_size: int = 1  # size of the mesh axis "model"
    head_strategy: str = "pad"  # "pad": append zero dummy heads; "replicate": repeat each head r times
    head_dim_multiple: int = 1  # 128 on TPU
    dp_size: int = 1  # num_blocks must be a multiple of this

    LOGICAL_FIELDS = (
        "model", "num_layers", "num_kv_heads", "head_dim", "dtype", "scale_scheme", "block_size", "spec_kinds"
    )  # fmt: skip

    def __post_init__(self):
        object.__setattr__(self, "layer_specs", tuple(self.layer_specs))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.head_strategy not in HEAD_STRATEGIES:
            raise ValueError(f"head_strategy {self.head_strategy!r} is not one of {HEAD_STRATEGIES}")
        if min(self.num_kv_heads, self.head_dim, self.block_size, self.tp_size, self.dp_size) < 1:
            raise ValueError(f"sizes must be positive: {self}")
        for i, spec in enumerate(self.layer_specs):
            if spec.kind == SpecKind.SHARED:
                target = spec.shared_with
                if target >= i or self.layer_specs[target].kind == SpecKind.SHARED:
                    raise ValueError(f"layer {i} shares layer {target}, which is not an earlier cache layer")
        kinds = {self.layer_specs[i].kind == SpecKind.MLA for i in self.cache_layers}
        if len(kinds) > 1:
            raise ValueError("a layout mixes MLA and non-MLA cache layers")
        if self.is_mla and (
            self.num_kv_heads != 1 or self.kv_lora_rank + self.qk_rope_head_dim != self.head_dim
        ):
            raise ValueError("MLA: num_kv_heads must be 1 and kv_lora_rank + qk_rope_head_dim == head_dim")

    # Logical half.
    @property
    def num_layers(self) -> int:
        return len(self.layer_specs)

    @property
    def spec_kinds(self) -> tuple[str, ...]:
        return tuple(spec.describe() for spec in self.layer_specs)

    @functools.cached_property
    def cache_layers(self) -> tuple[int, ...]:
        """Model layer index of each cache layer; cache arrays and frames count layers in this order."""
        return tuple(i for i, spec in enumerate(self.layer_specs) if spec.kind != SpecKind.SHARED)

    @property
    def num_cache_layers(self) -> int:
        return len(self.cache_layers)

    @property
    def is_mla(self) -> bool:
        return bool(self.cache_layers) and self.layer_specs[self.cache_layers[0]].kind == SpecKind.MLA

    @property
    def scale_scheme(self) -> str:
        """ "none", or how the values carry their scales (SCALE_SCHEMES)."""
        return scale_scheme(self.dtype)

    @property
    def scale_bytes(self) -> int:
        """Bytes at the end of each head row that hold its scale (0: no scales)."""
        return SCALE_BYTES if self.scale_scheme == "token_head" else 0

    def scales(self, data: np.ndarray) -> np.ndarray:
        """The scales of a host chunk or cache in this layout ([..., slots, padded_head_dim] ->
        [..., slots] float32); a layout without scales has none to give (ValueError)."""
        if not self.scale_bytes:
            raise ValueError(f"a {self.dtype} cache has no scales")
        raw = np.ascontiguousarray(data[..., -self.scale_bytes :]).view(SCALE_DTYPE)
        return raw[..., 0].astype(np.float32)

    def logical(self) -> dict:
        return {name: getattr(self, name) for name in self.LOGICAL_FIELDS}

    def fingerprint(self) -> str:
        """Hex digest of the logical half; equal fingerprints mean KV can move between the two servers."""
        text = json.dumps(self.logical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def check_compatible(self, peer: KVLayout) -> None:
        """Raises LayoutMismatchError naming every logical field in which `peer` differs."""
        differences = []
        for name in self.LOGICAL_FIELDS:
            mine, theirs = getattr(self, name), getattr(peer, name)
            if name == "spec_kinds" and len(mine) == len(theirs):
                differences += [
                    f"layer {i}: {a} != {b}"
                    for i, (a, b) in enumerate(zip(mine, theirs, strict=True))
                    if a != b
                ]
            elif mine != theirs:
                differences.append(f"{name}: {mine!r} != {theirs!r}")
        if differences:
            raise LayoutMismatchError(differences)

    # Physical half.
    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def replication(self) -> int:
        """Physical copies of each kv head (1 under "pad" and for MLA)."""
        if self.is_mla or self.head_strategy == "pad":
            return 1
        return math.lcm(self.num_kv_heads, self.tp_size) // self.num_kv_heads

    @property
    def padded_num_kv_heads(self) -> int:
        """Physical kv heads: a multiple of tp_size (MLA: 1, replicated over the mesh instead)."""
        if self.is_mla:
            return 1
        if self.head_strategy == "pad":
            return round_up(self.num_kv_heads, self.tp_size)
        return self.num_kv_heads * self.replication

    @property
    def num_head_slots(self) -> int:
        """Size of the heads axis: 2 * padded kv heads (K/V interleaved), or 1 for MLA."""
        return 1 if self.is_mla else 2 * self.padded_num_kv_heads

    @property
    def head_dim_segments(self) -> tuple[tuple[int, int], ...]:
        """(offset in the padded head_dim, length) of each real part: the head, or MLA's latent and rope, then
        the scale's bytes (scale_bytes) at the row's end."""
        m = self.head_dim_multiple
        if not self.is_mla:
            parts = ((0, self.head_dim),)
        else:
            parts = ((0, self.kv_lora_rank), (round_up(self.kv_lora_rank, m), self.qk_rope_head_dim))
        values = self.padded_head_dim - self.scale_bytes
        return parts + (((values, self.scale_bytes),) if self.scale_bytes else ())

    @property
    def padded_head_dim(self) -> int:
        """A head row's width: its values, padded to head_dim_multiple, then the scale's bytes."""
        m = self.head_dim_multiple
        if not self.is_mla:
            values = round_up(self.head_dim, m)
        else:
            values = round_up(self.kv_lora_rank, m) + round_up(self.qk_rope_head_dim, m)
        return values + self.scale_bytes

    @property
    def token_shape(self) -> tuple[int, int]:
        """Shape of one token of one layer: (num_head_slots, padded_head_dim)."""
        return (self.num_head_slots, self.padded_head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one cache layer."""
        return self.block_size * math.prod(self.token_shape) * self.np_dtype.itemsize

    @property
    def heads_mesh_axis(self) -> str | None:
        """Mesh axis that shards the heads axis; MLA's single latent head is replicated."""
        return None if self.is_mla else "model"

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Stacked cache: [num_cache_layers, num_blocks, block_size, num_head_slots, padded_head_dim]."""
        if num_blocks % self.dp_size:
            raise ValueError(f"num_blocks {num_blocks} is not a multiple of dp_size {self.dp_size}")
        return (self.num_cache_layers, num_blocks, self.block_size, *self.token_shape)

    def first_needed_block(self, cache_layer: int, num_tokens: int) -> int:
        """First block of a request of num_tokens tokens that decode reads in this cache layer."""
        spec = self.layer_specs[self.cache_layers[cache_layer]]
        if spec.kind != SpecKind.SLIDING:
            return 0
        return max(0, num_tokens - spec.sliding_window) // self.block_size

    def with_physical(self, **changes) -> KVLayout:
        """The same logical layout with another physical half (tp_size, head_strategy, ...)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["layer_specs"] = [[s.kind.value, s.sliding_window, s.shared_with] for s in self.layer_specs]
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVLayout:
        fields = json.loads(text)
        fields["layer_specs"] = tuple(LayerSpec(SpecKind(k), w, s) for k, w, s in fields["layer_specs"])
        return cls(**fields)


def _physical_heads(layout: KVLayout, kv_head: int) -> range:
    """Physical head indices that hold real kv head `kv_head` in this layout."""
    r = layout.replication
    return range(kv_head * r, kv_head * r + r)


@dataclass(frozen=True)
class HeadMap:
    """Maps a chunk's heads axis and head_dim from a source physical layout to a destination one.

    head_index[j] is the source slot that fills destination slot j (-1: zero, a dummy head);
    dim_segments are (src offset, dst offset, length) runs of head_dim copied; the rest is zero.
    Hashable, so jitted kernels take it as a static argument.
    """

    head_index: tuple[int, ...]
    dim_segments: tuple[tuple[int, int, int], ...]
    src_token_shape: tuple[int, int]
    dst_token_shape: tuple[int, int]

    @property
    def is_identity(self) -> bool:
        return (
            self.src_token_shape == self.dst_token_shape
            and self.head_index == tuple(range(self.src_token_shape[0]))
            and self.dim_segments == ((0, 0, self.src_token_shape[1]),)
        )

    def apply_numpy(self, src: np.ndarray, out: np.ndarray) -> None:
        """out[..., :, :] = mapped src; out's leading axes must match src's. Zero-fills unmapped slots."""
        index = np.asarray(self.head_index)
        if self.is_identity:
            out[...] = src
            return
        live = np.flatnonzero(index >= 0)
        if len(live) < len(index) or sum(n for _, _, n in self.dim_segments) < out.shape[-1]:
            out[...] = 0
        for s, d, n in self.dim_segments:
            out[..., live, d : d + n] = src[..., index[live], s : s + n]

    def apply_jax(self, x):
        """The same mapping on a jax array (call inside jit; the index arrays are constants)."""
        import jax.numpy as jnp

        if self.is_identity:
            return x
        index = np.asarray(self.head_index)
        picked = jnp.take(x, np.maximum(index, 0), axis=-2)
        picked = jnp.where((index >= 0)[:, None], picked, jnp.zeros((), x.dtype))
        out = jnp.zeros((*x.shape[:-2], *self.dst_token_shape), x.dtype)
        for s, d, n in self.dim_segments:
            out = out.at[..., d : d + n].set(picked[..., s : s + n])
        return out


def head_map(src: KVLayout, dst: KVLayout) -> HeadMap:
    """Conversion of chunks from src's physical layout into dst's; src and dst must be compatible."""
    src.check_compatible(dst)
    same_dims = src.head_dim_segments == dst.head_dim_segments
    if src.token_shape == dst.token_shape and src.replication == dst.replication and same_dims:
        slots, dim = src.token_shape
        return HeadMap(tuple(range(slots)), ((0, 0, dim),), src.token_shape, dst.token_shape)
    dst_index = []
    if src.is_mla:
        dst_index = [0]
    else:
        for phys in range(dst.padded_num_kv_heads):
            kv_head = phys // dst.replication
            if kv_head >= dst.num_kv_heads:  # dummy head appended by "pad"
                dst_index += [-1, -1]
            else:
                src_phys = _physical_heads(src, kv_head)[0]
                dst_index += [2 * src_phys, 2 * src_phys + 1]
    segments = tuple(
        (s_off, d_off, n)
        for (s_off, n), (d_off, _) in zip(src.head_dim_segments, dst.head_dim_segments, strict=True)
    )
    return HeadMap(tuple(dst_index), segments, src.token_shape, dst.token_shape)
