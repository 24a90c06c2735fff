"""Random EAGLE-3 draft heads for a model, written in the format heads are published in (config.json with
`LlamaForCausalLMEagle3` and `draft_vocab_size`; safetensors with `fc`, `midlayer.*`, `norm`, `lm_head`
over a reduced vocabulary, `d2t` and `t2d`), with numpy (tests, benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from pdserve.engine.config import ModelConfig


def write_random_head(
    folder: Path,
    target: ModelConfig,
    draft_vocab_size: int = 2048,
    seed: int = 0,
    scale: float = 1.0,
    aux_layers: tuple[int, ...] | None = None,
    favoured: tuple[int, ...] = (),
) -> Path:
    """A head for `target` (its hidden size, KV heads and head size; a one-layer Llama with 2 x hidden
    inputs to Q/K/V), whose draft vocabulary is `draft_vocab_size` target ids drawn at random (sorted, so
    d2t's offsets are >= 0); `aux_layers`: written into eagle_config (None: the default layers).
    `favoured` target ids are in the draft vocabulary with LM head rows four times as large: the head
    drafts them most of the time, which of them depending on its input (drafts a target that writes
    them often accepts)."""
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, head_dim = (
        target.hidden_size,
        target.num_heads,
        target.num_kv_heads,
        target.head_dim,
    )
    inter = 2 * hidden

    def weight(out: int, inp: int) -> np.ndarray:
        return (scale * rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    n_aux = 3 if aux_layers is None else len(aux_layers)
    others = np.setdiff1d(np.arange(target.vocab_size), favoured)
    drawn = rng.choice(others, draft_vocab_size - len(favoured), replace=False)
    draft_ids = np.sort(np.concatenate([drawn, np.asarray(favoured, np.int64)]))
    boost = np.where(np.isin(draft_ids, favoured), 4, 1).astype(np.float32)
    t2d = np.zeros(target.vocab_size, bool)
    t2d[draft_ids] = True
    tensors = {
        "fc.weight": weight(hidden, n_aux * hidden),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": weight(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": weight(inter, hidden),
        "midlayer.mlp.up_proj.weight": weight(inter, hidden),
        "midlayer.mlp.down_proj.weight": weight(hidden, inter),
        "norm.weight": norm(),
        "lm_head.weight": weight(draft_vocab_size, hidden) * boost[:, None],
        "d2t": (draft_ids - np.arange(draft_vocab_size)).astype(np.int64),
        "t2d": t2d,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def eagle3_config(folder: Path, model, k: int = 3) -> str:
    """--speculative-config of a head written into `folder` for a loaded model (engine.loading.sources
    LoadedModel, with its tokenizer): 256 draft ids, "," and " and" favoured (the tests' model writes them
    every other token, so its drafts are often accepted), every draft verified (draft_policy "all")."""
    favoured = tuple(model.tokenizer.encode(t)[0] for t in (",", " and"))
    head = write_random_head(folder, model.config, draft_vocab_size=256, seed=5, favoured=favoured)
    return json.dumps(
        {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, "draft_policy": "all"}
    )
