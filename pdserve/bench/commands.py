"""The `pdserve bench` command line: `serve` (the load generator against a running decode-server),
`throughput` and `latency` (the engine in this process). Plain `pdserve bench --server ADDR ...` is
`pdserve bench serve --server ADDR ...`: today's usage, kept."""

from __future__ import annotations

import argparse

from pdserve.bench import offline, serve

SCENARIOS = {
    "serve": (
        "load generator against a decode-server's Generation API",
        serve.add_bench_args,
        serve.cmd_bench,
    ),
    "throughput": (
        "offline throughput of the engine in this process",
        offline.add_throughput_args,
        offline.cmd_throughput,
    ),
    "latency": (
        "end-to-end latency of one batch on the engine here",
        offline.add_latency_args,
        offline.cmd_latency,
    ),
}


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """`pdserve bench` on the command line's subparsers: a subcommand per scenario, and serve's flags on
    `bench` itself for the plain form."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks: serve (load generator, the default), throughput, latency",
        description="serve: the load generator against a running decode-server (the default: "
        "`pdserve bench --server ADDR ...` is `pdserve bench serve --server ADDR ...`); throughput and "
        "latency: the engine in this process.",
    )
    serve.add_bench_args(bench, required=False)
    bench.set_defaults(func=_plain(bench))
    scenarios = bench.add_subparsers(dest="scenario", metavar="{serve,throughput,latency}")
    for name, (help_text, add_args, cmd) in SCENARIOS.items():
        parser = scenarios.add_parser(name, help=help_text, description=help_text)
        add_args(parser)
        parser.set_defaults(func=cmd)
    return bench


def _plain(bench: argparse.ArgumentParser):
    """`pdserve bench --server ADDR ...`: serve, with --server required as `pdserve bench serve` has it."""

    def cmd(args: argparse.Namespace) -> int:
        if args.server is None:
            bench.error("the following arguments are required: --server")
        return serve.cmd_bench(args)

    return cmd
