"""Scheduling, admission, prefix reuse and the connector states without JAX: a fake runner "computes"
every row and samples token 1 for the rows that sample."""

import collections

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_connector import KVConnector
from pdserve.engine.core.request import Request, Status
from pdserve.engine.core.scheduler import SampledToken, Scheduler
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.fast

CONFIG = EngineConfig(
    block_size=4,
    num_blocks=16,
    max_num_seqs=3,
    max_model_len=64,
    max_num_batched_tokens=8,
    max_prefill_seqs=2,
)


def make(rid, prompt, t=0.0, max_tokens=16):
    prompt = list(range(prompt)) if isinstance(prompt, int) else prompt
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), 0, arrival_time=t)


def run(sched, out):
    """The fake runner: every row computed, sampling rows get token 1."""
    sampled = {row.request_id: [SampledToken(1)] for row in out.rows if row.samples}
    return [(request.request_id, run[0].token) for request, run in sched.update_from_output(out, sampled)]


def rows(step):
    return [(r.request_id, r.num_past, len(r.tokens), r.samples) for r in step.rows]


def test_decodes_go_first_then_chunks_fill_the_token_budget():
    sched = Scheduler(CONFIG)  # 8 tokens a step, 2 prompts computed at once
    for i in range(3):
        sched.add(make(f"r{i}", [10 * i + j for j in range(5)], t=i))
    step = sched.schedule()
    assert rows(step) == [("r0", 0, 5, True), ("r1", 0, 3, False)]  # r1 chunked at the budget
    run(sched, step)
    step = sched.schedule()  # r0 decodes in the same step as r1's rest and r2's prompt
    assert rows(step) == [("r0", 5, 1, True), ("r1", 3, 2, True), ("r2", 0, 5, True)]
    assert step.rows[0].tokens == [1]
    run(sched, step)
    assert rows(sched.schedule()) == [("r0", 6, 1, True), ("r1", 5, 1, True), ("r2", 5, 1, True)]


def test_long_prompt_is_chunked_while_running_requests_decode():
    sched = Scheduler(CONFIG)
    sched.add(make("short", 3))
    run(sched, sched.schedule())
    sched.add(make("long", 20))
    step = sched.schedule()
    assert rows(step) == [("short", 3, 1, True), ("long", 0, 7, False)]
    run(sched, step)
    assert sched.requests["long"].num_computed == 7
    assert rows(sched.schedule()) == [("short", 4, 1, True), ("long", 7, 7, False)]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=12)
)
@example([(4, 1, 0), (26, 12, 0), (28, 8, 0), (2, 8, 0), (3, 7, 0)])  # a preempted victim came straight back
@example([(4, 1, 0), (26, 12, 1), (28, 8, 0), (2, 8, 0), (3, 7, 0)])
def test_no_running_request_waits_while_prompts_are_computed(arrivals):
    """(prompt length, max tokens, steps before the next arrival): every step holds a decode row for each
    request that was running (unless it was preempted for blocks) and stays within the token budget."""
    config = EngineConfig(**{**CONFIG.__dict__, "num_blocks": 24, "max_num_seqs": 4})
    sched = Scheduler(config)
    pending = collections.deque(arrivals)
    steps = 0
    while pending or sched.num_unfinished:
        if pending:
            length, max_tokens, wait = pending.popleft()
            sched.add(
                make(f"r{steps}-{len(pending)}", list(range(1, length + 1)), t=steps, max_tokens=max_tokens)
            )
        for _ in range(wait if pending else 1):
            running = list(sched.running)
            step = sched.schedule()
            if step is None:
                break
            decoded = {r.request_id for r in step.rows if len(r.tokens) == 1 and r.num_past > 0}
            still_running = {r.request_id for r in running if r.status is Status.RUNNING}
            assert still_running <= decoded
            assert sum(len(r.tokens) for r in step.rows) <= config.max_num_batched_tokens
            run(sched, step)
            steps += 1
            assert steps < 2000
    assert sched.kv.pool.num_used == 0


def test_admission_waits_for_blocks_and_seq_limit():
    config = EngineConfig(**{**CONFIG.__dict__, "num_blocks": 4})  # 16 tokens of cache
    sched = Scheduler(config)
    sched.add(make("a", 12))
    sched.add(make("b", 8))  # does not fit while a holds 3 blocks
    step = sched.schedule()
    assert [r.request_id for r in step.rows] == ["a"]
    assert sched.kv.pool.num_available == 1 and sched.waiting[0].request_id == "b"


def test_decode_preempts_the_newest_request_which_finds_its_blocks_again():
    sched = Scheduler(EngineConfig(**{**CONFIG.__dict__, "num_blocks": 4, "max_num_batched_tokens": 16}))
    old, new = make("old", 8, t=0), make("new", [9, 8, 7, 6, 5, 4, 3, 2], t=1)
    sched.add(old)
    sched.add(new)
    run(sched, sched.schedule())
    assert sched.kv.pool.num_available == 0
    step = sched.schedule()  # both need a 3rd block for token 9: only preempting "new" frees one
    assert [r.request_id for r in step.rows] == ["old"]
    assert new.status is Status.PREEMPTED and new.num_computed == 0 and sched.waiting[0] is new
    assert sched.kv.pool.num_cached == 1  # its two full blocks went back cached; old's 3rd evicted the tail
    run(sched, step)
    sched.abort("old")  # room again: "new" is readmitted with its first block cached...
    step = sched.schedule()
    assert [(r.request_id, r.num_past, r.tokens) for r in step.rows] == [("new", 4, [5, 4, 3, 2, 1])]
    assert new.num_cached_tokens == 0  # ...which is not a prompt hit of the client's request
    sched.abort("new")
    assert sched.kv.pool.num_used == 0 and not sched.requests


def test_a_shared_prefix_is_computed_once_and_survives_an_abort_of_its_first_owner():
    sched = Scheduler(EngineConfig(**{**CONFIG.__dict__, "max_num_batched_tokens": 16}))
    system = list(range(100, 112))  # 3 full blocks
    sched.add(make("a", [*system, 1, 2]))
    run(sched, sched.schedule())  # a's prompt computed: its 3 full blocks are in the cache
    sched.add(make("b", [*system, 3]))
    step = sched.schedule()  # a decodes; b's prompt is one token past the cached head
    assert [(r.request_id, r.num_past, r.tokens) for r in step.rows] == [("a", 14, [1]), ("b", 12, [3])]
    shared = sched.block_ids("a")[:3]
    assert sched.block_ids("b")[:3] == shared and sched.requests["b"].num_cached_tokens == 12
    assert [sched.kv.pool.ref_counts[blk] for blk in shared] == [2, 2, 2]
    run(sched, step)
    sched.abort("a")
    assert [sched.kv.pool.ref_counts[blk] for blk in shared] == [1, 1, 1]  # b still holds them
    sched.abort("b")
    assert sched.kv.pool.num_used == 0 and sched.kv.pool.num_cached == 3
    sched.kv.pool.check()


def test_lora_requests_share_only_blocks_of_their_adapter():
    class Adapter:
        def __init__(self, fingerprint):
            self.fingerprint, self.name = fingerprint, fingerprint

    sched = Scheduler(CONFIG)
    sched.pin_adapter = lambda request: True  # no device slots here
    prompt = list(range(6))
    first = make("base", prompt, max_tokens=1)
    sched.add(first)
    run(sched, sched.schedule())
    with_adapter = make("lora", prompt)
    with_adapter.lora = Adapter("fp-1")
    sched.add(with_adapter)
    step = sched.schedule()
    assert step.rows[0].num_past == 0  # the base model's blocks are not its KV
    run(sched, step)
    again = make("lora-2", prompt)
    again.lora = Adapter("fp-1")
    sched.add(again)
    step = sched.schedule()
    assert [(r.request_id, r.num_past) for r in step.rows] == [("lora", 6), ("lora-2", 4)]


class Recorder(KVConnector):
    """Decode-role connector of the test: every request with an id starting 'remote' has remote KV."""

    def __init__(self, hold=False):
        self.allocated, self.finished, self.hold = [], [], hold

    def num_external_tokens(self, request, num_cached_tokens):
        remote = request.request_id.startswith("remote")
        return len(request.prompt_ids) - num_cached_tokens if remote else 0

    def on_blocks_allocated(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            self.allocated.append((request.request_id, list(block_ids)))

    def request_finished(self, request):
        self.finished.append(request.request_id)
        return self.hold


def test_remote_kv_states_arrival_and_fallback():
    connector = Recorder()
    sched = Scheduler(CONFIG, connector=connector)
    sched.add(make("remote-1", 6))
    sched.add(make("remote-2", 6))
    assert sched.schedule() is None  # admitted, but nothing to compute here
    assert [rid for rid, _ in connector.allocated] == ["remote-1", "remote-2"]
    assert all(len(blocks) == 2 for _, blocks in connector.allocated)  # 6 prompt tokens + the first token
    r1, r2 = sched.requests["remote-1"], sched.requests["remote-2"]
    assert r1.status is Status.WAITING_FOR_REMOTE_KV and sched.num_active == 2 and sched.num_unfinished == 0
    ((out, _),) = sched.remote_kv_arrived("remote-1", SampledToken(7))
    assert out is r1 and r1.output_ids == [7] and r1.status is Status.RUNNING and r1.num_computed == 6
    sched.remote_kv_failed("remote-2")  # no replica could send it: computed here, in its blocks
    assert r2.status is Status.RUNNING and r2.num_computed == 0
    step = sched.schedule()
    assert [(r.request_id, r.num_past, len(r.tokens)) for r in step.rows] == [
        ("remote-1", 6, 1),
        ("remote-2", 0, 6),
    ]
    with pytest.raises(ValueError, match="not waiting for KV"):
        sched.remote_kv_arrived("remote-2", SampledToken(1))
    sched.abort("remote-1")
    sched.abort("remote-2")
    assert sched.kv.pool.num_used == 0 and connector.finished == []  # aborts send nothing


def test_a_finished_request_is_held_while_its_kv_is_sent():
    connector = Recorder(hold=True)
    sched = Scheduler(CONFIG, connector=connector)
    sched.add(make("p", 7, max_tokens=1))
    run(sched, sched.schedule())
    request = sched.sending[0]
    assert request.status is Status.FINISHED_SENDING and connector.finished == ["p"]
    assert len(sched.block_ids("p")) == 2 and sched.num_unfinished == 0
    sched.finish_sending("p")
    assert request.status is Status.FINISHED and sched.kv.pool.num_used == 0 and not sched.requests


def test_a_remote_request_is_admitted_while_a_long_prompt_is_chunked():
    connector = Recorder()
    sched = Scheduler(CONFIG, connector=connector)
    sched.add(make("long", 30))
    run(sched, sched.schedule())  # first chunk
    sched.add(make("remote-1", 6))
    step = sched.schedule()
    assert [(r.request_id, r.num_past) for r in step.rows] == [("long", 8)]
    assert [rid for rid, _ in connector.allocated] == ["remote-1"]  # its transfer can start now


def test_remote_kv_fills_only_the_blocks_after_the_decode_sides_cached_prefix():
    from pdserve.engine.core.kv_connector import DecodeConnector, ReceiveKV

    connector = DecodeConnector(block_size=4, local_below=3)
    sched = Scheduler(EngineConfig(**{**CONFIG.__dict__, "max_num_batched_tokens": 16}), connector=connector)
    sched.add(make("turn1", 10, max_tokens=1))  # computed here (no connector expectation): cached
    run(sched, sched.schedule())
    for rid, prompt in [("turn2", [*range(10), 50, 51, 52, 53, 54, 55]), ("hit", [*range(8), 60, 61])]:
        connector.expect(rid, ReceiveKV())
        sched.add(make(rid, prompt))
    connector.expect("short", ReceiveKV())
    sched.add(make("short", [70, 71]))
    step = sched.schedule()
    ready = {t.request_id: t.num_external_tokens for t in connector.take_outputs()}
    # turn2: blocks 0-1 cached here, 8 tokens arrive; hit: 2 tokens left (<= a block): computed here,
    # after its cached head; short: below local_below
    assert ready == {"turn2": 8, "hit": 0, "short": 0}
    turn2 = sched.requests["turn2"]
    assert turn2.status is Status.WAITING_FOR_REMOTE_KV and turn2.num_computed == 8
    assert sched.block_ids("turn2")[:2] == sched.block_ids("hit")[:2]  # both share turn1's blocks
    assert [(r.request_id, r.num_past) for r in step.rows] == [("hit", 8), ("short", 0)]
    sched.remote_kv_failed("turn2")  # the fallback computes the rest here, after the cached prefix
    assert turn2.num_computed == 8 and turn2.status is Status.RUNNING


@pytest.mark.parametrize("windowed", [False, True])
def test_kv_received_for_sliding_window_layers_never_enters_the_prefix_cache(windowed):
    """Sliding-window layers receive only the window's blocks: a later prompt must not hit the rest."""
    sched = Scheduler(CONFIG, connector=Recorder(), windowed_transfers=windowed)
    sched.add(make("remote", 12, max_tokens=2))
    assert sched.schedule() is None
    sched.remote_kv_arrived("remote", SampledToken(7))
    run(sched, sched.schedule())  # its second token: finished
    hits = sched.kv.lookup([*range(12), 99])
    assert len(hits) == (0 if windowed else 3)


def test_blocks_out_of_every_sliding_window_are_given_back_as_a_request_advances():
    """Every layer attends within 8 tokens (2 blocks of 4). A 40-token prompt is admitted with its 10 blocks;
    they are given back as its 8-token chunks pass them, and its decode holds the window's blocks only."""
    sched = Scheduler(CONFIG, release_window=8)
    sched.add(make("long", 40, max_tokens=12))
    held = []  # blocks referenced before each step, and whether it is a decode step
    while sched.requests:
        step = sched.schedule()
        held.append((sched.kv.pool.num_used, len(step.rows[0].tokens) == 1))
        run(sched, step)
    prefill = [n for n, decode in held if not decode]
    assert prefill == [10, 10, 8, 6, 4]  # chunks end at 8, 16, ...: blocks before (computed - 8) / 4 go
    assert max(n for n, decode in held if decode) <= 8 // 4 + 1  # the window's blocks and the next token's
    assert sched.kv.pool.num_used == 0  # finishing gave back exactly the rest


def _forking(rid: str, prompt: int, n: int, max_tokens: int = 16) -> tuple[Request, list[Request]]:
    parent = Request(rid, list(range(prompt)), SamplingParams(n=n, max_tokens=max_tokens), 5)
    return parent, [parent.fork(i) for i in range(1, n)]


def test_a_first_token_of_n_sequences_forks_the_prompts_blocks():
    """n = 3, a prompt of 6 tokens in blocks of 4: the sequences share the full block (a reference each)
    and get their own copy of the partial one (a device copy each); each decodes on its own from there,
    with its own seed; admission counted their slots; everything is freed at the end."""
    sched = Scheduler(CONFIG)  # 3 sequence slots
    parent, children = _forking("p", 6, 3)
    assert [c.seed for c in children] == [6, 7] and parent.forks_pending
    sched.add(parent)
    sched.add(make("other", 3))
    step = sched.schedule()
    assert rows(step) == [("p", 0, 6, True)]  # n=3 takes every slot: "other" waits
    forks = tuple((c, SampledToken(t)) for c, t in zip(children, (2, 3), strict=True))
    got = sched.update_from_output(step, {"p": [SampledToken(1, forks=forks)]})
    assert [(r.request_id, t.token) for r, (t,) in got] == [("p", 1), ("p#1", 2), ("p#2", 3)]
    (head, tail), (_, copy), (_, copy2) = (sched.block_ids(r) for r in ("p", "p#1", "p#2"))
    assert sched.block_ids("p#1")[0] == sched.block_ids("p#2")[0] == head and len({tail, copy, copy2}) == 3
    assert sched.take_block_copies() == [(tail, copy), (tail, copy2)] and sched.take_block_copies() == []
    assert sched.kv.pool.ref_counts[head] == 3 and sched.kv.pool.ref_counts[copy] == 1
    assert not parent.forks_pending and sched.requests["p#1"].output_ids == [2]
    assert sched.requests["p#1"].num_computed == 6 and sched.requests["p#1"].status is Status.RUNNING
    step = sched.schedule()  # the three decode; "other" still waits
    assert sorted(rows(step)) == [("p", 6, 1, True), ("p#1", 6, 1, True), ("p#2", 6, 1, True)]
    row = next(r for r in step.rows if r.request_id == "p#1")
    assert row.tokens == [2] and row.block_tables.groups[0] == [head, copy]
    sched.abort("p")  # and its sequences
    assert not sched.requests.get("p#1") and sched.kv.pool.ref_counts[head] == 0
    sched.abort("other")
    sched.kv.pool.check()
    assert sched.kv.pool.num_used == 0


def test_forks_that_end_at_once_hold_nothing_and_a_short_pool_queues_them():
    """A sequence its first token ends (max_tokens 1, as on a prefill server) takes no blocks; when the
    pool has no block for a copy, the sequence is queued first as preempted, and recomputes its prompt
    (found in the prefix cache) and its first token."""
    sched = Scheduler(CONFIG)
    parent, children = _forking("p", 6, 3, max_tokens=1)
    sched.add(parent)
    step = sched.schedule()
    forks = tuple((c, SampledToken(3)) for c in children)
    got = sched.update_from_output(step, {"p": [SampledToken(1, forks=forks)]})
    assert [(r.request_id, r.finish_reason.value) for r, _ in got] == [("p", "length")] + [
        (f"p#{i}", "length") for i in (1, 2)
    ]
    assert not sched.requests and sched.take_block_copies() == [] and sched.kv.pool.num_used == 0

    config = EngineConfig(**{**CONFIG.__dict__, "num_blocks": 3})
    sched = Scheduler(config)
    parent, children = _forking("q", 6, 3)
    sched.add(parent)
    step = sched.schedule()  # q holds 2 of the 3 blocks: one copy fits, not two
    forks = tuple((c, SampledToken(2)) for c in children)
    sched.update_from_output(step, {"q": [SampledToken(1, forks=forks)]})
    late = sched.requests["q#2"]
    assert late.status is Status.PREEMPTED and late.num_computed == 0 and sched.waiting[0] is late
    assert late.output_ids == [2] and sched.kv.pool.num_used == 3
    assert len(sched.take_block_copies()) == 1


def test_n_past_the_free_slots_is_admitted_in_parts_and_its_forks_wait_behind_later_requests():
    """The fan-out policy (Scheduler._admit): a request of n = 3 with one free slot is admitted with the
    slots there are; its forks past them wait at the back of the queue with their first tokens, behind a
    request that arrived after it (which is admitted as soon as a slot frees), and then decode."""
    sched = Scheduler(CONFIG)  # 3 sequence slots
    sched.add(make("a", 3, t=0.0, max_tokens=2))
    sched.add(make("b", 3, t=0.1, max_tokens=8))
    first = sched.schedule()
    run(sched, first)  # a and b decode: one slot is free
    parent, children = _forking("p", 6, 3)
    parent.arrival_time = 0.2
    sched.add(parent)
    sched.add(make("late", 3, t=0.3))
    step = sched.schedule()
    assert ("p", 0, 6, True) in rows(step) and parent.fork_slots == 0  # admitted with the one free slot
    forks = tuple((c, SampledToken(t)) for c, t in zip(children, (2, 3), strict=True))
    sampled = {row.request_id: [SampledToken(1)] for row in step.rows if row.samples}
    sampled["p"] = [SampledToken(1, forks=forks)]
    sched.update_from_output(step, sampled)  # a ends (max_tokens 2): its slot goes to "late" first
    assert [r.request_id for r in sched.waiting] == ["late", "p#1", "p#2"]
    assert all(sched.requests[c].output_ids == [t] for c, t in (("p#1", 2), ("p#2", 3)))
    step = sched.schedule()
    assert "late" in {r.request_id for r in step.rows} and "p#1" not in {r.request_id for r in step.rows}
    for _ in range(40):  # everyone finishes, the forks included, each with its own first token first
        if not sched.requests:
            break
        run(sched, sched.schedule())
    assert not sched.requests and sched.kv.pool.num_used == 0


def test_forks_are_preempted_before_a_later_short_request():
    """Blocks run out: the sequences of the request holding the most are preempted first (its last fork
    first), not the newest request, which is the short one that came after the forks."""
    config = EngineConfig(**{**CONFIG.__dict__, "num_blocks": 7, "max_num_seqs": 4})
    sched = Scheduler(config)
    parent, children = _forking("p", 7, 3, max_tokens=16)  # 2 blocks, a partial one
    parent.arrival_time = 0.0
    sched.add(parent)
    step = sched.schedule()
    forks = tuple((c, SampledToken(t)) for c, t in zip(children, (2, 3), strict=True))
    sched.update_from_output(step, {"p": [SampledToken(1, forks=forks)]})
    sched.take_block_copies()
    sched.add(make("short", 3, t=1.0))
    run(sched, sched.schedule())  # p, p#1, p#2 decode; short is prefilled
    assert {"p", "p#1", "p#2", "short"} <= set(sched.requests)
    for _ in range(6):  # decodes fill the blocks until someone must give theirs back
        if sched.num_preemptions:
            break
        run(sched, sched.schedule())
    assert sched.num_preemptions and sched.requests["short"].status is Status.RUNNING
    assert sched.requests["p#2"].status is Status.PREEMPTED


def test_a_request_waits_for_its_host_tier_blocks_and_one_that_ends_meanwhile_frees_them():
    """Host tier hits (--kv-offloading-size): the request is admitted with them counted as computed, but
    has no row until the engine says its blocks are copied in (kv_loaded); ended before that, it holds
    nothing and is no longer waited for."""
    import dataclasses

    sched = Scheduler(dataclasses.replace(CONFIG, num_host_blocks=8))
    prompt = list(range(100, 113))  # 3 full blocks before the last token
    sched.add(make("a", prompt, max_tokens=1))
    while sched.requests:
        run(sched, sched.schedule())
    sched.add(make("flood", 61, t=1, max_tokens=1))  # 16 blocks: a's cached blocks are evicted
    while sched.requests:
        run(sched, sched.schedule())
    offloads = sched.kv.take_offloads()
    assert len(offloads) == 3
    sched.kv.offloads_landed([slot for _, slot in offloads])
    for rid, t in (("b", 2), ("c", 3)):
        sched.add(make(rid, prompt, t=t, max_tokens=1))
    step = sched.schedule()
    assert step is None and set(sched.loading) == {"b", "c"}  # both found a's blocks in the host tier
    assert [sched.requests[r].num_computed for r in "bc"] == [12, 12]
    loads = dict(sched.kv.take_loads())
    assert sorted(s for s, _ in loads["b"]) == sorted(slot for _, slot in offloads)
    numbers = dict(sched.loading)
    sched.abort("c")
    assert set(sched.loading) == {"b"}
    sched.kv_loaded(list(numbers.items()))
    assert rows(sched.schedule()) == [("b", 12, 1, True)]
    sched.kv.pool.check(), sched.kv.host.check()
