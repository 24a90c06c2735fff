"""A failure pinned to one request ends that request alone (FinishReason.ERROR); the others of its batch
finish with the tokens they would have had. The engine is tests/faulty_engine.py's: the real one, built
to fail on purpose. (What a daemon does when the whole engine is broken:
tests/services/test_supervision.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.core.request import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from tests.faulty_engine import ONCE, PINNED, FaultyEngine

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The three primary colours are", "def quicksort(xs):", "1, 2, 3, 4,"]


def test_a_failure_pinned_to_one_request_ends_it_alone(loaded_model, small_config, make_engine):
    engine = FaultyEngine(loaded_model, small_config)
    pinned = dataclasses.replace(GREEDY, stop=(PINNED,))
    results = engine.generate(PROMPTS, [GREEDY, pinned, GREEDY])
    assert [r.finish_reason for r in results] == ["length", FinishReason.ERROR.value, "length"]
    assert len(results[1].token_ids) == 1  # its second token failed in its stream: nothing of it is shown
    reference = make_engine().generate([PROMPTS[0], PROMPTS[2]], GREEDY)
    assert [results[0].token_ids, results[2].token_ids] == [r.token_ids for r in reference]
    assert not engine.has_unfinished and engine.scheduler.kv.pool.num_used == 0
    # and the engine serves on
    assert engine.generate([PROMPTS[1]], GREEDY)[0].finish_reason == "length"


def test_a_failed_step_ends_its_requests_and_the_engine_serves_on(loaded_model, small_config, make_engine):
    """As services.engine_loop drives it: a step that raises is followed by fail_step, which ends the
    requests of that step with FinishReason.ERROR and frees their blocks; a request added afterwards runs
    to the colocated engine's tokens."""
    engine = FaultyEngine(loaded_model, small_config)
    ids = [engine.add_request(PROMPTS[0], GREEDY), engine.add_request(PROMPTS[1], replace_stop(ONCE))]
    finished = {}
    while engine.has_unfinished:
        try:
            outputs = engine.step().tokens
        except RuntimeError as e:
            outputs = engine.fail_step(str(e)).tokens
        finished.update((o.request_id, o) for o in outputs if o.finished)
    assert [finished[i].finish_reason for i in ids] == [FinishReason.ERROR] * 2  # one step ran both
    assert "injected: one step failed" in finished[ids[1]].error
    assert engine.scheduler.kv.pool.num_used == 0
    (after,) = engine.generate([PROMPTS[2]], GREEDY)
    assert after.token_ids == make_engine().generate([PROMPTS[2]], GREEDY)[0].token_ids


def replace_stop(marker: str) -> SamplingParams:
    return dataclasses.replace(GREEDY, stop=(marker,))
