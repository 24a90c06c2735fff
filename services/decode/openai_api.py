"""An OpenAI-compatible HTTP API on decode-server (`--http-port`): /v1/models, /v1/completions and
/v1/chat/completions, streamed as server-sent events or not. It runs on the same event loop as the gRPC
server and goes through the same core (services.decode.core: make_request / stream), so validation,
admission, disaggregated prefill and cleanup are identical.

For an inference gateway (docs/gateway.md): POST /v1/completions/render and /v1/chat/completions/render
take the same bodies and return the prompt's token ids without generating (vLLM's shapes: a list of
{"token_ids"} for completions, one object for chat), which llm-d's precise prefix scorer hashes; GET
/health is 200 while serving, 503 while draining. A request may carry `x-prefiller-host-port`
(services.decode.config.PREFILL_HINT_HEADER).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

import grpc
from aiohttp import web

from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import Constraint, InvalidRequestError, SamplingParams
from pdserve.services.decode.core import PREFILL_HINT_HEADER, GenerationCore, ServiceError
from pdserve.services.decode.tool_formats import detect, marked_by_special_tokens
from pdserve.services.decode.tools import ToolChoice, ToolStream, tool_choice
from pdserve.services.sampling import FIELD_NAMES, params_from_values
from pdserve.services.security import ServerSecurity, token_ok

_HTTP_STATUS = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INTERNAL: 500,
}
_DEFAULT_MAX_TOKENS = {False: 16, True: 256}  # completions, chat: OpenAI's defaults
REQUEST_ID_HEADER = "X-Request-Id"  # the client's id of the request: in the log line (vLLM's header)
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds the client will wait (at most the server's --http-timeout)


def _error(
    status: int, message: str, kind: str, param: str | None = None, retry_after_ms: int | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    headers = {}
    if retry_after_ms is not None or status in (429, 503):  # seconds, as RFC 9110 has it
        headers["Retry-After"] = str(max(1, -(-(retry_after_ms or 1000) // 1000)))
    return web.json_response(body, status=status, headers=headers)


def _service_error(e: ServiceError) -> web.Response:
    return _error(_HTTP_STATUS.get(e.code, 500), e.message, "server_error", retry_after_ms=e.retry_after_ms)


def _invalid(e: InvalidRequestError) -> web.Response:
    """404 for an adapter not loaded here, else 400, naming the field."""
    return _error(404 if e.status == "NOT_FOUND" else 400, str(e), "invalid_request_error", e.field)


def _params(body: dict, default_max_tokens: int) -> SamplingParams:
    """OpenAI fields (and vLLM's extensions: top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos)
    -> SamplingParams through services.sampling's one mapping; OpenAI's own shapes are normalised first.
    Type errors become InvalidRequestError naming the field; the defaults are OpenAI's (temperature 1)."""
    return dataclasses.replace(_knobs(body, default_max_tokens), constraint=_constraint(body))


def _knobs(body: dict, default_max_tokens: int) -> SamplingParams:
    """_params without the constraint (whose text grows with the body: it is read off the event loop)."""
    values = {name: body[name] for name in FIELD_NAMES if name in body}
    if body.get("n", 1) not in (1, None):
        raise InvalidRequestError("n", "only n=1 is supported")
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    logprobs = body.get("logprobs")
    if body.get("top_logprobs") is not None:  # chat: logprobs is a bool, top_logprobs the count
        values["logprobs"] = body["top_logprobs"] if logprobs else None
    elif isinstance(logprobs, bool):
        values["logprobs"] = 0 if logprobs else None
    values["max_tokens"] = values.get("max_tokens") or body.get("max_completion_tokens") or default_max_tokens
    return params_from_values(values)


# vLLM's guided-decoding extensions: body key -> Constraint kind
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "guided_choice": "choice",
}


def _constraint(body: dict) -> Constraint | None:
    """OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"schema": ...}}), or one of vLLM's guided_* keys; None: free text."""
    fmt = body.get("response_format")
    given = [key for key in _GUIDED if body.get(key) is not None]
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise InvalidRequestError("response_format", "type must be text, json_object or json_schema")
        if given and kind != "text":
            raise InvalidRequestError(given[0], "at most one of response_format and the guided_* keys")
        if kind == "json_object":
            return Constraint("json_object")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequestError("response_format", "json_schema.schema must be a JSON object")
            return Constraint("json_schema", json.dumps(schema))
    if len(given) > 1:
        raise InvalidRequestError(given[-1], "at most one of response_format and the guided_* keys")
    if not given:
        return None
    key, value = given[0], body[given[0]]
    if key == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidRequestError(key, "must be a list of strings")
        return Constraint("choice", choices=tuple(value))
    if key == "guided_json" and isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise InvalidRequestError(key, "must be a string" + (" or an object" if key == "guided_json" else ""))
    return Constraint(_GUIDED[key], value)


class OpenAIFrontend:
    """`security`: the public port's settings; its bearer tokens and TLS apply here too. `tool_call_parser`:
    the format of the model's own tool calls (services.decode.tool_formats; "auto": its chat template's)."""

    def __init__(
        self,
        service: GenerationCore,
        security: ServerSecurity | None = None,
        tool_call_parser: str = "auto",
        timeout_s: float = 600.0,
    ):
        self.service = service
        self.security = security
        self.timeout_s = timeout_s  # a request's deadline unless its TIMEOUT_HEADER asks for less
        self.model = service.engine.model.config.name
        tokenizer = service.engine.tokenizer
        self.tool_format = detect(tokenizer.chat_template) if tool_call_parser == "auto" else tool_call_parser
        self.tool_markers_special = marked_by_special_tokens(self.tool_format, tokenizer)
        middlewares = [self._authorize] if security is not None and security.tokens else []
        self.app = web.Application(client_max_size=8 << 20, middlewares=middlewares)
        self.app.add_routes(
            [
                web.get("/v1/models", self.models),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions/render", self.render_completions),
                web.post("/v1/chat/completions/render", self.render_chat_completions),
                web.get("/health", self.health),
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
        if not token_ok([("authorization", request.headers.get("Authorization", ""))], self.security.tokens):
            return _error(401, "missing or invalid bearer token", "authentication_error")
        return await handler(request)

    async def models(self, request: web.Request) -> web.Response:
        """The base model, then every loaded LoRA adapter (usable as `model`, with the base as parent)."""
        base = {"id": self.model, "object": "model", "created": 0, "owned_by": "pdserve"}
        adapters = [
            {**base, "id": name, "parent": self.model} for name in sorted(self.service.engine.loras.adapters)
        ]
        return web.json_response({"object": "list", "data": [base, *adapters]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def render_completions(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    async def render_chat_completions(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)

    async def health(self, request: web.Request) -> web.Response:
        if self.service.loop.failure is not None:
            return web.json_response({"status": "engine failed"}, status=503)
        if self.service.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

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
            self._precheck(body, chat)
            engine_request, tools = await self.service.prepare(lambda: self.engine_request(body, chat, label))
        except InvalidRequestError as e:
            return _invalid(e)
        except ServiceError as e:
            return _service_error(e)
        outputs = _until(self.service.stream(engine_request, timeout_s, hint, label), timeout_s)
        model = engine_request.lora.name if engine_request.lora else self.model  # echoed in responses
        if body.get("stream"):
            return await self._stream(request, outputs, rid, chat, body, model, tools)
        return await self._complete(outputs, rid, chat, model, tools)

    async def _render(self, request: web.Request, chat: bool) -> web.Response:
        """The prompt's token ids as Generate would compute them: the same parsing, validation and
        tokenizer (chat template included), through the engine's own make_request, off the event loop
        and admission-bounded like a generation; nothing is queued."""
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            self._precheck(body, chat)
            engine_request, _ = await self.service.prepare(lambda: self.engine_request(body, chat))
        except InvalidRequestError as e:
            return _invalid(e)
        except ServiceError as e:
            return _service_error(e)
        model = engine_request.lora.name if engine_request.lora else self.model
        rendered = {"model": model, "token_ids": list(engine_request.prompt_ids)}
        return web.json_response(rendered if chat else [rendered])

    def _precheck(self, body: dict, chat: bool) -> None:
        """The checks that cost next to nothing (the sampling knobs), on the event loop: a bad body is
        refused before it waits for a preparation thread."""
        self.service.check_params(_knobs(body, default_max_tokens=_DEFAULT_MAX_TOKENS[chat]))

    def engine_request(self, body: dict, chat: bool, label: str = "") -> tuple[Request, ToolChoice | None]:
        """The engine request of an OpenAI body whose key types _json_body checked, and its tools
        (InvalidRequestError names the bad field). CPU work by the size of the body (the chat template,
        the tokenizer, a constraint's compilation): run it through GenerationCore.prepare."""
        tools = tool_choice(body, self.tool_format, self.service.config.limits.max_tools) if chat else None
        return self._prepare(body, chat, tools, label), tools

    def _prepare(self, body: dict, chat: bool, tools: ToolChoice | None, label: str) -> Request:
        """engine_request's request; `tools`: the chat's tools, given to its template, and the constraint
        of a required or named call."""
        tokenizer, max_chars = self.service.engine.tokenizer, self.service.engine.config.max_prompt_chars
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(_message_ok(m) for m in messages):
                raise InvalidRequestError("messages", "must be a non-empty list of {role, content}")
            self.service.config.limits.check_chat([_text_of(m) for m in messages], max_chars)
            template_tools = {"tools": tools.template_tools} if tools is not None else {}
            prompt = tokenizer.encode_chat(
                [_message(m) for m in messages], max_chars=max_chars, **template_tools
            )
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str) and not (
                isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
            ):
                raise InvalidRequestError("prompt", "must be a string or a list of token ids")
        params = _params(body, default_max_tokens=_DEFAULT_MAX_TOKENS[chat])
        forced = tools.constraint() if tools is not None else None
        if forced is not None:
            if params.constraint is not None:
                raise InvalidRequestError("tool_choice", "a required or named call and a response_format")
            params = dataclasses.replace(params, constraint=forced)
        if tools is not None and tools.mode == "auto" and self.tool_markers_special:
            params = dataclasses.replace(params, skip_special_tokens=False)
        try:
            adapter, salt = self._adapter(body), body.get("cache_salt") or ""
            return self.service.make_request(prompt, params, label, lora=adapter, cache_salt=salt)
        except InvalidRequestError as e:
            if e.field != "constraint":
                raise
            # name the key the constraint came from
            key = (
                "tool_choice"
                if forced is not None
                else next((k for k in ("response_format", *_GUIDED) if body.get(k) is not None), e.field)
            )
            raise InvalidRequestError(key, str(e).removeprefix("constraint: ")) from None

    def _adapter(self, body: dict) -> str:
        """`lora_adapter`, else `model` when it names a loaded adapter (vLLM's convention); "": the base."""
        name = body.get("lora_adapter") or ""
        model = body.get("model")
        if not name and isinstance(model, str) and model in self.service.engine.loras.adapters:
            name = model
        if not isinstance(name, str):
            raise InvalidRequestError("lora_adapter", "must be a string")
        return name

    async def _complete(
        self, outputs, rid: str, chat: bool, model: str, tools: ToolChoice | None
    ) -> web.Response:
        text, finish, usage, logprobs = [], None, None, []
        try:
            async for output in outputs:
                text.append(output.text)
                logprobs += output.logprobs
                if output.finished:
                    finish, usage = output.finish_reason.value, _usage(output)
        except ServiceError as e:
            return _service_error(e)
        choice = {"index": 0, "finish_reason": finish, "logprobs": self._logprobs(logprobs, chat)}
        if chat:
            choice["message"] = message = {"role": "assistant", "content": "".join(text)}
            calls = _tool_calls(tools, message, finish)
            if calls:
                choice["finish_reason"] = "tool_calls"
                message["tool_calls"] = calls
        else:
            choice["text"] = "".join(text)
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def _stream(
        self, request, outputs, rid: str, chat: bool, body: dict, model: str, tools: ToolChoice | None
    ) -> web.StreamResponse:
        """Server-sent chunks as tokens arrive; with tools, services.decode.tools.ToolStream's deltas."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        created, kind = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

        async def send(choice: dict, usage=None):
            chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
            if usage is not None:
                chunk["usage"] = usage
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        if chat:
            await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        tool_stream = ToolStream(tools) if tools is not None else None
        try:
            async for output in outputs:
                choice = {
                    "index": 0,
                    "finish_reason": output.finish_reason.value if output.finished else None,
                }
                choice["logprobs"] = self._logprobs(output.logprobs, chat)
                usage = None
                if output.finished and (body.get("stream_options") or {}).get("include_usage"):
                    usage = _usage(output)
                if tool_stream is not None:  # one chunk per delta; the last carries the finish
                    deltas = tool_stream.feed(output.text)
                    if output.finished:
                        more, choice["finish_reason"] = tool_stream.finish(choice["finish_reason"])
                        deltas += more
                    deltas = deltas or [{}]
                    for i, delta in enumerate(deltas):
                        last = i == len(deltas) - 1
                        await send(
                            {
                                "index": 0,
                                "delta": delta,
                                "logprobs": choice["logprobs"] if i == 0 else None,
                                "finish_reason": choice["finish_reason"] if last else None,
                            },
                            usage if last else None,
                        )
                    continue
                if chat:
                    choice["delta"] = {"content": output.text} if output.text else {}
                else:
                    choice["text"] = output.text
                await send(choice, usage)
        except ServiceError as e:
            await response.write(
                f"data: {json.dumps({'error': {'message': e.message, 'type': 'server_error'}})}\n\n".encode()
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _logprobs(self, logprobs, chat: bool):
        if not logprobs:
            return None
        decode = self.service.engine.tokenizer.decode
        if chat:
            return {
                "content": [
                    {
                        "token": decode([lp.token_id]),
                        "logprob": lp.logprob,
                        "top_logprobs": [{"token": decode([t]), "logprob": v} for t, v in lp.top],
                    }
                    for lp in logprobs
                ]
            }
        return {
            "tokens": [decode([lp.token_id]) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{decode([t]): v for t, v in lp.top} for lp in logprobs],
        }


def _text_of(m: dict) -> str:
    """What a chat message gives the template to render, as text (its size is what rendering costs)."""
    calls = m.get("tool_calls")
    return str(m.get("role", "")) + (m.get("content") or "") + (json.dumps(calls) if calls else "")


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


def _message_ok(m) -> bool:
    """A chat message: content text, or an assistant's tool calls (content null)."""
    if not isinstance(m, dict):
        return False
    return isinstance(m.get("content"), str) or (
        m.get("content") is None and isinstance(m.get("tool_calls"), list)
    )


def _message(m: dict) -> dict:
    """A message as the chat template takes it: role and content, and the tool fields templates read."""
    out = {"role": m.get("role", "user"), "content": m.get("content") or ""}
    out.update({k: m[k] for k in ("tool_calls", "tool_call_id", "name") if k in m})
    return out


def _tool_calls(tools: ToolChoice | None, message: dict, finish: str | None) -> list[dict]:
    """Parses the finished text of `message` (its content is replaced by what is left of it) into tool
    calls; none when the output stopped short of a whole call (finish "length")."""
    if tools is None or tools.mode == "none" or finish != "stop":
        return []
    try:
        message["content"], calls = tools.calls(message["content"])
    except ValueError:  # a required call that stopped short of its JSON
        return []
    return calls


# The JSON types of the body keys read here, besides services.sampling's knobs (params_from_values checks
# those): a key of another type is a 400 naming it before anything reads it.
_BODY_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "messages": (list,),
    "prompt": (str, list),
    "stream": (bool,),
    "stream_options": (dict,),
    "n": (int,),
    "logprobs": (bool, int),
    "top_logprobs": (int,),
    "max_completion_tokens": (int,),
    "response_format": (dict,),
    "tools": (list,),
    "tool_choice": (str, dict),
    "lora_adapter": (str,),
    "cache_salt": (str,),  # vLLM's: a tenant's prefix-cache salt
    "user": (str,),
    "guided_json": (str, dict),
    "guided_regex": (str,),
    "guided_grammar": (str,),
    "guided_choice": (list,),
}
_JSON_NAMES = {str: "a string", list: "a list", dict: "an object", bool: "a boolean", int: "an integer"}


def _check_types(body: dict) -> None:
    for key, kinds in _BODY_TYPES.items():
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise InvalidRequestError(key, "must be " + " or ".join(_JSON_NAMES[k] for k in kinds))


async def _json_body(request: web.Request) -> dict | web.Response:
    """The request's JSON object with its keys of the right types, or the 400 response saying why not."""
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
    except RecursionError:
        return _error(400, "invalid JSON: nested too deeply", "invalid_request_error")
    except ValueError as e:
        return _error(400, f"invalid JSON: {e}", "invalid_request_error")
    try:
        _check_types(body)
    except InvalidRequestError as e:
        return _invalid(e)
    return body


def _usage(output: RequestOutput) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` as OpenAI and vLLM report it."""
    return {
        "prompt_tokens": output.num_prompt_tokens,
        "completion_tokens": output.num_output_tokens,
        "total_tokens": output.num_prompt_tokens + output.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }
