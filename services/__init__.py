"""The gRPC daemons' services (installed as `pdserve.services`): the prefill role (`prefill/`), the decode
role (`decode/`) and what both share here. The roles never import each other; `pdserve.daemons` composes
them."""
