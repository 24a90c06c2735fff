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
    seed: int | None = None  # the seed it sampled with (its own, or the one its server drew)
    num_resumes: int = 0  # times its stream broke and was resumed on another server (Client)
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
        if response.HasField("seed"):
            self.seed = response.seed
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


# A stream that ends with one of these after it started broke on the server's side (it died, or it was
# drained past its grace period): the request is resumed on the next target. Others are answers (a bad
# request, the engine failing on this one, a deadline) and are raised.
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED})
RESUME_BACKOFF_S = (0.2, 0.5, 1.0, 2.0)  # before each further attempt (the last one repeats)


def resumption(
    request: pb.GenerateRequest, received: Completion | None, seed: int | None
) -> pb.GenerateRequest:
    """`request` sent again after its stream broke: with the tokens `received` so far (none: it starts
    over) to resume from, and the `seed` its first server reported when it had none of its own."""
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    if received is not None and received.token_ids:
        again.resume_token_ids[:] = received.token_ids
        again.return_prompt_ids = False  # (the first message brought them)
    if seed is not None and not request.sampling.HasField("seed"):
        again.sampling.seed = seed
    return again


class Client:
    """Blocking client; thread-safe (one channel per target, many concurrent calls).

    `target`: ADDR, dns:///NAME:PORT, or several of them separated by commas. A request whose stream
    breaks (RESUMABLE: its server died or went away) is sent again, to the next target (the same one when
    there is one: a Service's address reaches another pod), up to `max_resumes` times (default: 3 with
    several targets, none with one, whose errors are the caller's to see); after tokens came,
    as a resumption (GenerateRequest.resume_token_ids) with the seed the first server reported, so the
    caller sees one uninterrupted output (greedy and seeded: the very tokens; a request of n > 1 sequences
    is not resumed). Stats, model info and adapters go to the first target.
    `credentials`: TLS (services.security.channel_credentials; None: plaintext); `token`: a bearer token
    sent with every call.
    """

    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        max_resumes: int | None = None,
    ):
        targets = [t.strip() for t in target.split(",") if t.strip()]
        if not targets:
            raise ValueError(f"no target in {target!r}")
        security = ChannelSecurity(credentials)
        self.channels = [security.open(t, channel_options()) for t in targets]
        self.channel = self.channels[0]
        self.metadata = bearer_metadata(token)
        self.stubs = [pb_grpc.GenerationStub(c) for c in self.channels]
        self.stub = self.stubs[0]
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.max_resumes = max_resumes if max_resumes is not None else (3 if len(targets) > 1 else 0)
        self.num_resumes = 0  # streams resumed elsewhere so far (all calls)

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
        """Runs a built request to completion: one Completion per sequence (its n, in index order),
        resumed on another target if its stream breaks (see the class)."""
        start = time.perf_counter()
        completions: dict[int, Completion] = {}
        seed, target, attempt = None, 0, request
        for resumes in range(self.max_resumes + 1):
            remaining = None if timeout is None else max(0.0, timeout - (time.perf_counter() - start))
            try:
                for response in self.stubs[target].Generate(
                    attempt, timeout=remaining, metadata=self.metadata
                ):
                    if response.HasField("seed") and seed is None:  # (a resumption's: the same)
                        seed = response.seed
                    completions.setdefault(response.index, Completion()).add(
                        response, time.perf_counter() - start
                    )
                    if on_response is not None:
                        on_response(response)
                return [completions[i] for i in sorted(completions)]
            except grpc.RpcError as e:
                received = any(c.token_ids for c in completions.values())
                if (
                    e.code() not in RESUMABLE
                    or resumes == self.max_resumes
                    or (received and request.sampling.n > 1)
                ):
                    raise
            time.sleep(RESUME_BACKOFF_S[min(resumes, len(RESUME_BACKOFF_S) - 1)])
            target = (target + 1) % len(self.stubs)
            attempt = resumption(request, completions.get(0), seed)
            self.num_resumes += 1
            for completion in completions.values():
                completion.num_resumes += 1
        raise AssertionError("unreachable")

    def stats(self, timeout: float | None = 30.0) -> admin_pb2.ServerStats:
        """The daemon's Admin.GetStats: blocks used and free, queues, requests and transfer totals."""
        return self.admin.GetStats(admin_pb2.GetStatsRequest(), timeout=timeout, metadata=self.metadata)

    def drain(self, timeout: float | None = 30.0) -> admin_pb2.DrainResponse:
        """The daemon's Admin.Drain: it drains as on SIGTERM (a decode server with --migrate-to moves its
        running requests to its peers) and exits once drained."""
        return self.admin.Drain(admin_pb2.DrainRequest(), timeout=timeout, metadata=self.metadata)

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
        for channel in self.channels:
            channel.close()
