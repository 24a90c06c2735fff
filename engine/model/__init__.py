"""Model code: the decoder's forward pass (every family) as plain functions over a weights pytree and a
paged KV cache, the sampler, and the one sharding table."""
