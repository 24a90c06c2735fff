"""A small Python client of the Generation service (what `pdserve generate --server` uses)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import grpc

from pdserve.v1 import admin_pb2, admin_pb2_grpc
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from services.grpc_server import channel_options
from services.security import ChannelSecurity, bearer_metadata, channel_credentials, read_tokens


@dataclasses.dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # time to the first token, seen by the client
    token_times_s: list[float]  # arrival time of each token since the call started


FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in pb.FinishReason.items()}


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    chat: Sequence[dict] | None = None,
    max_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    logprobs: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    lora_adapter: str = "",
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, max_tokens=max_tokens, lora_adapter=lora_adapter)
    if chat is not None:
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in chat)
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    s = request.sampling
    s.temperature, s.top_k, s.min_p = temperature, top_k, min_p
    if top_p is not None:
        s.top_p = top_p
    if seed is not None:
        s.seed = seed
    if logprobs is not None:
        s.logprobs = logprobs
    request.stop.stop.extend(stop)
    request.stop.stop_token_ids.extend(stop_token_ids)
    request.stop.ignore_eos = ignore_eos
    return request


class Client:
    """Blocking client; thread-safe (one channel, many concurrent calls).

    `credentials`: TLS (services.security.channel_credentials; None: plaintext); `token`: a bearer token
    sent with every call.
    """

    def __init__(
        self, target: str, credentials: grpc.ChannelCredentials | None = None, token: str | None = None
    ):
        self.channel = ChannelSecurity(credentials).open(target, channel_options())
        self.metadata = bearer_metadata(token)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    @classmethod
    def connect(
        cls,
        target: str,
        *,
        tls: bool = False,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        token_file: str | None = None,
    ) -> Client:
        """A client from command-line settings: TLS when `tls` or any PEM is given (the system roots
        without `ca`), the first token of `token_file`. Raises ValueError / OSError for unusable files."""
        credentials = channel_credentials(ca, cert, key) if tls or ca or cert or key else None
        token = read_tokens(token_file)[0] if token_file else None
        return cls(target, credentials=credentials, token=token)

    def stream(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def generate(self, *args, timeout: float | None = None, **kwargs) -> Completion:
        """Runs one request to completion (see build_request for the arguments)."""
        start = time.perf_counter()
        token_ids, text, times = [], [], []
        last = pb.GenerateResponse()
        for response in self.stream(build_request(*args, **kwargs), timeout=timeout):
            now = time.perf_counter() - start
            token_ids += response.token_ids
            times += [now] * len(response.token_ids)
            text.append(response.text)
            last = response
        return Completion(
            request_id=last.request_id,
            token_ids=token_ids,
            text="".join(text),
            finish_reason=FINISH_NAMES[last.finish_reason],
            prompt_tokens=last.usage.prompt_tokens,
            completion_tokens=last.usage.completion_tokens,
            ttft_s=times[0] if times else float("nan"),
            token_times_s=times,
        )

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def load_lora(self, name: str, path: str) -> admin_pb2.LoraAdapterInfo:
        """Loads a PEFT adapter folder (a path on the server's filesystem) under `name`."""
        request = admin_pb2.LoadLoraAdapterRequest(name=name, path=path)
        return self.admin.LoadLoraAdapter(request, metadata=self.metadata)

    def unload_lora(self, name: str) -> None:
        self.admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(name=name), metadata=self.metadata)

    def list_loras(self) -> admin_pb2.LoraAdapterList:
        return self.admin.ListLoraAdapters(admin_pb2.ListLoraAdaptersRequest(), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()
