"""Generated protobuf and gRPC code of the pdserve.v1 protos (scripts/gen_protos.sh)."""
