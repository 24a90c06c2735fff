"""Model families disaggregated: a Qwen3 checkpoint (tests/families.py) prefilled at TP 1 and decoded at TP 2
by servers on threads of this process gives transformers' greedy tokens."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from services.client import Client
from tests.families import engine_of, hf_greedy, write_qwen3
from tests.helpers import assert_all_free, in_process

pytestmark = pytest.mark.daemon


def test_qwen3_prefill_tp1_to_decode_tp2_equals_transformers(tmp_path, loaded_model, small_config):
    import dataclasses

    import jax

    from services.decode.core import GenerationCore
    from services.decode.server import serve as serve_decode
    from services.prefill.server import PrefillService
    from services.prefill.server import serve as serve_prefill

    pytest.importorskip("transformers")
    model = write_qwen3(tmp_path, loaded_model.config.vocab_size)
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
