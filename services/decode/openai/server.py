"""The OpenAI-compatible HTTP API on decode-server (`--http-port`), as vLLM serves it: the aiohttp app and
its routes. /v1/models (and /v1/models/{id}), /v1/completions (completions.CompletionServing) and
/v1/chat/completions (chat.ChatServing), streamed as server-sent events or not (serving, streams);
/tokenize, /detokenize, /version; /health and /metrics, which need no token. It runs on the same event
loop as the gRPC server and goes through the same core (services.decode.core: prepare / stream), so
validation, admission, disaggregated prefill and cleanup are identical.

`model` must be one of the served names (`--served-model-name`; the first is the one responses carry)
or a loaded adapter's (models.ServedModels); another is 404, as vLLM answers. For an inference gateway
(docs/gateway.md): POST /v1/completions/render and /v1/chat/completions/render return the prompt's token
ids without generating (vLLM's shapes), which llm-d's precise prefix scorer hashes; /health is 200 while
serving, 503 while draining. A request may carry `x-prefiller-host-port`
(services.decode.config.PREFILL_HINT_HEADER), `X-Request-Id` and `X-Request-Timeout` (serving).
"""

from __future__ import annotations

from aiohttp import web

from pdserve import __version__
from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.services.decode.core import GenerationCore
from pdserve.services.decode.openai import protocol, responses
from pdserve.services.decode.openai.chat import ChatServing
from pdserve.services.decode.openai.completions import CompletionServing
from pdserve.services.decode.openai.models import ServedModels
from pdserve.services.decode.openai.serving import REFUSALS, json_body, refusal
from pdserve.services.decode.tools import ToolChoice
from pdserve.services.security import ServerSecurity, token_ok

OPEN_PATHS = ("/health", "/metrics")  # served without a bearer token: liveness checks and scrapes


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
        self.service = service
        self.security = security
        self.models = ServedModels(service, served_model_names)
        defaults = dict(sampling_defaults or {})
        self.chat = ChatServing(service, self.models, defaults, timeout_s, tool_call_parser, reasoning_parser)
        self.completions = CompletionServing(service, self.models, defaults, timeout_s)
        middlewares = [self._authorize] if security is not None and security.tokens else []
        self.app = web.Application(client_max_size=8 << 20, middlewares=middlewares)
        self.app.add_routes(
            [
                web.get("/v1/models", self.list_models),
                web.get("/v1/models/{model}", self.model_card),
                web.post("/v1/completions", self.completions.create),
                web.post("/v1/chat/completions", self.chat.create),
                web.post("/v1/completions/render", self.completions.render),
                web.post("/v1/chat/completions/render", self.chat.render),
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

    def engine_request(self, body: dict, chat: bool, label: str = "") -> tuple[Request, ToolChoice | None]:
        """The engine request of a one-choice chat (`chat`) or completions body and its tools
        (Serving.engine_request); CPU work by the size of the body: run it through GenerationCore.prepare."""
        return (self.chat if chat else self.completions).engine_request(body, label)

    # ---- models, tokens, version, health, metrics ------------------------------------------------------
    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.models.cards()})

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        card = next((c for c in self.models.cards() if c["id"] == name), None)
        return responses.model_not_found(name) if card is None else web.json_response(card)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a `prompt` (as a completion's: `add_special_tokens` default true) or `messages`
        (rendered as a chat's); `return_token_strs` adds the vocabulary spellings."""
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            self.models.check(body)
            ids = await self.service.prepare(lambda: self._tokenize(body))
        except REFUSALS as e:
            return refusal(e)
        tokenizer = self.service.engine.tokenizer
        strs = [tokenizer.id_to_token(t) for t in ids] if body.get("return_token_strs") else None
        length = self.service.engine.config.max_model_len
        return web.json_response(
            {"count": len(ids), "max_model_len": length, "tokens": ids, "token_strs": strs}
        )

    def _tokenize(self, body: dict) -> list[int]:
        if "messages" in body:
            return self.chat.prompt_ids(body, None)
        prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(prompt, str) or not isinstance(special, bool):
            raise InvalidRequestError(
                "prompt", "must be a string (add_special_tokens a boolean), or send messages"
            )
        return self.completions.encode(prompt, special)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if isinstance(body, web.Response):
            return body
        tokens, vocab = body.get("tokens"), self.service.engine.model.config.vocab_size
        try:
            self.models.check(body)
            if not protocol.token_ids(tokens) or not all(0 <= t < vocab for t in tokens):
                raise InvalidRequestError("tokens", f"must be a list of token ids in [0, {vocab})")
            if len(tokens) > self.service.engine.config.max_model_len:
                raise InvalidRequestError("tokens", f"more than {self.service.engine.config.max_model_len}")
        except REFUSALS as e:
            return refusal(e)
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
