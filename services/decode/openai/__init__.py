"""The OpenAI-compatible HTTP API of decode-server, as vLLM serves it: `server` (the aiohttp app and its
routes) hands each generation call to its endpoint, `chat` or `completions`, both behind `serving`'s one
interface; `protocol` reads what every body carries, `models` the served names and adapters, `responses`
writes vLLM's answer shapes, `streams` sends server-sent events, `reasoning` splits a thinking model's
reasoning out. All of it goes through the same core as gRPC (services.decode.core)."""
