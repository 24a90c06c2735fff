"""A decode step's matrix products alone, in XLA and in torch: where XLA:CPU is the wall (issue 50).

The products are the model's (engine.model.forward's): per layer Q/K/V fused, the attention output, gate
and up fused, down; then the logits. `xla_products` computes them as the engine's step does
(engine.model.projection.project in a lax.scan over the layers, the logits by
engine.model.forward.output_logits); `torch_products` the same products in torch (oneDNN on a CPU: what
vLLM's CPU engine runs) on the same weights in the same dtype. Each takes a batch of rows and chains the
products through a residual, so that neither can skip one. Attention, norms, rotary embeddings, sampling
and the cache are left out: the step's time less these products is theirs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np


def _median_seconds(fn, rounds: int, calls: int = 5) -> float:
    fn()  # compiled / warmed
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def xla_products(weights, cfg, batch: int, rounds: int, stacked: bool = False) -> float:
    """Median seconds of one step's products in XLA at `batch` rows (dense, unquantized layers only), as
    the step computes them: in a lax.scan over the layers, each projection held as `weights` hold it
    (engine.model.projection: per layer on a CPU).

    stacked: every projection stacked over the layers first (the TPU's layout): on XLA:CPU the scan then
    copies each layer's slice of each matrix before its dot, and the difference is what those copies
    cost."""
    import jax
    import jax.numpy as jnp

    from pdserve.engine.model.forward import output_logits
    from pdserve.engine.model.projection import at_layer, hold_apart, project, stack_layers

    width = weights.layers[0].wo.shape[1]  # the attention output's width (heads x head_dim, padded)

    def layer(h, w):
        qkv = project("td,dkx->tkx", h, w.w_qkv).reshape(h.shape[0], -1)[:, :width]
        h = h + project("ti,id->td", qkv, w.wo)
        gate_up = project("td,dci->tci", h, w.w_gate_up)
        return h + project("ti,id->td", jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], w.w_down)

    def run(segment, x):
        scanned, held = hold_apart(segment)

        def body(h, xs):
            w, index = xs
            return layer(h, at_layer(w, held, index)), None

        return jax.lax.scan(body, x, (scanned, jnp.arange(segment.wo.shape[0])))[0]

    @jax.jit
    def products(weights, x):
        for segment in weights.layers:
            x = run(segment, x)
        return output_logits(weights, x, cfg)

    if stacked:
        weights = dataclasses.replace(
            weights,
            layers=tuple(
                dataclasses.replace(seg, **{n: stack_layers(p) for n, p in hold_apart(seg)[1].items()})
                for seg in weights.layers
            ),
        )
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, cfg.hidden_size)), weights.embed.dtype)
    return _median_seconds(lambda: products(weights, x).block_until_ready(), rounds)


def torch_products(weights, cfg, batch: int, rounds: int, threads: int) -> float:
    """Median seconds of the same products in torch on `threads` threads, on copies of the same weights in
    the same dtype (2-D [in, out] matrices, as a linear layer's transposed weight)."""
    import ml_dtypes
    import torch

    from pdserve.engine.model.projection import stack_layers

    def matrices(held) -> list:  # [L, in, ...out] -> L matrices [in, out], in the weights' dtype
        host = np.asarray(stack_layers(held))
        wide = host.dtype == ml_dtypes.bfloat16
        flat = host.reshape(host.shape[0], host.shape[1], -1)
        tensor = torch.from_numpy(flat.astype(np.float32) if wide else flat)
        return list(tensor.to(torch.bfloat16) if wide else tensor)

    layers = [
        list(zip(*(matrices(getattr(seg, n)) for n in ("w_qkv", "wo", "w_gate_up", "w_down")), strict=True))
        for seg in weights.layers
    ]
    _, wo, _, w_down = layers[0][0]
    width, intermediate, dtype = wo.shape[0], w_down.shape[0], wo.dtype
    head = matrices(weights.lm_head[None] if weights.lm_head is not None else weights.embed.T[None])[0]
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((batch, cfg.hidden_size), np.float32)).to(
        dtype
    )
    torch.set_num_threads(threads)

    def products():
        with torch.inference_mode():
            h = x
            for segment in layers:
                for w_qkv, wo, w_gate_up, w_down in segment:
                    h = h + (h @ w_qkv)[:, :width] @ wo
                    gate_up = (h @ w_gate_up).view(batch, 2, intermediate)
                    h = h + (torch.nn.functional.silu(gate_up[:, 0]) * gate_up[:, 1]) @ w_down
            return (h @ head).float()

    return _median_seconds(products, rounds)
