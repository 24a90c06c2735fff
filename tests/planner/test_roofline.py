"""Roofline projections (planner/roofline.py): a chip's costs from its published figures, by hand for an
8B-class dense model; labelled as a projection; what cannot be projected is refused."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.planner.costs import Padding, Profile, RowShape, StepCosts
from pdserve.planner.roofline import (
    CHIPS,
    MODELS,
    Efficiencies,
    matmul_params,
    measured_efficiencies,
    project,
    retarget,
)

pytestmark = pytest.mark.fast

DIMS = MODELS["llama-3.1-8b"]
MEASURED = Profile(
    StepCosts(fixed_s=0.05, per_token_s=1e-3, padding=Padding((8, 16, 32, 64, 128, 256, 512), 64)),
    engine_info={
        "model": "llama-8b",
        "dtype": "bfloat16",
        "kv_dtype": "bfloat16",
        "device_kind": "cpu",
        "weight_bytes": 16e9,
        "kv_bytes_per_token": 2 * 32 * 8 * 128 * 2,
        "model_dims": DIMS,
        "block_size": 16,
        "max_model_len": 8192,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 512,
        "tp": "1",
    },
)


def test_a_projection_by_hand():
    chip, given = CHIPS["tpu-v6e"], Efficiencies(0.5, 0.8, "given")
    projected = project(MEASURED, chip, 4, given, host_overhead_s=0.002)
    c = projected.costs
    params = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 4096 * 128256
    assert matmul_params(DIMS) == params
    assert c.fixed_s == pytest.approx(16e9 / 4 / (1640e9 * 0.8) + 0.002)
    all_reduce = 2 * 32 * 2 * 4096 * 2 * 3 / 4 / 448e9
    assert c.per_token_s == pytest.approx(2 * params / 4 / (918e12 * 0.5) + all_reduce)
    assert c.per_kv_read_s == pytest.approx(2 * 32 * 8 * 128 * 2 / 4 / (1640e9 * 0.8))
    assert c.padding == MEASURED.costs.padding
    e = projected.engine_info
    free = 32 * (1 << 30) * 4 * 0.9 - 16e9
    assert int(e["kv_blocks"]) == int(free // (2 * 32 * 8 * 128 * 2 * 16)) and e["tp"] == "4"
    assert (
        projected.projection.startswith("PROJECTION for 4 x tpu-v6e")
        and "Not measured" in projected.projection
    )
    # a decode step of 64 sequences at 1,000 tokens of context: weights and KV read, a few ms
    step = c.seconds([RowShape(1, 1000)] * 64)
    assert 0.005 < step < 0.02
    assert Profile.from_json(projected.to_json()) == projected


def test_what_cannot_be_projected_is_refused():
    moe = dataclasses.replace(
        MEASURED, engine_info={**MEASURED.engine_info, "model_dims": {**DIMS, "num_experts": 8}}
    )
    with pytest.raises(ValueError, match="mixture of experts"):
        project(moe, CHIPS["h100"], 1, Efficiencies(0.5, 0.8, "given"))
    with pytest.raises(ValueError, match="do not fit 1 x tpu-v5e"):
        project(MEASURED, CHIPS["tpu-v5e"], 1, Efficiencies(0.5, 0.8, "given"))


def test_efficiencies_measured_against_the_host_roofline_are_clamped():
    """On whole steps of the measured profile: a 512-token chunk (0.05 + 0.512 s) for compute, a lone
    decode (0.05 s + its 8-token bucket) for memory; a slow host's are clamped to 1, a fast one's to the
    floor, one in between is the ratio."""
    chunk, decode = 0.05 + 512e-3, 0.05 + 8e-3
    assert MEASURED.costs.seconds([RowShape(512, 0)]) == pytest.approx(chunk)
    slow = measured_efficiencies(MEASURED, (1e9, 1e9))
    assert (slow.compute, slow.memory) == (1.0, 1.0) and "measured here" in slow.source
    fast = measured_efficiencies(MEASURED, (1e18, 1e15))
    assert (fast.compute, fast.memory) == (0.05, 0.05)
    flops = 512 * 2 * matmul_params(DIMS) / chunk / 0.5  # (a host at which the chunk runs at half its peak)
    between = measured_efficiencies(MEASURED, (flops, 16e9 / decode / 0.25))
    assert (between.compute, between.memory) == (pytest.approx(0.5), pytest.approx(0.25))


def test_another_models_sizes_carry_the_measured_efficiencies():
    """A 135M-class profile retargeted to the 8B dims: the weights (params + embeddings, bf16) and the KV
    a token (2 x layers x kv heads x head_dim x 2 bytes) follow the dims; its projection is the 8B's."""
    small = dataclasses.replace(MEASURED, engine_info={**MEASURED.engine_info, "model": "small"})
    big = retarget(small, "llama-8b", DIMS)
    assert big.engine_info["weight_bytes"] == (matmul_params(DIMS) + 4096 * 128256) * 2
    assert big.engine_info["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert big.engine_info["model"] == "llama-8b" and big.costs == small.costs
    given = Efficiencies(0.5, 0.8, "given")
    assert project(big, CHIPS["h100"], 2, given).costs.fixed_s == pytest.approx(
        big.engine_info["weight_bytes"] / 2 / (3350e9 * 0.8) + 0.002
    )
