"""After warmup, a mixed workload compiles nothing new (every shape comes from a warmed bucket)."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import jax
import numpy as np
import pytest

from pdserve import kvtransfer
from pdserve.engine.boundary import AddRequest, SendKV
from pdserve.engine.core.kv_connector import PrefillConnector
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing.compile_watch import count_compilations
from pdserve.testing.eagle3 import write_random_head

pytestmark = pytest.mark.model

# Few buckets (the property does not depend on their number): steps of 1 to 16 tokens (a long prompt in
# chunks of 16), 1 to 4 rows.
WARMUP_CONFIG = dict(
    max_model_len=256, max_num_seqs=4, num_blocks=64, max_prefill_seqs=2, max_num_batched_tokens=16
)


def test_warmup_covers_a_mixed_workload(make_engine):
    engine = make_engine(**WARMUP_CONFIG)
    with count_compilations() as counted:
        variants = engine.runner.warmup(progress=False)
    runner = engine.runner
    shapes = len(runner.step_shapes()) + len(runner.score_shapes()) + len(runner.sampler_shapes())
    shapes += len(runner.copy_shapes())
    assert counted() > 0 and variants == shapes
    prompts = ["Hi", "Tell me a story about a dragon " * 3, "x " * 150, "1 2 3", "The sky is", "Once"]
    params = [
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=30),
        SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.2, seed=2, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.5, min_p=0.1, seed=3, max_tokens=25, prompt_logprobs=2),
        SamplingParams(temperature=0.9, seed=4, max_tokens=10, n=3),  # forked: 3 sampling rows, 2 copies
    ]
    with count_compilations() as counted:
        results = engine.generate(prompts, params)
        chat = engine.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}])
        results += engine.generate([chat], SamplingParams(temperature=0, max_tokens=8))
        assert engine.prompt_logits(chat).shape == (engine.model.config.vocab_size,)
    assert counted() == 0
    assert all(r.finish_reason in ("stop", "length") for r in results)


def test_warmup_covers_a_tensor_parallel_engine(make_engine):
    """At TP 2 a step's logits come split over the vocabulary: the sampler is warmed on that sharding (a
    replicated warmup would leave every sampler shape to compile on first use)."""
    engine = make_engine(jax.devices()[:2], **WARMUP_CONFIG, tp=2)
    engine.runner.warmup(progress=False)
    params = [
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=0.8, seed=1, max_tokens=5, n=2, repetition_penalty=1.1, logprobs=1),
    ]
    with count_compilations() as counted:
        engine.generate(["Hi", "Tell me a story about a dragon " * 2], params)
        engine.generate(["Once"], SamplingParams(temperature=0, max_tokens=3))
    assert counted() == 0


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_warmup_covers_speculative_decoding(make_engine, loaded_model, tmp_path, method):
    """With speculation the steps return more logits rows (EngineConfig.logits_bucket) and the sampler
    takes as many; an EAGLE-3 head's steps also return the aux states, and its pass runs after each step:
    warmup compiles those, and decoding with drafts (penalties, logprobs, n > 1, a prompt in chunks beside
    drafting rows) compiles nothing new."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "draft_policy": "all"}
    if method == "eagle3":
        head = write_random_head(tmp_path / "head", loaded_model.config)
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "draft_policy": "all"}
    engine = make_engine(**WARMUP_CONFIG, speculative_config=json.dumps(spec))
    engine.runner.warmup(progress=False)
    quote = "one two three four one two three four one two three four one two"
    prompts = [quote, quote + " three", "x " * 40, quote + " four one"]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=20, logprobs=2, repetition_penalty=1.1),
        SamplingParams(temperature=0, max_tokens=8),
        SamplingParams(temperature=0.9, seed=6, max_tokens=12, n=2, ignore_eos=True),
    ]
    before = engine.scheduler.drafts.stats.num_drafts
    with count_compilations() as counted:
        engine.generate(prompts, params)
    assert counted() == 0 and engine.scheduler.drafts.stats.num_drafts > before


def test_warmup_covers_kv_transfers(make_engine):
    """A daemon's engine also runs its KV transfers at start (LLMEngine.warmup_transfers): a prefill's
    frames of any prompt length, with or without a held prefix, and their insert into a decode cache from
    host memory (as the wire delivers them) compile nothing new; the warmup leaves the cache as it was."""
    engine = make_engine(**WARMUP_CONFIG)
    engine.runner.warmup(progress=False)
    rng = np.random.default_rng(3)
    engine.generate([rng.integers(100, 30000, 250).tolist()], SamplingParams(temperature=0, max_tokens=4))
    held = [np.array(leaf) for leaf in jax.tree.leaves(engine.runner.cache)]  # copies: the cache is donated
    assert engine.warmup_transfers() > 0
    after = [np.array(leaf) for leaf in jax.tree.leaves(engine.runner.cache)]
    assert all(np.array_equal(a, b) for a, b in zip(held, after, strict=True)) and held[0].any()
    with sending(engine), count_compilations() as counted:
        for length, first_block in [(3, 0), (40, 0), (100, 2), (181, 0), (250, 5)]:
            chunks = sent_chunks(
                engine, rng.integers(100, 30000, length).tolist(), SendKV(first_block=first_block)
            )
            for chunk in chunks:  # received: host bytes, each into the decode side's blocks
                engine.runner.insert_kv(
                    dataclasses.replace(chunk, data=np.asarray(chunk.data)), RECEIVER_BLOCKS
                )
    assert chunks and counted() == 0


def test_inserts_compile_ahead_for_a_peer_of_another_tp(make_engine):
    """A sender at TP 2 pads its KV heads otherwise than a receiver at TP 1, so its frames hold other
    numbers of blocks: the receiver's warmup did not compile those inserts. compile_inserts_from (what a
    decode server runs as it greets such a replica, on a thread) compiles them, once per layout; the
    sender's frames, encoded, decoded and converted as the daemons do, then insert with no compilation."""
    receiver = make_engine(**WARMUP_CONFIG)
    sender = make_engine(jax.devices()[:2], **WARMUP_CONFIG, tp=2)
    frame_bytes = kvtransfer.plan.HEADER_RESERVE_BYTES + 4 * sender.kv_layout.block_bytes * 3  # 3 blocks
    for engine in (sender, receiver):
        engine.runner.warmup(progress=False)
        engine.warmup_transfers(frame_bytes)
    sizes = {p.bucket for p in kvtransfer.distinct_frames(sender.kv_layout, 16, frame_bytes)}
    assert sizes != {p.bucket for p in kvtransfer.distinct_frames(receiver.kv_layout, 16, frame_bytes)}
    assert receiver.compile_inserts_from(sender.kv_layout, frame_bytes) > 0
    assert receiver.compile_inserts_from(sender.kv_layout, frame_bytes) == 0  # once per layout
    rng = np.random.default_rng(5)
    sharding = kvtransfer.chunk_sharding(receiver.mesh, receiver.kv_layout)
    with sending(sender), count_compilations() as counted:
        for length in (20, 100, 250):
            chunks = sent_chunks(
                sender, rng.integers(100, 30000, length).tolist(), SendKV(max_frame_bytes=frame_bytes)
            )
            frames = kvtransfer.encode_request("r", sender.kv_layout, length, chunks, frame_bytes)
            received = kvtransfer.FrameAssembler("r", length, sender.kv_layout, receiver.kv_layout, sharding)
            for data in frames:
                receiver.runner.insert_kv(received.add(kvtransfer.deserialize_frame(data)), RECEIVER_BLOCKS)
    assert counted() == 0


RECEIVER_BLOCKS = list(
    range(63, 47, -1)
)  # a receiver's blocks for a request (16 hold max_model_len's 256 tokens)


@contextlib.contextmanager
def sending(engine):
    """The engine as a prefill server's: requests added with SendKV hand their KV over (KVReady)."""
    original = engine.kv_connector
    engine.set_kv_connector(PrefillConnector(engine.kv_layout))
    try:
        yield
    finally:
        engine.set_kv_connector(original)


def sent_chunks(engine, prompt: list[int], send: SendKV) -> list:
    """The KV chunks a prefill of `prompt` hands over, in plan order (its whole computation)."""
    request = engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=1), "r")
    engine.apply(AddRequest(request, send))
    chunks = []
    while engine.has_unfinished:
        chunks += [c for ready in engine.step().kv for c in ready.chunks]
    return chunks
