"""A small Python client of the Generation service (what `pdserve generate --server` uses)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterator, Sequence

import grpc

from pdserve.engine.sampling_params import Constraint
from pdserve.services.grpc_server import channel_options
from pdserve.services.sampling import set_constraint, set_request_fields
from pdserve.services.security import ChannelSecurity, bearer_metadata, channel_credentials, read_tokens
from pdserve.services.wire import FINISH_NAMES, logprobs_from_proto
from pdserve.v1 import admin_pb2, admin_pb2_grpc
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc


@dataclasses.dataclass
class Completion:
    """One finished request as a client saw it (also what `pdserve generate --json` prints)."""

    request_id: str = ""
    prompt_ids: list[int] = dataclasses.field(default_factory=list)  # when asked for (return_prompt_ids)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, found in a prefix cache (not computed again)
    completion_tokens: int = 0
    token_times_s: list[float] = dataclasses.field(default_factory=list)  # each token's arrival since start
    logprobs: list = dataclasses.field(default_factory=list)  # TokenLogprobs per token, when asked for
    prompt_logprobs: list = dataclasses.field(
        default_factory=list
    )  # per prompt token after the first, if asked

    @property
    def ttft_s(self) -> float:
        """Time to the first token, seen by the client (NaN without tokens)."""
        return self.token_times_s[0] if self.token_times_s else float("nan")

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None below two tokens)."""
        times = self.token_times_s
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    def add(self, response: pb.GenerateResponse, now_s: float) -> None:
        """Folds one streamed response in, `now_s` after the request started."""
        self.request_id = response.request_id or self.request_id
        self.prompt_ids += response.prompt_ids
        self.token_ids += response.token_ids
        self.token_times_s += [now_s] * len(response.token_ids)
        self.text += response.text
        self.logprobs += [logprobs_from_proto(lp) for lp in response.logprobs]
        self.prompt_logprobs += [logprobs_from_proto(lp) for lp in response.prompt_logprobs]
        if response.finish_reason:
            self.finish_reason = FINISH_NAMES[response.finish_reason]
            self.prompt_tokens = response.usage.prompt_tokens
            self.cached_prompt_tokens = response.usage.cached_prompt_tokens
            self.completion_tokens = response.usage.completion_tokens

    def record(self, startup_s: float | None = None) -> dict:
        """The JSON record of `pdserve generate --json` (local or --server: the same fields)."""
        return {
            "prompt_ids": self.prompt_ids,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "timings": {
                "startup_s": startup_s,
                "ttft_s": self.token_times_s[0] if self.token_times_s else None,
                "tpot_s": self.tpot_s,
                "token_times_s": self.token_times_s,
            },
        }


def add_client_flags(parser: argparse.ArgumentParser, server_help: str, required: bool = False) -> None:
    """--server and the TLS / mTLS / token flags of every command that calls a daemon."""
    parser.add_argument("--server", default=None, required=required, help=server_help)
    tls = parser.add_argument_group("with --server: TLS and auth (default: plaintext, no token)")
    tls.add_argument("--tls", action="store_true", help="TLS, server verified against the system roots")
    tls.add_argument("--tls-ca", metavar="PEM", help="TLS, server verified against this CA")
    tls.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    tls.add_argument("--tls-key", metavar="PEM", help="its private key")
    tls.add_argument("--token-file", metavar="FILE", help="bearer token (the file's first token)")


def client_from_flags(args: argparse.Namespace) -> Client | None:
    """A Client for --server with the add_client_flags settings; None (error printed) when they fail."""
    try:
        return Client.connect(
            args.server,
            tls=args.tls,
            ca=args.tls_ca,
            cert=args.tls_cert,
            key=args.tls_key,
            token_file=args.token_file,
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    chat: Sequence[dict] | None = None,
    request_id: str = "",
    lora_adapter: str = "",
    return_prompt_ids: bool = False,
    constraint: Constraint | None = None,
    cache_salt: str = "",
    **sampling_fields,
) -> pb.GenerateRequest:
    """A GenerateRequest. `sampling_fields`: any knob of services.sampling.FIELDS by its SamplingParams
    name (temperature, top_p, ..., max_tokens, stop, stop_token_ids, ignore_eos); left out or None: the
    server's default (greedy, 256 tokens). `constraint`: structured output (None: free text).
    `cache_salt`: the tenant's prefix-cache salt (GenerateRequest.cache_salt)."""
    request = pb.GenerateRequest(
        request_id=request_id,
        lora_adapter=lora_adapter,
        return_prompt_ids=return_prompt_ids,
        cache_salt=cache_salt,
    )
    if constraint is not None:
        set_constraint(request.constraint, constraint)
    if chat is not None:
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in chat)
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    return set_request_fields(request, sampling_fields)


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
        return self.generate_request(build_request(*args, **kwargs), timeout=timeout)

    def generate_request(
        self, request: pb.GenerateRequest, timeout: float | None = None, on_response=None
    ) -> Completion:
        """Runs a built request (of one sequence) to completion; `on_response(r)` sees each
        GenerateResponse as it arrives."""
        if request.sampling.n > 1:
            raise ValueError("a request of n > 1 sequences: use generate_sequences")
        return self.generate_sequences(request, timeout, on_response)[0]

    def generate_sequences(
        self, request: pb.GenerateRequest, timeout: float | None = None, on_response=None
    ) -> list[Completion]:
        """Runs a built request to completion: one Completion per sequence (its n, in index order)."""
        start = time.perf_counter()
        completions: dict[int, Completion] = {}
        for response in self.stream(request, timeout=timeout):
            completions.setdefault(response.index, Completion()).add(response, time.perf_counter() - start)
            if on_response is not None:
                on_response(response)
        return [completions[i] for i in sorted(completions)]

    def stats(self, timeout: float | None = 30.0) -> admin_pb2.ServerStats:
        """The daemon's Admin.GetStats: blocks used and free, queues, requests and transfer totals."""
        return self.admin.GetStats(admin_pb2.GetStatsRequest(), timeout=timeout, metadata=self.metadata)

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
