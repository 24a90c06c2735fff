"""The roles composed: the command lines of `prefill-server`, `decode-server` and `pdserve serve` (both roles
in one process). The only module that imports both services/prefill and services/decode."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys

from pdserve.engine.compile_cache import configure_jax
from pdserve.engine.distributed import ProcessGroup, add_distributed_args, join, process_group
from pdserve.flags import (
    add_config_flags,
    add_deprecated_flags,
    add_engine_args,
    config_from_flags,
    engine_config,
    load_adapters,
    log_deprecations,
)
from pdserve.services.decode.openai.reasoning import PARSERS as REASONING_PARSERS
from pdserve.services.decode.tool_formats import PARSERS
from pdserve.services.sampling import add_limit_flags, limits_from_flags

EXIT_ENGINE_FAILED = 4  # the engine could not serve any more (services.engine_loop): restart the process
HTTP_PORT = 8000  # decode-server's OpenAI API, on by default (--no-http: off)
KV_EVENTS_MODES = ("authenticated", "plain", "off")  # --kv-events: who may read them (kv_events_config)


@contextlib.contextmanager
def refusing_unloadable_models():
    """A model reference that cannot be served (engine.loading.sources.MODEL_ERRORS: not found, an
    architecture or config feature pdserve lacks) ends the command with one line on stderr, exit status 1."""
    from pdserve.engine.loading.sources import MODEL_ERRORS

    try:
        yield
    except MODEL_ERRORS as e:
        raise SystemExit(f"error: {e}") from None


def use_cpu_devices(count: int) -> None:
    """On a CPU-only host, expose `count` CPU devices (for TP or disjoint role device sets); call before
    JAX is imported."""
    if count > 1 and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
        )


def keep_freed_memory() -> None:
    """glibc: buffers up to 32 MiB (KV frames, gRPC messages, host copies) come from the heap, and up to
    256 MiB of freed heap stays mapped, so each transfer's fresh buffers reuse pages instead of
    page-faulting new ones (measured: a frame serialized 3.6x faster, KV over gRPC 10-25% faster; see
    docs/benchmark-history.md, "kvtransfer"). No-op without glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 256 << 20)


def prepare_process(args: argparse.Namespace, num_cpu_devices: int) -> None:
    """Before JAX is imported: CPU devices, the allocator, logging."""
    use_cpu_devices(num_cpu_devices)
    keep_freed_memory()
    from pdserve.services.logs import configure_logging

    configure_logging(args.log_level, args.log_format)
    log_deprecations(args, logging.getLogger(__name__))


def common_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_deprecated_flags(parser)
    add_distributed_args(parser)
    parser.add_argument("--port", type=int, required=True, help="0: pick a free port (printed)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--cpu-devices", type=int, default=0, help="fake CPU devices (CPU-only hosts)")
    parser.add_argument("--no-warmup", action="store_true", help="compile shapes lazily (tests, laptops)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="log a stats line (throughput, running, waiting, KV use, hit rate) every S s not idle; 0: off",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="what clients call the model (the OpenAI API's `model`, the KV events' topic); the first is "
        "the one responses carry (default: --model as given)",
    )
    parser.add_argument(
        "--log-format", choices=["text", "json"], default="text", help="json: one object a line"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus /metrics HTTP port (0: any)"
    )
    parser.add_argument(
        "--lora-root",
        metavar="DIR",
        help="Admin.LoadLoraAdapter reads adapter folders inside DIR only (default: run-time loads off)",
    )
    parser.add_argument(
        "--engine-step-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="a step running longer means a hung engine: NOT_SERVING, then exit 4",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="export OpenTelemetry traces of each request's phases over OTLP/gRPC to URL (http://HOST:PORT: "
        "plaintext); the W3C traceparent a caller sends is their parent (services/tracing.py; the tracing "
        "extra); default: off",
    )
    parser.add_argument(
        "--step-log",
        metavar="FILE",
        help="append each engine step's rows and wall time to FILE, a JSON line each (engine/step_log.py; "
        "`pdserve profile --from-step-log FILE` fits the planner's step costs to it); default: off",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, how long running requests (a decode server's relayed ones too) may still finish "
        "before they are cut (keep the pod's terminationGracePeriodSeconds above it)",
    )
    add_limit_flags(parser)
    events = parser.add_argument_group("KV cache events (ZMQ, vLLM's format: llm-d's router reads them)")
    events.add_argument(
        "--kv-events-port",
        type=int,
        help="PUB port (default 5557, or a free one when another daemon of this host has it; 0: any)",
    )
    events.add_argument(
        "--kv-events-replay-port", type=int, help="replay (ROUTER) port (default 5558, likewise; 0: any)"
    )
    events.add_argument("--kv-events-pod", help="pod name in the topic (default: $POD_IP or host, :port)")
    events.add_argument(
        "--kv-events",
        choices=KV_EVENTS_MODES,
        help="who may read them (they carry every cached block's token ids): `authenticated`, pdserve's "
        "decode servers whose CURVE keys came through the Handshake (a prefill server's default); `plain`, "
        "anyone who reaches the ports (llm-d's router; fence them); `off` (a decode server's default)",
    )
    parser.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="bearer tokens (one a line) that every call but health checks must present (a prefill "
        "server's callers: decode servers with --prefill-auth-token-file)",
    )
    tls = parser.add_argument_group("TLS of the listening port (default: plaintext)")
    tls.add_argument("--tls-cert", metavar="PEM", help="server certificate chain")
    tls.add_argument("--tls-key", metavar="PEM", help="server private key")
    tls.add_argument("--tls-client-ca", metavar="PEM", help="CA of client certificates (mutual TLS)")
    tls.add_argument(
        "--require-client-cert",
        action="store_true",
        help="refuse clients without one (needed with --tls-client-ca: gRPC Python has no optional ones)",
    )


def server_security(args: argparse.Namespace, allowed_peers=()):
    """The listening port's ServerSecurity from the flags (exits naming what is inconsistent)."""
    from pdserve.services.security import ServerSecurity, read_tokens

    token_file = getattr(args, "auth_token_file", None)
    try:
        security = ServerSecurity(
            cert=args.tls_cert,
            key=args.tls_key,
            client_ca=args.tls_client_ca,
            require_client_cert=args.require_client_cert,
            tokens=read_tokens(token_file) if token_file else (),
            allowed_peers=tuple(allowed_peers) if args.tls_client_ca else (),
        )
        security.credentials()  # reads the PEM files now: a wrong path fails before the engine loads
        return security
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from e


def kv_events_config(args: argparse.Namespace, role: str):
    """The KV events a daemon of `role` publishes (None: none). A prefill server's are for decode servers
    (`authenticated` by default); a decode server's only for an endpoint picker (`plain`, opt-in)."""
    from pdserve.services.kv_events_zmq import KVEventsConfig

    mode = args.kv_events or ("authenticated" if role == "prefill" else "off")
    if mode == "off":
        return None
    if mode == "authenticated" and role != "prefill":
        raise SystemExit(
            "error: --kv-events=authenticated: only a prefill server has readers that register keys (its "
            "decode servers); a decode server's events are for an endpoint picker: plain, or off"
        )
    return KVEventsConfig(
        args.kv_events_port, args.kv_events_replay_port, args.kv_events_pod, mode == "plain"
    )


def resolve_group(args: argparse.Namespace) -> ProcessGroup | None:
    """The multi-process job of this daemon (flags, else LeaderWorkerSet's env), None: one process."""
    try:
        return process_group(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e


def devices_per_process(args: argparse.Namespace, group: ProcessGroup | None) -> int:
    """Fake CPU devices this process exposes: --cpu-devices, else its share of --tp (--tp is global)."""
    tp = engine_config(args).tp
    if group is None:
        return max(args.cpu_devices, tp)
    return args.cpu_devices or -(-tp // group.num_processes)


def prefill_speculation(config):
    """A prefill engine's config. An EAGLE-3 head is kept: the prefill server runs it over the prompt and
    sends its KV and input with the target's (engine.draft_runner), so the decode server drafts at once.
    Another --speculative-config (n-gram) is dropped, with a line in the log: a prefill server decodes
    nothing, and the decode server needs only the tokens."""
    import dataclasses

    if not config.speculative_config or config.speculation.method == "eagle3":
        return config
    logging.getLogger(__name__).info(
        "prefill: --speculative-config has no effect here (drafts are verified where tokens decode)"
    )
    return dataclasses.replace(config, speculative_config="")


def build_engine(
    args: argparse.Namespace, group: ProcessGroup | None = None, engine_class=None, decodes: bool = True
):
    """-> (engine, services.group.Leader or None): the daemon's engine, compiled (unless --no-warmup),
    with the --lora adapters loaded (`engine_class`: an LLMEngine subclass instead, e.g. the
    fault-injecting one of the tests). `decodes` False (a prefill server): the engine samples first
    tokens only, so it leaves --speculative-config out (nothing to draft; its steps keep the shapes of
    speculation off). In a multi-process group the processes join one JAX job first; a
    worker then follows the leader's device operations here and exits when the leader stops; the leader
    returns once every worker follows."""
    from pdserve.engine.llm_engine import LLMEngine

    join(group)
    configure_jax()
    config = engine_config(args)
    if not decodes:
        config = prefill_speculation(config)
    if group is not None:
        import jax

        if config.tp != jax.device_count():
            raise SystemExit(f"error: --tp {config.tp} must span the group's {jax.device_count()} devices")
    with refusing_unloadable_models():
        engine = (engine_class or LLMEngine).from_model(args.model, config, warmup=not args.no_warmup)
    if not args.no_warmup:  # the KV frames it sends or receives (a prefill's, a migration's), every shape
        engine.warmup_transfers(insert=decodes)
    leader = None
    if group is not None:
        from pdserve.services.group import follow, lead

        if not group.is_leader:
            raise SystemExit(follow(engine, engine.kv_layout, group))
        leader = lead(engine, group, args.host)
    load_adapters(engine, args.lora)
    return engine, leader


def prefill_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefill-server", description="pdserve prefill server")
    common_args(parser)
    parser.add_argument(
        "--allowed-peer-names",
        default="decode",
        help="with --tls-client-ca: client certificate names (CN or SAN) allowed, comma-separated",
    )
    return parser


def prefill_main(argv: list[str] | None = None, service_class=None) -> int:
    """`prefill-server ARGS`. `service_class`: a PrefillService subclass to serve instead (e.g. the
    fault-injecting one of the tests)."""
    args = prefill_parser().parse_args(argv)
    allowed = [n for n in args.allowed_peer_names.split(",") if n]
    security = server_security(args, allowed)
    group = resolve_group(args)
    prepare_process(args, devices_per_process(args, group))
    from pdserve.services.prefill.server import PrefillService, serve

    engine, leader = build_engine(args, group, decodes=False)
    service = (service_class or PrefillService).for_engine(engine, limits=limits_from_flags(args))
    if args.step_log:
        service.loop.log_steps(args.step_log)
    service.tracing = tracing_of(args, "pdserve-prefill")
    run_daemon(
        leader, lambda stop: serve(service, args.port, stop, **serve_options(args, security, "prefill"))
    )
    return 0


def tracing_of(args: argparse.Namespace, service: str):
    """The daemon's services.tracing.Tracing with --otlp-traces-endpoint; None (off) without."""
    if not args.otlp_traces_endpoint:
        return None
    from pdserve.services.tracing import Tracing

    return Tracing(args.otlp_traces_endpoint, service)


def serve_options(args: argparse.Namespace, security, role: str) -> dict:
    """The keyword arguments both daemons' serve() take from the common flags."""
    return dict(
        host=args.host,
        security=security,
        metrics_port=args.metrics_port,
        lora_root=args.lora_root,
        kv_events=kv_events_config(args, role),
        step_timeout_s=args.engine_step_timeout,
        served_model_names=tuple(args.served_model_name or [args.model]),
        stats_interval_s=args.log_stats_interval,
        grace_s=args.drain_timeout,
    )


def run_daemon(leader, serving) -> None:
    """Runs `serving(stop)` (a daemon's serve coroutine) until SIGTERM drains it. `leader`: the
    services.group.Leader of a multi-process daemon (None: one process), whose broken group ends the
    process, and whose workers are stopped after the drain."""
    from pdserve.services.engine_loop import EngineStopped
    from pdserve.services.group import supervised
    from pdserve.services.grpc_server import run_until_signal

    try:
        run_until_signal(lambda stop: supervised(leader, stop, serving(stop)))
    except EngineStopped as e:  # health went NOT_SERVING and waiting calls were failed: exit for a restart
        logging.getLogger(__name__).error("exiting %d: the engine failed: %s", EXIT_ENGINE_FAILED, e)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(EXIT_ENGINE_FAILED)  # the engine thread may be hung in a device call: do not join it
    if leader is not None:
        leader.stop()


def decode_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        default="local",
        help="prefill servers: ADDR[,ADDR...] (host:port or dns:///name:port), or `local` (colocated)",
    )
    from pdserve.services.decode.config import DecodeConfig, Routing

    add_config_flags(parser, DecodeConfig)
    add_config_flags(parser, Routing)
    parser.add_argument(
        "--http-port",
        type=int,
        default=HTTP_PORT,
        help=f"the OpenAI-compatible HTTP API's port (default {HTTP_PORT}, vLLM's; 0: any free port)",
    )
    parser.add_argument("--no-http", action="store_true", help="serve no HTTP API (gRPC only)")
    parser.add_argument(
        "--http-plaintext",
        action="store_true",
        help="serve the HTTP API without the port's TLS (behind an inference gateway; tokens still apply)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=("auto", *PARSERS),
        default="auto",
        help="how the model writes tool calls, for tool_choice auto (auto: what its chat template asks for)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split a thinking model's reasoning into the chat message's `reasoning` (default: off)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="the HTTP API's default sampling parameters: auto, the model folder's generation_config.json "
        "(vLLM's default); vllm, none (OpenAI's defaults); or a folder's generation_config.json",
    )
    parser.add_argument(
        "--http-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="an HTTP request's deadline (a client's X-Request-Timeout header may ask for less)",
    )


def decode_config(args: argparse.Namespace):
    from pdserve.services.decode.config import DecodeConfig

    return config_from_flags(DecodeConfig, args, limits=limits_from_flags(args))


def prefill_channel_security(args: argparse.Namespace):
    """How decode-server reaches prefill servers: TLS when any --prefill-tls-* flag is given."""
    from pdserve.services.security import PLAINTEXT, ChannelSecurity, channel_credentials, read_tokens

    token = None
    try:
        if args.prefill_auth_token_file:
            token = read_tokens(args.prefill_auth_token_file)[0]
        if not (args.prefill_tls_ca or args.prefill_tls_cert or args.prefill_tls_key):
            return ChannelSecurity(token=token) if token else PLAINTEXT
        credentials = channel_credentials(args.prefill_tls_ca, args.prefill_tls_cert, args.prefill_tls_key)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from e
    return ChannelSecurity(credentials, args.prefill_tls_server_name, token)


def decode_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decode-server", description="pdserve decode server")
    common_args(parser)
    decode_args(parser)
    parser.add_argument(
        "--migrate-to",
        default="",
        metavar="ADDR[,ADDR...]|dns:///NAME:PORT",
        help="decode servers to move running requests to, with their KV, when this one drains (SIGTERM); "
        "reached with the --prefill-tls-* and --prefill-auth-token-file settings (default: none, they "
        "finish here within the grace period)",
    )
    tls = parser.add_argument_group("TLS to the prefill servers (default: plaintext)")
    tls.add_argument("--prefill-tls-ca", metavar="PEM", help="CA of the prefill servers' certificates")
    tls.add_argument("--prefill-tls-cert", metavar="PEM", help="this server's client certificate (mTLS)")
    tls.add_argument("--prefill-tls-key", metavar="PEM", help="its private key")
    tls.add_argument("--prefill-tls-server-name", help="name to check their certificates against")
    tls.add_argument(
        "--migrate-tls-server-name",
        help="name to check the --migrate-to peers' certificates against (default: the prefill servers')",
    )
    tls.add_argument(
        "--prefill-auth-token-file",
        metavar="FILE",
        help="the bearer token (the file's first) presented to prefill servers run with --auth-token-file",
    )
    return parser


def decode_main(argv: list[str] | None = None, engine_class=None) -> int:
    """`decode-server ARGS`. `engine_class`: an LLMEngine subclass to serve with (tests)."""
    args = decode_parser().parse_args(argv)
    security = server_security(args)
    kv_events_config(args, "decode")  # refuses a mode this role cannot serve before the model loads
    prefill_security = prefill_channel_security(args)
    group = resolve_group(args)
    prepare_process(args, devices_per_process(args, group))
    from pdserve.services.decode.config import Routing
    from pdserve.services.decode.core import GenerationCore

    try:
        routing = config_from_flags(Routing, args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e

    engine, leader = build_engine(args, group, engine_class)
    targets = None if args.prefill == "local" else [t for t in args.prefill.split(",") if t]
    core = GenerationCore.for_engine(
        engine,
        prefill_targets=targets,
        config=decode_config(args),
        prefill_security=prefill_security,
        routing=routing,
    )
    if args.migrate_to:
        from pdserve.services.decode.migration import Migrator

        peers = prefill_security
        if args.migrate_tls_server_name:
            peers = dataclasses.replace(peers, server_name=args.migrate_tls_server_name)
        core.migrator = Migrator(core, [t for t in args.migrate_to.split(",") if t], peers)
    run_decode_server(core, args, security, leader)
    return 0


def run_decode_server(core, args: argparse.Namespace, security, leader=None) -> None:
    """Serves a GenerationCore with the flags' ports, TLS and adapter root until SIGTERM (`leader`: see
    run_daemon)."""
    from pdserve.services.decode.server import serve

    if args.step_log:  # (the decode engine's: a colocated prefill engine beside it logs none)
        core.loop.log_steps(args.step_log)
    core.tracing = tracing_of(args, "pdserve-decode")
    options = serve_options(args, security, "decode")
    http = dict(
        sampling_defaults=sampling_defaults(args.generation_config, core.engine.model.path),
        http_port=None if args.no_http else args.http_port,
        http_plaintext=args.http_plaintext,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        http_timeout_s=args.http_timeout,
    )
    run_daemon(leader, lambda stop: serve(core, args.port, stop, **http, **options))


def sampling_defaults(choice: str, model_path) -> dict:
    """--generation-config: the HTTP API's default sampling parameters (engine.loading.sources.
    generation_defaults), said on stdout when there are some."""
    from pdserve.engine.loading.sources import generation_defaults

    if choice == "vllm":
        return {}
    folder = model_path if choice == "auto" else choice
    if choice != "auto" and not os.path.isfile(os.path.join(folder, "generation_config.json")):
        raise SystemExit(f"--generation-config {choice}: no generation_config.json there")
    defaults = generation_defaults(folder)
    if defaults:
        print(f"default sampling parameters from {folder}/generation_config.json: {defaults}", flush=True)
    return defaults


def serve_main(args: argparse.Namespace) -> int:
    """`pdserve serve`: both roles in one process on disjoint device sets, KV moved device to device."""
    prefill_devices = [int(d) for d in args.prefill_devices.split(",")]
    decode_devices = [int(d) for d in args.decode_devices.split(",")]
    if set(prefill_devices) & set(decode_devices):
        raise SystemExit("--prefill-devices and --decode-devices must be disjoint")
    security = server_security(args)
    kv_events_config(args, "decode")  # refuses a mode this role cannot serve before the model loads
    if resolve_group(args) is not None:
        raise SystemExit("error: pdserve serve runs in one process (no --num-processes, no LeaderWorkerSet)")
    prepare_process(args, max(args.cpu_devices, max(prefill_devices + decode_devices) + 1))
    import dataclasses

    import jax

    from pdserve import kvtransfer
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.local_prefiller import LocalPrefiller
    from pdserve.services.engine_loop import EngineLoop

    configure_jax()
    devices = jax.devices()
    with refusing_unloadable_models():
        model = load_model(args.model)
    base = engine_config(args)
    prefill_engine = LLMEngine(
        model,
        dataclasses.replace(prefill_speculation(base), tp=len(prefill_devices)),
        [devices[i] for i in prefill_devices],
    )
    decode_engine = LLMEngine(
        model, dataclasses.replace(base, tp=len(decode_devices)), [devices[i] for i in decode_devices]
    )
    if not args.no_warmup:
        prefill_engine.warmup(progress=True)
        decode_engine.warmup(progress=True)
        decode_engine.warmup_transfers()  # a migration's frames
        to_decode = kvtransfer.head_map(prefill_engine.kv_layout, decode_engine.kv_layout)
        prefill_engine.warmup_transfers(kvtransfer.LOCAL_CHUNK_BYTES, to_decode, receiver=decode_engine)
    for role, engine in (("prefill", prefill_engine), ("decode", decode_engine)):
        engine.log_summary(role=role)
    for engine in (prefill_engine, decode_engine):
        load_adapters(engine, args.lora)
    prefill_loop = EngineLoop(prefill_engine, name="prefill-engine")
    prefill_loop.start()
    local = LocalPrefiller(prefill_loop, prefill_engine.kv_layout)
    core = GenerationCore.for_engine(decode_engine, local_prefiller=local, config=decode_config(args))
    try:
        run_decode_server(core, args, security)
    finally:
        prefill_loop.stop()
    return 0
