"""The JAX model runtime shared by the prefill and decode roles (installed as `pdserve.engine`).

Rooms by job:
- `core/`: the scheduling core, free of device code: requests, the scheduler, the KV cache manager over
  the block pool, KV connectors (remote KV as a request state), sampling parameters, outputs.
- `model/`: the forward pass as plain functions over pytrees: weights, layers, attention (and its TPU
  kernel seam), MLA, MoE, the paged cache, the sampler, the sharding table.
- `loading/`: checkpoints (GGUF, safetensors) -> weights and config; known models fetched into a cache.
- `lora/`: PEFT adapters on the host and in device slots.
- here, the runtime: `llm_engine.LLMEngine` (schedule -> run -> update), `model_runner` (host batches ->
  compiled steps), `config`, `args` (the flags), `tokenizer`, `constraints`, `distributed` and
  `multihost` (one engine over several processes).
"""
