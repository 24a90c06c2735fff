"""The OpenAI API as vLLM serves it, driven by the official openai client against the shared decode server
(every prompt prefilled by the prefill server) and compared with the colocated engine where the request is
deterministic: served names and 404s, content parts, the final usage chunk, several prompts in one call,
echo, structured_outputs, the chat template's arguments, tokenize / detokenize, fields refused by name.
Conformance written from the OpenAI API reference and vLLM's documented behaviour."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from pdserve.testing.launch import scrape

pytestmark = pytest.mark.daemon

GREEDY = dict(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def http(decode, openai):
    return openai.OpenAI(base_url=f"http://{decode.addresses['http']}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(http):
    return http.models.list().data[0].id


def call(decode, path: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET (no body) or POST to the decode server's HTTP port."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{decode.addresses['http']}{path}", data=data)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_served_names_and_models_that_are_not(http, model, decode, model_path, openai):
    """The served name (by default --model as given) is the first card and what responses carry; a model
    not served is vLLM's 404; /v1/models/{id} answers for each card; /version and /health answer."""
    assert model == str(model_path)
    card = http.models.retrieve(model)
    assert card.id == model and card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError):
        http.models.retrieve("not-served")
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4o` does not exist"):
        http.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
    assert http.completions.create(model=model, prompt="Hi", **GREEDY).model == model
    assert call(decode, "/version")[1]["version"] and call(decode, "/health") == (200, {"status": "ok"})


def test_content_parts_are_the_text_joined_by_newlines(http, model, colocated, loaded_model, openai):
    """What `vllm bench serve --backend openai-chat` and guidellm send: content as a list of text parts,
    answered as the same text joined with newlines would be, and as the colocated engine answers it;
    an image part is refused naming messages."""
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    joined = "What is the capital\nof France?"
    ids = loaded_model.tokenizer.encode_chat([{"role": "user", "content": joined}])
    expected = colocated(ids, max_tokens=6, field="text")
    for content in (parts, joined):
        reply = http.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], **GREEDY
        )
        assert reply.choices[0].message.content == expected and reply.object == "chat.completion"
    image = [*parts, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    with pytest.raises(openai.BadRequestError, match="image_url") as err:
        http.chat.completions.create(model=model, messages=[{"role": "user", "content": image}], **GREEDY)
    assert err.value.body["param"] == "messages"


def test_streams_end_with_a_usage_chunk_of_no_choices(http, model, colocated, loaded_model, decode):
    """stream_options.include_usage: the token chunks carry no usage and a last chunk of no choices
    carries it (what vLLM's benchmark client reads); continuous_usage_stats: every chunk carries its
    choice's so far; stream_options without stream is refused."""
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = loaded_model.tokenizer.encode_chat(messages)
    expected = colocated(ids, max_tokens=6, ignore_eos=True, field="text")
    for create, kw in (
        (http.chat.completions.create, dict(messages=messages)),
        (http.completions.create, dict(prompt=ids)),
    ):
        chunks = list(
            create(
                model=model,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
                **kw,
                **GREEDY,
            )
        )
        *tokens, last = chunks
        assert (
            last.choices == [] and last.usage.completion_tokens == 6 and last.usage.prompt_tokens == len(ids)
        )
        assert all(c.usage is None for c in tokens)
        text = "".join(
            (c.choices[0].delta.content or "") if "messages" in kw else c.choices[0].text for c in tokens
        )
        assert text == expected
    running = list(
        http.completions.create(
            model=model,
            prompt=ids,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            **GREEDY,
        )
    )
    assert [c.usage.completion_tokens for c in running] == [1, 2, 3, 4, 5, 6, 6]
    status, body = call(decode, "/v1/completions", {"model": model, "prompt": "Hi", "stream_options": {}})
    assert status == 400 and body["error"]["param"] == "stream_options"


def test_several_prompts_in_one_call_are_choices_in_order(http, model, colocated, loaded_model):
    """A list of prompts (strings and token ids; what lm-evaluation-harness batches): a choice each,
    indexed in the prompts' order, each the colocated engine's answer; usage summed; streamed too."""
    texts = ["The sky is", "Once upon a time, in a land far away,", "1, 2, 3,"]
    prompts = [texts[0], loaded_model.tokenizer.encode(texts[1]), texts[2]]
    expected = [colocated(p, max_tokens=6, ignore_eos=True, field="text") for p in prompts]
    reply = http.completions.create(model=model, prompt=prompts, extra_body={"ignore_eos": True}, **GREEDY)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == expected and reply.usage.completion_tokens == 18
    streamed = ["", "", ""]
    for chunk in http.completions.create(
        model=model, prompt=prompts, stream=True, extra_body={"ignore_eos": True}, **GREEDY
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected


def test_echo_puts_the_prompt_before_the_completion(http, model, colocated, loaded_model):
    prompt = "The capital of France is"
    completion = colocated(prompt, max_tokens=6, field="text")
    assert (
        http.completions.create(model=model, prompt=prompt, echo=True, **GREEDY).choices[0].text
        == prompt + completion
    )
    ids = loaded_model.tokenizer.encode(prompt)
    alone = http.completions.create(model=model, prompt=ids, echo=True, max_tokens=0)
    assert alone.choices[0].text == loaded_model.tokenizer.decode(ids)
    streamed = "".join(
        c.choices[0].text
        for c in http.completions.create(model=model, prompt=prompt, echo=True, stream=True, **GREEDY)
    )
    assert streamed == prompt + completion


def test_structured_outputs_and_their_deprecated_guided_aliases(http, model):
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        reply = http.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Is water wet?"}], extra_body=extra, **GREEDY
        )
        assert reply.choices[0].message.content in ("yes", "no")


def test_the_chat_templates_arguments(decode, model, loaded_model):
    """add_generation_prompt and continue_final_message render as the template renders them (an open last
    message, to be continued); both at once are refused; chat_template_kwargs reach the template."""
    tokenizer = loaded_model.tokenizer
    messages = [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Autumn moon"},
    ]
    status, rendered = call(
        decode,
        "/v1/chat/completions/render",
        {
            "model": model,
            "messages": messages,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert status == 200 and rendered["token_ids"] == tokenizer.encode(
        text[: text.rindex("Autumn moon") + 11]
    )
    status, rendered = call(
        decode,
        "/v1/chat/completions/render",
        {"model": model, "messages": messages[:1], "add_generation_prompt": False},
    )
    assert rendered["token_ids"] == tokenizer.encode(
        tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False)
    )
    status, body = call(
        decode, "/v1/chat/completions", {"model": model, "messages": messages, "continue_final_message": True}
    )
    assert status == 400 and body["error"]["param"] == "continue_final_message"
    status, body = call(
        decode,
        "/v1/chat/completions/render",
        {"model": model, "messages": messages[:1], "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert status == 200
    status, body = call(
        decode,
        "/v1/chat/completions",
        {"model": model, "messages": messages[:1], "chat_template_kwargs": {"tokenize": True}},
    )
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"


def test_tokenize_and_detokenize(decode, model, loaded_model):
    tokenizer = loaded_model.tokenizer
    status, body = call(
        decode, "/tokenize", {"model": model, "prompt": "Hello world", "return_token_strs": True}
    )
    ids = tokenizer.encode("Hello world")
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] > 0
    assert body["token_strs"] == [tokenizer.id_to_token(t) for t in ids]
    messages = [{"role": "user", "content": "Hi"}]
    assert call(decode, "/tokenize", {"messages": messages})[1]["tokens"] == tokenizer.encode_chat(messages)
    assert call(decode, "/detokenize", {"tokens": ids}) == (200, {"prompt": "Hello world"})
    status, body = call(decode, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and body["error"]["param"] == "tokens"
    assert call(decode, "/tokenize", {"model": "other", "prompt": "x"})[0] == 404


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"n": 0}, "n"),
        ({"n": 33}, "n"),  # more than the decode server's max_num_seqs decode together
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_fields_not_served_yet_are_refused_by_name(decode, model, extra, field):
    status, body = call(decode, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2, **extra})
    assert status == 400 and body["error"]["param"] == field


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(
    http, model, decode, prefill, make_engine, loaded_model, openai
):
    """lm-evaluation-harness's loglikelihood request (token-id prompts, echo, logprobs 1, max_tokens 1):
    one Prefill call, whose trailer carries the prompt's logprobs; they equal the colocated engine's, the
    first position null, each position's top_logprobs its own token first (lm-eval's is_greedy reads
    them). vLLM's prompt_logprobs extension and gRPC's carry the same; not with stream."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.services.client import Client

    tokenizer = loaded_model.tokenizer
    contexts = [tokenizer.encode("The capital of France is Paris"), tokenizer.encode("One, two, three, four")]
    (expected_a, expected_b) = make_engine().generate(
        contexts, SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    )
    calls = Client(prefill.address).stats().num_requests_total
    reply = http.completions.create(
        model=model, prompt=contexts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    assert Client(prefill.address).stats().num_requests_total == calls + 2  # one Prefill call a prompt
    for choice, ids, expected in zip(reply.choices, contexts, (expected_a, expected_b), strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = lp.token_logprobs[1 : len(ids)]
        want = [e.logprob for e in expected.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
        for i in range(1, len(ids)):
            token = tokenizer.decode([ids[i]])
            assert (
                next(iter(lp.top_logprobs[i])) == token and lp.top_logprobs[i][token] == lp.token_logprobs[i]
            )
        assert choice.text.startswith(tokenizer.decode(ids)) and lp.tokens[-1] == tokenizer.decode(
            expected.token_ids
        )
    extension = http.completions.create(
        model=model, prompt=contexts[0], max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = extension.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(contexts[0])
    for entry, want in zip(entries[1:], expected_a.prompt_logprobs[1:], strict=True):
        own = entry[str(want.token_id)]
        assert own["rank"] == want.rank and abs(own["logprob"] - want.logprob) < 1e-4 and len(entry) <= 3
    streamed = Client(decode.address).generate(contexts[0], max_tokens=1, prompt_logprobs=1)
    assert [(e.token_id, e.rank) for e in streamed.prompt_logprobs] == [
        (e.token_id, e.rank) for e in expected_a.prompt_logprobs[1:]
    ]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        http.completions.create(
            model=model, prompt="Hi", max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        )


def test_logit_bias_forces_and_bans_the_first_token_too(http, model, colocated, loaded_model):
    """The first token is the prefill server's: a bias forcing a token, and one banning the greedy first
    token, give the colocated engine's tokens (OpenAI's string keys)."""
    prompt = loaded_model.tokenizer.encode("The capital of France is")
    forced = loaded_model.tokenizer.encode(" banana")[0]
    reply = http.completions.create(model=model, prompt=prompt, logit_bias={str(forced): 100}, **GREEDY)
    assert reply.choices[0].text == loaded_model.tokenizer.decode([forced] * 6)
    first = colocated(prompt, max_tokens=6)[0]
    banned = http.completions.create(model=model, prompt=prompt, logit_bias={str(first): -100}, **GREEDY)
    expected = colocated(prompt, max_tokens=6, logit_bias=((first, -100.0),), field="text")
    assert banned.choices[0].text == expected and not banned.choices[0].text.startswith(
        loaded_model.tokenizer.decode([first])
    )


def test_metrics_on_the_http_port_count_tokens_and_queue_time(http, model, decode):
    """/metrics on the API port (no token needed): vLLM's token counters and queue time, pdserve's names."""
    reply = http.completions.create(
        model=model, prompt="Count: one, two,", extra_body={"ignore_eos": True}, **GREEDY
    )
    with urllib.request.urlopen(f"http://{decode.addresses['http']}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {
        line.split(" ")[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["pdserve_generation_tokens_total"] >= reply.usage.completion_tokens == 6
    assert values["pdserve_prompt_tokens_total"] >= reply.usage.prompt_tokens
    assert values["pdserve_request_queue_time_seconds_count"] >= 1 and "pdserve_preemptions_total" in values


def test_n_choices_cost_one_prefill_and_are_the_colocated_sequences(
    http, model, colocated, loaded_model, prefill, decode
):
    """n = 4, seeded: one Prefill call and one KV transfer (the prefill server samples the four first
    tokens, the decode server forks the KV); choice i is what the colocated engine samples with seed + i;
    the prompt counts once in the usage. Streamed, the choices interleave under their indexes."""
    prompt = loaded_model.tokenizer.encode("Once upon a time, in a land far away, there lived a king who had")
    knobs = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    expected = [colocated(prompt, seed=5 + i, field="text", **knobs) for i in range(4)]
    prefills = scrape(prefill.addresses["metrics"])["pdserve_prefill_duration_seconds_count"]
    transfers = scrape(decode.addresses["metrics"])['pdserve_kv_transfers_total{role="decode"}']
    reply = http.completions.create(
        model=model,
        prompt=prompt,
        n=4,
        seed=5,
        temperature=1.0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert scrape(prefill.addresses["metrics"])["pdserve_prefill_duration_seconds_count"] == prefills + 1
    assert scrape(decode.addresses["metrics"])['pdserve_kv_transfers_total{role="decode"}'] == transfers + 1
    assert [c.index for c in reply.choices] == [0, 1, 2, 3] and [c.text for c in reply.choices] == expected
    assert len(set(expected)) > 1
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 32
    streamed = [""] * 4
    for chunk in http.completions.create(
        model=model,
        prompt=prompt,
        n=4,
        seed=5,
        stream=True,
        temperature=1.0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected
    chat = http.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], n=2, temperature=0, max_tokens=4
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message == chat.choices[1].message


def test_reasoning_is_split_out_of_the_content(http, model):
    """--reasoning-parser qwen3 (the shared server's): an output that starts with <think> has its thinking
    in `reasoning`, whole and streamed (the output is forced by a choice constraint: the test model does
    not think); one that does not is all content."""
    thought, answer = "The user greets me.", "Hello there!"
    forced = {"structured_outputs": {"choice": [f"<think>{thought}</think>{answer}"]}}
    messages = [{"role": "user", "content": "Hi"}]
    reply = http.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0, extra_body=forced
    )
    message = reply.choices[0].message
    assert (message.model_extra["reasoning"], message.content) == (thought, answer)
    reasoning, content = "", ""
    for chunk in http.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0, extra_body=forced, stream=True
    ):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (thought, answer)
    plain = http.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0, extra_body={"guided_choice": [answer]}
    )
    assert (
        plain.choices[0].message.content == answer
        and plain.choices[0].message.model_extra["reasoning"] is None
    )


def test_allowed_token_ids_and_bad_words_hold_from_the_first_token(http, model, colocated, loaded_model):
    """The first token is the prefill server's: allowed_token_ids without the greedy first token, and
    bad_words naming it, give the colocated engine's tokens."""
    tokenizer = loaded_model.tokenizer
    prompt = tokenizer.encode("The capital of France is")
    first = colocated(prompt, max_tokens=6)[0]
    allowed = [first + 1, 13, 28]
    reply = http.completions.create(
        model=model, prompt=prompt, extra_body={"allowed_token_ids": allowed}, **GREEDY
    )
    expected = colocated(prompt, max_tokens=6, allowed_token_ids=tuple(allowed), field="text")
    assert reply.choices[0].text == expected
    assert set(colocated(prompt, max_tokens=6, allowed_token_ids=tuple(allowed))) <= set(allowed)
    word = tokenizer.decode([first])
    reply = http.completions.create(model=model, prompt=prompt, extra_body={"bad_words": [word]}, **GREEDY)
    assert reply.choices[0].text == colocated(prompt, max_tokens=6, bad_words=(word,), field="text")
    assert first not in colocated(prompt, max_tokens=6, bad_words=(word,))


def test_a_constraint_after_the_reasoning_starts_on_the_decode_side(decode, colocated, loaded_model):
    """reasoning_end over gRPC, disaggregated: the prefill server's first token is free when it is still
    reasoning (here it is the marker itself), and the decode server constrains the rest: the colocated
    engine's tokens."""
    from pdserve.engine.sampling_params import Constraint
    from pdserve.services.client import Client

    prompt = loaded_model.tokenizer.encode("The capital of France is")
    first = colocated(prompt, max_tokens=4, ignore_eos=True)[0]
    kw = dict(max_tokens=12, constraint=Constraint("choice", choices=("yes", "no")), reasoning_end=(first,))
    expected = colocated(prompt, **kw)
    client = Client(decode.address)
    try:
        got = client.generate(prompt, **kw)
    finally:
        client.close()
    assert got.token_ids == expected and expected[0] == first
    assert loaded_model.tokenizer.decode(expected[1:], skip_special_tokens=True) in ("yes", "no")
