"""The ragged engine generates the tokens of the grid engine it replaced, greedy and seeded.

tests/data/grid_engine_tokens.json holds what the grid engine (rows x tokens x past-blocks steps,
alternating prefill and decode steps; commit 5d62e15) generated for WORKLOAD on the test model (the default
model's first 4 layers, pdserve.testing.models): that commit's `engine` package, first on sys.path, ran
`workload` with its own SamplingParams and LLMEngine, the adapters written by pdserve.testing.lora.

The workload runs at TP 2 with two LoRA adapters: short prompts decoded together (prefill-only, then
decode-only steps), then long prompts (chunked) arriving while others decode (mixed steps), base and
adapter requests in the same steps. The steps the two engines run differ completely; a request's
tokens must not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

RECORDED = Path(__file__).resolve().parents[1] / "data" / "grid_engine_tokens.json"
SIZES = dict(num_blocks=192, max_model_len=1024, max_num_seqs=8, max_loras=2, tp=2)
BUDGET = 256  # the grid engine's max_prefill_tokens: its prefill chunk


def workload(engine, adapter_paths: dict[str, str]) -> dict[str, list[int]]:
    """(name -> token ids) of the workload's requests, driven step by step on `engine`."""
    from pdserve.engine.sampling_params import SamplingParams

    for name, path in adapter_paths.items():
        engine.loras.load(name, path)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
    story = "Once upon a time, in a kingdom by the sea, there lived a dragon who collected clocks. "
    arrivals = {  # step -> requests arriving before it: (name, prompt, params, adapter)
        0: [
            ("short-greedy", "The capital of France is", greedy, None),
            ("short-seeded", "Write a poem about the sea.", seeded, None),
            ("short-lora", "Hello, my name is", greedy, "a8"),
        ],
        6: [("long-greedy", story * 12, greedy, None), ("decode-lora", "1, 2, 3, 4,", seeded, "b4")],
        9: [("long-lora", "Summarize: " + story * 7, seeded, "a8")],
        12: [("long-seeded", story * 20, seeded, "b4")],
    }
    ids, tokens, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_unfinished:
        for name, prompt, params, adapter in arrivals.get(step, ()):
            ids[engine.add_request(prompt, params, lora=adapter)] = name
            tokens[name] = []
        for output in engine.step().tokens:
            tokens[ids[output.request_id]] += output.new_token_ids
        step += 1
    return tokens


def write_adapters(folder: Path, cfg) -> dict[str, str]:
    from pdserve.testing.lora import write_random_adapter

    return {
        "a8": str(write_random_adapter(folder / "a8", cfg, rank=8, seed=21)),
        "b4": str(write_random_adapter(folder / "b4", cfg, rank=4, seed=22, targets=("q_proj", "v_proj"))),
    }


def test_tokens_equal_the_grid_engines(make_engine, loaded_model, tmp_path):
    import jax

    engine = make_engine(devices=jax.devices()[:2], **SIZES, max_num_batched_tokens=BUDGET)
    got = workload(engine, write_adapters(tmp_path, loaded_model.config))
    assert got == json.loads(RECORDED.read_text())
