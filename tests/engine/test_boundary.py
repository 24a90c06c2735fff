"""The engine's boundary without a model: typed commands in (engine.boundary), EngineOutputs out, the
real scheduler, connectors and output streams behind them, and a scripted runner in place of the device
(its steps "compute" every row; its sampler returns the tokens a test scripts; its KV reads and writes
are recorded). As a decode server and a prefill server drive an engine: remote admission, arrival, a
failed insert, the local fallback, abort during a transfer, forgetting, and the prefill side's KV out."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from pdserve.engine.boundary import (
    Abort,
    AddRequest,
    EngineStats,
    InsertKV,
    KVInsertError,
    KVReady,
    QueueFull,
    ReceiveKV,
    RemoteKVDone,
    RemoteKVFailed,
    SendKV,
    TransferReady,
    Utility,
)
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.kv_connector import DecodeConnector, PrefillConnector
from pdserve.engine.core.request import FinishReason, Status
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loading.sources import LoadedModel
from pdserve.engine.model.kv_cache import kv_layout
from pdserve.engine.model.sampler import SampleResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kvtransfer import KVChunk
from pdserve.kvtransfer.plan import HEADER_RESERVE_BYTES

pytestmark = pytest.mark.fast

VOCAB = 32
EOS = 0
CONFIG = EngineConfig(
    block_size=4, num_blocks=32, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=8, dtype="float32"
)
MODEL = ModelConfig(
    architecture="llama",
    vocab_size=VOCAB,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    name="scripted",
)


def tokenizer() -> Tokenizer:
    """Token i is the word "wI" (EOS: "w0"); decoding joins them with spaces."""
    backend = Backend(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    return Tokenizer(backend, eos_token_ids=[EOS])


class ScriptedRunner:
    """The device side of the test: steps compute every row; `script` holds the token each sampling row
    gets next, per request (default 5); KV reads and writes are recorded."""

    mesh = None
    lora = None

    def __init__(self, config: EngineConfig = CONFIG):
        self.config = config
        self.layout = kv_layout(MODEL, config)
        self.script: dict[str, list[int]] = {}
        self.steps: list[list[tuple[str, int, int]]] = []  # per step: (request id, first position, tokens)
        self.inserted: list[tuple[int, list[int]]] = []  # (chunk's first token, the blocks written)
        self.fail_inserts = False

    def forward(self, rows):
        self.steps.append([(r.request_id, r.num_past, len(r.tokens)) for r in rows])
        return rows

    def sample(self, rows, sample_rows, indices, allowed) -> SampleResult:
        tokens = [(self.script.get(rows[i].request_id) or [5]).pop(0) for i in indices]
        n = len(tokens)
        zeros = np.zeros((n, 0))
        return SampleResult(np.array(tokens), np.zeros(n), zeros.astype(np.int32), zeros)

    def insert_kv(self, chunk: KVChunk, block_ids) -> None:
        if self.fail_inserts:
            raise RuntimeError("injected: the write failed")
        self.inserted.append((chunk.token_start, list(block_ids.groups[0])))

    def gather_kv(self, layout, block_ids, num_tokens, *, max_frame_bytes, head_map, frames):
        return [KVChunk(p.layer_start, p.token_start, p.num_tokens, np.zeros(1)) for p in frames]


def engine(connector=None, config: EngineConfig = CONFIG) -> tuple[LLMEngine, ScriptedRunner]:
    runner = ScriptedRunner(config)
    e = LLMEngine(LoadedModel(MODEL, {}, tokenizer(), None), config, runner=runner)
    if connector is not None:
        e.set_kv_connector(connector)
    return e, runner


def request(e: LLMEngine, rid: str, prompt_len: int, max_tokens: int = 3, **params):
    prompt = [1 + i % (VOCAB - 1) for i in range(prompt_len)]
    return e.make_request(prompt, SamplingParams(max_tokens=max_tokens, **params), request_id=rid)


def chunk(token_start: int, num_tokens: int) -> KVChunk:
    return KVChunk(0, token_start, num_tokens, np.zeros(1))


def test_commands_are_plain_data():
    """Nothing callable crosses: every command survives a pickle round trip, and utilities are named."""
    e, _ = engine()
    commands = [
        AddRequest(request(e, "a", 6), ReceiveKV(), max_waiting=4),
        AddRequest(request(e, "b", 6), SendKV(first_block=1)),
        Abort("a"),
        InsertKV("a", chunk(0, 4), 0, transfer=1),
        RemoteKVDone("a", 7, None, 2, transfer=1),
        RemoteKVFailed("a"),
        Utility("stats"),
    ]
    for command in commands:
        assert pickle.loads(pickle.dumps(command)) == command
    with pytest.raises(ValueError, match="unknown engine utility"):
        Utility("scheduler")
    with pytest.raises(TypeError, match="not an engine command"):
        e.apply("abort everything")


def test_remote_admission_arrival_and_decode():
    """A ReceiveKV request: its blocks are allocated (TransferReady), the chunks are written into them in
    order, RemoteKVDone starts it, and its first token comes out of the next step like the rest."""
    e, runner = engine(DecodeConnector(CONFIG.block_size))
    r = request(e, "remote", 10, max_tokens=3)
    e.apply(AddRequest(r, ReceiveKV()))
    e.apply(AddRequest(request(e, "local", 6, max_tokens=1)))
    scheduled = e.schedule_step()  # admits both; the transfer can start before the step computes
    out = e.take_outputs()
    assert out.transfers == [TransferReady("remote", 10, 0)] and out.tokens == [] and runner.steps == []
    assert r.status is Status.WAITING_FOR_REMOTE_KV and out.stats.num_incoming == 1
    out = e.run_step(scheduled)
    assert runner.steps == [[("local", 0, 6)]] and out.transfers == [] and out.tokens[0].finished
    runner.steps.clear()
    assert e.apply(InsertKV("remote", chunk(0, 8), 0)) and e.apply(InsertKV("remote", chunk(8, 2), 0))
    blocks = e.scheduler.block_ids("remote")
    assert [(start, ids[:3]) for start, ids in runner.inserted] == [(0, blocks[:3]), (8, blocks[:3])]
    e.apply(RemoteKVDone("remote", 7, None, num_cached_tokens=4))
    runner.script["remote"] = [8, 9]
    (first,) = e.take_outputs().tokens  # out at once, before the next step computes
    assert first.new_token_ids == [7] and first.num_cached_tokens == 4 and first.text == "w7"
    second, third = e.step(), e.step()
    assert runner.steps[0] == [("remote", 10, 1)]  # decoding after the transferred prompt
    assert [o.new_token_ids for o in second.tokens] == [[8]]
    assert [o.new_token_ids for o in third.tokens] == [[9]] and third.tokens[0].finished
    assert third.tokens[0].finish_reason is FinishReason.LENGTH and e.step().tokens == []
    assert third.stats.num_running == 0 and third.stats.num_used_blocks == 0


def test_a_failed_insert_discards_its_attempt_only():
    """An insert that fails is kept for its transfer attempt: that attempt's RemoteKVDone is refused, and
    the next attempt, writing the same blocks again, starts the request."""
    e, runner = engine(DecodeConnector(CONFIG.block_size))
    e.apply(AddRequest(request(e, "r", 10), ReceiveKV()))
    e.step()
    runner.fail_inserts = True
    assert not e.apply(InsertKV("r", chunk(0, 10), 0, transfer=0))
    with pytest.raises(KVInsertError, match="injected: the write failed"):
        e.apply(RemoteKVDone("r", 7, transfer=0))
    runner.fail_inserts = False
    assert e.apply(InsertKV("r", chunk(0, 10), 0, transfer=1))
    e.apply(RemoteKVDone("r", 7, transfer=1))
    assert e.scheduler.requests["r"].status is Status.RUNNING


def test_the_local_fallback_computes_the_prompt_here():
    e, runner = engine(DecodeConnector(CONFIG.block_size))
    e.apply(AddRequest(request(e, "r", 10, max_tokens=1), ReceiveKV()))
    e.step()
    e.apply(RemoteKVFailed("r"))
    out = e.step()  # the first 8 tokens (the step's budget)
    assert runner.steps == [[("r", 0, 8)]] and out.tokens == []
    out = e.step()
    assert runner.steps[1] == [("r", 8, 2)] and [o.new_token_ids for o in out.tokens] == [[5]]
    assert out.tokens[0].finished


def test_abort_during_a_transfer_frees_the_blocks_and_forgets_the_transfer():
    """Abort while KV arrives: the blocks go back, later chunks of the transfer write nothing, and a
    failure kept for it does not outlive it (a new request of that id starts clean)."""
    e, runner = engine(DecodeConnector(CONFIG.block_size))
    e.apply(AddRequest(request(e, "r", 10), ReceiveKV()))
    e.step()
    runner.fail_inserts = True
    e.apply(InsertKV("r", chunk(0, 8), 0))
    assert e.apply(Abort("r")) and not e.apply(Abort("r"))
    runner.fail_inserts = False
    assert not e.apply(InsertKV("r", chunk(8, 2), 0)) and runner.inserted == []
    assert e.step().stats.num_used_blocks == 0
    e.apply(AddRequest(request(e, "r", 10), ReceiveKV()))
    assert e.step().transfers == [TransferReady("r", 10, 0)]
    e.apply(RemoteKVDone("r", 7))  # the aborted attempt's failure is forgotten
    assert e.step().tokens[0].new_token_ids == [7]


def test_a_cached_head_is_not_transferred():
    """A prompt whose head is in this engine's prefix cache receives only the blocks after it."""
    e, _ = engine(DecodeConnector(CONFIG.block_size))
    e.apply(AddRequest(request(e, "first", 10, max_tokens=1)))  # computed here: its 2 full blocks cached
    while e.has_unfinished:
        e.step()
    e.apply(AddRequest(request(e, "second", 16), ReceiveKV()))
    (ready,) = e.step().transfers
    assert ready == TransferReady("second", 8, 2)  # blocks 0-1 here, 8 tokens from block 2 on


def test_the_prefill_side_sends_the_kv_as_it_computes_then_the_first_token():
    """A SendKV request: each step's KVReady holds the frames its chunk completed; the step that finishes
    it (one token) brings the rest, marked last, before the token, and its blocks are back at once."""
    e, runner = engine()
    e.set_kv_connector(PrefillConnector(e.kv_layout))
    runner.script["p"] = [9]
    frame_bytes = HEADER_RESERVE_BYTES + 2 * CONFIG.block_size * 32  # two blocks of one layer a frame
    e.apply(AddRequest(request(e, "p", 12, max_tokens=1), SendKV(max_frame_bytes=frame_bytes)))
    first = e.step()
    assert [k.last for k in first.kv] == [False] and first.tokens == []
    assert all(c.token_start + c.num_tokens <= 8 for c in first.kv[0].chunks)
    second = e.step()
    items = second.for_requests()
    assert [type(i) for i in items] == [KVReady, type(second.tokens[0])] and items[0].last
    assert second.tokens[0].new_token_ids == [9] and second.tokens[0].finished
    sent = [c for k in (*first.kv, *second.kv) for c in k.chunks]
    assert sum(c.num_tokens for c in sent if c.layer_start == 0) == 12
    assert second.stats.num_used_blocks == 0


def test_the_admission_queue_bound_refuses_a_request():
    e, _ = engine(DecodeConnector(CONFIG.block_size))
    e.apply(AddRequest(request(e, "a", 6), None, max_waiting=1))
    with pytest.raises(QueueFull, match="admission queue full"):
        e.apply(AddRequest(request(e, "b", 6), None, max_waiting=1))
    assert set(e.scheduler.requests) == {"a"}


def test_a_stop_string_is_reported_to_the_scheduler_which_ends_the_request():
    """The output stream finds the stop string; the scheduler ends the request (its blocks freed) and the
    output says STOP with the text before it."""
    e, runner = engine()
    runner.script["s"] = [3, 4, 5, 6]
    e.apply(AddRequest(request(e, "s", 6, max_tokens=8, stop=("w4",))))
    outputs = []
    while e.has_unfinished:
        outputs += e.step().tokens
    assert outputs[-1].finish_reason is FinishReason.STOP and "w4" not in "".join(o.text for o in outputs)
    assert len(outputs) == 2 and e.stats() == dataclasses.replace(e.stats(), num_running=0, num_used_blocks=0)


def test_utilities_answer_with_plain_data():
    e, _ = engine()
    e.apply(AddRequest(request(e, "a", 6)))
    stats = e.apply(Utility("stats"))
    assert isinstance(stats, EngineStats) and stats.num_waiting == 1 and stats.num_blocks == 32
    assert e.apply(Utility("list_adapters")) == [] and not e.apply(Utility("remove_adapter", ("x",)))
