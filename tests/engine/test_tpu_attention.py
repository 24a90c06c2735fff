"""The TPU kernel's adapter (engine/tpu_attention.py) without a TPU: its argument mapping against jax's own
reference of the kernel, and the model's path for kernels that read the new K/V from the cache."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from engine.attention import ragged_paged_attention_reference, set_attention_impl
from engine.tpu_attention import kernel_attention

LAYERS, BLOCKS, BS, KVH, G, D, WIDTH = 2, 64, 16, 2, 3, 32, 8


def _padded(reference, q, *args, **kwargs):
    """jax's reference returns the real tokens' rows only; the kernel returns one per query row."""
    out = reference(q, *args, **kwargs)
    return np.pad(out, ((0, q.shape[0] - out.shape[0]), (0, 0), (0, 0)))


@pytest.mark.fast
@pytest.mark.parametrize("window, cap", [(None, None), (20, 4.0)])
def test_the_adapter_calls_the_kernel_as_the_reference_attends(window, cap):
    """jax's ref_ragged_paged_attention (eager, the kernel's arguments) through the adapter equals pdserve's
    reference on a cache that holds the new K/V too: a decode over a past, a chunk after a past, a fresh
    prompt, then padding rows; layer 1 of the stacked cache; GQA; a window and a soft cap."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    rng = np.random.default_rng(0)
    seqs = [(37, 1), (20, 45), (0, 9)]  # (past, new tokens)
    t, slots = 64, 5
    cache = rng.standard_normal((LAYERS, BLOCKS, BS, 2 * KVH, D)).astype(np.float32)
    tables = np.zeros((slots, WIDTH), np.int32)
    blocks = iter(rng.permutation(BLOCKS))
    q = rng.standard_normal((t, KVH, G, D)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((t, KVH, D)).astype(np.float32) for _ in range(2))
    start = 0
    for i, (past, n) in enumerate(seqs):
        ids = [int(next(blocks)) for _ in range(-(-(past + n) // BS))]
        tables[i, : len(ids)] = ids
        for j in range(n):  # the new tokens' K/V where the model writes them before the kernel reads
            pos = past + j
            cache[1, ids[pos // BS], pos % BS, 0::2] = k_new[start + j]
            cache[1, ids[pos // BS], pos % BS, 1::2] = v_new[start + j]
        start += n
    q_lens = [n for _, n in seqs] + [0] * (slots - len(seqs))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = np.asarray([p + n for p, n in seqs] + [0] * (slots - len(seqs)), np.int32)
    args = (q, k_new, v_new, cache, 1, kv_lens, tables, cu)
    kwargs = dict(sm_scale=0.3, sliding_window=window, soft_cap=cap)
    cfg = SimpleNamespace(layer_windows=(window, window) if window else ())
    got = kernel_attention(cfg, kernel=functools.partial(_padded, ref_ragged_paged_attention))(
        *args, **kwargs
    )
    expected = jax.jit(functools.partial(ragged_paged_attention_reference, **kwargs))(*args)
    np.testing.assert_allclose(np.asarray(got)[:start], np.asarray(expected)[:start], atol=2e-5)


@pytest.mark.model
def test_a_kernel_reading_the_new_kv_from_the_cache_gets_them_written_layer_by_layer(tmp_path, loaded_model):
    """The model's path for such kernels (cache carried through the layer scan, each layer's K/V written
    before its attention), run with the reference flagged as one: transformers' greedy tokens on Gemma 3's
    sliding and full layers, batched with a chunked prefill."""
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from tests.families import engine_of, hf_greedy, write_family

    pytest.importorskip("transformers")
    model = write_family("gemma3", tmp_path, loaded_model.config.vocab_size)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, loaded_model.config.vocab_size, n).tolist() for n in (9, 100)]
    expected = [hf_greedy(model, p, 12)[1] for p in prompts]
    flagged = functools.wraps(ragged_paged_attention_reference)(
        lambda *args, **kwargs: ragged_paged_attention_reference(*args, **kwargs)
    )
    flagged.reads_new_kv_from_cache = True
    set_attention_impl(flagged)
    try:
        config = EngineConfig(num_blocks=64, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
        engine = engine_of(tmp_path, loaded_model.tokenizer, config)
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        assert [c.token_ids for c in engine.generate(prompts, greedy)] == expected
    finally:
        set_attention_impl(None)
