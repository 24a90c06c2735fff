"""Roofline projections: a profile for a chip not at hand (`pdserve profile --project CHIP --from
PROFILE`), from the chip's published figures and the efficiencies the measured profile shows against this
host's own roofline. Every figure it gives is a projection, and the profile says so (Profile.projection).

The measured profile (of any engine configuration of the model) and this host's peaks, measured here
(host_roofline: a float32 matrix product, a large copy), give two efficiencies: compute (a prompt chunk's
FLOPs at the host's peak, over the step the profile predicts for it) and memory (the weights at the host's
bandwidth, over a lone decode step), each clamped to [MIN_EFFICIENCY, 1]. The chip's costs are then, in
the profile's terms (planner.costs), per TP-way shard of the model:
- per_token_s: 2 x the matmul parameters / TP / (peak FLOP/s x compute efficiency), plus, with TP > 1, two
  all-reduces of a hidden vector a layer over the interconnect;
- fixed_s: the weights / TP read at (HBM bandwidth x memory efficiency), plus the host's share of a step
  (`host_overhead_s`: scheduling and sampling on the host, not scaled);
- per_kv_read_s: a token's KV bytes / TP at the same bandwidth;
- per_pair_s: 4 x layers x heads x head_dim / TP FLOPs at the compute rate (the attention's products);
- per_row_s: the logits of a row (2 x hidden x vocab / TP FLOPs) at the compute rate.
A step costs the sum of its terms (a roofline would take the larger of compute and memory: near the ridge
the projection is pessimistic, up to 2x). Dense models only: a mixture of experts is refused.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from pdserve.planner.costs import Profile, RowShape, StepCosts

MIN_EFFICIENCY = 0.05
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published per-chip figures: dense bf16 peak, HBM bandwidth and capacity, interconnect bandwidth
    per chip (ICI / NVLink, one direction)."""

    name: str
    peak_tflops: float
    hbm_gbps: float  # GB/s
    hbm_gib: float
    interconnect_gbps: float  # GB/s


CHIPS = {
    c.name: c
    for c in (
        Chip("tpu-v5e", 197.0, 819.0, 16.0, 200.0),
        Chip("tpu-v6e", 918.0, 1640.0, 32.0, 448.0),
        Chip("tpu-v5p", 459.0, 2765.0, 95.0, 600.0),
        Chip("h100", 989.0, 3350.0, 80.0, 450.0),
        Chip("h200", 989.0, 4800.0, 141.0, 450.0),
    )
}


# Dense models' sizes (their config.json's), for projecting a model not measured here (retarget)
MODELS = {
    "llama-3.1-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_layers": 32,
        "num_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "num_experts": 0,
        "num_experts_per_tok": 0,
    },
    "llama-3.1-70b": {
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_layers": 80,
        "num_heads": 64,
        "num_kv_heads": 8,
        "head_dim": 128,
        "num_experts": 0,
        "num_experts_per_tok": 0,
    },
}


@dataclasses.dataclass(frozen=True)
class Efficiencies:
    compute: float
    memory: float
    source: str  # how they were had (measured here, or given)


def host_roofline(size: int = 1024, copy_mib: int = 256) -> tuple[float, float]:
    """This host's (FLOP/s, bytes/s): a float32 matrix product of `size`, a copy of `copy_mib` MiB; the
    best of three."""
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    src = np.ones(copy_mib << 18, dtype=np.float32)
    dst = np.empty_like(src)
    flops, copies = [], []
    for _ in range(3):
        start = time.perf_counter()
        a @ a
        flops.append(2 * size**3 / (time.perf_counter() - start))
        start = time.perf_counter()
        np.copyto(dst, src)
        copies.append(2 * src.nbytes / (time.perf_counter() - start))  # (read and written)
    return max(flops), max(copies)


def matmul_params(dims: dict) -> float:
    """The parameters a token multiplies by in a dense decoder (attention projections, gated MLP, the
    logits)."""
    h, layers = dims["hidden_size"], dims["num_layers"]
    q = dims["num_heads"] * dims["head_dim"]
    kv = dims["num_kv_heads"] * dims["head_dim"]
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * dims["intermediate_size"]
    return layers * per_layer + h * dims["vocab_size"]


def measured_efficiencies(profile: Profile, host: tuple[float, float]) -> Efficiencies:
    """What the measured `profile` achieves against this host's roofline `host` (FLOP/s, bytes/s), on
    whole steps (however the fit shares a step among its terms): compute, a prompt chunk of the token
    budget (its matmuls' FLOPs at the host's peak, over the step); memory, a lone decode step (the weights
    read at the host's bandwidth, over the step)."""
    e, c = profile.engine_info, profile.costs
    flops, bandwidth = host
    budget = int(e.get("max_num_batched_tokens", 512))
    compute = budget * 2 * matmul_params(e["model_dims"]) / flops / c.seconds([RowShape(budget, 0)])
    memory = float(e["weight_bytes"]) / bandwidth / c.seconds([RowShape(1, 0)])
    clamp = lambda x: float(min(max(x, MIN_EFFICIENCY), 1.0))  # noqa: E731
    return Efficiencies(
        clamp(compute),
        clamp(memory),
        f"measured here: host {flops / 1e9:.0f} GFLOP/s, {bandwidth / 1e9:.1f} GB/s",
    )


def retarget(profile: Profile, model: str, dims: dict, dtype_bytes: int = 2) -> Profile:
    """`profile` with another dense model's sizes (`dims`, as engine.step_log.MODEL_DIMS; bf16 weights and
    KV of `dtype_bytes`): for projecting a model not measured here, at the efficiencies measured on the
    profile's own model (measured_efficiencies before retargeting). Its step costs are the measured
    model's: only a projection of it means anything."""
    weights = (matmul_params(dims) + dims["hidden_size"] * dims["vocab_size"]) * dtype_bytes  # (+ embeddings)
    kv = 2 * dims["num_layers"] * dims["num_kv_heads"] * dims["head_dim"] * dtype_bytes
    measured = profile.engine_info.get("measured_model") or profile.engine_info.get("model", "?")
    info = {**profile.engine_info, "model": model, "model_dims": dict(dims), "weight_bytes": weights}
    info["measured_model"] = measured  # (whose steps the efficiencies come from)
    info.update(kv_bytes_per_token=kv, dtype="bfloat16", kv_dtype="bfloat16")
    return dataclasses.replace(profile, engine_info=info, fit={}, steps=(), transfer={})


def project(
    profile: Profile,
    chip: Chip,
    tp: int,
    efficiencies: Efficiencies,
    host_overhead_s: float = 0.002,
    dtype_bytes: int = 2,
    memory_fraction: float = 0.9,
) -> Profile:
    """`profile`'s model on `tp` of `chip` (bf16 weights and KV: `dtype_bytes`), as a projected Profile
    (see the module): its costs, and a cache of what `memory_fraction` of the chips' HBM leaves after the
    weights."""
    e = profile.engine_info
    dims = e["model_dims"]
    if dims.get("num_experts"):
        raise ValueError("a roofline projection of a mixture of experts is not supported")
    scale = dtype_bytes / _bytes_of(e.get("dtype", "bfloat16"))  # the measured engine's weights -> bf16's
    weight_bytes = float(e["weight_bytes"]) * scale
    kv_scale = dtype_bytes / _bytes_of(e.get("kv_dtype", e.get("dtype", "bfloat16")))
    kv_per_token = float(e["kv_bytes_per_token"]) * kv_scale
    flop_rate = chip.peak_tflops * 1e12 * efficiencies.compute
    byte_rate = chip.hbm_gbps * 1e9 * efficiencies.memory
    hidden, layers = dims["hidden_size"], dims["num_layers"]
    all_reduce = (
        0.0
        if tp == 1
        else 2 * layers * 2 * hidden * dtype_bytes * (tp - 1) / tp / (chip.interconnect_gbps * 1e9)
    )
    costs = StepCosts(
        fixed_s=weight_bytes / tp / byte_rate + host_overhead_s,
        per_token_s=2 * matmul_params(dims) / tp / flop_rate + all_reduce,
        per_row_s=2 * hidden * dims["vocab_size"] / tp / flop_rate,
        per_kv_read_s=kv_per_token / tp / byte_rate,
        per_pair_s=4 * layers * dims["num_heads"] * dims["head_dim"] / tp / flop_rate,
        padding=profile.costs.padding,
    )
    block_size = int(e["block_size"])
    free = chip.hbm_gib * GIB * tp * memory_fraction - weight_bytes
    if free <= 0:
        raise ValueError(f"the weights ({weight_bytes / GIB:.1f} GiB) do not fit {tp} x {chip.name}")
    engine_info = {
        **e,
        "platform": chip.name,
        "device_kind": chip.name,
        "devices": str(tp),
        "tp": str(tp),
        "dtype": "bfloat16",
        "kv_dtype": "bfloat16",
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "kv_blocks": str(int(free // (kv_per_token * block_size))),
        "host": "",
    }
    label = (
        f"PROJECTION for {tp} x {chip.name} ({chip.peak_tflops:g} TFLOP/s bf16, {chip.hbm_gbps:g} GB/s HBM, "
        f"{chip.hbm_gib:g} GiB, {chip.interconnect_gbps:g} GB/s interconnect: published figures) at compute "
        f"efficiency {efficiencies.compute:.2f} and memory efficiency {efficiencies.memory:.2f} "
        f"({efficiencies.source}), host overhead {host_overhead_s * 1e3:g} ms a step; {e.get('model', '?')} "
        f"from the profile of {e.get('measured_model', e.get('model', '?'))} on {e.get('device_kind', '?')}. "
        "Not measured."
    )
    return Profile(costs, engine_info=engine_info, fit={}, projection=label)


def _bytes_of(dtype: str) -> int:
    """An element's bytes of a dtype the engine names (kvtransfer's DTYPES; another: bfloat16's)."""
    from pdserve.kvtransfer.layout import DTYPES  # (here: the command lines are built without JAX)

    return DTYPES.get(dtype, DTYPES["bfloat16"]).itemsize
