"""The model's weights as a registered dataclass pytree: layers stacked on a leading axis for `lax.scan`
(on a CPU the projections held one array per layer instead: engine.model.projection.PerLayer).

Head padding for tensor parallelism lives here: KV heads are padded up to a multiple of the TP size by
appending zero heads, and query heads are padded group by group so every padded KV head keeps a full
group. Padded query heads have zero output projections, so they add nothing to the result.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pdserve.engine.config import ModelConfig
from pdserve.engine.loading.checkpoints import Checkpoint
from pdserve.engine.model.projection import PerLayer, held_per_layer
from pdserve.engine.model.quantized import QUANTIZED, Int8Weight, quantize, scale_axes
from pdserve.engine.model.sharding import named

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's weights, each stacked over layers (leading axis L); the projections of
    QUANTIZED may be held as a PerLayer (engine.model.projection.held_per_layer)."""

    attn_norm: jax.Array  # [L, hidden]
    # Q, K and V fused per KV head: the last axis is (group * head_dim | head_dim | head_dim), so one
    # matmul computes all three and a TP shard holds whole groups with their KV head.
    # With --quantization int8 the projections of engine.model.quantized.QUANTIZED are Int8Weights.
    wo: jax.Array  # [L, heads * head_dim, hidden]  (MLA: heads * v_head_dim)
    mlp_norm: jax.Array  # [L, hidden]
    w_qkv: jax.Array | None = None  # [L, hidden, kv_heads, (group + 2) * head_dim]; None with MLA
    b_qkv: jax.Array | None = None  # [L, kv_heads, (group + 2) * head_dim]  (zeros without qkv bias)
    w_gate_up: jax.Array | None = None  # [L, hidden, 2, intermediate]  (gate, up); None with experts
    w_down: jax.Array | None = None  # [L, intermediate, hidden]
    q_norm: jax.Array | None = None  # [L, head_dim] with ModelConfig.qk_norm (Qwen3), else None
    k_norm: jax.Array | None = None  # [L, head_dim]
    post_attn_norm: jax.Array | None = None  # [L, hidden] with ModelConfig.sandwich_norms (Gemma), else None
    post_mlp_norm: jax.Array | None = None  # [L, hidden]
    # A mixture of experts in place of the MLP (ModelConfig.num_experts), else None. Each expert's
    # intermediate axis is split over the mesh like the dense MLP's (tensor-parallel experts).
    w_router: jax.Array | None = None  # [L, hidden, experts]
    experts_gate_up: jax.Array | None = None  # [L, experts, hidden, 2, intermediate]
    experts_down: jax.Array | None = None  # [L, experts, intermediate, hidden]
    shared_gate_up: jax.Array | None = None  # [L, hidden, 2, shared intermediate]: DeepSeek's shared experts
    shared_down: jax.Array | None = None  # [L, shared intermediate, hidden]
    # Multi-head latent attention (ModelConfig.is_mla; engine.model.mla), else None. The latent's projection
    # is replicated, every per-head array split over the mesh by heads. r: kv_lora_rank, qr: q_lora_rank.
    w_q: jax.Array | None = None  # [L, hidden (qr with q_lora_rank), heads, nope + rope dims]
    w_q_a: jax.Array | None = None  # [L, hidden, qr] with q_lora_rank
    q_a_norm: jax.Array | None = None  # [L, qr]
    w_kv_a: jax.Array | None = None  # [L, hidden, r + rope dims]
    kv_a_norm: jax.Array | None = None  # [L, r]
    w_uk: jax.Array | None = None  # [L, heads, nope dims, r]: keys' up-projection, absorbed into queries
    w_uv: jax.Array | None = None  # [L, heads, r, v_head_dim]: values' up-projection, after attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # [vocab, hidden]
    # Runs of consecutive layers of one structure (ModelConfig.layer_segments: DeepSeek's dense layers,
    # then its expert layers), each stacked for its own lax.scan; one run for every other model.
    layers: tuple[LayerWeights, ...]
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None  # [hidden, vocab]; None when tied to `embed`


_AXES = {"embed": ("vocab", "embed"), "final_norm": ("embed",), "lm_head": ("embed", "vocab")}
_LAYER_AXES = {
    "attn_norm": ("layers", "embed"),
    "w_qkv": ("layers", "embed", "kv_heads", None),
    "b_qkv": ("layers", "kv_heads", None),
    "wo": ("layers", "heads", "embed"),
    "mlp_norm": ("layers", "embed"),
    "w_gate_up": ("layers", "embed", None, "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    "q_norm": ("layers", None),
    "k_norm": ("layers", None),
    "post_attn_norm": ("layers", "embed"),
    "post_mlp_norm": ("layers", "embed"),
    "w_router": ("layers", "embed", None),
    "experts_gate_up": ("layers", None, "embed", None, "mlp"),
    "experts_down": ("layers", None, "mlp", "embed"),
    "shared_gate_up": ("layers", "embed", None, "mlp"),
    "shared_down": ("layers", "mlp", "embed"),
    "w_q": ("layers", None, "heads", None),
    "w_q_a": ("layers", "embed", None),
    "q_a_norm": ("layers", None),
    "w_kv_a": ("layers", "embed", None),
    "kv_a_norm": ("layers", None),
    "w_uk": ("layers", "heads", None, None),
    "w_uv": ("layers", "heads", None, None),
}


def pad_heads(w: np.ndarray, axis: int, cfg: ModelConfig, tp: int, kv: bool) -> np.ndarray:
    """Pads a fused (heads * head_dim) axis: KV heads appended, query heads appended per KV group."""
    kv_pad = cfg.padded_num_kv_heads(tp) - cfg.num_kv_heads
    if kv_pad == 0:
        return w
    axis = axis % w.ndim
    shape = list(w.shape)
    if kv:
        grouped = w.reshape(*shape[:axis], cfg.num_kv_heads, cfg.head_dim, *shape[axis + 1 :])
    else:
        grouped = w.reshape(
            *shape[:axis], cfg.num_kv_heads, cfg.group_size * cfg.head_dim, *shape[axis + 1 :]
        )
    widths = [(0, 0)] * grouped.ndim
    widths[axis] = (0, kv_pad)
    padded = np.pad(grouped, widths)
    return padded.reshape(*shape[:axis], -1, *shape[axis + 1 :])


def _fused_qkv(cfg: ModelConfig, host: dict[str, np.ndarray], tp: int) -> dict[str, np.ndarray]:
    """Q, K, V (weights and biases) fused per padded KV head, and the output projection padded alike."""
    kv_heads = cfg.padded_num_kv_heads(tp)

    def per_kv_head(name: str, kv: bool) -> np.ndarray:  # [..., heads * head_dim] -> [..., kv_heads, -1]
        w = pad_heads(host[name], -1, cfg, tp, kv=kv)
        return w.reshape(*w.shape[:-1], kv_heads, -1)

    return {
        "w_qkv": np.concatenate([per_kv_head(n, kv=n != "wq") for n in ("wq", "wk", "wv")], axis=-1),
        "b_qkv": np.concatenate([per_kv_head(n, kv=n != "bq") for n in ("bq", "bk", "bv")], axis=-1),
        "wo": pad_heads(host["wo"], 1, cfg, tp, kv=False),
    }


def _mla(cfg: ModelConfig, host: dict[str, np.ndarray], tp: int) -> dict[str, np.ndarray]:
    """MLA's arrays: queries per head, the latent's projection, kv_b split into the keys' and the values'
    up-projections per head (absorbed around attention, engine.model.mla). Heads are split, never padded."""
    if cfg.num_heads % tp:
        raise ValueError(f"MLA: {cfg.num_heads} heads do not split over TP {tp}")
    h, r, nope = cfg.num_heads, cfg.kv_lora_rank, cfg.head_dim - cfg.rope_dim
    q = host["w_q_b" if cfg.q_lora_rank else "wq"]
    kv_b = host["w_kv_b"].reshape(-1, r, h, nope + cfg.v_head_dim)  # [L, r, heads, nope + v]
    return {
        "w_q": q.reshape(*q.shape[:-1], h, cfg.head_dim),
        "w_q_a": host.get("w_q_a"),
        "q_a_norm": host.get("q_a_norm"),
        "w_kv_a": host["w_kv_a"],
        "kv_a_norm": host["kv_a_norm"],
        "w_uk": kv_b[..., :nope].transpose(0, 2, 3, 1),
        "w_uv": kv_b[..., nope:].transpose(0, 2, 1, 3),
        "wo": host["wo"],
    }


def stack_in_place(arrays: list[np.ndarray], axis: int) -> np.ndarray:
    """`np.stack(arrays, axis)` as a view of a copy in which each array keeps its own memory order (the new
    axis outermost): one contiguous copy per array where they are transposed views of stored tensors, which
    np.stack would interleave element by element. The devices' copy (`_put`) puts it in their layout."""
    order = sorted(range(arrays[0].ndim), key=lambda a: -arrays[0].strides[a])  # outermost in memory first
    in_memory = np.stack([a.transpose(order) for a in arrays])
    return np.moveaxis(in_memory.transpose(0, *(np.argsort(order) + 1)), 0, axis)


def _mlp(host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The MLP's stacked arrays, gate and up fused: dense ones over the layers that have them, experts
    (and shared experts) over theirs (engine.loading.checkpoints._layers_with)."""
    out = {"w_router": host.get("w_router")}
    for prefix in ("w", "experts", "shared"):
        if f"{prefix}_gate" in host:
            out[f"{prefix}_gate_up"] = stack_in_place([host[f"{prefix}_gate"], host[f"{prefix}_up"]], axis=-2)
            out[f"{prefix}_down"] = host[f"{prefix}_down"]
    return out


def layer_arrays(cfg: ModelConfig, layer: dict[str, np.ndarray], tp: int) -> dict[str, np.ndarray | None]:
    """One layer's LayerWeights arrays (leading axis 1) from its checkpoint arrays (the names of
    engine.loading.checkpoints: `wq` `wk` `wv` [D, heads * head_dim], their biases `bq` `bk` `bv`, `wo`,
    `w_gate` `w_up` [D, I], `w_down`, `attn_norm`, `mlp_norm`; in an expert layer `experts_gate`
    `experts_up` [E, D, I], `experts_down`, the router `w_router` [D, E] and shared experts `shared_gate`
    `shared_up` `shared_down`; with MLA its own; with qk_norm `q_norm` `k_norm` [head_dim], with
    sandwich_norms `post_attn_norm` `post_mlp_norm` [D]): heads padded for TP, Q/K/V and gate/up fused."""
    host = {name: w[None] for name, w in layer.items()}
    return {
        "attn_norm": host["attn_norm"],
        **(_mla(cfg, host, tp) if cfg.is_mla else _fused_qkv(cfg, host, tp)),
        "mlp_norm": host["mlp_norm"],
        "q_norm": host.get("q_norm"),
        "k_norm": host.get("k_norm"),
        "post_attn_norm": host.get("post_attn_norm"),
        "post_mlp_norm": host.get("post_mlp_norm"),
        **_mlp(host),
    }


def put_layer(arrays: dict[str, np.ndarray | None], mesh: Mesh, dtype: np.dtype) -> LayerWeights:
    """One layer's arrays (layer_arrays', leading axis 1) onto `mesh` as a LayerWeights of one layer, each
    sharded as the stacked layers' (an EAGLE-3 head's layer: engine.model.eagle3)."""
    return LayerWeights(
        **{
            name: None if w is None else _put(w.astype(dtype), named(mesh, *_LAYER_AXES[name]))
            for name, w in arrays.items()
        }
    )


def _put(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array onto the devices of `sharding`: each of this process's devices gets its own slice."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@functools.partial(jax.jit, static_argnums=0)
def _zeros(specs: tuple[tuple[str, tuple[int, ...], np.dtype, NamedSharding], ...]) -> dict[str, jax.Array]:
    """Zeroed arrays by name, each of its (name, shape, dtype, sharding) in `specs`."""
    return {
        name: jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)
        for name, shape, dtype, sharding in specs
    }


@functools.partial(jax.jit, donate_argnums=0, static_argnames="axis")
def _write_at(targets: dict, pieces: dict, index: dict, axis: int = 0) -> dict:
    """Each of `targets` with its piece (cast to its dtype) written from its `index` of `axis` on, in place
    (donated): one call, one compiled program, for all of a layer's arrays."""
    return {
        name: jax.lax.dynamic_update_slice_in_dim(
            target, pieces[name].astype(target.dtype), index[name], axis=axis
        )
        for name, target in targets.items()
    }


_VOCAB_PIECE_BYTES = 64 * 2**20  # the embeddings and the head are read and placed in pieces of this size
LOAD_THREADS = min(4, os.cpu_count() or 1)  # threads that read and copy weights ahead of their writes


@dataclasses.dataclass
class _Placed:
    """Pieces of weights on the devices, by name, each bound for its `index` of `axis` of the stacked array
    of the same name (or the one `held_as` names: a projection held per layer is its own array, `key#layer`),
    each of its (name, shape, dtype, sharding) in `targets`: a layer's part of each stacked weight, or a
    piece of the vocabulary. The names, shapes and shardings are the same for every layer of a run, so
    its writes are one compiled program."""

    pieces: dict[str, jax.Array]
    targets: tuple[tuple[str, tuple[int, ...], np.dtype, NamedSharding], ...]
    index: dict[str, int]
    axis: int = 0
    held_as: dict[str, str] = dataclasses.field(default_factory=dict)


def _layer_pieces(
    cfg: ModelConfig, reader, i: int, segment: range, mesh: Mesh, dtype, quantization
) -> _Placed:
    """Layer i's arrays read, fused and padded (layer_arrays), quantized with `quantization` "int8" and put
    on the devices in their stored dtype (cast to `dtype` as they are written into the stacked arrays of
    the layers of `segment`; a projection held per layer into an array of its own, named `key#layer`)."""
    pieces, targets, index, held_as = {}, [], {}, {}
    per_layer = held_per_layer(mesh)
    for name, w in layer_arrays(cfg, reader.layer(i), mesh.shape["model"]).items():
        if w is None:
            continue
        axes = _LAYER_AXES[name]
        parts = [(name, w, axes, dtype)]
        if quantization == "int8" and name in QUANTIZED:
            values, scale = quantize(w)
            parts = [(name, values, axes, values.dtype), (f"{name}/scale", scale, scale_axes(axes), dtype)]
        alone = per_layer and name in QUANTIZED  # an array of one layer, written at 0
        layers, at = (1, 0) if alone else (len(segment), i - segment.start)
        for key, array, part_axes, target_dtype in parts:
            sharding = named(mesh, *part_axes)
            pieces[key], index[key] = _put(array, sharding), at
            if alone:
                held_as[key] = f"{key}#{i - segment.start}"
            targets.append((key, (layers, *array.shape[1:]), np.dtype(target_dtype), sharding))
    return _Placed(pieces, tuple(targets), index, held_as=held_as)


def _vocab_pieces(cfg: ModelConfig, reader, name: str, mesh: Mesh, dtype) -> list[Callable[[], _Placed]]:
    """The embeddings' or the head's reads (each the size of several layers: a piece of the vocabulary at a
    time), each a task giving the piece on the devices, replicated (its rows need not divide over the mesh;
    each device keeps its part when it is written into the array)."""
    if name == "lm_head" and cfg.tie_word_embeddings:
        return []
    vocab, axis = reader.vocab_size(name), 0 if name == "embed" else 1
    shape = (vocab, cfg.hidden_size) if axis == 0 else (cfg.hidden_size, vocab)
    step = max(1, _VOCAB_PIECE_BYTES // (4 * cfg.hidden_size))  # (float32 where dequantized)

    def piece(start: int) -> _Placed:
        host = reader.global_tensor(name, slice(start, min(start + step, vocab)))
        target = (name, shape, dtype, named(mesh, *_AXES[name]))
        return _Placed({name: _put(host, named(mesh))}, (target,), {name: start}, axis)

    return [functools.partial(piece, start) for start in range(0, vocab, step)]


def _in_order(tasks: Iterable[Callable[[], _Placed]], workers: int) -> Iterator[_Placed]:
    """Each task's result, in order, computed on `workers` threads that run at most `workers` tasks ahead of
    the caller (so the host holds that many layers' arrays at once). Reading a file, numpy's copies and
    the devices' copies (which transpose a stored tensor into its layout) release the GIL."""
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="weights") as pool:
        pending: collections.deque = collections.deque()
        for task in tasks:
            pending.append(pool.submit(task))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _return_freed_memory() -> None:
    """Hands the host memory of the arrays freed so far back to the system. glibc keeps freed blocks of
    up to 32 MB in its heap (its mmap threshold rises to the largest block freed), so the per-layer arrays
    of a model with small layers would otherwise stay resident beside their device copies."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()


def build_weights(
    cfg: ModelConfig,
    checkpoint: Checkpoint,
    mesh: Mesh,
    dtype: jnp.dtype = jnp.float32,
    progress: bool = False,
    quantization: str = "none",
) -> Weights:
    """Streams `checkpoint`'s weights onto `mesh`, a layer at a time: each layer's arrays are read, fused
    and padded for the mesh's TP size (`quantization` "int8": the projections quantized,
    engine.model.quantized), put on the devices as they are stored (each device receives only its own
    shard; the devices' copy transposes a stored [out, in] tensor into its layout) and written, cast to
    `dtype`, into their layer of the stacked device arrays (created zeroed in their sharding). Reads and
    copies run on LOAD_THREADS threads a few layers ahead of the writes: the host holds that many layers at
    once. `progress`: a bar of the stored bytes read."""
    from tqdm import tqdm

    dtype = np.dtype(dtype)
    start_time = time.perf_counter()
    with (
        checkpoint.reader() as reader,
        tqdm(total=checkpoint.nbytes, unit="B", unit_scale=True, desc="weights", disable=not progress) as bar,
    ):
        segments = []
        for start, end in cfg.layer_segments():
            segment = range(start, end)
            tasks = [
                functools.partial(_layer_pieces, cfg, reader, i, segment, mesh, dtype, quantization)
                for i in segment
            ]
            segments.append(_layer_weights(_write_stacked(tasks, bar, reader)))
        vocab = [
            task for name in ("embed", "lm_head") for task in _vocab_pieces(cfg, reader, name, mesh, dtype)
        ]
        outside = _write_stacked(vocab, bar, reader)
        # (a copy: a device array on a CPU may alias its host array, here the file's pages)
        final_norm = _put(
            np.array(reader.global_tensor("final_norm"), dtype), named(mesh, *_AXES["final_norm"])
        )
        weights = Weights(
            embed=outside["embed"],
            layers=tuple(segments),
            final_norm=final_norm,
            lm_head=outside.get("lm_head"),
        )
    jax.block_until_ready(weights)
    _return_freed_memory()
    seconds = time.perf_counter() - start_time
    log.info(
        "weights loaded: %.2f GiB stored, %.2f GiB on the devices, %.1f s (%.2f GB/s)",
        checkpoint.nbytes / 2**30,
        weight_bytes(weights) / 2**30,
        seconds,
        checkpoint.nbytes / 1e9 / max(seconds, 1e-9),
    )
    return weights


def _write_stacked(tasks: list, bar, reader) -> dict[str, jax.Array]:
    """The stacked arrays that `tasks`' pieces (each task's _Placed) are written into, each created zeroed
    with its first piece; the tasks run ahead on LOAD_THREADS threads (_in_order)."""
    stacked: dict[str, jax.Array] = {}
    for placed in _in_order(tasks, LOAD_THREADS):
        array_of = {name: placed.held_as.get(name, name) for name in placed.pieces}  # where each piece goes
        new = tuple(target for target in placed.targets if array_of[target[0]] not in stacked)
        if new:
            stacked.update({array_of[name]: zeros for name, zeros in _zeros(new).items()})
        targets = {name: stacked[array_of[name]] for name in placed.pieces}
        written = _write_at(targets, placed.pieces, placed.index, axis=placed.axis)
        stacked.update({array_of[name]: array for name, array in written.items()})
        bar.update(reader.bytes_read - bar.n)
        _return_freed_memory()
    return stacked


def _layer_weights(stacked: dict[str, jax.Array]) -> LayerWeights:
    """A segment's LayerWeights from its stacked arrays (a projection held per layer: one per layer, named
    `key#layer`), a quantized projection's values and scale paired."""

    def weight(key: str):
        layers = sum(name.startswith(f"{key}#") for name in stacked)  # held per layer: one array each
        return PerLayer(tuple(stacked[f"{key}#{i}"] for i in range(layers))) if layers else stacked.get(key)

    arrays = {name: weight(name) for name in _LAYER_AXES}
    for name in QUANTIZED:
        values, scale = arrays[name], weight(f"{name}/scale")
        if isinstance(values, PerLayer) and scale is not None:
            arrays[name] = PerLayer(tuple(map(Int8Weight, values.arrays, scale.arrays)))
        elif scale is not None:
            arrays[name] = Int8Weight(values, scale)
    return LayerWeights(**arrays)


def weight_bytes(weights: Weights) -> int:
    """Bytes of the weights' global arrays (a replicated array counted once)."""
    return sum(x.nbytes for x in jax.tree.leaves(weights))
