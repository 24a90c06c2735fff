"""The KV cache sized from memory (engine.memory), max_model_len from the model, refusals before serving."""

from __future__ import annotations

import pytest

from pdserve.engine import memory
from pdserve.engine.config import EngineConfig, SizingError
from pdserve.engine.llm_engine import LLMEngine

# The tests' step sizes (the largest step is what the profile compiles)
SIZES = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256)
MIB = 2**20


def fraction_for(kv_bytes: int, weight_bytes: int) -> float:
    """The CPU memory fraction that leaves about `kv_bytes` for the cache beside weights of `weight_bytes`
    and the runtime (the budget is a fraction of the RAM available at start; this box's varies)."""
    available = memory.available_ram()
    return (kv_bytes + weight_bytes + memory.CPU_RUNTIME_RESERVE + 192 * MIB) / (available + weight_bytes)


@pytest.mark.model
def test_kv_capacity_follows_the_memory_fraction(loaded_model, caplog):
    """Two fractions, two capacities: each cache takes what its fraction leaves beyond the weights and the
    largest step's measured temporaries, and the start-up line says so."""
    probe = LLMEngine(loaded_model, EngineConfig(num_blocks=64, **SIZES))
    weights = probe.runner.memory.weight_bytes
    del probe
    engines = {}
    for target in (96 * MIB, 288 * MIB):
        config = EngineConfig(gpu_memory_utilization=fraction_for(target, weights), **SIZES)
        engines[target] = engine = LLMEngine(loaded_model, config)
        plan = engine.runner.memory
        assert plan.fraction == config.gpu_memory_utilization and plan.activation_bytes > 0
        kv = plan.num_blocks * plan.block_bytes
        rest = plan.budget_bytes - plan.activation_bytes  # the cache: the rest, in steady steps
        assert 0 <= rest - kv < rest / 2 ** (memory.STEADY_BITS - 1) + 2 * plan.block_bytes
        assert plan.num_blocks == memory.steady_num_blocks(plan.num_blocks)
        assert plan.runtime_bytes >= memory.CPU_RUNTIME_RESERVE
        assert engine.config.num_blocks == plan.num_blocks == engine.scheduler.kv.num_blocks
        assert engine.runner.cache.shape[1] == plan.num_blocks
        with caplog.at_level("INFO", logger="pdserve.engine.llm_engine"):
            engine.log_summary()
        assert f"kv_tokens={plan.num_blocks * 16} " in caplog.text
    small, large = (engines[t].runner.memory for t in sorted(engines))
    more = (large.num_blocks - small.num_blocks) * small.block_bytes  # the extra budget went to the cache
    assert more > (288 - 96) * MIB / 2, (small, large)  # (RAM available moves between the reads)
    info = engines[96 * MIB].summary()
    assert info["platform"] == "cpu" and info["max_model_len"] == "1024" and info["compile_cache"]


@pytest.mark.fast
def test_a_cpu_cache_size_holds_across_starts(tmp_path):
    """The RAM available at start moves between starts; the cache's size (a dimension of every compiled
    step) rounds down to steps that absorb it, giving up at most 1/16 of the blocks, and a later start with
    the same layout keeps the last start's size while it fits and gives up at most 1/8."""
    import jax

    assert memory.steady_num_blocks(6448) == memory.steady_num_blocks(6439) == 6400
    rounded = [memory.steady_num_blocks(n) for n in (0, 1, 31, 32, 33, 63, 64, 65)]
    assert rounded == [0, 1, 31, 32, 32, 62, 64, 64]
    for n in range(1, 5000, 7):
        steady = memory.steady_num_blocks(n)
        assert (
            n - n / 2 ** (memory.STEADY_BITS - 1) < steady <= n and memory.steady_num_blocks(steady) == steady
        )
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        assert memory.steady_num_blocks(6401, key="a") == 6400  # near a step's edge
        assert memory.steady_num_blocks(6390, key="a") == 6144  # the next start's budget is a little less
        assert memory.steady_num_blocks(6410, key="a") == 6144  # and then more: the last size holds
        assert memory.steady_num_blocks(6410, key="b") == 6400  # another layout: its own
        assert memory.steady_num_blocks(6100, key="a") == 5888  # the last no longer fits: sized again
        assert memory.steady_num_blocks(7000, key="a") == 6912  # far more: no longer within 1/8
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.model
def test_weights_beyond_the_budget_are_refused_before_loading(loaded_model):
    with pytest.raises(SizingError) as refusal:
        LLMEngine(loaded_model, EngineConfig(gpu_memory_utilization=1e-5, **SIZES))
    message = str(refusal.value)
    assert message.startswith("the weights need") and "parameters in float32 over TP 1" in message
    assert "--tp" in message and "--gpu-memory-utilization" in message


@pytest.mark.model
def test_a_cache_that_cannot_hold_one_request_is_refused_naming_the_numbers_and_flags(loaded_model):
    """engine.memory.plan on the engine's real mesh and weights, the largest step's temporaries given as
    more than the budget (what a long max_model_len's tables cost): no block is left for one request."""
    engine = LLMEngine(loaded_model, EngineConfig(num_blocks=64, **SIZES))
    runner = engine.runner
    config = EngineConfig(gpu_memory_utilization=0.5, **SIZES).on_platform("cpu")
    huge = lambda _config: memory.StepTemps(memory.available_ram())  # noqa: E731
    with pytest.raises(SizingError) as refusal:
        memory.plan(loaded_model.config, config, runner.mesh, runner.weights, huge)
    message = str(refusal.value)
    assert "does not fit one request of 1024 tokens" in message and "the largest step takes" in message
    for flag in ("--tp", "--max-model-len", "--gpu-memory-utilization"):
        assert flag in message


@pytest.mark.model
def test_max_model_len_defaults_to_the_model_context(loaded_model):
    """The test model's context is 8192 (max_position_embeddings): the default where the cache holds it,
    capped to the cache otherwise; a longer one is refused before any weight is read."""
    sizes = dict(max_num_seqs=8, max_num_batched_tokens=256)
    context = loaded_model.config.max_position_embeddings
    assert context == 8192
    assert (
        LLMEngine(loaded_model, EngineConfig(num_blocks=context // 16, **sizes)).config.max_model_len
        == context
    )
    assert LLMEngine(loaded_model, EngineConfig(num_blocks=64, **sizes)).config.max_model_len == 1024
    with pytest.raises(SizingError, match="exceeds the model's context"):
        LLMEngine(loaded_model, EngineConfig(num_blocks=64, max_model_len=2 * context, **sizes))


@pytest.mark.model
def test_a_quantized_cache_holds_about_four_times_the_float32_blocks(loaded_model, monkeypatch):
    """--kv-cache-dtype fp8: a block is a quarter of float32's bytes, so the same memory budget holds four
    times the blocks (the tokens the start-up line, Admin stats and the KV events report); int8: a quarter
    plus each head row's 2-byte scale (66 bytes a row of 64 values: 3.88 times the blocks)."""
    import dataclasses

    # one budget for the three plans: the host's available RAM moves between readings (other tests beside)
    monkeypatch.setenv(memory.AVAILABLE_RAM_ENV, str(memory.available_ram()))
    monkeypatch.setattr(memory, "STEADY_BITS", 64)  # the blocks the budget holds, not rounded to steady steps

    engine = LLMEngine(loaded_model, EngineConfig(num_blocks=64, **SIZES))
    mesh, cfg = engine.runner.mesh, loaded_model.config
    config = EngineConfig(gpu_memory_utilization=0.05, **SIZES).on_platform("cpu")
    fp8 = dataclasses.replace(config, kv_cache_dtype="fp8")
    assert fp8.cache_dtype == "float8_e4m3fn" and config.cache_dtype == "float32"
    assert memory.block_bytes(cfg, config, mesh) == 4 * memory.block_bytes(cfg, fp8, mesh)
    no_temporaries = lambda _config: memory.StepTemps(0)  # noqa: E731
    _, full = memory.plan(cfg, config, mesh, engine.runner.weights, no_temporaries)
    _, quarter = memory.plan(cfg, fp8, mesh, engine.runner.weights, no_temporaries)
    assert quarter.num_blocks in range(4 * full.num_blocks, 4 * full.num_blocks + 4)
    assert quarter.summary()["kv_dtype"] == "float8_e4m3fn" and full.summary()["kv_dtype"] == "float32"
    int8 = dataclasses.replace(config, kv_cache_dtype="int8")
    assert memory.block_bytes(cfg, int8, mesh) * 4 * 64 == memory.block_bytes(cfg, config, mesh) * 66
    _, scaled = memory.plan(cfg, int8, mesh, engine.runner.weights, no_temporaries)
    # the budget B holds full = B // F float32 blocks, so F * full <= B < F * (full + 1), and int8 blocks
    # of F * 66 / 256 bytes number from full * 256 // 66 up to ((full + 1) * 256 - 1) // 66
    lowest, highest = full.num_blocks * 256 // 66, ((full.num_blocks + 1) * 256 - 1) // 66
    assert scaled.num_blocks in range(lowest, highest + 1)
    assert scaled.summary()["kv_dtype"] == "int8"
