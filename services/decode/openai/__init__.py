"""The OpenAI-compatible HTTP API of decode-server, as vLLM serves it: `protocol` reads bodies into engine
requests, `responses` writes vLLM's response and chunk shapes, `server` routes them (aiohttp) over the same
core as gRPC."""
