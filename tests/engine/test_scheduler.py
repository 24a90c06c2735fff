"""Scheduling and admission without JAX: requests are plain objects, steps are simulated."""

import pytest

from engine.block_manager import BlockAllocator, BlockTable
from engine.config import EngineConfig
from engine.request import Request, Status
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

pytestmark = pytest.mark.fast

CONFIG = EngineConfig(
    block_size=4, num_blocks=16, max_num_seqs=3, max_model_len=64, max_prefill_tokens=8, max_prefill_seqs=2
)


def make(alloc, rid, prompt_len, t=0.0):
    return Request(rid, list(range(prompt_len)), SamplingParams(), 0, BlockTable(alloc, 4), arrival_time=t)


def run_prefill(sched, step):
    for chunk in step.prefill:
        chunk.request.num_computed += chunk.length
        if chunk.samples:
            chunk.request.output_ids.append(1)
            sched.promote(chunk.request)


def test_prefill_batches_short_prompts_then_alternates_with_decode():
    alloc = BlockAllocator(CONFIG.num_blocks)
    sched = Scheduler(CONFIG, alloc)
    for i in range(3):
        sched.add(make(alloc, f"r{i}", 5, t=i))
    step = sched.schedule()
    assert [c.request.request_id for c in step.prefill] == ["r0", "r1"]  # max_prefill_seqs
    run_prefill(sched, step)
    step = sched.schedule()
    assert [r.request_id for r in step.decode] == ["r0", "r1"]  # decode gets its turn
    for r in step.decode:
        r.num_computed += 1
    step = sched.schedule()
    assert [c.request.request_id for c in step.prefill] == ["r2"]


def test_long_prompt_is_chunked_one_request_per_continued_step():
    alloc = BlockAllocator(CONFIG.num_blocks)
    sched = Scheduler(CONFIG, alloc)
    sched.add(make(alloc, "long", 20))
    sched.add(make(alloc, "short", 3))
    step = sched.schedule()
    assert [(c.request.request_id, c.start, c.length) for c in step.prefill] == [
        ("long", 0, 8),
        ("short", 0, 3),
    ]
    assert not step.prefill[0].samples and step.prefill[1].samples
    run_prefill(sched, step)
    step = sched.schedule()
    assert step.decode  # the short one decodes between chunks
    for r in step.decode:
        r.num_computed += 1
    step = sched.schedule()
    assert [(c.request.request_id, c.start, c.length) for c in step.prefill] == [("long", 8, 8)]


def test_admission_waits_for_blocks_and_seq_limit():
    alloc = BlockAllocator(4)  # 16 tokens of cache
    sched = Scheduler(CONFIG, alloc)
    sched.add(make(alloc, "a", 12))
    sched.add(make(alloc, "b", 8))  # does not fit while a holds 3 blocks
    step = sched.schedule()
    assert [c.request.request_id for c in step.prefill] == ["a"]
    assert alloc.num_free == 1 and list(sched.waiting)[0].request_id == "b"


def test_decode_preempts_the_newest_request_when_blocks_run_out():
    alloc = BlockAllocator(4)
    sched = Scheduler(CONFIG, alloc)
    old, new = make(alloc, "old", 8, t=0), make(alloc, "new", 8, t=1)
    sched.add(old)
    sched.add(new)
    run_prefill(sched, sched.schedule())
    assert alloc.num_free == 0
    step = sched.schedule()  # both need a 3rd block for token 9: only preempting "new" frees one
    assert [r.request_id for r in step.decode] == ["old"]
    assert new.status is Status.WAITING and new.num_computed == 0 and sched.waiting[0] is new
    sched.remove(old)
    sched.remove(new)
    assert alloc.num_free == 4
