"""The gRPC daemons (prefill-server, decode-server) and what they share."""
