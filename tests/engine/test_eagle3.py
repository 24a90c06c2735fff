"""EAGLE-3 draft heads, model-free: a head written in the published format loads (and a mismatched one is
refused by name), and the paged draft pass (engine.model.eagle3.draft_step) equals a dense numpy reference
of the head run over the whole sequence: prompts caught up in chunks of two sequences in scattered
blocks, then greedy drafts, each position's KV written in the sequence's own blocks and nowhere else."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from pdserve.engine.config import ModelConfig, SpeculativeConfig, UnsupportedModelError
from pdserve.engine.loading.checkpoints import CheckpointError
from pdserve.engine.loading.eagle3 import default_aux_layers, load_eagle3_head
from pdserve.engine.model.attention import ragged_paged_attention_reference
from pdserve.engine.model.eagle3 import DraftModel, draft_step
from pdserve.engine.model.sharding import make_mesh
from pdserve.testing.eagle3 import write_random_head

pytestmark = pytest.mark.fast

TARGET = ModelConfig(
    architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=4,
    num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
    tie_word_embeddings=True,
)  # fmt: skip
BLOCKS, BS, WIDTH, K = 24, 8, 8, 3
_draft = jax.jit(
    draft_step, static_argnames=("cfg", "row", "num_drafts", "attention", "norm_before_residual")
)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    folder = write_random_head(tmp_path_factory.mktemp("head") / "h", TARGET, draft_vocab_size=120, seed=3)
    return load_eagle3_head(folder, TARGET)


def test_a_published_head_loads_and_a_mismatched_one_is_refused(head, tmp_path):
    assert head.aux_layers == default_aux_layers(6) == (2, 3, 3)
    assert head.draft_vocab_size == 120 and head.name.startswith("eagle3@")
    other = write_random_head(
        tmp_path / "b", dataclasses.replace(TARGET, num_kv_heads=4), draft_vocab_size=120
    )
    with pytest.raises(UnsupportedModelError, match="num_kv_heads"):
        load_eagle3_head(other, TARGET)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(
        json.dumps({**config, "num_key_value_heads": 2, "num_hidden_layers": 2})
    )
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers"):
        load_eagle3_head(other, TARGET)
    (other / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 2}))
    (other / "model.safetensors").unlink()
    (other / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="convert it to safetensors"):
        load_eagle3_head(other, TARGET)
    renamed = write_random_head(tmp_path / "c", TARGET, draft_vocab_size=120, seed=3, aux_layers=(1, 2, 4))
    assert load_eagle3_head(renamed, TARGET).aux_layers == (1, 2, 4)


def _rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, positions):  # [n, heads, d], halves layout
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    angles = positions[:, None, None] * inv
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate(
        [x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1
    )


def _dense_drafts(head, embed, tokens, hidden, k):
    """The head over a whole sequence in float64: inputs (next token, fused target state) at each prompt
    position, then k greedy drafts, each from the last output (before the final norm) and the token just
    drafted; returns the drafts (target ids)."""
    t = {name: v.astype(np.float64) for name, v in head.tensors.items() if v.dtype.kind == "f"}
    p = "midlayer."
    group, d = TARGET.num_heads // TARGET.num_kv_heads, TARGET.head_dim
    toks, hs, drafts = list(tokens), list(hidden), []
    for _ in range(k):
        n = len(toks)
        e = _rms(embed[toks], t[p + "input_layernorm.weight"])
        h = np.stack(hs)
        x = np.concatenate([e, _rms(h, t[p + "hidden_norm.weight"])], -1)
        q = _rope((x @ t[p + "self_attn.q_proj.weight"].T).reshape(n, -1, d), np.arange(n))
        kk = _rope((x @ t[p + "self_attn.k_proj.weight"].T).reshape(n, -1, d), np.arange(n))
        v = (x @ t[p + "self_attn.v_proj.weight"].T).reshape(n, -1, d)
        kk, v = np.repeat(kk, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        attn = np.einsum("hqk,khd->qhd", w / w.sum(-1, keepdims=True), v).reshape(n, -1)
        res = h + attn @ t[p + "self_attn.o_proj.weight"].T
        m = _rms(res, t[p + "post_attention_layernorm.weight"])
        gate, up = m @ t[p + "mlp.gate_proj.weight"].T, m @ t[p + "mlp.up_proj.weight"].T
        out = (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T + res
        draft = int(np.argmax(_rms(out[-1], t["norm.weight"]) @ t["lm_head.weight"].T))
        drafts.append(draft + int(head.tensors["d2t"][draft]))
        toks.append(drafts[-1])
        hs.append(out[-1])
    return drafts


def test_paged_drafting_equals_the_dense_head(head):
    rng = np.random.default_rng(0)
    mesh = make_mesh(1)
    model = DraftModel.build(head, mesh, np.float32)
    embed = rng.standard_normal((TARGET.vocab_size, TARGET.hidden_size)).astype(np.float32)
    rows = TARGET.num_layers + 1  # the head's KV: the last row
    cache0 = rng.standard_normal((rows, BLOCKS, BS, 2 * TARGET.num_kv_heads, TARGET.head_dim)).astype(
        np.float32
    )
    lengths = {"a": 37, "b": 21}
    tables = {"a": [17, 3, 9, 20, 5, 11], "b": [2, 14, 7, 22]}  # scattered; 6 and 4 blocks hold the lookahead
    tokens = {s: rng.integers(0, TARGET.vocab_size, n + 1) for s, n in lengths.items()}  # one past the prompt
    aux = {s: rng.standard_normal((n, 3 * TARGET.hidden_size)).astype(np.float32) for s, n in lengths.items()}
    fc = head.tensors["fc.weight"].astype(np.float64)
    expected = {s: _dense_drafts(head, embed, tokens[s][1:], aux[s] @ fc.T, K) for s in lengths}

    def run(cache, spans):  # spans: (sequence, start, count, lookahead)
        t, s = 64, 4
        tok, aux_rows, all_aux = (
            np.zeros(t, np.int32),
            np.zeros(t, np.int32),
            np.zeros((t, aux["a"].shape[1]), np.float32),
        )
        cu, kv_lens = np.full(s + 1, sum(c for _, _, c, _ in spans), np.int32), np.zeros(s, np.int32)
        last, ahead, bt = np.zeros(s, np.int32), np.zeros(s, np.int32), np.zeros((s, WIDTH), np.int32)
        at = 0
        for i, (name, start, count, lookahead) in enumerate(spans):
            tok[at : at + count] = tokens[name][start + 1 : start + count + 1]
            all_aux[at : at + count] = aux[name][start : start + count]
            aux_rows[at : at + count] = np.arange(at, at + count)
            cu[i], kv_lens[i], last[i], ahead[i] = at, start + count, at + count - 1, lookahead
            bt[i, : len(tables[name])] = tables[name]
            at += count
        drafts, cache = _draft(
            model.weights,
            embed,
            cache,
            all_aux,
            aux_rows,
            tok,
            cu,
            kv_lens,
            bt,
            last,
            ahead,
            cfg=model.config,
            row=TARGET.num_layers,
            num_drafts=K,
            attention=ragged_paged_attention_reference,
            norm_before_residual=False,
        )
        return np.asarray(drafts), cache

    # a's prompt in two chunks, b's in one: b drafts after the first pass, a after the second with one
    # position of lookahead (its third draft is computed against KV not written, and not used)
    drafts, cache = run(jax.numpy.asarray(cache0), [("a", 0, 20, 0), ("b", 0, 21, K - 1)])
    assert drafts[1].tolist() == expected["b"]
    drafts, cache = run(cache, [("a", 20, 17, 1)])
    assert drafts[0, :2].tolist() == expected["a"][:2]
    cache = np.asarray(cache)
    np.testing.assert_array_equal(
        cache[: TARGET.num_layers], cache0[: TARGET.num_layers]
    )  # the target's rows
    written = {"a": 37 + 1, "b": 21 + K - 1}  # prompt positions and lookahead
    untouched = np.ones((BLOCKS, BS), bool)
    for name, n in written.items():
        for pos in range(n):
            untouched[tables[name][pos // BS], pos % BS] = False
    np.testing.assert_array_equal(cache[-1][untouched], cache0[-1][untouched])


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"method": "eagle3", "num_speculative_tokens": 3}, "model"),
        (
            {"method": "eagle3", "num_speculative_tokens": 3, "model": "h", "prompt_lookup_min": 2},
            "prompt_lookup",
        ),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "h"}, "model"),
        ({"method": "eagle", "num_speculative_tokens": 3, "model": "h"}, "method"),
    ],
)
def test_the_speculative_config_refuses_eagle3_keys_by_name(given, named):
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.parse(json.dumps(given))
    ok = SpeculativeConfig.parse('{"method": "eagle3", "model": "/h", "num_speculative_tokens": 2}')
    assert (ok.method, ok.model, ok.num_speculative_tokens, ok.prompt_lookup_min) == ("eagle3", "/h", 2, 0)


def test_the_draft_layer_is_part_of_the_kv_layout():
    """A replica's KV fits only a server with the same head (or none): the layout names the draft layer's
    digest in its model and counts its layer, so a handshake refuses the others by name."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model.kv_cache import kv_layout
    from pdserve.kvtransfer import LayoutMismatchError

    config = EngineConfig(num_blocks=8, max_model_len=64, dtype="float32")
    layouts = [
        kv_layout(dataclasses.replace(TARGET, draft_layer=d), config) for d in ("", "eagle3@a", "eagle3@b")
    ]
    assert [layout.num_layers for layout in layouts] == [6, 7, 7]
    for i, j in ((0, 1), (1, 2)):
        with pytest.raises(LayoutMismatchError, match="model") as refused:
            layouts[i].check_compatible(layouts[j])
        assert "eagle3@" in str(refused.value)
    layouts[1].check_compatible(kv_layout(dataclasses.replace(TARGET, draft_layer="eagle3@a"), config))
