"""Model families disaggregated: checkpoints of testing/families.py prefilled at TP 1 and decoded at TP 2 by
servers on threads of this process give transformers' greedy tokens; sliding-window layers receive only the
window's blocks, DeepSeek-V2's MLA layers only the latent."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from pdserve.kvtransfer import plan_frames
from pdserve.services.client import Client
from pdserve.testing.families import engine_of, hf_greedy, write_family
from tests.helpers import assert_all_free, in_process

pytestmark = [pytest.mark.daemon, pytest.mark.standalone]  # starts every daemon it uses


# Gemma 3: sliding and full layers, 1 KV head padded to 2; DeepSeek-V2: MLA heads split, its latent
# replicated, experts split (each family alone against transformers: tests/engine/test_families.py)
@pytest.mark.parametrize("family", ["gemma3", "deepseek_v2"])
def test_prefill_tp1_to_decode_tp2_equals_transformers(family, tmp_path, loaded_model, small_config):
    import dataclasses

    import jax

    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.server import serve as serve_decode
    from pdserve.services.prefill.server import PrefillService
    from pdserve.services.prefill.server import serve as serve_prefill

    pytest.importorskip("transformers")
    model = write_family(family, tmp_path, loaded_model.config.vocab_size)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, loaded_model.config.vocab_size, n).tolist() for n in (40, 300)]  # 300: chunked
    expected = [hf_greedy(model, p, 16)[1] for p in prompts]
    devices = jax.devices()
    prefill_engine = engine_of(tmp_path, loaded_model.tokenizer, small_config, devices[:1])
    decode_engine = engine_of(
        tmp_path, loaded_model.tokenizer, dataclasses.replace(small_config, tp=2), devices[1:3]
    )
    with contextlib.ExitStack() as stack:
        service = PrefillService.for_engine(prefill_engine)
        prefill = stack.enter_context(
            in_process(lambda stop, ready: serve_prefill(service, 0, stop, on_ready=ready, kv_events=None))
        )
        core = GenerationCore.for_engine(decode_engine, prefill_targets=[prefill])
        decode = stack.enter_context(
            in_process(lambda stop, ready: serve_decode(core, 0, stop, on_ready=ready))
        )
        client = Client(decode)
        for prompt, tokens in zip(prompts, expected, strict=True):
            assert (
                client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True).token_ids == tokens
            )
        assert core.counters.num_transfers_total == len(prompts)  # both prefilled over there
        assert_all_free(decode, prefill)
    # the bytes received are the frame plans' (sliding layers: from their window's first block), and a
    # sliding layer's share of a 300-token prompt (19 blocks) is the blocks that reach into its last 24 tokens
    src, dst = prefill_engine.kv_layout, decode_engine.kv_layout
    plans = [plan_frames(src, len(prompt)) for prompt in prompts]
    received = sum(f.num_layers * f.bucket for plan in plans for f in plan) * dst.block_bytes
    assert core.counters.kv_transfer_bytes_total == received
    cfg = decode_engine.model.config
    per_layer = [
        sum(f.num_blocks for f in plans[1] if f.layer_start <= i < f.layer_end) for i in range(cfg.num_layers)
    ]
    assert per_layer == [19 - (300 - 24) // 16 if cfg.window(i) else 19 for i in range(cfg.num_layers)]
    assert [cfg.window(i) for i in range(cfg.num_layers)] == ([24, 0, 24] if family == "gemma3" else [0, 0])
    # the cache's rows: Gemma 3's sliding layers share the row of its one full layer (engine.core.kv_groups)
    assert decode_engine.runner.cache.shape[0] == (1 if family == "gemma3" else cfg.num_layers)
    if family == "deepseek_v2":  # the latent only: 32 + 8 numbers a token and layer, whatever the heads
        assert dst.is_mla and dst.block_bytes == 16 * (32 + 8) * 4
