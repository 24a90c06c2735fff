"""Building an engine's device side: the mesh, the weights on it, the adapter slots, the attention, an
EAGLE-3 head, the memory plan that sizes the KV cache, and the ModelRunner that holds them.

Every refusal a configuration can meet (a length past the model's, weights that cannot fit, a feature the
model or a multi-host group does not support) is raised here before the weights load.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import jax

from pdserve.engine import memory, multihost
from pdserve.engine.compilation import step_temps
from pdserve.engine.config import EngineConfig, ModelConfig, UnsupportedModelError
from pdserve.engine.core.kv_groups import KVGroups
from pdserve.engine.loading.eagle3 import Eagle3Head
from pdserve.engine.loading.sources import LoadedModel
from pdserve.engine.lora_slots import LoraSlots
from pdserve.engine.model.attention import AttentionFn, ragged_paged_attention_reference
from pdserve.engine.model.eagle3 import DraftModel
from pdserve.engine.model.sharding import make_mesh
from pdserve.engine.model.tpu_attention import kernel_attention, kernel_unsupported
from pdserve.engine.model.weights import build_weights
from pdserve.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


def build_runner(
    model: LoadedModel,
    config: EngineConfig,
    devices: Sequence[jax.Device] | None = None,
    attention: AttentionFn | None = None,
    progress: bool = False,
    head: Eagle3Head | None = None,
) -> ModelRunner:
    """The device side of an engine on `devices` (default: all): attending with `attention` (default: on a
    TPU jax's Pallas kernel over this mesh where it applies, else the reference), with `head`'s weights
    (an EAGLE-3 head; its KV is one more layer of the cache), the cache sized by engine.memory."""
    rss_at_start = memory.resident_bytes()
    mesh = make_mesh(config.tp, devices)
    platform = mesh.devices.flat[0].platform
    config = config.on_platform(platform)  # "auto" dtype resolved
    if attention is None:
        attention = _default_attention(model.config, config, mesh, platform)
    dtype = jax.numpy.dtype(config.dtype)
    _check_features(model.config, config, head)
    memory.model_len(model.config, config)  # refused before the weights load: a length past the model's,
    memory.check_weights_fit(model.config, config, mesh, model.checkpoint.num_params)  # weights too large
    weights = build_weights(model.config, model.checkpoint, mesh, dtype, progress, config.quantization)
    lora_slots = None
    if config.max_loras:
        lora_slots = LoraSlots(model.config, config.max_loras, config.max_lora_rank, mesh, dtype)
    lora_weights = None if lora_slots is None else lora_slots.weights
    draft = None if head is None else DraftModel.build(head, mesh, dtype)
    temps = functools.partial(
        step_temps,
        model.config,
        mesh=mesh,
        weights=weights,
        lora_weights=lora_weights,
        attention=attention,
    )
    resident = (weights, lora_weights, None if draft is None else draft.weights)
    config, plan = memory.plan(model.config, config, mesh, resident, temps, rss_at_start)
    runner = ModelRunner(model.config, config, weights, mesh, lora_slots, attention, draft)
    runner.memory = plan
    return runner


def _default_attention(model: ModelConfig, config: EngineConfig, mesh, platform: str) -> AttentionFn:
    """jax's Pallas kernel over `mesh` on a TPU where it applies, else the reference (with speculative
    decoding, reading a verification row of 1 + k tokens in its decode loop, not in a prefill window)."""
    reference = ragged_paged_attention_reference
    if config.speculation.num_speculative_tokens:
        short_rows = 1 + config.speculation.num_speculative_tokens
        reference = functools.partial(ragged_paged_attention_reference, short_rows=short_rows)
    if platform != "tpu":
        return reference
    reference = functools.partial(reference, flat_rows=False)  # a TPU's tiled cache is read block by block
    unsupported = kernel_unsupported(model, config.tp, config.dtype, config.cache_dtype)
    if unsupported:
        log.warning("TPU attention kernel not used (%s): the reference attends", unsupported)
        return reference
    return kernel_attention(model, mesh)


def _check_features(model: ModelConfig, config: EngineConfig, head: Eagle3Head | None) -> None:
    """The features this model and process cannot have, refused by name before anything loads."""
    if config.quantization != "none" and (model.num_experts or model.is_mla):
        raise UnsupportedModelError(
            f"--quantization {config.quantization}: mixture-of-experts and MLA models are served "
            "unquantized (--quantization none)"
        )
    if config.kv_offloading_size:
        _check_host_tier(model, config)
    if config.max_loras and (model.num_experts or model.is_mla):
        raise ValueError(
            "LoRA adapters on mixture-of-experts or MLA models are not supported (max_loras > 0)"
        )
    if head is not None and multihost.is_multi_process():
        raise UnsupportedModelError("an EAGLE-3 head in a multi-host group is not supported")


def _check_host_tier(model: ModelConfig, config: EngineConfig) -> None:
    """--kv-offloading-size's refusal (a multi-host group), before the weights load; where there is no
    prefix cache (hybrid models, --no-prefix-caching) the tier only stages a prefill server's streams."""
    flag = f"--kv-offloading-size {config.kv_offloading_size:g}"
    if multihost.is_multi_process():
        raise UnsupportedModelError(
            f"{flag}: a multi-host group does not offload yet (each host would copy its own shards)"
        )
    if not config.enable_prefix_caching or not KVGroups.of(model).is_identity:
        why = "--no-prefix-caching" if not config.enable_prefix_caching else "a hybrid model's layer groups"
        log.warning("%s: no prefix cache (%s) to offload: the tier only stages prefill streams", flag, why)
