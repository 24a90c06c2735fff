"""Transport security of the daemons: TLS / mutual TLS credentials, bearer tokens on the public API and the
peer-certificate check of the internal Prefill service.

Everything is off by default (plaintext, no auth). A server's policy is a `ServerSecurity`; its checks run
in one interceptor that leaves grpc.health.v1 open for probes. Clients open channels with a
`ChannelSecurity` (credentials from `channel_credentials`) and send `bearer_metadata(token)` with each call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import inspect
import logging
import ssl
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

OPEN_METHODS_PREFIX = "/grpc.health.v1.Health/"  # probes need no token and no client identity


def read_tokens(path: str | Path) -> tuple[str, ...]:
    """Bearer tokens from a file: one per line; blank lines and lines starting with `#` are skipped."""
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    tokens = tuple(line for line in lines if line and not line.startswith("#"))
    if not tokens:
        raise ValueError(f"{path}: no token in the file")
    return tokens


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel_credentials(
    ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials of a client: `ca` verifies the server (default: the system roots); `cert` and `key`
    are the client certificate presented for mutual TLS."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs both its cert and its key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert)
    )


@dataclasses.dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches a server: TLS `credentials` (None: plaintext), optionally the name to check
    the server certificate against instead of the target's host (e.g. targets resolved to pod IPs), and
    the bearer token its calls present."""

    credentials: grpc.ChannelCredentials | None = None
    server_name: str | None = None
    token: str | None = None  # presented with each call (`metadata`) to a server that asks for tokens

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.token)

    def open(self, target: str, options=(), aio: bool = False):
        """A blocking (or grpc.aio) channel to `target`, secure when there are credentials."""
        module = grpc.aio if aio else grpc
        if self.credentials is None:
            return module.insecure_channel(target, options=list(options))
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return module.secure_channel(target, self.credentials, options=list(options))


PLAINTEXT = ChannelSecurity()


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """What a listening port requires. Without `cert` the port is plaintext.

    cert, key: the server's certificate chain and private key (PEM files).
    client_ca: CA that signs client certificates (mutual TLS); needs `require_client_cert`, which refuses
        a TLS handshake without one (gRPC Python cannot ask for an optional client certificate).
    tokens: accepted bearer tokens; when set, every call but health checks needs
        `authorization: Bearer <token>` (else UNAUTHENTICATED).
    allowed_peers: names of which the client certificate's common name or a SAN must be one (else
        PERMISSION_DENIED); only checked when set.
    """

    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None
    require_client_cert: bool = False
    tokens: tuple[str, ...] = ()
    allowed_peers: tuple[str, ...] = ()

    def __post_init__(self):
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS needs both a certificate and its key")
        if self.client_ca and not self.cert:
            raise ValueError("a client CA (mutual TLS) needs the server's own certificate and key")
        if self.require_client_cert != bool(self.client_ca):
            raise ValueError(
                "mutual TLS needs both the client CA and require_client_cert (--require-client-cert): "
                "gRPC Python cannot ask for an optional client certificate"
            )
        if self.allowed_peers and not self.client_ca:
            raise ValueError("checking peer names needs mutual TLS (a client CA)")

    def credentials(self) -> grpc.ServerCredentials | None:
        """The port's TLS credentials, or None for plaintext."""
        if self.cert is None:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.client_ca),
            require_client_auth=self.require_client_cert,
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The same TLS / mutual TLS for an HTTP port (the OpenAI API), or None for plaintext."""
        if self.cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            context.load_verify_locations(self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The interceptor that enforces tokens and peer names (none when neither is configured)."""
        if self.tokens and self.cert is None:
            log.warning("bearer tokens on a plaintext port: they can be read on the network")
        return [_Guard(self)] if self.tokens or self.allowed_peers else []

    async def check(self, context: grpc.aio.ServicerContext) -> None:
        """Aborts the call (UNAUTHENTICATED, PERMISSION_DENIED) unless it passes this policy."""
        if self.tokens and not token_ok(context.invocation_metadata(), self.tokens):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        if self.allowed_peers and not peer_names(context) & set(self.allowed_peers):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"client certificate is not one of {sorted(self.allowed_peers)}",
            )


def peer_names(context: grpc.aio.ServicerContext) -> set[str]:
    """The verified client certificate's common name and subject alternative names (empty without one)."""
    auth = context.auth_context()
    values = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return {v.decode() if isinstance(v, bytes) else v for v in values}


def token_ok(metadata, tokens: tuple[str, ...]) -> bool:
    """Whether (key, value) pairs carry `authorization: Bearer <one of tokens>` (constant-time compare)."""
    header = next((value for key, value in metadata or () if key == "authorization"), "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return False
    presented_bytes = presented.strip().encode()
    ok = False
    for token in tokens:  # every token is compared, in constant time
        ok |= hmac.compare_digest(presented_bytes, token.encode())
    return ok


def _read(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


class _Guard(grpc.aio.ServerInterceptor):
    """Runs `ServerSecurity.check` before every method but the health checks."""

    def __init__(self, security: ServerSecurity):
        self.security = security

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHODS_PREFIX):
            return handler
        return _guarded(handler, self.security.check)


def _guarded(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """`handler` with `await check(context)` run before its behaviour; same kind and (de)serializers."""
    kind = f"{'stream' if handler.request_streaming else 'unary'}_"
    kind += "stream" if handler.response_streaming else "unary"
    behavior = getattr(handler, kind)
    if inspect.isasyncgenfunction(behavior):

        async def wrapped(request, context):
            await check(context)
            async with contextlib.aclosing(behavior(request, context)) as responses:  # its cleanup runs now
                async for response in responses:
                    yield response

    else:

        async def wrapped(request, context):
            await check(context)
            return await behavior(request, context)

    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
