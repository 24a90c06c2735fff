"""The OpenAI-compatible HTTP API on decode-server (`--http-port`), as vLLM serves it: /v1/models (and
/v1/models/{id}), /v1/completions (one or several prompts, `echo`) and /v1/chat/completions, streamed as
server-sent events (a final usage chunk with `stream_options.include_usage`) or not; /tokenize,
/detokenize, /version; /health and /metrics, which need no token. It runs on the same event loop as the
gRPC server and goes through the same core (services.decode.core: prepare / stream), so validation,
admission, disaggregated prefill and cleanup are identical.

`model` must be one of the served names (`--served-model-name`; the first is the one responses carry)
or a loaded adapter's; another is 404, as vLLM answers. For an inference gateway (docs/gateway.md): POST
/v1/completions/render and /v1/chat/completions/render return the prompt's token ids without generating
(vLLM's shapes), which llm-d's precise prefix scorer hashes; /health is 200 while serving, 503 while
draining. A request may carry `x-prefiller-host-port` (services.decode.config.PREFILL_HINT_HEADER).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from aiohttp import web

from pdserve import __version__
from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.services.decode.core import PREFILL_HINT_HEADER, GenerationCore, ServiceError
from pdserve.services.decode.openai import protocol, reasoning, responses
from pdserve.services.decode.tool_formats import detect, marked_by_special_tokens
from pdserve.services.decode.tools import ToolChoice, ToolStream, tool_choice
from pdserve.services.security import ServerSecurity, token_ok

REQUEST_ID_HEADER = "X-Request-Id"  # the client's id of the request: in the log line (vLLM's header)
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds the client will wait (at most the server's --http-timeout)
OPEN_PATHS = ("/health", "/metrics")  # served without a bearer token: liveness checks and scrapes


@dataclasses.dataclass
class _Call:
    """One HTTP call's engine requests (one per prompt, of `n` choices each) and what its response needs
    of the body."""

    requests: list[Request]
    model: str  # the name the response carries
    tools: ToolChoice | None = None
    echo: list[str] = dataclasses.field(default_factory=list)  # each prompt's text, with `echo`
    echo_only: bool = False  # `echo` with max_tokens 0: the prompt alone (one token is generated)

    @property
    def n(self) -> int:
        """Choices per prompt (the body's n)."""
        return self.requests[0].params.n


@dataclasses.dataclass
class _Answer:
    """What a non-streamed call collected, each list by choice: rendered by _completion_body."""

    rid: str
    chat: bool
    body: dict
    call: _Call
    finals: list  # each choice's last output (None: it did not finish)
    texts: list[list[str]]
    logprobs: list[list]
    prompt_lps: list  # each choice's prompt logprobs (the n choices of a prompt share one list)


class OpenAIFrontend:
    """`security`: the public port's settings; its bearer tokens and TLS apply here too (not to
    OPEN_PATHS). `tool_call_parser`: the format of the model's own tool calls (services.decode.
    tool_formats; "auto": its chat template's). `served_model_names`: what clients call the model (the
    first is the one responses carry; default: the model's name). `reasoning_parser`: how a thinking model's
    reasoning is split out of a chat's content (services.decode.openai.reasoning; None: it is not).
    `sampling_defaults`: the sampling parameters a request that does not set them gets (the model's
    generation config, engine.loading.sources.generation_defaults; OpenAI's otherwise)."""

    def __init__(
        self,
        service: GenerationCore,
        security: ServerSecurity | None = None,
        tool_call_parser: str = "auto",
        timeout_s: float = 600.0,
        served_model_names: tuple[str, ...] = (),
        reasoning_parser: str | None = None,
        sampling_defaults: dict | None = None,
    ):
        if reasoning_parser is not None and reasoning_parser not in reasoning.PARSERS:
            raise ValueError(f"reasoning parser {reasoning_parser!r}: one of {reasoning.PARSERS}")
        self.reasoning_parser = reasoning_parser
        self.markers = reasoning.marker_ids(service.engine.tokenizer)  # (<think>, </think>) ids, if tokens
        self.sampling_defaults = dict(sampling_defaults or {})
        self.service = service
        self.security = security
        self.timeout_s = timeout_s  # a request's deadline unless its TIMEOUT_HEADER asks for less
        self.names = tuple(served_model_names) or (service.engine.model.config.name,)
        self.model = self.names[0]
        tokenizer = service.engine.tokenizer
        self.tool_format = detect(tokenizer.chat_template) if tool_call_parser == "auto" else tool_call_parser
        self.tool_markers_special = marked_by_special_tokens(self.tool_format, tokenizer)
        middlewares = [self._authorize] if security is not None and security.tokens else []
        self.app = web.Application(client_max_size=8 << 20, middlewares=middlewares)
        self.app.add_routes(
            [
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model}", self.model_card),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions/render", self.render_completions),
                web.post("/v1/chat/completions/render", self.render_chat_completions),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/version", self.version),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
            ]
        )
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        # a client that goes away cancels its handler: the request is aborted and its blocks freed
        self._runner = web.AppRunner(self.app, handler_cancellation=True)
        await self._runner.setup()
        ssl_context = self.security.ssl_context() if self.security is not None else None
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _authorize(self, request: web.Request, handler):
        if request.path not in OPEN_PATHS and not token_ok(
            [("authorization", request.headers.get("Authorization", ""))], self.security.tokens
        ):
            return responses.error(401, "missing or invalid bearer token", "authentication_error")
        return await handler(request)

    # ---- models, tokens, version, health, metrics ------------------------------------------------------
    def _cards(self) -> list[dict]:
        """The served names, then every loaded LoRA adapter (usable as `model`, with the base as parent)."""
        length = self.service.engine.config.max_model_len
        base = {"object": "model", "created": 0, "owned_by": "pdserve", "max_model_len": length}
        cards = [{**base, "id": name, "root": self.model, "parent": None} for name in self.names]
        adapters = sorted(self.service.engine.loras.adapters)
        return cards + [{**base, "id": name, "root": name, "parent": self.model} for name in adapters]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self._cards()})

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        card = next((c for c in self._cards() if c["id"] == name), None)
        return responses.model_not_found(name) if card is None else web.json_response(card)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a `prompt` (as a completion's: `add_special_tokens` default true) or `messages`
        (rendered as a chat's); `return_token_strs` adds the vocabulary spellings."""
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            self._check_model(body)
            ids = await self.service.prepare(lambda: self._tokenize(body))
        except _REFUSALS as e:
            return _refusal(e)
        tokenizer = self.service.engine.tokenizer
        strs = [tokenizer.id_to_token(t) for t in ids] if body.get("return_token_strs") else None
        length = self.service.engine.config.max_model_len
        return web.json_response(
            {"count": len(ids), "max_model_len": length, "tokens": ids, "token_strs": strs}
        )

    def _tokenize(self, body: dict) -> list[int]:
        if "messages" in body:
            return self._chat_ids(body, None)
        prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(prompt, str) or not isinstance(special, bool):
            raise InvalidRequestError(
                "prompt", "must be a string (add_special_tokens a boolean), or send messages"
            )
        return self._encode(prompt, special)

    def _encode(self, prompt: str, add_special_tokens: bool) -> list[int]:
        """A text prompt's token ids, refused past the engine's max_prompt_chars before any tokenizing."""
        max_chars = self.service.engine.config.max_prompt_chars
        if len(prompt) > max_chars:
            raise InvalidRequestError("prompt", f"longer than {max_chars} characters")
        return self.service.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        tokens, vocab = body.get("tokens"), self.service.engine.model.config.vocab_size
        try:
            self._check_model(body)
            if not protocol.token_ids(tokens) or not all(0 <= t < vocab for t in tokens):
                raise InvalidRequestError("tokens", f"must be a list of token ids in [0, {vocab})")
            if len(tokens) > self.service.engine.config.max_model_len:
                raise InvalidRequestError("tokens", f"more than {self.service.engine.config.max_model_len}")
        except _REFUSALS as e:
            return _refusal(e)
        return web.json_response({"prompt": self.service.engine.tokenizer.decode(tokens)})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def health(self, request: web.Request) -> web.Response:
        if self.service.loop.failure is not None:
            return web.json_response({"status": "engine failed"}, status=503)
        if self.service.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return await self.service.metrics.scrape(request.path)

    # ---- generation --------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def render_completions(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    async def render_chat_completions(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)

    def _timeout(self, request: web.Request) -> float:
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

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            label = self.service.config.limits.check_request_id(
                request.headers.get(REQUEST_ID_HEADER, rid), REQUEST_ID_HEADER
            )
            timeout_s = self._timeout(request)
            hint = self.service.prefill_hint(request.headers.get(PREFILL_HINT_HEADER))
            self._check_model(body)
            self._precheck(body, chat)
            call = await self._prepare(body, chat, label)
        except _REFUSALS as e:
            return _refusal(e)
        streams = [_until(self.service.stream(r, timeout_s, hint, label), timeout_s) for r in call.requests]
        if body.get("stream"):
            return await self._stream(request, streams, rid, chat, body, call)
        return await self._complete(streams, rid, chat, body, call)

    async def _prepare(self, body: dict, chat: bool, label: str) -> _Call:
        """The call's engine requests, each tokenized (and its constraint compiled) off the event loop."""
        if chat:
            if body.get("echo"):
                raise InvalidRequestError("echo", "is served by /v1/completions only")
            tools = tool_choice(body, self.tool_format, self.service.config.limits.max_tools)
            request = await self.service.prepare(lambda: self._chat_request(body, tools, label))
            return _Call([request], self._response_model(request), tools)
        prompts = protocol.completion_prompts(body, self.service.config.limits.max_prompts_per_call)
        echo_only = bool(body.get("echo")) and body.get("max_tokens") == 0
        if echo_only:
            body = {**body, "max_tokens": 1}
        requests = []
        for prompt in prompts:
            requests.append(
                await self.service.prepare(lambda p=prompt: self._completion_request(body, p, label))
            )
        call = _Call(requests, self._response_model(requests[0]), echo_only=echo_only)
        if body.get("echo"):
            decode = self.service.engine.tokenizer.decode
            call.echo = [p if isinstance(p, str) else decode(p) for p in prompts]
        return call

    def _response_model(self, request: Request) -> str:
        return request.lora.name if request.lora else self.model

    async def _render(self, request: web.Request, chat: bool) -> web.Response:
        """The prompts' token ids as Generate would compute them: the same parsing, validation and
        tokenizer (chat template included), through the engine's own make_request, off the event loop
        and admission-bounded like a generation; nothing is queued."""
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            self._check_model(body)
            self._precheck(body, chat)
            call = await self._prepare(body, chat, "")
        except _REFUSALS as e:
            return _refusal(e)
        rendered = [{"model": call.model, "token_ids": list(r.prompt_ids)} for r in call.requests]
        return web.json_response(rendered[0] if chat else rendered)

    def _check_model(self, body: dict) -> None:
        """`model` names a served name or a loaded adapter (omitted or empty: the base model)."""
        name = body.get("model")
        if name and name not in self.names and name not in self.service.engine.loras.adapters:
            raise _ModelNotFound(name)

    def _precheck(self, body: dict, chat: bool) -> None:
        """The checks that cost next to nothing (the sampling knobs), on the event loop: a bad body is
        refused before it waits for a preparation thread."""
        self.service.check_params(protocol.knobs(body, chat, self.sampling_defaults))

    def _chat_ids(self, body: dict, tools: ToolChoice | None) -> list[int]:
        """The chat's prompt: its messages rendered by the model's template with the body's template
        arguments (and `tools`: the chat's tools, given to the template)."""
        tokenizer, max_chars = self.service.engine.tokenizer, self.service.engine.config.max_prompt_chars
        messages = protocol.chat_messages(body)
        self.service.config.limits.check_chat([protocol.message_size(m) for m in messages], max_chars)
        template_args = protocol.chat_template_args(body)
        if tools is not None:
            template_args["tools"] = tools.template_tools
        return tokenizer.encode_chat(messages, max_chars=max_chars, **template_args)

    def _chat_request(self, body: dict, tools: ToolChoice | None, label: str) -> Request:
        params = protocol.sampling_params(body, True, self.sampling_defaults)
        forced = tools.constraint() if tools is not None else None
        if forced is not None:
            if params.constraint is not None:
                raise InvalidRequestError("tool_choice", "a required or named call and a response_format")
            params = dataclasses.replace(params, constraint=forced)
        if tools is not None and tools.mode == "auto" and self.tool_markers_special:
            params = dataclasses.replace(params, skip_special_tokens=False)
        ids = self._chat_ids(body, tools)
        if self.reasoning_parser is not None and params.constraint is not None:  # constrain the answer only
            params = dataclasses.replace(
                params, reasoning_end=reasoning.constraint_waits_for(ids, self.markers)
            )
        return self._engine_request(body, ids, params, label, forced is not None)

    def _completion_request(self, body: dict, prompt: str | list[int], label: str) -> Request:
        """A text prompt gets the model's special tokens (its BOS), as vLLM's completions do, unless
        `add_special_tokens` is false."""
        if isinstance(prompt, str) and body.get("add_special_tokens") is False:
            prompt = self._encode(prompt, False) or prompt  # ("" stays text: the engine refuses it by name)
        return self._engine_request(
            body, prompt, protocol.sampling_params(body, False, self.sampling_defaults), label, False
        )

    def _engine_request(self, body: dict, prompt, params, label: str, forced: bool) -> Request:
        try:
            adapter, salt = self._adapter(body), body.get("cache_salt") or ""
            return self.service.make_request(prompt, params, label, lora=adapter, cache_salt=salt)
        except InvalidRequestError as e:
            if e.field != "constraint":
                raise
            key = "tool_choice" if forced else protocol.constraint_field(body)  # the key it came from
            raise InvalidRequestError(key, str(e).removeprefix("constraint: ")) from None

    def engine_request(self, body: dict, chat: bool, label: str = "") -> tuple[Request, ToolChoice | None]:
        """The engine request of a one-choice body (its first prompt) and its tools; CPU work by the size
        of the body: run it through GenerationCore.prepare."""
        if chat:
            tools = tool_choice(body, self.tool_format, self.service.config.limits.max_tools)
            return self._chat_request(body, tools, label), tools
        prompt = protocol.completion_prompts(body, self.service.config.limits.max_prompts_per_call)[0]
        return self._completion_request(body, prompt, label), None

    def _adapter(self, body: dict) -> str:
        """`lora_adapter`, else `model` when it names a loaded adapter (vLLM's convention); "": the base."""
        name = body.get("lora_adapter") or ""
        model = body.get("model")
        if not name and isinstance(model, str) and model in self.service.engine.loras.adapters:
            name = model
        if not isinstance(name, str):
            raise InvalidRequestError("lora_adapter", "must be a string")
        return name

    # ---- responses ---------------------------------------------------------------------------------
    async def _complete(self, streams, rid: str, chat: bool, body: dict, call: _Call) -> web.Response:
        num_choices = len(streams) * call.n
        finals: list[RequestOutput | None] = [None] * num_choices
        texts: list[list[str]] = [[] for _ in range(num_choices)]
        logprobs: list[list] = [[] for _ in range(num_choices)]
        prompt_lps: list[list | None] = [None] * num_choices  # each choice's prompt logprobs, if asked
        try:
            async for index, output in _merged(streams, call.n):
                texts[index].append(output.text)
                logprobs[index] += output.logprobs
                if output.prompt_logprobs is not None:
                    prompt_lps[index] = output.prompt_logprobs
                if output.finished:
                    finals[index] = output
        except ServiceError as e:
            return responses.service_error(e)
        # rendered and serialized off the event loop: its size grows with the prompt logprobs and choices
        answer = _Answer(rid, chat, body, call, finals, texts, logprobs, prompt_lps)
        data = await asyncio.to_thread(self._completion_body, answer)
        return web.Response(body=data, content_type="application/json")

    def _completion_body(self, a: _Answer) -> bytes:
        """A whole (non-streamed) answer as JSON: CPU work by its size, on a worker thread. A prompt's
        logprobs are rendered once and shared by its n choices."""
        chat, body, call = a.chat, a.body, a.call
        decode = responses.memoized(self.service.engine.tokenizer.decode)
        rendered: dict = {}  # (renderer, id of a prompt's entries) -> its rendering

        def once(render, entries, *args):
            """render(entries, *args), computed once for each prompt's entries."""
            key = (render, id(entries))
            if key not in rendered:
                rendered[key] = render(entries, *args)
            return rendered[key]

        choices = []
        for index, final in enumerate(a.finals):
            prompt = index // call.n  # (vLLM's choice order: prompt by prompt, its n sequences each)
            finish = final.finish_reason.value if final is not None else None
            text = "".join(a.texts[index])
            entries, ids = [] if call.echo_only else a.logprobs[index], call.requests[prompt].prompt_ids
            prompt_entries = a.prompt_lps[index]
            if call.echo and prompt_entries is not None and not entries:  # the prompt's alone: shared
                rendered_lps = once(responses.logprobs, prompt_entries, chat, decode, ids)
            else:
                if call.echo and prompt_entries is not None:  # the prompt's first
                    entries = [*prompt_entries, *entries]
                rendered_lps = responses.logprobs(entries, chat, decode, ids)
            choice = {"index": index, "finish_reason": finish, "logprobs": rendered_lps}
            if body.get("prompt_logprobs") is not None and not chat:
                choice["prompt_logprobs"] = once(responses.prompt_logprobs, prompt_entries or [], decode)
            if chat:
                choice["message"] = message = {"role": "assistant", "content": text}
                if self.reasoning_parser is not None:  # (tool calls are read in the content only)
                    message["reasoning"], message["content"] = reasoning.split(self.reasoning_parser, text)
                calls = responses.tool_calls(
                    call.tools, message, finish, body.get("parallel_tool_calls", True)
                )
                if calls:
                    choice["finish_reason"] = "tool_calls"
                    message["tool_calls"] = calls
            else:
                choice["text"] = (call.echo[prompt] if call.echo else "") + ("" if call.echo_only else text)
            choices.append(choice)
        response = {
            "id": a.rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": call.model,
            "choices": choices,
            "usage": responses.usage([f for f in a.finals if f is not None]),
        }
        if chat and body.get("prompt_logprobs") is not None:  # (vLLM: the response's, for chat)
            response["prompt_logprobs"] = responses.prompt_logprobs(a.prompt_lps[0] or [], decode)
        return responses.json_bytes(response)

    async def _stream(
        self, request, streams, rid: str, chat: bool, body: dict, call: _Call
    ) -> web.StreamResponse:
        """Server-sent chunks as tokens arrive (a chat's role chunk with its first token); with tools,
        services.decode.tools.ToolStream's deltas; with stream_options.include_usage, a last chunk of no
        choices carrying the usage (continuous_usage_stats: every chunk carries its choice's so far)."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        created, kind = int(time.time()), "chat.completion.chunk" if chat else "text_completion"
        options = body.get("stream_options") or {}
        include_usage = options.get("include_usage", True) if options else False
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        decode = responses.memoized(self.service.engine.tokenizer.decode)

        async def send(choices: list[dict], usage=None, large: bool = False):
            """One chunk; a `large` one (the prompt's logprobs) is serialized off the event loop."""
            chunk = {"id": rid, "object": kind, "created": created, "model": call.model, "choices": choices}
            if usage is not None:
                chunk["usage"] = usage
            data = (
                await asyncio.to_thread(responses.json_bytes, chunk) if large else json.dumps(chunk).encode()
            )
            await response.write(b"data: " + data + b"\n\n")

        tool_streams: dict[int, ToolStream] = {}  # by choice, with tools
        thinking: dict[int, reasoning.ReasoningSplit] = {}  # by choice, with a reasoning parser
        started, finals = set(), []
        try:
            async for index, output in _merged(streams, call.n):
                so_far = (
                    responses.running_usage(output.num_prompt_tokens, output.num_output_tokens)
                    if continuous
                    else None
                )
                if output.finished:
                    finals.append(output)
                if chat and index not in started:  # the role chunk, when the first token arrives (as vLLM)
                    started.add(index)
                    role = {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    await send(
                        [role], responses.running_usage(output.num_prompt_tokens, 0) if continuous else None
                    )
                finish = output.finish_reason.value if output.finished else None
                lp = responses.logprobs(output.logprobs, chat, decode)
                text = output.text
                if chat and self.reasoning_parser is not None:  # reasoning first, in its own chunks
                    parts = thinking.setdefault(index, reasoning.ReasoningSplit(self.reasoning_parser))
                    thought, text = parts.feed(text)
                    if output.finished:
                        more = parts.finish()
                        thought, text = thought + more[0], text + more[1]
                    if thought:
                        delta = {"index": index, "delta": {"reasoning": thought}, "logprobs": lp}
                        await send([{**delta, "finish_reason": None}], so_far)
                        lp = None
                    if not text and finish is None:  # (nothing of the content yet)
                        continue
                if call.tools is not None:  # one chunk per delta; the last carries the finish
                    tool_stream = tool_streams.setdefault(index, ToolStream(call.tools))
                    deltas = tool_stream.feed(text)
                    if output.finished:
                        more, finish = tool_stream.finish(finish)
                        deltas += more
                    if not body.get("parallel_tool_calls", True):  # the first call's deltas only
                        deltas = [
                            d for d in deltas if all(c.get("index") == 0 for c in d.get("tool_calls", []))
                        ]
                    deltas = deltas or [{}]
                    for i, delta in enumerate(deltas):
                        last = i == len(deltas) - 1
                        choice = {
                            "index": index,
                            "delta": delta,
                            "logprobs": lp if i == 0 else None,
                            "finish_reason": finish if last else None,
                        }
                        await send([choice], so_far)
                    continue
                large = False
                if not chat and call.echo and index not in started:  # the prompt (and its logprobs) first
                    started.add(index)
                    text = call.echo[index // call.n] + ("" if call.echo_only else text)
                    if output.prompt_logprobs is not None:  # (rendered off the event loop: by its size)
                        entries = [*output.prompt_logprobs, *([] if call.echo_only else output.logprobs)]
                        ids = call.requests[index // call.n].prompt_ids
                        lp = await asyncio.to_thread(responses.logprobs, entries, chat, decode, ids)
                        large = True
                elif call.echo_only:
                    text, lp = "", None
                choice = {"index": index, "logprobs": lp, "finish_reason": finish}
                if chat:
                    choice["delta"] = {"content": text} if text else {}
                else:
                    choice["text"] = text
                await send([choice], so_far, large)
            if include_usage:
                await send([], responses.usage(finals))
        except ServiceError as e:
            await response.write(
                f"data: {json.dumps({'error': {'message': e.message, 'type': 'server_error'}})}\n\n".encode()
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _ModelNotFound(Exception):
    """A body's `model` that this server does not serve."""


_REFUSALS = (_ModelNotFound, InvalidRequestError, ServiceError)  # what a handler answers with an error


def _refusal(e: Exception) -> web.Response:
    """The HTTP answer to one of _REFUSALS: vLLM's 404 for a model not served, 400 / 404 naming a field,
    or the status of a service error."""
    if isinstance(e, _ModelNotFound):
        return responses.model_not_found(str(e))
    if isinstance(e, InvalidRequestError):
        return responses.invalid(e)
    return responses.service_error(e)


async def _until(outputs, timeout_s: float):
    """`outputs` (GenerationCore.stream) within a deadline of `timeout_s` seconds; past it the stream is
    closed (the request aborted, its blocks freed) and ServiceError DEADLINE_EXCEEDED raised."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    output = await anext(outputs)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise ServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"the request's deadline ({timeout_s:g} s) passed"
                ) from None
            yield output
    finally:
        await outputs.aclose()


async def _merged(streams: list, n: int = 1) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of every stream as outputs arrive: stream i's sequence j (of its `n`) is choice
    i * n + j. The first ServiceError is raised and every other stream closed (its request aborted); so are
    all when the consumer stops early."""
    if len(streams) == 1:  # (the usual call: no task)
        async for output in streams[0]:
            yield output.index, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output, None))
        except ServiceError as e:
            await queue.put((index, None, e))
        finally:
            await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, output, failure = await queue.get()
            if failure is not None:
                raise failure
            if output is None:
                running -= 1
                continue
            yield index * n + output.index, output
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _json_body(request: web.Request) -> dict | web.Response:
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
