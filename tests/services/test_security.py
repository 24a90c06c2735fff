"""Transport security with real daemons on loopback: a prefill-server that requires mutual TLS with a
`decode` client certificate, and a decode-server with TLS and bearer tokens on its public port that
reaches the prefill-server over mutual TLS. Plaintext and untrusted clients are refused, tokens are
checked, the rogue certificate is denied, oversized requests are refused, and neither the prompt nor the
token reaches the logs. Certificates are made here with `cryptography`."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.client import Client, build_request
from pdserve.services.security import ChannelSecurity, ServerSecurity, bearer_metadata, channel_credentials
from pdserve.testing.launch import ServerThread, decode_server, prefill_server
from pdserve.v1 import admin_pb2, admin_pb2_grpc, prefill_pb2

pytestmark = pytest.mark.daemon

TOKEN = "tok-7f3a9c1e5b2d48e6a0c4"
OTHER_TOKEN = "tok-second-b81d"
WRONG_TOKEN = "tok-wrong-55aa3e"
SECRET_PROMPT = "Quixotic marmoset 48213 recites the zebra ledger:"
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


# --- certificates ---------------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(cn, issuer_key=None, issuer_cn=None, *, ca=False, sans=(), usage=ExtendedKeyUsageOID.CLIENT_AUTH):
    """A key and a certificate for `cn`, signed by the issuer (self-signed without one)."""
    key = ec.generate_private_key(ec.SECP256R1())
    issuer_key = issuer_key or key
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(issuer_cn or cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return key, builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, key, cert) -> tuple[str, str]:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (cert PEM path, key PEM path): ca, server, decode, intruder (same CA), untrusted
    (self-signed, CN=decode)."""
    directory = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _issue("pdserve test CA", ca=True)
    sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    return {
        "ca": _write(directory, "ca", ca_key, ca_cert),
        "server": _write(
            directory,
            "server",
            *_issue(
                "pdserve-server", ca_key, "pdserve test CA", sans=sans, usage=ExtendedKeyUsageOID.SERVER_AUTH
            ),
        ),
        "decode": _write(directory, "decode", *_issue("decode", ca_key, "pdserve test CA")),
        "intruder": _write(directory, "intruder", *_issue("intruder", ca_key, "pdserve test CA")),
        "untrusted": _write(directory, "untrusted", *_issue("decode", sans=sans)),
    }


def creds(pki, root="ca", client=None) -> grpc.ChannelCredentials:
    cert, key = pki[client] if client else (None, None)
    return channel_credentials(pki[root][0], cert, key)


# --- daemons ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure_prefill(model_path, log_dir, pki, tokens):
    cert, key = pki["server"]
    tls = ["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"][0], "--require-client-cert"]
    extra = [
        *tls,
        "--auth-token-file",
        str(tokens),
    ]  # the decode server's token too, not only its certificate
    daemon = prefill_server(model_path, log_dir, name="prefill-mtls", extra=extra)
    yield daemon
    assert daemon.terminate() == 0


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# tokens of the test clients\n{TOKEN}\n\n{OTHER_TOKEN}\n")
    return path


@pytest.fixture(scope="module")
def secure_decode(model_path, log_dir, pki, secure_prefill, tokens):
    cert, key = pki["server"]
    decode_cert, decode_key = pki["decode"]
    extra = [
        *("--tls-cert", cert, "--tls-key", key, "--auth-token-file", str(tokens), "--http-port", "0"),
        *(
            "--prefill-tls-ca",
            pki["ca"][0],
            "--prefill-tls-cert",
            decode_cert,
            "--prefill-tls-key",
            decode_key,
        ),
        *("--prefill-auth-token-file", str(tokens)),
    ]
    daemon = decode_server(model_path, secure_prefill.address, log_dir, name="decode-tls", extra=extra)
    yield daemon
    assert daemon.terminate() == 0


def health_status(address: str, security: ChannelSecurity) -> int:
    with security.open(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def prefill_stats(address: str, pki, client="decode", token=TOKEN) -> admin_pb2.ServerStats:
    return Client(address, credentials=creds(pki, client=client), token=token).stats()


# --- tests -----------------------------------------------------------------------------------------


def test_plaintext_and_untrusted_clients_are_refused(secure_prefill, secure_decode, pki):
    plaintext = ChannelSecurity()
    for address in (secure_prefill.address, secure_decode.address):
        assert code_of(lambda a=address: health_status(a, plaintext)) == grpc.StatusCode.UNAVAILABLE
    # the client does not trust the server's CA
    client = Client(secure_decode.address, credentials=creds(pki, root="untrusted"), token=TOKEN)
    assert code_of(lambda: client.generate("Hi", max_tokens=2)) == grpc.StatusCode.UNAVAILABLE
    untrusting = ChannelSecurity(creds(pki, root="untrusted", client="decode"))
    assert code_of(lambda: health_status(secure_prefill.address, untrusting)) == grpc.StatusCode.UNAVAILABLE
    # the server does not trust the client's (self-signed) certificate, nor a client without one
    for client_cert in ("untrusted", None):
        security = ChannelSecurity(creds(pki, client=client_cert))
        code = code_of(lambda s=security: health_status(secure_prefill.address, s))
        assert code == grpc.StatusCode.UNAVAILABLE, client_cert


def test_health_is_open_without_token(secure_prefill, secure_decode, pki):
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health_status(secure_decode.address, ChannelSecurity(creds(pki))) == serving
    intruder = ChannelSecurity(creds(pki, client="intruder"))  # probes need no particular identity
    assert health_status(secure_prefill.address, intruder) == serving


def test_missing_or_wrong_token_is_unauthenticated(secure_decode, pki):
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    for token in (None, WRONG_TOKEN, TOKEN[:-1], TOKEN + "x"):
        client = Client(secure_decode.address, credentials=creds(pki), token=token)
        assert code_of(lambda c=client: c.generate("Hi", max_tokens=2)) == unauthenticated, token
        assert code_of(client.model_info) == unauthenticated
    with ChannelSecurity(creds(pki)).open(secure_decode.address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        get_stats = stub.GetStats
        assert code_of(lambda: get_stats(admin_pb2.GetStatsRequest())) == unauthenticated
        basic = (("authorization", f"Basic {TOKEN}"),)
        assert code_of(lambda: get_stats(admin_pb2.GetStatsRequest(), metadata=basic)) == unauthenticated
        stats = get_stats(admin_pb2.GetStatsRequest(), metadata=bearer_metadata(OTHER_TOKEN))
        assert stats.role == "decode"


def test_right_token_is_served_over_mtls_end_to_end(secure_prefill, secure_decode, pki, colocated):
    before = prefill_stats(secure_prefill.address, pki).num_requests_total
    client = Client(secure_decode.address, credentials=creds(pki), token=TOKEN)
    assert client.model_info().prefill_mode == "remote"
    got = client.generate("The capital of France is", **GREEDY)
    assert got.token_ids == colocated("The capital of France is", **GREEDY) and got.finish_reason == "length"
    assert prefill_stats(secure_prefill.address, pki).num_requests_total == before + 1  # went remote
    second = Client(secure_decode.address, credentials=creds(pki), token=OTHER_TOKEN)
    assert second.generate("The capital of France is", **GREEDY).token_ids == got.token_ids


def test_cancelled_stream_through_the_token_check_frees_its_blocks(secure_decode, pki):
    import time

    client = Client(secure_decode.address, credentials=creds(pki), token=TOKEN)
    stream = client.stream(build_request("Count to a thousand:", max_tokens=500, ignore_eos=True))
    assert next(stream).token_ids
    stream.cancel()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the abort reaches the engine thread asynchronously
        stats = client.stats()
        if stats.num_running == 0 and stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks:
            break
        time.sleep(0.1)
    assert stats.num_running == 0 and stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks, (
        stats
    )


def test_http_api_takes_the_public_ports_tls_and_tokens(secure_decode, pki):
    """The OpenAI HTTP API of a decode server with TLS and tokens: HTTPS with the same certificate, 401
    without the right bearer token (/tokenize included), answers with it; /health and /metrics answer
    without one (load balancers' checks, scrapes); plaintext HTTP does not connect."""
    import ssl

    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx2")  # the openai client's HTTP library
    tls = httpx.Client(verify=ssl.create_default_context(cafile=pki["ca"][0]))
    base = f"https://{secure_decode.addresses['http']}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key=WRONG_TOKEN, http_client=tls).models.list()
    client = openai.OpenAI(base_url=base, api_key=TOKEN, http_client=tls)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2
    plaintext = openai.OpenAI(base_url=base.replace("https", "http"), api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        plaintext.models.list()
    root = base.removesuffix("/v1")
    assert tls.get(f"{root}/health").status_code == 200
    scrape = tls.get(f"{root}/metrics")
    assert scrape.status_code == 200 and "pdserve_engine_info" in scrape.text
    assert tls.post(f"{root}/tokenize", json={"prompt": "x"}).status_code == 401
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert tls.post(f"{root}/tokenize", json={"prompt": "x"}, headers=headers).status_code == 200


def test_cli_generate_with_tls_ca_and_token_file(secure_decode, pki, tokens, capsys):
    from pdserve.cli import main

    argv = ["generate", "--server", secure_decode.address, "--tls-ca", pki["ca"][0], "--json"]
    argv += ["--max-tokens", "3", "Hello"]
    assert main([*argv, "--token-file", str(tokens)]) == 0
    assert '"finish_reason": "length"' in capsys.readouterr().out
    assert main(argv) == 2  # no token
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_prefill_refuses_rogue_certificate(secure_prefill, pki):
    with ChannelSecurity(creds(pki, client="intruder")).open(secure_prefill.address) as channel:
        handshake = channel.unary_unary(
            "/pdserve.v1.Prefill/Handshake",
            request_serializer=prefill_pb2.HandshakeRequest.SerializeToString,
        )
        prefill = channel.unary_stream(
            "/pdserve.v1.Prefill/Prefill", request_serializer=prefill_pb2.PrefillRequest.SerializeToString
        )
        denied, token = (
            grpc.StatusCode.PERMISSION_DENIED,
            bearer_metadata(TOKEN),
        )  # a stolen token: not enough
        request = prefill_pb2.HandshakeRequest(layout_json="{}")
        assert code_of(lambda: handshake(request, metadata=token)) == denied
        request = prefill_pb2.PrefillRequest(prompt_ids=[1, 2])
        assert code_of(lambda: list(prefill(request, metadata=token))) == denied
    assert code_of(lambda: prefill_stats(secure_prefill.address, pki, client="intruder")) == denied
    assert prefill_stats(secure_prefill.address, pki).role == "prefill"  # the decode certificate is let in


def test_prefill_asks_for_a_token_too(secure_prefill, pki):
    """With --auth-token-file a prefill server refuses its Admin and Prefill services to a caller with
    the right certificate but no token, or a wrong one (its decode servers present theirs:
    --prefill-auth-token-file, used by every other test of this module)."""
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    for token in (None, WRONG_TOKEN):
        assert code_of(lambda t=token: prefill_stats(secure_prefill.address, pki, token=t)) == unauthenticated
    with ChannelSecurity(creds(pki, client="decode")).open(secure_prefill.address) as channel:
        handshake = channel.unary_unary(
            "/pdserve.v1.Prefill/Handshake",
            request_serializer=prefill_pb2.HandshakeRequest.SerializeToString,
        )
        assert code_of(lambda: handshake(prefill_pb2.HandshakeRequest(layout_json="{}"))) == unauthenticated


def test_oversized_request_is_refused_and_daemon_keeps_serving(secure_decode, pki):
    request = build_request("word " * (2 << 20), max_tokens=2)  # 10 MiB > the 8 MiB limit
    options = [("grpc.max_send_message_length", 64 << 20)]  # so that the server, not this client, refuses
    with ChannelSecurity(creds(pki)).open(secure_decode.address, options) as channel:
        generate = channel.unary_stream(
            "/pdserve.v1.Generation/Generate", request_serializer=type(request).SerializeToString
        )
        code = code_of(lambda: list(generate(request, metadata=bearer_metadata(TOKEN))))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    client = Client(secure_decode.address, credentials=creds(pki), token=TOKEN)
    assert client.generate("Still serving", max_tokens=2, ignore_eos=True).completion_tokens == 2


def test_logs_hold_no_prompt_or_token(secure_prefill, secure_decode, pki):
    client = Client(secure_decode.address, credentials=creds(pki), token=TOKEN)
    assert client.generate(SECRET_PROMPT, max_tokens=4, ignore_eos=True).completion_tokens == 4
    wrong = Client(secure_decode.address, credentials=creds(pki), token=WRONG_TOKEN)
    assert code_of(lambda: wrong.generate(SECRET_PROMPT, max_tokens=2)) == grpc.StatusCode.UNAUTHENTICATED
    for daemon in (secure_prefill, secure_decode):
        text = daemon.log_path.read_text()
        for secret in ("marmoset", "zebra ledger", TOKEN, OTHER_TOKEN, WRONG_TOKEN):
            assert secret not in text, (daemon.name, secret)


def test_peer_names_are_checked_in_process(pki):
    """The peer-name check on its own (an in-process server, no engine): the decode certificate is let in,
    another certificate of the same CA is denied, a client without one cannot complete the handshake."""
    import asyncio
    import queue

    from pdserve.services.grpc_server import add_port, make_server

    cert, key = pki["server"]
    security = ServerSecurity(
        cert=cert, key=key, client_ca=pki["ca"][0], require_client_cert=True, allowed_peers=("decode",)
    )
    ready: queue.Queue[str] = queue.Queue()

    async def serve(stop: asyncio.Event):
        server, _ = make_server(["pdserve.v1.Admin"], security)

        async def get_stats(request, context):
            return admin_pb2.ServerStats(role="test")

        admin = grpc.method_handlers_generic_handler(
            "pdserve.v1.Admin",
            {
                "GetStats": grpc.unary_unary_rpc_method_handler(
                    get_stats,
                    request_deserializer=admin_pb2.GetStatsRequest.FromString,
                    response_serializer=admin_pb2.ServerStats.SerializeToString,
                )
            },
        )
        server.add_generic_rpc_handlers((admin,))
        port = add_port(server, "127.0.0.1", 0, security)
        await server.start()
        ready.put(f"127.0.0.1:{port}")
        await stop.wait()
        await server.stop(1)

    thread = ServerThread(serve)
    try:
        address = ready.get(timeout=30)
        denied = code_of(lambda: prefill_stats(address, pki, client="intruder"))
        assert denied == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda: prefill_stats(address, pki, client=None)) == grpc.StatusCode.UNAVAILABLE
        assert prefill_stats(address, pki).role == "test"
    finally:
        thread.stop()


def test_security_config_is_checked(tmp_path, pki):
    from pdserve.daemons import prefill_main
    from pdserve.services.security import read_tokens

    cert, key = pki["server"]
    base = ["--model", "unused", "--port", "0", "--tls-cert", cert, "--tls-key", key]
    with pytest.raises(SystemExit, match="optional client certificate"):  # before any engine is built
        prefill_main([*base, "--tls-client-ca", pki["ca"][0]])
    with pytest.raises(SystemExit, match="No such file"):
        prefill_main([*base[:-1], str(tmp_path / "missing.key")])

    with pytest.raises(ValueError):
        ServerSecurity(cert="server.pem")  # no key
    with pytest.raises(ValueError):
        ServerSecurity(require_client_cert=True)
    with pytest.raises(ValueError, match="optional client certificate"):
        ServerSecurity(cert="server.pem", key="server.key", client_ca="ca.pem")  # not required
    empty = tmp_path / "tokens"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError):
        read_tokens(empty)
