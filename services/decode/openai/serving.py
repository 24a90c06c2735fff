"""What the two generation endpoints share (vLLM's OpenAIServing): a call's way through the server. Its
body is read and checked, its request id, deadline and prefill hint taken from the headers, its engine
requests prepared off the event loop, and its outputs streamed (streams.send_events) or collected into
one answer, rendered on a worker thread. Each endpoint fills in the same interface (`Serving`):
chat.ChatServing and completions.CompletionServing."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.services.decode.core import PREFILL_HINT_HEADER, GenerationCore
from pdserve.services.decode.errors import ServiceError
from pdserve.services.decode.openai import protocol, responses, streams
from pdserve.services.decode.openai.models import ModelNotFound, ServedModels
from pdserve.services.decode.tools import ToolChoice
from pdserve.services.tracing import TRACEPARENT

REQUEST_ID_HEADER = "X-Request-Id"  # the client's id of the request: in the log line (vLLM's header)
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds the client will wait (at most the server's --http-timeout)
# The seed each prompt's request samples with (its own, or one drawn here), comma-separated in prompt order:
# what a proxy resends with `resume_token_ids` to resume a broken stream elsewhere exactly (docs/usage.md)
SEED_HEADER = "X-Pdserve-Seed"

REFUSALS = (ModelNotFound, InvalidRequestError, ServiceError)  # what a handler answers with an error


def refusal(e: Exception) -> web.Response:
    """The HTTP answer to one of REFUSALS: vLLM's 404 for a model not served, 400 / 404 naming a field,
    or the status of a service error."""
    if isinstance(e, ModelNotFound):
        return responses.model_not_found(str(e))
    if isinstance(e, InvalidRequestError):
        return responses.invalid(e)
    return responses.service_error(e)


async def json_body(request: web.Request) -> dict | web.Response:
    """The request's JSON object with its keys of the right types, or the 400 response saying why not."""
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
    except RecursionError:
        return responses.error(400, "invalid JSON: nested too deeply", "invalid_request_error")
    except ValueError as e:
        return responses.error(400, f"invalid JSON: {e}", "invalid_request_error")
    try:
        protocol.check_types(body)
        protocol.check_fields(body)
    except InvalidRequestError as e:
        return responses.invalid(e)
    return body


@dataclasses.dataclass
class Call:
    """One HTTP call's engine requests (one per prompt, of `n` choices each) and its body; each endpoint
    adds what its answer needs (chat.ChatCall, completions.CompletionCall)."""

    body: dict
    requests: list[Request]
    model: str  # the name the answer carries

    @property
    def n(self) -> int:
        """Choices per prompt (the body's n)."""
        return self.requests[0].params.n


@dataclasses.dataclass
class Collected:
    """What a non-streamed call collected, each list by choice (prompt by prompt, its n sequences each)."""

    finals: list[RequestOutput | None]  # each choice's last output (None: it did not finish)
    texts: list[list[str]]
    logprobs: list[list]
    prompt_lps: list  # each choice's prompt logprobs (the n choices of a prompt share one list)
    token_ids: list[list[int]]  # each choice's generated token ids (`return_token_ids`)


class Serving(abc.ABC):
    """One generation endpoint: `create` answers a call, `render` gives its prompts' token ids. A subclass
    says how a body becomes the call's engine requests (`prepare`, `engine_request`) and how its answer
    looks (`choices`, `choice_stream`, `rendered`). `sampling_defaults`: the sampling parameters a request
    that does not set them gets; `timeout_s`: a call's deadline unless its TIMEOUT_HEADER asks for less."""

    id_prefix: str  # of the ids of the answers
    object: str  # the answer's object
    chunk_object: str  # a streamed chunk's object
    chat: bool  # whether bodies are chats (protocol's defaults differ)

    def __init__(
        self,
        service: GenerationCore,
        models: ServedModels,
        sampling_defaults: Mapping[str, Any],
        timeout_s: float,
    ):
        self.service = service
        self.models = models
        self.sampling_defaults = sampling_defaults
        self.timeout_s = timeout_s

    # ---- what each endpoint says ---------------------------------------------------------------------
    @abc.abstractmethod
    async def prepare(self, body: dict, label: str) -> Call:
        """The call's engine requests, each tokenized (and its constraint compiled) off the event loop
        (GenerationCore.prepare); `label`: the client's id of the call."""

    @abc.abstractmethod
    def engine_request(self, body: dict, label: str = "") -> tuple[Request, ToolChoice | None]:
        """The engine request of a one-choice body (its first prompt) and its tools; CPU work by the size
        of the body: run it through GenerationCore.prepare."""

    @abc.abstractmethod
    def choices(self, call: Call, got: Collected, decode: Callable[[list[int]], str]) -> list[dict]:
        """A non-streamed answer's choices, from what the call collected."""

    def answer_fields(self, call: Call, got: Collected, decode: Callable[[list[int]], str]) -> dict:
        """Fields of a non-streamed answer after its usage (none here)."""
        return {}

    @abc.abstractmethod
    def choice_stream(self, call: Call, index: int, decode: Callable) -> streams.ChoiceStream:
        """The chunks of choice `index` of a streamed answer."""

    @abc.abstractmethod
    def rendered(self, prompts: list[dict]) -> dict | list:
        """The render endpoint's answer, from each prompt's {model, token_ids}."""

    # ---- the way through, the same for both -----------------------------------------------------------
    async def create(self, request: web.Request) -> web.StreamResponse:
        """Answers a generation call, streamed (`stream`) or whole."""
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        rid = self.id_prefix + uuid.uuid4().hex
        try:
            label = self.service.config.limits.check_request_id(
                request.headers.get(REQUEST_ID_HEADER, rid), REQUEST_ID_HEADER
            )
            timeout_s = self.timeout(request)
            hint = self.service.prefill_hint(request.headers.get(PREFILL_HINT_HEADER))
            self.models.check(body)
            self.precheck(body)
            call = await self.prepare(body, label)
        except REFUSALS as e:
            return refusal(e)
        traceparent = request.headers.get(TRACEPARENT)  # (the caller's span: services.tracing)
        outputs = [
            streams.until(self.service.stream(r, timeout_s, hint, label, traceparent=traceparent), timeout_s)
            for r in call.requests
        ]
        headers = {SEED_HEADER: ",".join(str(r.seed) for r in call.requests)}
        if body.get("stream"):
            decode = responses.memoized(self.service.engine.tokenizer.decode)
            return await streams.send_events(
                request,
                streams.merged(outputs, call.n),
                rid,
                self.chunk_object,
                call.model,
                body.get("stream_options") or {},
                lambda index: self.choice_stream(call, index, decode),
                headers,
                bool(body.get("return_token_ids")),
            )
        response = await self._complete(outputs, rid, call)
        response.headers.update(headers)
        return response

    async def render(self, request: web.Request) -> web.Response:
        """The prompts' token ids as a generation would compute them: the same parsing, validation and
        tokenizer (chat template included), through the engine's own make_request, off the event loop
        and admission-bounded like a generation; nothing is queued."""
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            self.models.check(body)
            self.precheck(body)
            call = await self.prepare(body, "")
        except REFUSALS as e:
            return refusal(e)
        return web.json_response(
            self.rendered([{"model": call.model, "token_ids": list(r.prompt_ids)} for r in call.requests])
        )

    def timeout(self, request: web.Request) -> float:
        """The request's deadline in seconds: TIMEOUT_HEADER when it asks for less than the server's."""
        value = request.headers.get(TIMEOUT_HEADER)
        if value is None:
            return self.timeout_s
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds < float("inf"):
            raise InvalidRequestError(TIMEOUT_HEADER, f"{value!r} is not a positive number of seconds")
        return min(seconds, self.timeout_s)

    def precheck(self, body: dict) -> None:
        """The checks that cost next to nothing (the sampling knobs, the resumption's shape), on the event
        loop: a bad body is refused before it waits for a preparation thread."""
        self.service.check_params(protocol.knobs(body, self.chat, self.sampling_defaults))
        protocol.check_resumption(body)

    def sampling_params(self, body: dict) -> SamplingParams:
        """The body's sampling parameters, constraint included (protocol.sampling_params)."""
        return protocol.sampling_params(body, self.chat, self.sampling_defaults)

    def make_request(self, body: dict, prompt, params, label: str, forced: bool) -> Request:
        """The engine request of `prompt` (text or ids) under `params`, with the body's adapter and cache
        salt; a constraint that does not compile is refused naming the body key it came from (`forced`: a
        tool call's, tool_choice)."""
        try:
            adapter, salt = self.models.adapter(body), body.get("cache_salt") or ""
            resumed = body.get("resume_token_ids") or ()
            return self.service.make_request(prompt, params, label, adapter, salt, resumed)
        except InvalidRequestError as e:
            if e.field != "constraint":
                raise
            key = "tool_choice" if forced else protocol.constraint_field(body)  # the key it came from
            raise InvalidRequestError(key, str(e).removeprefix("constraint: ")) from None

    async def _complete(self, outputs: list, rid: str, call: Call) -> web.Response:
        """The whole answer, once every choice has finished."""
        num_choices = len(outputs) * call.n
        got = Collected(
            [None] * num_choices,
            [[] for _ in range(num_choices)],
            [[] for _ in range(num_choices)],
            [None] * num_choices,  # each choice's prompt logprobs, if asked
            [[] for _ in range(num_choices)],
        )
        try:
            async for index, output in streams.merged(outputs, call.n):
                got.texts[index].append(output.text)
                got.logprobs[index] += output.logprobs
                got.token_ids[index] += output.new_token_ids
                if output.prompt_logprobs is not None:
                    got.prompt_lps[index] = output.prompt_logprobs
                if output.finished:
                    got.finals[index] = output
        except ServiceError as e:
            return responses.service_error(e)
        # rendered and serialized off the event loop: its size grows with the prompt logprobs and choices
        data = await asyncio.to_thread(self._answer, rid, call, got)
        return web.Response(body=data, content_type="application/json")

    def _answer(self, rid: str, call: Call, got: Collected) -> bytes:
        """A whole (non-streamed) answer as JSON: CPU work by its size, on a worker thread."""
        decode = responses.memoized(self.service.engine.tokenizer.decode)
        response = {
            "id": rid,
            "object": self.object,
            "created": int(time.time()),
            "model": call.model,
            "choices": self.choices(call, got, decode),
            "usage": responses.usage([f for f in got.finals if f is not None]),
        }
        response.update(self.answer_fields(call, got, decode))
        if call.body.get("return_token_ids"):  # (vLLM's extension)
            for choice, ids in zip(response["choices"], got.token_ids, strict=True):
                choice["token_ids"] = ids
        return responses.json_bytes(response)
