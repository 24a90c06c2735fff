"""Self-distills a small EAGLE-3 head for the default model on this CPU and writes it in the published format
(config.json + safetensors), for bench/bench_eagle3.py --head. Nothing trained is committed.

    .venv/bin/python -m pip install optax      # (the `distill` extra)
    .venv/bin/python bench/distill_eagle3.py --out /tmp/head [--prompts 128] [--tokens 160] [--steps 1500]
        [--smoke]

The data are the model's own greedy answers (chat template) to instructions made of task x topic, none of
them bench_eagle3's workloads. For each answer the target's residual stream entering layers 2, 15 and 27
(the head's aux layers) is read at every position from the engine's own step (a head makes the step
return them). The head (fc, one decoder layer taking [embedding | hidden], norm, LM head over the 4096
tokens the answers use most, d2t) is trained with Adam (optax) on the cross entropy of the token two
ahead, as EAGLE-3 is: a first pass reads the target's states, each later pass the previous pass's outputs
shifted by a position (an approximation of EAGLE-3's training-time test: the i-th draft learns to read
the head's own state; it attends to that pass's keys, where drafting attends to the first pass's).
Attention is dense and causal over each answer. The instructions are pdserve.bench.prompts' TASKS x
TOPICS. --smoke: the test model, 4 answers of 8 tokens, 2 training steps of 2 sequences.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from pdserve.bench.prompts import TASKS, TOPICS

DRAFT_VOCAB = 4096


def answers(engine, tokenizer, num_prompts: int, max_tokens: int) -> list[list[int]]:
    """Prompt + greedy answer of each instruction (task x topic)."""
    from pdserve.engine.sampling_params import SamplingParams

    texts = [task.format(t=topic) for topic in TOPICS for task in TASKS][:num_prompts]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [p + c.token_ids for p, c in zip(prompts, done, strict=True)]


def aux_states(engine, sequence: list[int]):
    """The target's aux states at every position of `sequence` [n, 3 x hidden] (float32, host), from the
    engine's own steps in its scratch blocks."""
    import numpy as np

    from pdserve.engine.core.scheduler import Row

    kv, rid = engine.scheduler.kv, "distill"
    if not kv.allocate(rid, len(sequence)):
        raise RuntimeError("not enough free KV blocks")
    try:
        step, parts = engine.config.max_num_batched_tokens, []
        for start in range(0, len(sequence), step):
            chunk = sequence[start : start + step]
            engine.runner.forward([Row(chunk, start, kv.block_tables(rid), -1)])
            parts.append(np.asarray(engine.runner.aux[: len(chunk)], np.float32))
        return np.concatenate(parts)
    finally:
        kv.free(rid)


def make_loss(cfg, embed, passes: int):
    """The loss of a batch of sequences (`passes` drafts deep): tokens [B, L], aux [B, L, 3H], the draft id
    of the token two ahead [B, L] (-1: none), valid [B, L]."""
    import jax
    import jax.numpy as jnp

    from pdserve.engine.model.layers import apply_rope, rope_inverse_frequencies

    inv = jnp.asarray(rope_inverse_frequencies(cfg))[0]
    d, eps = cfg.head_dim, cfg.rms_norm_eps
    group = cfg.num_heads // cfg.num_kv_heads
    pre = "midlayer."

    def rms(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w

    def layer(p, tokens, hidden, valid):
        b, n = tokens.shape
        e = rms(embed[tokens], p[pre + "input_layernorm.weight"])
        x = jnp.concatenate([e, rms(hidden, p[pre + "hidden_norm.weight"])], -1)
        positions = jnp.arange(n)
        q = (x @ p[pre + "self_attn.q_proj.weight"].T).reshape(b, n, -1, d)
        k = (x @ p[pre + "self_attn.k_proj.weight"].T).reshape(b, n, -1, d)
        v = (x @ p[pre + "self_attn.v_proj.weight"].T).reshape(b, n, -1, d)
        rot = jax.vmap(lambda t: apply_rope(t, positions, inv))
        q, k = rot(q), rot(k)
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d)
        mask = jnp.tril(jnp.ones((n, n), bool))[None, None] & valid[:, None, None, :]
        attn = jax.nn.softmax(jnp.where(mask, scores, -1e30), -1)
        out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, n, -1)
        res = hidden + out @ p[pre + "self_attn.o_proj.weight"].T
        m = rms(res, p[pre + "post_attention_layernorm.weight"])
        gate, up = m @ p[pre + "mlp.gate_proj.weight"].T, m @ p[pre + "mlp.up_proj.weight"].T
        return jax.nn.silu(gate) * up @ p[pre + "mlp.down_proj.weight"].T + res

    def xent(p, out, labels):
        logits = rms(out, p["norm.weight"]) @ p["lm_head.weight"].T
        logp = jax.nn.log_softmax(logits, -1)
        picked = jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
        ok = labels >= 0
        return -jnp.sum(jnp.where(ok, picked, 0.0)) / jnp.maximum(ok.sum(), 1), ok

    def loss(p, tokens, aux, labels, valid):
        # pass 1: position j reads token j + 1 and the target's states at j; predicts token j + 2. Pass i
        # > 1, as the i-th draft: position j reads token j + 1 and pass i - 1's output at j - 1 (not the
        # target's states); predicts token j + 2. Weights 1, 1/2, 1/4, ...
        next_tokens = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], 1)
        out = layer(p, next_tokens, aux @ p["fc.weight"].T, valid)
        total, _ = xent(p, out, labels)
        for i in range(1, passes):
            shifted = jnp.concatenate([jnp.zeros_like(out[:, :1]), out[:, :-1]], 1)
            out = layer(p, next_tokens, shifted, valid)
            value, _ = xent(p, out, labels.at[:, :i].set(-1))
            total = total + value / 2**i
        return total

    return loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=160, help="max_tokens of each answer")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=8, help="sequences a step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--passes", type=int, default=3, help="drafts deep the loss trains (EAGLE-3's test)")
    parser.add_argument("--smoke", action="store_true", help="the test model, 4 answers, 2 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.tokens, args.steps, args.batch = 4, 8, 2, 2
    try:
        import optax
    except ImportError:
        raise SystemExit("needs optax: .venv/bin/python -m pip install optax (the `distill` extra)") from None
    import jax
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import save_file

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.eagle3 import load_eagle3_head
    from pdserve.engine.loading.sources import load_model
    from pdserve.testing.eagle3 import write_random_head
    from pdserve.testing.models import bench_model

    t0 = time.perf_counter()
    model = load_model(str(bench_model(args.smoke))).in_memory()
    work = Path(tempfile.mkdtemp(prefix="distill_eagle3_"))
    start = write_random_head(work / "start", model.config, DRAFT_VOCAB, seed=0, scale=0.5)
    spec = json.dumps({"method": "eagle3", "model": str(start), "num_speculative_tokens": 1})
    config = EngineConfig(num_blocks=1024, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=256)
    engine = LLMEngine(model, dataclasses.replace(config, speculative_config=spec))
    sequences = answers(engine, model.tokenizer, args.prompts, args.tokens)
    auxes = [aux_states(engine, s) for s in sequences]
    print(
        f"data: {len(sequences)} answers, {sum(map(len, sequences))} tokens, {time.perf_counter() - t0:.0f} s"
    )

    counts = collections.Counter(t for s in sequences for t in s)
    draft_ids = np.sort(np.asarray([t for t, _ in counts.most_common(DRAFT_VOCAB)], np.int64))
    if len(draft_ids) < DRAFT_VOCAB:  # (a small corpus: the rest of the vocabulary by id)
        extra = np.setdiff1d(np.arange(model.config.vocab_size), draft_ids)[: DRAFT_VOCAB - len(draft_ids)]
        draft_ids = np.sort(np.concatenate([draft_ids, extra]))
    to_draft = np.full(model.config.vocab_size, -1, np.int64)
    to_draft[draft_ids] = np.arange(DRAFT_VOCAB)
    length = max(map(len, sequences))
    n = len(sequences)
    tokens = np.zeros((n, length), np.int32)
    aux = np.zeros((n, length, auxes[0].shape[1]), np.float32)
    valid = np.zeros((n, length), bool)
    labels = np.full((n, length), -1, np.int32)  # the draft id of the token two ahead (-1: none)
    for i, (s, a) in enumerate(zip(sequences, auxes, strict=True)):
        tokens[i, : len(s)], aux[i, : len(s)], valid[i, : len(s)] = s, a, True
        labels[i, : len(s) - 2] = to_draft[s[2:]]

    head = load_eagle3_head(start, model.config)
    params = {k: jnp.asarray(v, jnp.float32) for k, v in head.tensors.items() if v.dtype.kind == "f"}
    embed = jnp.asarray(model.checkpoint.host["embed"], jnp.float32)
    loss = make_loss(head.config, embed, args.passes)
    optimizer = optax.adamw(args.lr, weight_decay=0.0)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    rng = np.random.default_rng(0)
    for i in range(args.steps):
        pick = rng.choice(n, args.batch, replace=False)
        batch = tuple(jnp.asarray(a[pick]) for a in (tokens, aux, labels, valid))
        params, state, value = step(params, state, batch)
        if i % 100 == 0 or i == args.steps - 1:
            print(f"step {i}: loss {float(value):.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    tensors = {k: np.asarray(v) for k, v in params.items()}
    tensors["d2t"] = (draft_ids - np.arange(DRAFT_VOCAB)).astype(np.int64)
    t2d = np.zeros(model.config.vocab_size, bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text((start / "config.json").read_text())
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
