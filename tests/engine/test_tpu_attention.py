"""The TPU kernel's adapter (model/tpu_attention.py) without a TPU: its argument mapping against jax's own
reference of the kernel, and the model's path for kernels that read the new K/V from the cache."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from pdserve.engine.model.attention import ragged_paged_attention_reference
from pdserve.engine.model.tpu_attention import kernel_attention

LAYERS, BLOCKS, BS, KVH, G, D, WIDTH = 2, 64, 16, 2, 3, 32, 8


def _padded(reference, q, *args, **kwargs):
    """jax's reference returns the real tokens' rows only; the kernel returns one per query row."""
    out = reference(q, *args, **kwargs)
    return np.pad(out, ((0, q.shape[0] - out.shape[0]), (0, 0), (0, 0)))


def _case(head_dim: int, dtype, padded_head: bool = False):
    """A decode over a past, a chunk after a past, a fresh prompt, then padding rows, in layer 1 of a stacked
    cache that already holds the new K/V (where the model writes them before the kernel reads); GQA. With
    `padded_head`, KV head 1 is TP padding: zeros in the cache and in its queries."""
    rng = np.random.default_rng(0)
    seqs = [(37, 1), (20, 45), (0, 9)]  # (past, new tokens)
    t, slots = 64, 5
    cache = rng.standard_normal((LAYERS, BLOCKS, BS, 2 * KVH, head_dim)).astype(np.float32)
    tables = np.zeros((slots, WIDTH), np.int32)
    blocks = iter(rng.permutation(BLOCKS))
    q = rng.standard_normal((t, KVH, G, head_dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((t, KVH, head_dim)).astype(np.float32) for _ in range(2))
    if padded_head:
        q[:, 1], k_new[:, 1], v_new[:, 1], cache[..., 2:4, :] = 0, 0, 0, 0
    start = 0
    for i, (past, n) in enumerate(seqs):
        ids = [int(next(blocks)) for _ in range(-(-(past + n) // BS))]
        tables[i, : len(ids)] = ids
        for j in range(n):
            pos = past + j
            cache[1, ids[pos // BS], pos % BS, 0::2] = k_new[start + j]
            cache[1, ids[pos // BS], pos % BS, 1::2] = v_new[start + j]
        start += n
    q_lens = [n for _, n in seqs] + [0] * (slots - len(seqs))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = np.asarray([p + n for p, n in seqs] + [0] * (slots - len(seqs)), np.int32)
    cast = [a.astype(dtype) for a in (q, k_new, v_new, cache)]
    return (*cast, 1, kv_lens, tables, cu), start


def _compare(kernel, head_dim, dtype, window, cap, atol, padded_head=False, cache_dtype=None, **adapter):
    """The adapter over `kernel` against pdserve's reference on one _case. `cache_dtype`: the cache's
    (fp8): the kernel reads the new tokens' K/V from it, so the reference gets them as stored too."""
    args, num_real = _case(head_dim, dtype, padded_head)
    if cache_dtype is not None:
        q, k_new, v_new, cache, *rest = args
        stored = [x.astype(cache_dtype) for x in (k_new, v_new, cache)]
        args = (q, *(x.astype(dtype) for x in stored[:2]), stored[2], *rest)
    kwargs = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    cfg = SimpleNamespace(layer_windows=(window, window) if window else ())
    got = kernel_attention(cfg, kernel=kernel, **adapter)(*args, **kwargs)
    expected = jax.jit(functools.partial(ragged_paged_attention_reference, **kwargs))(*args)
    got, expected = (np.asarray(x, np.float32)[:num_real] for x in (got, expected))
    np.testing.assert_allclose(got, expected, atol=atol)


@pytest.mark.fast
@pytest.mark.parametrize("window, cap", [(None, None), (20, 4.0)])
def test_the_adapter_calls_the_kernel_as_the_reference_attends(window, cap):
    """jax's ref_ragged_paged_attention (eager, the kernel's arguments) through the adapter equals pdserve's
    reference: the pages of layer 1 of the stacked cache, queries of several sequences and partial
    blocks, GQA, a window and a soft cap."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    _compare(functools.partial(_padded, ref_ragged_paged_attention), 32, np.float32, window, cap, atol=2e-5)


@pytest.fixture
def tpu_interpreter():
    """jax's TPU interpret mode, with the two fixes it needs in jax 0.10.2 (tests/tpu_interpret.py)."""
    from jax.experimental.pallas import tpu as pltpu

    from tests import tpu_interpret

    undo = tpu_interpret.patch()
    jax.clear_caches()
    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            yield
    finally:
        pltpu.reset_tpu_interpret_mode_state()
        undo()
        jax.clear_caches()


@pytest.mark.fast
@pytest.mark.parametrize(
    "dtype, window, cap, atol, cache_dtype",
    [
        (np.float32, None, None, 1e-5, None),
        ("bfloat16", 20, 4.0, 0.04, None),
        (np.float32, None, None, 1e-5, "float8_e4m3fn"),  # --kv-cache-dtype fp8: scale 1.0
    ],
)
def test_the_pallas_kernel_interpreted_on_cpu_attends_as_the_reference(
    tpu_interpreter, dtype, window, cap, atol, cache_dtype
):
    """jax's Pallas kernel itself (TPU interpret mode) through the adapter, on the shapes it tiles: head_dim
    128, one real and one padded KV head, three sequences with partial blocks, then padding rows; float32,
    bfloat16 with a window and a soft cap (bfloat16 rounding of the kernel's output), and float32 queries
    over an fp8 cache."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    blocks = dict(num_kv_pages_per_block=2, num_queries_per_block=16)
    _compare(
        ragged_paged_attention,
        128,
        dtype,
        window,
        cap,
        atol,
        padded_head=True,
        cache_dtype=cache_dtype,
        block_sizes=blocks,
    )


@pytest.mark.model
def test_a_kernel_reading_the_new_kv_from_the_cache_gets_them_written_layer_by_layer(tmp_path, loaded_model):
    """The model's path for such kernels (cache carried through the layer scan, each layer's K/V written
    before its attention), run with the reference flagged as one: transformers' greedy tokens on Gemma 3's
    sliding and full layers, batched with a chunked prefill."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.testing.families import engine_of, hf_greedy, write_family

    pytest.importorskip("transformers")
    model = write_family("gemma3", tmp_path, loaded_model.config.vocab_size)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, loaded_model.config.vocab_size, n).tolist() for n in (9, 100)]
    expected = [hf_greedy(model, p, 12)[1] for p in prompts]
    flagged = functools.wraps(ragged_paged_attention_reference)(
        lambda *args, **kwargs: ragged_paged_attention_reference(*args, **kwargs)
    )
    flagged.reads_new_kv_from_cache = True
    config = EngineConfig(num_blocks=64, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    engine = engine_of(tmp_path, loaded_model.tokenizer, config, attention=flagged)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == expected


@pytest.mark.fast
def test_models_the_kernel_cannot_tile_keep_the_reference():
    """The engine asks `kernel_unsupported` before installing the kernel on a TPU."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model.tpu_attention import kernel_unsupported

    def model(head_dim, kv_heads, **extra):
        sizes = dict(vocab_size=8, hidden_size=8, intermediate_size=4, num_layers=1, rope_theta=1e4)
        return ModelConfig(
            "llama",
            **sizes,
            num_heads=4 * kv_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            **extra,
        )

    assert kernel_unsupported(model(128, 2), 1, "bfloat16") is None
    assert kernel_unsupported(model(128, 3), 2, "bfloat16") is None  # padded to 4: 2 a chip
    assert "multiple of 128" in kernel_unsupported(model(64, 3), 1, "bfloat16")  # SmolLM2
    assert "tiled" in kernel_unsupported(model(128, 3), 1, "bfloat16")  # 6 K and V heads in 3 words
    assert kernel_unsupported(model(128, 2), 1, "bfloat16", "float8_e4m3fn") is None  # an fp8 cache
    assert "tiled" in kernel_unsupported(model(128, 1), 1, "bfloat16", "float8_e4m3fn")  # 2 heads, 4 a word
    assert "per token and head" in kernel_unsupported(model(128, 2), 1, "bfloat16", "int8")  # the reference


@pytest.mark.model
def test_two_engines_of_one_process_each_compile_with_their_own_attention(loaded_model):
    """The attention is a property of each engine's runner, not of the process: two engines built on
    different meshes before either runs (as `pdserve serve` builds its prefill and decode engines) each
    trace their own implementation, and give the reference's tokens."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    traced = []

    def tagged(tag):
        def attend(*args, **kwargs):
            traced.append(tag)  # at trace time: once per layer scan of each compiled step
            return ragged_paged_attention_reference(*args, **kwargs)

        return attend

    config = EngineConfig(num_blocks=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8)
    devices = jax.devices()
    first = LLMEngine(loaded_model, config, devices[:1], attention=tagged("first"))
    second = LLMEngine(
        loaded_model, EngineConfig(**{**config.__dict__, "tp": 2}), devices[2:4], tagged("second")
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    a = first.generate(["Hello there"], greedy)[0].token_ids
    assert set(traced) == {"first"}
    b = second.generate(["Hello there"], greedy)[0].token_ids
    assert set(traced) == {"first", "second"}
    assert second.runner.mesh.devices.tolist() == devices[2:4] and a == b
