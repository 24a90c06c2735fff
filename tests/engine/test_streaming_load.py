"""Weights streamed from a sharded bfloat16 checkpoint to the devices: bounded host memory, no host copy
left, the same logits as transformers (engine.model.weights.build_weights)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import requires_reference

pytestmark = pytest.mark.model

MIB = 2**20
# About 210 MB in three shards: layers that dominate the bytes, as in the models users serve
SIZES = dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=8000)


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory) -> Path:
    from pdserve.testing.load_probe import write_random_llama

    folder = tmp_path_factory.mktemp("random-llama")
    write_random_llama(folder, shards=3, **SIZES)
    return folder


def test_host_memory_stays_bounded_and_no_host_copy_remains(random_llama):
    """Loaded in a fresh process (pdserve.testing.load_probe): the resident memory's high-water mark
    (VmHWM) grows by at most the device copy (on a CPU, host memory too: the checkpoint's bytes in
    bfloat16) plus the largest shard plus 160 MiB (JAX's runtime and the loader's compiled writes), where a
    whole host copy would add at least the checkpoint again; the Python/numpy memory held at once
    (tracemalloc) stays under half the checkpoint, and what is left of it after the load under 2%."""
    probe = subprocess.run(
        [sys.executable, "-m", "pdserve.testing.load_probe", str(random_llama), "--dtype", "bfloat16"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    cost = json.loads(probe.stdout.strip().splitlines()[-1])
    stored = cost["checkpoint_bytes"]
    largest_shard = max(p.stat().st_size for p in random_llama.glob("*.safetensors"))
    assert cost["weight_bytes"] == pytest.approx(stored, rel=0.01)  # bfloat16 in, bfloat16 on the devices
    growth = cost["rss_peak"] - cost["rss_before"]
    assert growth <= stored + largest_shard + 160 * MIB, cost
    assert cost["traced_peak"] < stored / 2, cost
    assert cost["traced_after"] < stored / 50, cost
    assert cost["logits_finite"]


@pytest.mark.reference
@requires_reference
def test_streamed_weights_match_transformers(random_llama):
    """The same folder in transformers (float32) and in pdserve (float32 on CPU): equal logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.checkpoints import SafetensorsCheckpoint
    from pdserve.engine.loading.sources import LoadedModel
    from pdserve.testing.load_probe import PROBE_PROMPT

    hf = AutoModelForCausalLM.from_pretrained(random_llama, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([PROBE_PROMPT])).logits[0, -1].numpy()
    del hf
    checkpoint = SafetensorsCheckpoint(random_llama)
    config = EngineConfig(num_blocks=16, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=16)
    engine = LLMEngine(LoadedModel(checkpoint.config, checkpoint, None, random_llama), config)
    logits = engine.prompt_logits(PROBE_PROMPT)
    assert np.max(np.abs(logits - expected)) <= 1e-3 * max(1.0, np.max(np.abs(expected)))
