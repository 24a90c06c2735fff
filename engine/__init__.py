"""The JAX model runtime shared by the prefill and decode roles (installed as `pdserve.engine`).

Rooms by job:
- `core/`: the scheduling core, free of device code: requests, the scheduler, the KV cache manager over
  the block pool, KV connectors (remote KV as a request state), sampling parameters, outputs.
- `model/`: the forward pass as plain functions over pytrees: weights, layers, attention (and its TPU
  kernel seam), MLA, MoE, the paged cache, the sampler, the sharding table.
- `loading/`: checkpoints (GGUF, safetensors) -> weights and config; known models fetched into a cache.
- `lora/`: PEFT adapters on the host and in device slots.
- here, the runtime, a module a job: `llm_engine.LLMEngine` (the engine core: commands, the step loop,
  remote KV) over `builder` (the device side and its refusals), `input_processor` (requests built and
  checked, off the engine thread), `executor` (a step on the device -> sampled tokens), `token_masks`
  (allowed tokens, constraints), `draft_runner` (an EAGLE-3 head's passes), `host_tier` and `host_kv`
  (the host-memory KV tier), `offline` (`generate`, `prompt_logits`); `model_runner` with `compilation`
  and `kv_io` (the device work); `config`, `memory` (the cache's size), `tokenizer`, `constraints`,
  `distributed` and `multihost` (one engine over several processes).
"""
