"""Device slots holding the adapters in use: a fixed number, least recently used evicted first.

All slots live in one LoraWeights pytree, layers stacked on axis 0, laid out for the fused projections of
engine.model.weights: Q/K/V per (padded) KV head, gate and up side by side, heads padded for tensor
parallelism exactly like the base weights. The slot axis sits where the products need it: after the contracted
input axis in A ([in, slots, ..., R]), first in B ([slots, R, out]) and after the part axis of the batched
expansions (k/v, gate/up), so XLA contracts every array in place, with no per-step transpose. A slot of zeros
adds nothing.

A request pins its adapter's slot from admission to its end, so a slot is only rewritten once no
running request reads it; when every slot is pinned by another adapter, the request waits.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pdserve.engine.config import ModelConfig
from pdserve.engine.lora.adapter import LoraAdapter
from pdserve.engine.model.lora import LoraWeights
from pdserve.engine.model.sharding import named
from pdserve.engine.model.weights import pad_heads
from pdserve.engine.multihost import DeviceOp, Publish

SLOT = "slots"  # marks the slot axis in _AXES (replicated)
_AXES = {
    "qkv_a": ("layers", "embed", SLOT, None, None),
    "q_b": ("layers", SLOT, None, "kv_heads", None),
    "kv_b": ("layers", None, SLOT, None, "kv_heads", None),
    "o_a": ("layers", "heads", SLOT, None),
    "o_b": ("layers", SLOT, None, "embed"),
    "gate_up_a": ("layers", "embed", SLOT, None, None),
    "gate_up_b": ("layers", None, SLOT, None, "mlp"),
    "down_a": ("layers", "mlp", SLOT, None),
    "down_b": ("layers", SLOT, None, "embed"),
}
SLOT_AXIS = {name: axes.index(SLOT) for name, axes in _AXES.items()}  # in the stacked arrays


def _sharding(mesh: Mesh, name: str, with_slots: bool = True):
    axes = [None if a == SLOT else a for a in _AXES[name] if with_slots or a != SLOT]
    return named(mesh, *axes)


def slot_shapes(cfg: ModelConfig, max_rank: int, tp: int) -> dict[str, tuple[int, ...]]:
    """Shape of one slot of each array (without the layer and slot axes; see slot_arrays)."""
    kv_heads, hd, r = cfg.padded_num_kv_heads(tp), cfg.head_dim, max_rank
    d, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "qkv_a": (d, 3, r),
        "q_b": (r, kv_heads, cfg.group_size * hd),
        "kv_b": (2, r, kv_heads, hd),
        "o_a": (cfg.padded_num_heads(tp) * hd, r),
        "o_b": (r, d),
        "gate_up_a": (d, 2, r),
        "gate_up_b": (2, r, i),
        "down_a": (i, r),
        "down_b": (r, d),
    }


def slot_arrays(adapter: LoraAdapter, cfg: ModelConfig, max_rank: int, tp: int) -> dict[str, np.ndarray]:
    """One adapter in the slot layout (without the slot axis), rank zero-padded to `max_rank`."""
    kv_heads = cfg.padded_num_kv_heads(tp)
    pad = max_rank - adapter.rank
    a = {m: np.pad(x, ((0, 0), (0, 0), (0, pad))) for m, x in adapter.a.items()}  # [L, in, R]
    b = {m: np.pad(x, ((0, 0), (0, pad), (0, 0))) for m, x in adapter.b.items()}  # [L, R, out]
    layers = cfg.num_layers

    def per_kv_head(module: str, kv: bool) -> np.ndarray:  # [L, R, heads * head_dim] -> [L, R, kv_heads, -1]
        return pad_heads(b[module], -1, cfg, tp, kv=kv).reshape(layers, max_rank, kv_heads, -1)

    return {
        "qkv_a": np.stack([a["q_proj"], a["k_proj"], a["v_proj"]], axis=2),
        "q_b": per_kv_head("q_proj", kv=False),
        "kv_b": np.stack([per_kv_head("k_proj", kv=True), per_kv_head("v_proj", kv=True)], axis=1),
        "o_a": pad_heads(a["o_proj"], 1, cfg, tp, kv=False),
        "o_b": b["o_proj"],
        "gate_up_a": np.stack([a["gate_proj"], a["up_proj"]], axis=2),
        "gate_up_b": np.stack([b["gate_proj"], b["up_proj"]], axis=1),
        "down_a": a["down_proj"],
        "down_b": b["down_proj"],
    }


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(weights: LoraWeights, values: dict[str, jax.Array], slot: jax.Array) -> LoraWeights:
    def write(name: str) -> jax.Array:
        full, value = getattr(weights, name), jnp.expand_dims(values[name], SLOT_AXIS[name])
        start = [0] * full.ndim
        start[SLOT_AXIS[name]] = slot
        return jax.lax.dynamic_update_slice(full, value.astype(full.dtype), start)

    return LoraWeights(**{name: write(name) for name in _AXES})


class LoraSlots:
    """`num_slots` adapters resident on the mesh; `acquire` pins one (loading it), `release` unpins."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, mesh: Mesh, dtype: jnp.dtype):
        self.cfg, self.num_slots, self.max_rank, self.mesh, self.dtype = cfg, num_slots, max_rank, mesh, dtype
        self.tp = mesh.shape["model"]
        self.weights = LoraWeights(
            **{
                name: jnp.zeros(_with_slots(shape, name, num_slots, cfg), dtype, device=_sharding(mesh, name))
                for name, shape in slot_shapes(cfg, max_rank, self.tp).items()
            }
        )
        self._resident: collections.OrderedDict[str, int] = (
            collections.OrderedDict()
        )  # key -> slot, LRU first
        self._pins: collections.Counter[str] = collections.Counter()
        self.num_loads = 0  # adapters written into a slot since start
        self.publish: Publish | None = None  # the leader of a multi-process engine (engine.multihost)

    @property
    def resident(self) -> list[str]:
        """Keys (name@fingerprint) of the adapters in a slot, least recently used first."""
        return list(self._resident)

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """Pins `adapter` in a slot and returns the slot; None when every slot is pinned by others."""
        key = adapter.key
        slot = self._resident.get(key)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._load(adapter, slot)
            self._resident[key] = slot
        self._resident.move_to_end(key)
        self._pins[key] += 1
        return slot

    def release(self, adapter: LoraAdapter) -> None:
        self._pins[adapter.key] -= 1
        if self._pins[adapter.key] <= 0:
            del self._pins[adapter.key]

    def _free_slot(self) -> int | None:
        used = set(self._resident.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            return free[0]
        victim = next((key for key in self._resident if not self._pins[key]), None)
        return None if victim is None else self._resident.pop(victim)

    def warmup(self) -> None:
        """Compiles the slot write, so that the first adapter load while serving compiles nothing: writes
        zeros into a slot that holds no resident adapter (no request reads it). With every slot holding an
        adapter, the write has run already."""
        used = set(self._resident.values())
        slot = next((s for s in range(self.num_slots) if s not in used), None)
        if slot is not None:
            shapes = slot_shapes(self.cfg, self.max_rank, self.tp)  # one layer's
            layers = self.cfg.num_layers
            self.write({name: np.zeros((layers, *shape), np.float32) for name, shape in shapes.items()}, slot)

    def _load(self, adapter: LoraAdapter, slot: int) -> None:
        self.write(slot_arrays(adapter, self.cfg, self.max_rank, self.tp), slot)
        self.num_loads += 1

    def write(self, host: dict[str, np.ndarray], slot: int) -> None:
        """Writes an adapter's host arrays (slot_arrays) into `slot`; published first (engine.multihost)."""
        if self.publish is not None:
            self.publish(DeviceOp("lora_write", host, {"slot": slot}))
        values = {
            name: jax.device_put(x.astype(self.dtype), _sharding(self.mesh, name, with_slots=False))
            for name, x in host.items()
        }
        self.weights = _write_slot(self.weights, values, jnp.int32(slot))


def _with_slots(shape: tuple[int, ...], name: str, num_slots: int, cfg: ModelConfig) -> tuple[int, ...]:
    """[layers, *shape] with the slot axis inserted where _AXES puts it."""
    full = [cfg.num_layers, *shape]
    full.insert(SLOT_AXIS[name], num_slots)
    return tuple(full)
