"""The KV cache sized from the devices' memory, and what an engine runs on (its start-up summary).

With no `--num-blocks`, the KV cache takes what the memory fraction (`--gpu-memory-utilization`) leaves of
each device once the weights (and LoRA slots) are on it and the step's temporaries are set aside. Those
are measured, not estimated: the steps of the smallest and largest token buckets are compiled ahead of
time against two small caches of the same layout, and XLA's memory analysis gives their temporary bytes
per device as a line in the cache's size (StepTemps: on a CPU a cache of a narrower dtype than float32 is
converted, and copied, inside the step, so those temporaries grow with the blocks; elsewhere they do not).

On a CPU, where the devices share the host's RAM, the budget comes from the RAM available at start
(`available_ram`: MemAvailable, within the container's cgroup limit): with `--gpu-memory-utilization F`,
F of it for everything (weights included); without it, the KV cache (and the temporaries that grow with
it) takes CPU_KV_SHARE of what is left after the weights and the step's fixed temporaries, so that any
model whose weights fit serves with no sizing flag (as vLLM's CPU backend gives its KV cache a budget of
its own); that size is kept steady from one start to the next (steady_num_blocks), so that a restart
finds its executables in the persistent compilation cache. On accelerators the fraction (default 0.9,
vLLM's) covers everything. The start-up line's `sized_by` names the rule.

`--max-model-len` defaults to the model's context (max_position_embeddings), capped to what the cache
holds for one request; a larger value than the model's context is refused, and so is a budget that cannot
hold one request of an explicit `--max-model-len`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from pdserve.engine import compile_cache
from pdserve.engine.config import EngineConfig, ModelConfig, SizingError
from pdserve.engine.model.kv_cache import cache_shape

log = logging.getLogger(__name__)

# The memory fraction where --gpu-memory-utilization is not given, on an accelerator: most of its memory
# for everything (vLLM's default)
ACCELERATOR_FRACTION = 0.9
# On a CPU without --gpu-memory-utilization: the KV cache's share of the RAM left after the weights and the
# step's fixed temporaries (a CPU engine shares the host with everything else on it); and the share of the
# available RAM the weights and those temporaries may take before the model is refused as too large
CPU_KV_SHARE = 0.1
CPU_WEIGHTS_SHARE = 0.9
# Leading bits a CPU's cache size keeps (steady_num_blocks): 5, at most 1/16 of the budget's blocks given
# up by the rounding, 1/8 by keeping the last start's size (a start's budget moves by a few percent: what
# the runtime took before sizing varies by a hundred MB, the RAM available by more)
STEADY_BITS = 5
# On a CPU, counted with the runtime: the host-side arrays of a step, the compiled steps' code and what the
# allocator keeps of freed temporaries beyond XLA's accounting (measured: 18 to 30 MiB past a 6.5 GiB plan
# of a 1.2B bfloat16 model on jax 0.10; on jax 0.12, whose XLA:CPU runs bfloat16 dots in libraries of its
# own, 142 MiB past the plan of a 1.1B one, tests/services/test_memory_plan.py; with the projections held
# per layer, a dot per layer and projection in every step, 210 MiB past it: 320 MiB keeps about 100 MiB
# of margin)
CPU_RUNTIME_RESERVE = 320 * 2**20
# On an accelerator, each device's share of the same: the BLAS libraries' workspaces, the sampler's and the
# allocator's rounding beyond XLA's accounting (measured on an H200: 84 MB past a 101 GB plan)
DEVICE_RUNTIME_RESERVE = 256 * 2**20
# The RAM a CPU engine sizes from, in bytes, instead of what the host reports (a host that shares its RAM
# by policy; tests give a box-independent figure)
AVAILABLE_RAM_ENV = "PDSERVE_AVAILABLE_RAM"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class StepTemps:
    """The step's temporary bytes per device, a line in the cache's blocks: `base` with no block and
    `per_block` more for each (0 where the cache is updated in place: XLA:CPU converts, and copies, a cache
    narrower than float32 inside the step)."""

    base: int
    per_block: int = 0

    def at(self, num_blocks: int) -> int:
        return self.base + self.per_block * num_blocks


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How an engine's memory is split. Byte counts are per device; on a CPU, of the host's RAM (every
    CPU device's together)."""

    platform: str
    device_kind: str
    num_devices: int  # of the engine's mesh
    dtype: str
    kv_dtype: str  # the cache's element type (EngineConfig.cache_dtype)
    weight_bytes: int  # weights and LoRA slots
    num_blocks: int
    block_size: int
    block_bytes: int  # one KV block's
    max_model_len: int
    budget_bytes: int = (
        0  # what the memory fraction gives the engine (0: the cache was sized by --num-blocks)
    )
    activation_bytes: int = 0  # the step's temporaries at num_blocks (measured when sizing from memory)
    fraction: float = 0.0
    rule: str = ""  # how the memory was sized (sized_by): "" is by --num-blocks
    # What the runtime takes beyond XLA's accounting, counted against the budget as the weights are: a
    # reserve per device, and on a CPU what building the engine took of the host's RAM beyond the weights
    # (compiled executables, the loader's buffers the allocator keeps)
    runtime_bytes: int = 0
    num_host_blocks: int = 0  # slots of the host tier (--kv-offloading-size), a whole block each

    @property
    def planned_bytes(self) -> int:
        """Everything the plan counts: weights, the step's temporaries, the KV cache (and on a CPU the
        runtime's share)."""
        return (
            self.weight_bytes
            + self.runtime_bytes
            + self.activation_bytes
            + self.num_blocks * self.block_bytes
        )

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens the cache holds at once."""
        return self.kv_tokens / self.max_model_len

    def summary(self) -> dict[str, str]:
        """The start-up summary's fields (also Admin stats' and /metrics' engine info)."""
        sized = self.rule or "num_blocks"
        return {
            "platform": self.platform,
            "devices": str(self.num_devices),
            "device_kind": self.device_kind,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "weights_gib": f"{self.weight_bytes / GIB:.2f}",
            "kv_blocks": str(self.num_blocks),
            "kv_tokens": str(self.kv_tokens),
            "kv_gib": f"{self.num_blocks * self.block_bytes / GIB:.2f}",
            "activations_gib": f"{self.activation_bytes / GIB:.2f}",
            "runtime_gib": f"{self.runtime_bytes / GIB:.2f}",
            "max_model_len": str(self.max_model_len),
            "max_concurrency": f"{self.max_concurrency:.1f}",
            "sized_by": sized,
        } | ({"kv_host_blocks": str(self.num_host_blocks)} if self.num_host_blocks else {})


def _local_devices(mesh) -> list[jax.Device]:
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def device_bytes(trees, mesh) -> int:
    """Bytes the arrays of `trees` hold on the fullest of this process's devices of `mesh`; on a CPU, on
    all of them together (replicated arrays count once a device)."""
    per_device: dict[jax.Device, int] = {d: 0 for d in _local_devices(mesh)}
    for leaf in jax.tree.leaves(trees):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    values = per_device.values()
    return sum(values) if _platform(mesh) == "cpu" else max(values)


def memory_fraction(config: EngineConfig, platform: str) -> float:
    """The fraction of memory the engine may take for everything: --gpu-memory-utilization, or on an
    accelerator its default; 0 on a CPU without the flag (the KV cache's own share sizes it instead)."""
    if config.gpu_memory_utilization or platform == "cpu":
        return config.gpu_memory_utilization
    return ACCELERATOR_FRACTION


def _platform(mesh) -> str:
    return mesh.devices.flat[0].platform


def available_ram(held: int = 0) -> int:
    """The RAM available to this process now: Linux's MemAvailable (elsewhere the free pages), within the
    container's cgroup memory limit where one is set. AVAILABLE_RAM_ENV instead, when set, is the RAM at
    start: less `held`, what the engine has taken since (its weights)."""
    given = os.environ.get(AVAILABLE_RAM_ENV)
    if given:
        return int(given) - held
    meminfo, host = Path("/proc/meminfo"), None
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
    if host is None:
        host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit, used = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    try:
        if limit.read_text().strip() != "max":
            return min(host, int(limit.read_text()) - int(used.read_text()))
    except (OSError, ValueError):
        pass
    return host


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (Linux /proc/self/status: VmRSS now, VmHWM its high-water mark; 0
    where it cannot be read)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _budget(mesh, config: EngineConfig, weight_bytes: int, runtime: int, fixed_temps: int) -> tuple[int, str]:
    """What the engine may use beyond its weights (`weight_bytes`, on the devices already) and the runtime's
    share (`runtime`, MemoryPlan.runtime_bytes), and the rule that says so (the start-up line's sized_by):
    per device on an accelerator (the fullest device's), on a CPU of the host's RAM (module docstring)."""
    fraction = memory_fraction(config, _platform(mesh))
    if _platform(mesh) == "cpu":
        held = weight_bytes + runtime
        available = available_ram(held=held)
        if not fraction:
            share = int(CPU_KV_SHARE * max(0, available - fixed_temps))
            return fixed_temps + share, f"{CPU_KV_SHARE:g} of the RAM left after the weights and step"
        return int(fraction * (available + held)) - held, f"gpu_memory_utilization={fraction:g}"
    budgets = []
    for device in _local_devices(mesh):
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise SizingError(
                f"{device.device_kind} reports no memory limit: size the KV cache with --num-blocks"
            )
        # (the bytes in use hold the weights, not the runtime's share)
        budgets.append(int(fraction * stats["bytes_limit"]) - stats.get("bytes_in_use", 0) - runtime)
    return min(budgets), f"gpu_memory_utilization={fraction:g}"


def block_bytes(model: ModelConfig, config: EngineConfig, mesh) -> int:
    """One KV block's bytes per device (on a CPU, every device's together): the cache is split over the
    mesh by heads, or replicated (MLA's latent)."""
    total = whole_block_bytes(model, config)
    tp = config.tp
    per_device = total if model.is_mla else total // tp
    return per_device * tp if _platform(mesh) == "cpu" else per_device


def whole_block_bytes(model: ModelConfig, config: EngineConfig) -> int:
    """One KV block's bytes over every row of the cache and every head (all devices' shards together)."""
    shape = cache_shape(model, dataclasses.replace(config, num_blocks=1))
    return jax.numpy.dtype(config.cache_dtype).itemsize * math.prod(shape)


def host_blocks(model: ModelConfig, config: EngineConfig) -> int:
    """Slots of the host tier that --kv-offloading-size GiB hold: a slot is a whole block, every device's
    shards (one host's view of the cache)."""
    if not config.kv_offloading_size:
        return 0
    slot = whole_block_bytes(model, config)
    slots = int(config.kv_offloading_size * GIB) // slot
    if slots < 1:
        raise SizingError(
            f"--kv-offloading-size {config.kv_offloading_size:g} GiB holds no block of {slot / 2**20:.2f} MiB"
        )
    return slots


def steady_num_blocks(num_blocks: int, key: str | None = None) -> int:
    """A CPU's cache size for a budget of `num_blocks`: the size the last start with the same `key` (the
    sizing rule and the layout) took while that fits and gives up at most 1/2**(STEADY_BITS - 2) of the
    blocks, else `num_blocks` rounded down to its STEADY_BITS leading bits (at most 1/2**(STEADY_BITS - 1)
    fewer; remembered under `key` beside the compilation cache). On a CPU the budget is a share of the
    RAM available at start, which moves from one start to the next, and the cache's size is a dimension
    of every compiled step: unrounded, no start found the previous one's executables in the persistent
    compilation cache (a one-shot `pdserve generate` compiled each decode shape again, a daemon's restart
    its whole warmup); rounded alone, a budget near a step's edge still changed sides between starts."""
    num_blocks = int(num_blocks)
    least = num_blocks - num_blocks // 2 ** (STEADY_BITS - 2)
    last = None if key is None else compile_cache.remembered_size(key)
    if last is not None and least <= last <= num_blocks:
        return last
    granule = 1 << max(0, num_blocks.bit_length() - STEADY_BITS)
    steady = num_blocks // granule * granule
    if key is not None:
        compile_cache.remember_size(key, steady)
    return steady


def agreed_num_blocks(num_blocks: int) -> int:
    """The cache size every process of a multi-process engine takes: each sizes its own from its own
    devices, but all run the same steps on one cache (engine.multihost), so they take the smallest."""
    if jax.process_count() == 1:
        return int(num_blocks)
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(num_blocks))))


def model_len(model: ModelConfig, config: EngineConfig) -> int:
    """The asked max_model_len, or the model's context (in whole blocks); SizingError past the context."""
    context = model.max_position_embeddings
    if config.max_model_len > context:
        raise SizingError(
            f"--max-model-len {config.max_model_len} exceeds the model's context ({context} tokens, "
            "max_position_embeddings of its config)"
        )
    return config.max_model_len or context // config.block_size * config.block_size


def check_weights_fit(model: ModelConfig, config: EngineConfig, mesh, num_params: int) -> None:
    """Before any weight is read: SizingError when the weights alone (`num_params` in the serving dtype,
    split over the mesh) exceed the memory fraction (not checked with --num-blocks, which sizes the rest
    by hand). Heads padded for TP and replicated norms make the true figure slightly larger."""
    if config.num_blocks:
        return
    platform = _platform(mesh)
    fraction = memory_fraction(config, platform)
    itemsize = jax.numpy.dtype(config.dtype).itemsize
    weights = num_params * itemsize
    int8 = config.quantization == "int8"
    if int8:  # every parameter but the embeddings and head is (about) one byte
        outside = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
        weights = outside * itemsize + (num_params - outside)
    if platform != "cpu":
        weights //= config.tp
    if not fraction:  # a CPU without the flag: the weights may take most of its RAM (the cache comes after)
        fraction = CPU_WEIGHTS_SHARE
        budget = int(fraction * available_ram())
    else:
        budget = _budget(mesh, config, 0, 0, 0)[0]
    if weights > budget:
        where = "the available RAM" if platform == "cpu" else "device memory"
        raise SizingError(
            f"the weights need {weights / GIB:.2f} GiB {'in all' if platform == 'cpu' else 'per device'} "
            f"({num_params / 1e9:.2f}B parameters in {config.dtype}{', projections int8' if int8 else ''} "
            f"over TP {config.tp}), more than "
            f"{fraction:g} of {where} leaves ({max(budget, 0) / GIB:.2f} GiB). Shard over more devices "
            "(--tp) or raise --gpu-memory-utilization"
        )


def _rule_text(rule: str, platform: str) -> str:
    if rule.startswith("gpu_memory_utilization"):
        return "the available RAM" if platform == "cpu" else "device memory"
    return rule


def plan(
    model: ModelConfig,
    config: EngineConfig,
    mesh,
    resident,
    step_temps: Callable[[EngineConfig], StepTemps],
    rss_at_start: int | None = None,
) -> tuple[EngineConfig, MemoryPlan]:
    """`config` with num_blocks and max_model_len resolved (0: sized here), and the plan that says how.
    `resident`: what the devices hold already (the weights, the LoRA slots); `step_temps(config)`: the
    step's temporary bytes per device by cache size, measured by compiling it (StepTemps);
    `rss_at_start`: this process's resident bytes before the engine was built (on a CPU what it took
    since beyond the weights is counted: MemoryPlan.runtime_bytes; None: not counted)."""
    bs = config.block_size
    max_len = model_len(model, config)
    config = dataclasses.replace(config, num_host_blocks=host_blocks(model, config))
    weight_bytes = device_bytes(resident, mesh)
    per_block = block_bytes(model, config, mesh)
    device = mesh.devices.flat[0]
    fields = dict(
        platform=device.platform,
        device_kind=device.device_kind,
        num_devices=mesh.devices.size,
        dtype=config.dtype,
        kv_dtype=config.cache_dtype,
        weight_bytes=weight_bytes,
        block_size=bs,
        block_bytes=per_block,
        num_host_blocks=config.num_host_blocks,
    )
    if config.num_blocks:  # sized by the flag
        if not config.max_model_len:
            max_len = max(bs, min(max_len, config.num_blocks * bs))
        resolved = dataclasses.replace(config, max_model_len=max_len)
        return resolved, MemoryPlan(num_blocks=config.num_blocks, max_model_len=max_len, **fields)
    platform = device.platform
    fraction = memory_fraction(config, platform)
    temps = step_temps(dataclasses.replace(config, max_model_len=max_len))
    runtime = DEVICE_RUNTIME_RESERVE
    if platform == "cpu":  # every CPU device's temporaries in the same RAM
        temps = StepTemps(temps.base * config.tp, temps.per_block * config.tp)
        runtime = CPU_RUNTIME_RESERVE
        if rss_at_start is not None:
            runtime += max(0, resident_bytes() - rss_at_start - weight_bytes)
    budget, rule = _budget(mesh, config, weight_bytes, runtime, temps.base)
    num_blocks = max(0, (budget - temps.base) // (per_block + temps.per_block))
    if platform == "cpu":
        num_blocks = steady_num_blocks(
            num_blocks, key=f"kv_blocks {rule}, {per_block} B a block, temps {temps.base}+{temps.per_block} B"
        )
    num_blocks = agreed_num_blocks(num_blocks)
    activations = temps.at(num_blocks)
    one_request = -(-max_len // bs)
    if num_blocks < one_request:
        capped = num_blocks * bs
        if config.max_model_len or capped < min(max_len, config.max_num_batched_tokens):
            raise SizingError(
                f"the KV cache does not fit one request of {max_len} tokens: "
                f"{f'{fraction:g} of ' if fraction else ''}{_rule_text(rule, platform)} leaves "
                f"{max(budget, 0) / GIB:.2f} GiB per device beyond the weights "
                f"({weight_bytes / GIB:.2f} GiB), the largest step takes {activations / GIB:.2f} GiB, and "
                f"{one_request} blocks of {per_block / 2**20:.2f} MiB need "
                f"{one_request * per_block / GIB:.2f} GiB. Shard over more devices (--tp), lower "
                "--max-model-len, or raise --gpu-memory-utilization"
            )
        log.warning(
            "max_model_len %d (the model's context) capped to %d: the KV cache holds %d tokens",
            max_len,
            capped,
            capped,
        )
        max_len = capped
    resolved = dataclasses.replace(config, num_blocks=int(num_blocks), max_model_len=max_len)
    return resolved, MemoryPlan(
        num_blocks=int(num_blocks),
        max_model_len=max_len,
        budget_bytes=budget,
        activation_bytes=activations,
        fraction=fraction,
        rule=rule,
        runtime_bytes=runtime,
        **fields,
    )
