"""Multi-LoRA in the engine: PEFT loading and its refusals, HF transformers + peft parity, batches mixing
adapters, slots with LRU eviction, tensor parallelism, zero compilations after warmup."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from pdserve.engine.lora import (
    AdapterExistsError,
    AdapterMismatchError,
    AdapterRegistry,
    LoraLoadError,
    TooManyAdaptersError,
    UnknownAdapterError,
    load_peft_adapter,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing.compile_watch import count_compilations
from pdserve.testing.lora import write_random_adapter
from tests.conftest import requires_reference
from tests.engine.test_compile import WARMUP_CONFIG

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["The capital of France is", "Write a poem about the sea.", "Hello, my name is", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, loaded_model):
    """Three random adapters: rank 8 on every module, rank 4 on attention only, rank 16 on the MLP only."""
    root = tmp_path_factory.mktemp("adapters")
    cfg = loaded_model.config
    return {
        "all8": write_random_adapter(root / "all8", cfg, rank=8, seed=1),
        "attn4": write_random_adapter(
            root / "attn4", cfg, rank=4, seed=2, targets=("q_proj", "k_proj", "v_proj", "o_proj")
        ),
        "mlp16": write_random_adapter(
            root / "mlp16", cfg, rank=16, seed=3, targets=("gate_proj", "up_proj", "down_proj"), alpha=48
        ),
    }


@pytest.fixture
def lora_engine(make_engine, adapters):
    def make(**overrides):
        engine = make_engine(**{"max_loras": 2, **overrides})
        for name, path in adapters.items():
            engine.loras.load(name, str(path))
        return engine

    return make


def alone(engine, prompts, lora, params=GREEDY):
    return [
        engine.generate([p], params, lora=name)[0].token_ids for p, name in zip(prompts, lora, strict=True)
    ]


def test_adapters_change_tokens_and_batch_mixing_matches_alone(lora_engine):
    """Base, three adapters (one more than there are slots) and a chunked long prompt in one batch."""
    engine = lora_engine()
    prompts = [*PROMPTS, "Summarize: " + "the quick brown fox jumps over the lazy dog " * 40]
    lora = [None, "all8", "attn4", "mlp16", "all8"]
    expected = alone(engine, prompts, lora)
    base = alone(engine, prompts, [None] * len(prompts))
    assert expected[0] == base[0]
    assert all(expected[i] != base[i] for i in range(1, len(prompts)))  # every adapter changes the output
    mixed = [c.token_ids for c in engine.generate(prompts, GREEDY, lora=lora)]
    assert mixed == expected
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)
    assert [c.token_ids for c in engine.generate(prompts, sampled, lora=lora)] == alone(
        engine, prompts, lora, sampled
    )
    assert not engine.lora_slots._pins  # every pin released


def test_slots_are_reused_least_recently_used_first(lora_engine):
    engine = lora_engine()
    slots = engine.lora_slots
    engine.generate(PROMPTS[:1], GREEDY, lora="all8")
    engine.generate(PROMPTS[:1], GREEDY, lora="attn4")
    loads = slots.num_loads
    engine.generate(PROMPTS[:1], GREEDY, lora="all8")  # resident: no load; all8 becomes most recent
    assert slots.num_loads == loads
    engine.generate(PROMPTS[:1], GREEDY, lora="mlp16")  # evicts attn4, the least recently used
    assert slots.num_loads == loads + 1
    assert [key.split("@")[0] for key in slots.resident] == ["all8", "mlp16"]


def test_request_waits_while_every_slot_is_pinned(lora_engine):
    engine = lora_engine()  # 2 slots, for 3 adapters
    first = engine.add_request(PROMPTS[0], GREEDY, lora="all8")
    second = engine.add_request(PROMPTS[1], GREEDY, lora="attn4")
    third = engine.add_request(PROMPTS[2], GREEDY, lora="mlp16")
    base = engine.add_request(PROMPTS[3], GREEDY)
    # what an endpoint picker's LoRA-affinity scorer reads (services.metrics: vLLM's lora_requests_info
    # shape), from the stats of each step the engine loop publishes
    from pdserve.services.admin import Counters
    from pdserve.services.engine_loop import EngineLoop
    from pdserve.services.metrics import Metrics

    loop = EngineLoop(engine)
    registry = Metrics("decode", loop, Counters()).registry
    # prefill: all8 and attn4 pinned in the two slots; mlp16 must wait, the base request passes it
    loop.publish(engine.step())
    admitted = [r.request_id for r in engine.scheduler.prefilling + engine.scheduler.running]
    assert admitted == [first, second, base]
    assert [r.request_id for r in engine.scheduler.waiting] == [third]
    labels = {"role": "decode", "max_lora": "2"}
    info = dict(labels, running_lora_adapters="all8,attn4", waiting_lora_adapters="mlp16")
    assert registry.get_sample_value("pdserve_lora_requests_info", info) > 0
    while engine.has_unfinished:
        loop.publish(engine.step())
    assert engine.lora_slots.resident[-1].startswith("mlp16@")  # it had a slot once one was unpinned
    idle = dict(labels, running_lora_adapters="", waiting_lora_adapters="")
    assert registry.get_sample_value("pdserve_lora_requests_info", idle) > 0


def test_preempted_lora_requests_keep_their_adapter(lora_engine):
    """Too few blocks for all requests: the newest are preempted (keeping their slot) and recomputed."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    lora = ["all8", "attn4", None, "all8", "attn4"]
    prompts = [*PROMPTS, "A" * 3]
    roomy = [c.token_ids for c in lora_engine().generate(prompts, params, lora=lora)]
    tight = lora_engine(num_blocks=12)
    assert [c.token_ids for c in tight.generate(prompts, params, lora=lora)] == roomy
    assert tight.scheduler.kv.pool.num_used == 0 and not tight.lora_slots._pins


def test_tensor_parallel_lora_matches_tp1(lora_engine):
    import jax

    lora = [None, "all8", "attn4", "mlp16"]
    expected = [c.token_ids for c in lora_engine().generate(PROMPTS, GREEDY, lora=lora)]
    # the engine of test_grid_tokens.py (loaded from what it compiled): three adapters for its two slots,
    # so that one waits for a slot and is loaded into the sharded slot another left
    tp2 = lora_engine(devices=jax.devices()[:2], tp=2)
    assert tp2.config.tp == 2 and len(jax.devices()) >= 2
    assert [c.token_ids for c in tp2.generate(PROMPTS, GREEDY, lora=lora)] == expected


def test_rslora_scaling(lora_engine, loaded_model, tmp_path):
    """use_rslora scales by alpha / sqrt(r): the same weights with alpha' = alpha * sqrt(r) without it."""
    engine = lora_engine()
    cfg = loaded_model.config
    write_random_adapter(tmp_path / "rs", cfg, rank=4, seed=9, alpha=3.0, use_rslora=True)
    write_random_adapter(tmp_path / "plain", cfg, rank=4, seed=9, alpha=3.0 * 2)
    rs = load_peft_adapter("rs", tmp_path / "rs", cfg, 16)
    plain = load_peft_adapter("plain", tmp_path / "plain", cfg, 16)
    assert rs.scaling == pytest.approx(1.5) and plain.scaling == pytest.approx(1.5)
    np.testing.assert_array_equal(rs.b["q_proj"], plain.b["q_proj"])
    engine.loras.load("rs", str(tmp_path / "rs"))
    engine.loras.load("plain", str(tmp_path / "plain"))
    ids = engine.tokenizer.encode(PROMPTS[0])
    np.testing.assert_allclose(engine.prompt_logits(ids, "rs"), engine.prompt_logits(ids, "plain"), atol=1e-5)
    engine.loras.remove("rs")
    engine.loras.remove("plain")


def test_refusals(lora_engine, make_engine, loaded_model, tmp_path, adapters):
    engine = lora_engine()
    cfg = loaded_model.config
    with pytest.raises(UnknownAdapterError, match="'nope' is not loaded here") as e:
        engine.make_request("hi", GREEDY, lora="nope")
    assert e.value.status == "NOT_FOUND" and e.value.field == "lora_adapter"
    with pytest.raises(AdapterMismatchError, match="fingerprint"):
        engine.make_request("hi", GREEDY, lora="all8", lora_fingerprint="0" * 16)
    other = write_random_adapter(tmp_path / "other", cfg, rank=8, seed=99)
    with pytest.raises(AdapterExistsError, match="unload it first"):
        engine.loras.load("all8", str(other))
    assert (
        engine.loras.load("all8", str(adapters["all8"])) is engine.loras.adapters["all8"]
    )  # same files: no-op

    def refused(match, **kwargs):
        folder = write_random_adapter(tmp_path / match[:8].replace(" ", "_"), cfg, rank=4, **kwargs)
        with pytest.raises(LoraLoadError, match=match):
            load_peft_adapter("x", folder, cfg, max_rank=16)
        return folder

    big = write_random_adapter(tmp_path / "big", cfg, rank=32)
    with pytest.raises(LoraLoadError, match="rank 32 is outside 1..16"):
        load_peft_adapter("x", big, cfg, max_rank=16)
    refused("use_dora", use_dora=True)
    refused("modules_to_save", modules_to_save=["lm_head"])
    folder = refused("peft_type", peft_type="PREFIX_TUNING")
    (folder / "adapter_config.json").unlink()
    with pytest.raises(LoraLoadError, match="no adapter_config.json"):
        load_peft_adapter("x", folder, cfg, 16)
    with pytest.raises(LoraLoadError, match="not a directory"):
        load_peft_adapter("x", tmp_path / "missing", cfg, 16)
    wrong = write_random_adapter(tmp_path / "wrong", cfg, rank=4)
    config = json.loads((wrong / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))  # says 8, tensors are 4
    with pytest.raises(LoraLoadError, match="has shape"):
        load_peft_adapter("x", wrong, cfg, 16)
    (wrong / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraLoadError, match="adapter_model.safetensors"):
        load_peft_adapter("x", wrong, cfg, 16)
    with pytest.raises(LoraLoadError, match="LoRA is off"):
        make_engine().loras.load("x", str(adapters["all8"]))
    for bad, match in (({"r": "eight"}, "must be numbers"), ({"r": None}, "must be numbers")):
        (wrong / "adapter_config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(LoraLoadError, match=match):
            load_peft_adapter("x", wrong, cfg, 16)
    (wrong / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(LoraLoadError, match="not a JSON object"):
        load_peft_adapter("x", wrong, cfg, 16)


def test_adapters_held_are_bounded_and_one_folder_is_held_once(loaded_model, adapters):
    """--max-cpu-loras bounds the adapters loaded at once; the same files under a second name share the
    first one's host arrays."""
    registry = AdapterRegistry(loaded_model.config, 16, True, max_adapters=2)
    first = registry.load("a", str(adapters["all8"]))
    second = registry.load("b", str(adapters["all8"]))
    assert second.name == "b" and second.a is first.a and second.b is first.b
    with pytest.raises(TooManyAdaptersError, match="--max-cpu-loras") as refusal:
        registry.load("c", str(adapters["attn4"]))
    assert refusal.value.status == "RESOURCE_EXHAUSTED"
    assert registry.remove("a") and registry.load("c", str(adapters["attn4"])).name == "c"


def test_removed_adapter_finishes_running_requests(lora_engine):
    engine = lora_engine()
    expected = engine.generate(PROMPTS[:1], GREEDY, lora="attn4")[0].token_ids
    rid = engine.add_request(PROMPTS[0], GREEDY, lora="attn4")
    assert engine.loras.remove("attn4")
    with pytest.raises(UnknownAdapterError):
        engine.make_request("hi", GREEDY, lora="attn4")
    tokens = []
    while engine.has_unfinished:
        tokens += [t for o in engine.step().tokens if o.request_id == rid for t in o.new_token_ids]
    assert tokens == expected


def test_warmup_covers_lora_steps(lora_engine):
    engine = lora_engine(**WARMUP_CONFIG)
    engine.runner.warmup(progress=False)
    with count_compilations() as counted:
        engine.generate(PROMPTS, GREEDY, lora=[None, "all8", "mlp16", "attn4"])
    assert counted() == 0


@requires_reference
def test_matches_transformers_with_peft(model_path, lora_engine, tmp_path):
    """peft writes a random adapter onto the HF model; pdserve loads the saved folder and matches it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(
        r=8,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,  # random B: the adapter changes the model
    )
    model = get_peft_model(hf, config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.1)
    model.save_pretrained(tmp_path / "peft")
    engine = lora_engine()
    engine.loras.load("peft", str(tmp_path / "peft"))
    ids = engine.tokenizer.encode("Disaggregated serving splits prefill and decode because")
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1].numpy()
        generated = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
    logits = engine.prompt_logits(ids, "peft")
    assert np.max(np.abs(logits - expected)) <= 1e-3  # measured 2.4e-5
    assert np.max(np.abs(engine.prompt_logits(ids) - expected)) > 0.1  # the adapter matters
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert engine.generate([ids], params, lora="peft")[0].token_ids == generated.tolist()
    engine.loras.remove("peft")


def test_prefix_cache_shares_blocks_only_within_an_adapter(lora_engine, make_engine, adapters):
    engine = lora_engine()
    prompt = engine.tokenizer.encode("Shared head of a prompt. " * 12)
    baseline = make_engine(max_loras=2, enable_prefix_caching=False)
    for name in ("all8", "attn4"):
        if name not in baseline.loras.adapters:
            baseline.loras.load(name, str(adapters[name]))
    expected = {
        name: baseline.generate([prompt], GREEDY, lora=name)[0].token_ids for name in ("all8", "attn4", None)
    }
    runs = [
        (name, engine.generate([prompt], GREEDY, lora=name)[0]) for name in ("all8", "all8", "attn4", None)
    ]
    assert [c.token_ids for _, c in runs] == [expected[name] for name, _ in runs]
    cached = [c.num_cached_tokens for _, c in runs]
    assert cached[1] > 0 and cached[2] == 0  # the same adapter reuses its blocks; another adapter does not


def test_a_follower_replays_the_published_operations(lora_engine):
    """A multi-process engine's worker state comes only from the leader's published operations: every
    operation a workload publishes (steps, sampling, an adapter write, a KV gather and insert), through the
    group's wire encoding, replayed by a Follower from the state before the workload, rebuilds the same KV
    cache and adapter slots bit for bit. (One engine plays both processes: its state is put back first.)"""
    from pdserve.engine.multihost import Follower
    from pdserve.kvtransfer import KVChunk, plan_frames
    from pdserve.services.group import from_message, to_message

    engine = lora_engine()
    runner, slots, layout = engine.runner, engine.lora_slots, engine.kv_layout
    absent = next(
        n for n in ("all8", "attn4", "mlp16") if not any(k.startswith(f"{n}@") for k in slots.resident)
    )
    before = np.asarray(runner.cache), jax.tree.map(np.asarray, slots.weights)
    ops = []
    engine.publish_device_ops(lambda op: ops.append(from_message(to_message(op, len(ops)))))
    try:
        prompts = [PROMPTS[0], "Summarize: " + "the quick brown fox jumps over the lazy dog " * 30]
        sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6)
        engine.generate(prompts, [GREEDY, sampled], lora=[absent, None])
        kv = engine.scheduler.kv
        assert kv.allocate("scratch", 96)  # 6 blocks: 40 tokens read from the first 3, written to the others
        blocks = kv.block_ids("scratch")
        frames = plan_frames(layout, 40, 64 << 20)
        [chunk] = runner.gather_kv(
            layout, blocks[:3], 40, max_frame_bytes=64 << 20, head_map=None, frames=frames
        )
        host = KVChunk(chunk.layer_start, chunk.token_start, chunk.num_tokens, np.asarray(chunk.data) + 1)
        runner.insert_kv(host, blocks[3:])
        kv.free("scratch")
    finally:
        engine.publish_device_ops(None)
    after = np.asarray(runner.cache), jax.tree.map(np.asarray, slots.weights)
    assert {op.kind for op in ops} == {"step", "sample", "lora_write", "gather_kv", "insert_kv"}
    runner.cache = jax.device_put(before[0], runner.cache.sharding)
    slots.weights = jax.tree.map(lambda a, d: jax.device_put(a, d.sharding), before[1], slots.weights)
    follower = Follower(engine, layout)
    assert all(follower.apply(op) for op in ops)
    assert np.array_equal(np.asarray(runner.cache), after[0])
    assert jax.tree.all(jax.tree.map(np.array_equal, jax.tree.map(np.asarray, slots.weights), after[1]))


def test_constrained_requests_with_adapters_validate_and_match_alone(lora_engine):
    """A JSON-schema constraint on adapter rows and a base row, batched with a free adapter row: each
    equals its run alone, and the constrained outputs validate."""
    import jsonschema

    from pdserve.engine.sampling_params import Constraint

    engine = lora_engine()
    schema = {  # a finite language: random adapters cannot run it to max_tokens
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
    # its longest output: about 16 tokens of JSON and, at each of its 9 places for whitespace, at most 8
    # characters (engine.constraints): under 128 tokens however the model spends them
    constrained = SamplingParams(
        temperature=0.0, max_tokens=128, constraint=Constraint("json_schema", json.dumps(schema))
    )
    params = [constrained, SamplingParams(temperature=0.0, max_tokens=12), constrained]
    lora = ["all8", "attn4", None]
    prompts = ["The weather as JSON:"] * 3
    batch = engine.generate(prompts, params, lora=lora)
    for i, completion in enumerate(batch):
        assert completion.token_ids == engine.generate([prompts[i]], params[i], lora=lora[i])[0].token_ids
    for completion in (batch[0], batch[2]):
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)
