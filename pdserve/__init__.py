"""pdserve: disaggregated prefill/decode LLM serving on JAX and gRPC."""

__version__ = "0.1.0"
