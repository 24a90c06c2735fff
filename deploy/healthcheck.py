#!/usr/bin/env python3
"""pdserve-healthcheck: grpc.health.v1 Check over TLS for exec probes (the kubelet's native gRPC probes
are plaintext only). Exit 0 when the server reports SERVING, 1 otherwise."""

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve-healthcheck")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--host",
        default=os.environ.get("POD_IP") or "127.0.0.1",
        help="the server's address (default: $POD_IP, where deploy/'s daemons listen, else 127.0.0.1)",
    )
    parser.add_argument("--ca", help="CA of the server certificate (TLS); without it: plaintext")
    parser.add_argument("--cert", help="client certificate (mutual TLS)")
    parser.add_argument("--key", help="its private key")
    parser.add_argument("--server-name", help="name to check the server certificate against")
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 pod address
    target = f"{host}:{args.port}"
    if args.ca:

        def read(path):
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(read(args.ca), read(args.key), read(args.cert))
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(target)
    try:
        with channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as e:
        print(f"unhealthy: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(status)
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
