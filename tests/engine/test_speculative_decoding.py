"""Speculative decoding in the engine, on real weights: n-gram drafts and an EAGLE-3 head's (random
weights in the published format, favouring tokens the test model writes often) verified in the ragged
step give the tokens of decoding without them, greedy and seeded, whatever else the batch holds (a
chunked prompt, an adapter, a constraint, preemption), and end exactly where decoding without them ends
(a stop string or max_tokens inside a run of accepted drafts). The head's drafts depend on the tokens
only: alone or in a batch, its prompt in other chunks, they are the same."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import Constraint, SamplingParams
from pdserve.testing.eagle3 import eagle3_config
from pdserve.testing.lora import write_random_adapter

pytestmark = pytest.mark.model

# every draft verified: which drafts the "cost" policy verifies depends on this machine's speed
NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
    '"draft_policy": "all"}'
)
# 48 blocks of 16 (768 tokens): four prompts of ~150 tokens fit, 60 more tokens each do not (preemption)
SIZES = dict(max_loras=2, num_blocks=48)
QUOTE = "The quick brown fox jumps over the lazy dog. " * 3
LONG = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, " * 6  # > one step's budget


@pytest.fixture(scope="module")
def all_engines(make_engine, tmp_path_factory, loaded_model):
    """{None: without speculation, "ngram", "eagle3"}: the same sizes, the same adapter loaded in each."""
    adapter = write_random_adapter(
        tmp_path_factory.mktemp("adapter") / "a", loaded_model.config, rank=8, seed=1
    )
    eagle3 = eagle3_config(tmp_path_factory.mktemp("head") / "h", loaded_model)
    built = {
        None: make_engine(**SIZES),
        "ngram": make_engine(**SIZES, speculative_config=NGRAM),
        "eagle3": make_engine(**SIZES, speculative_config=eagle3),
    }
    for engine in built.values():
        if "a" not in engine.loras.adapters:
            engine.loras.load("a", str(adapter))
    return built


@pytest.fixture(params=["ngram", "eagle3"])
def engines(request, all_engines):
    """(without speculation, with the method's)."""
    return all_engines[None], all_engines[request.param]


def _runs(engine, prompt, params, **kwargs) -> tuple[list[list[int]], str, str]:
    """One request alone, step by step: the token runs of its outputs, its text and finish reason."""
    rid = engine.add_request(prompt, params, **kwargs)
    runs, text, finish = [], "", None
    while finish is None:
        for output in engine.step().tokens:
            if output.request_id == rid:
                runs.append(output.new_token_ids)
                text += output.text
                finish = output.finish_reason and output.finish_reason.value
    return runs, text, finish


def _generate(engine, prompts, params, lora=None):
    return [(o.token_ids, o.text, o.finish_reason) for o in engine.generate(prompts, params, lora=lora)]


def test_greedy_and_seeded_outputs_equal_decoding_without_speculation(engines):
    """One batch: a quoting prompt, a chunked long one, one on an adapter, one under a regex whose end
    refuses the drafts that follow, and seeded samples of each; then four long requests that outgrow the
    blocks (preemption). Every output equals the engine's without speculation, and drafts were accepted."""
    plain, spec = engines
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    regex = Constraint("regex", r"(1, 2, 3, ){3}4")
    prompts = [QUOTE, LONG, QUOTE, "1, 2, 3, 1, 2, 3, 1, 2, 3,"]
    params = [greedy, greedy, greedy, SamplingParams(temperature=0, max_tokens=40, constraint=regex)]
    lora = [None, None, "a", None]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
    prompts, params, lora = prompts * 2, params + [seeded] * 3 + [params[3]], lora * 2
    before = spec.scheduler.drafts.stats.num_accepted_tokens
    expected = _generate(plain, prompts, params, lora)
    assert _generate(spec, prompts, params, lora) == expected
    assert expected[3][1] == "1, 2, 3, 1, 2, 3, 1, 2, 3, 4" or expected[3][2] == "constraint_dead_end"
    assert spec.scheduler.drafts.stats.num_accepted_tokens > before

    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [f"{i}: " + LONG[: 150 + 5 * i] for i in range(4)]  # ~150 tokens: all fit, not grown
    preempted = spec.scheduler.num_preemptions
    assert _generate(spec, prompts, long) == _generate(plain, prompts, long)
    assert spec.scheduler.num_preemptions > preempted
    for engine in engines:
        assert engine.scheduler.kv.pool.num_used == 0
        engine.scheduler.kv.pool.check()


def test_a_stop_string_or_max_tokens_inside_an_accepted_run_ends_where_it_would_without(engines):
    """Runs of several accepted tokens; a stop string that completes inside one, and max_tokens that
    falls inside one, end the output at that token, as without speculation (the run's tokens after it
    are neither shown nor kept)."""
    plain, spec = engines
    free = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs, _, _ = _runs(spec, QUOTE, free)
    assert max(len(r) for r in runs) >= 2, runs

    tokens = [t for r in runs for t in r]
    ends = [sum(len(r) for r in runs[: i + 1]) for i in range(len(runs))]  # output index after each run
    tokenizer = spec.tokenizer
    cut_inside = 0
    for end, run in [(e, r) for e, r in zip(ends, runs, strict=True) if len(r) >= 2][:3]:
        last = end - len(run)  # the run's first token (index in the output): the rest is cut
        stop = tokenizer.decode(tokens[: last + 1])  # the text so far: it first completes at that token
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=(stop,))
        got, expected = _runs(spec, QUOTE, params), _runs(plain, QUOTE, params)
        assert (sum(got[0], []), got[1], got[2]) == (sum(expected[0], []), expected[1], expected[2])
        shown = len(sum(got[0], []))
        cut_inside += any(e - len(r) < shown < e for e, r in zip(ends, runs, strict=True))
        length = SamplingParams(temperature=0, max_tokens=last + 1, ignore_eos=True)
        got, expected = _runs(spec, QUOTE, length), _runs(plain, QUOTE, length)
        assert (sum(got[0], []), got[1], got[2]) == (sum(expected[0], []), expected[1], "length")
    assert cut_inside, "no stop string completed inside a run"


def test_a_draft_heads_drafts_depend_on_the_tokens_only(all_engines, monkeypatch):
    """The EAGLE-3 head's drafts after each sequence of tokens, from prompts run alone and then together
    with others (other steps, other chunks of the long prompt, other rows around them, the prompts' blocks
    from the prefix cache): wherever both runs drafted after the same tokens, the drafts are the same."""
    spec = all_engines["eagle3"]
    drafted: dict[tuple[int, ...], list[int]] = {}
    run = type(spec.drafter)._run

    def record(self, spans, num_tokens, aux):
        proposed = run(self, spans, num_tokens, aux)
        for span in spans:
            if span.propose:
                drafted[tuple(span.request.all_ids)] = proposed[span.request.request_id]
        return proposed

    monkeypatch.setattr(type(spec.drafter), "_run", record)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [QUOTE, LONG, "Once upon a time"]
    for prompt in prompts:
        _generate(spec, [prompt], greedy)
    alone, drafted = drafted, {}
    _generate(spec, ["1, 2, 3, 1, 2, 3", *prompts, "Hello there"], greedy)
    common = alone.keys() & drafted.keys()
    assert len(common) >= 20, len(common)
    assert {k: drafted[k] for k in common} == {k: alone[k] for k in common}
    assert max(map(len, alone.values())) == 3  # (fewer near max_tokens)
