"""The prefill replica of `pdserve serve`: an engine of this process on other devices
(services.decode.prefillers.Prefiller), its KV gathered in the decode layout and moved device to device."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import numpy as np

from pdserve import kvtransfer
from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.kvtransfer import KVChunk, KVLayout
from pdserve.services.decode.prefillers import FirstToken, PrefillCall, Prefiller, PrefillError
from pdserve.services.engine_loop import EngineLoop, EngineStopped
from pdserve.services.prefill_stream import PrefillFailed, PrefillStream, install_connector


class LocalPrefiller(Prefiller):
    """An engine of this process on other devices (the single-controller shape of `pdserve serve`).

    The gather converts heads to the decode layout, in chunks of up to kvtransfer.LOCAL_CHUNK_BYTES; each
    moves with kvtransfer.move_chunk (jax.device_put, host memory aliased between CPU devices, or Pathways'
    reshard under JAX_PLATFORMS=proxy).
    """

    def __init__(self, loop: EngineLoop, src: KVLayout):
        self.name = "local"
        self.loop = loop
        self.src = src
        install_connector(loop.engine)

    async def prefill(
        self, request: Request, dst: KVLayout, sharding, call: PrefillCall
    ) -> AsyncIterator[FirstToken | KVChunk]:
        held = call.held  # (no deadline here; in this process, the decode server's span covers it)
        lora = request.lora
        try:
            mine = self.loop.engine.make_request(
                list(request.prompt_ids),
                dataclasses.replace(request.params, max_tokens=1),  # the first token
                request.request_id,
                lora=lora.name if lora else None,
                lora_fingerprint=lora.fingerprint if lora else None,
                seed=request.seed,
                cache_salt=request.cache_salt,
            )
        except InvalidRequestError as e:
            raise PrefillError(f"{self.name}: {e}", replica_down=False) from e
        stream = PrefillStream(
            self.loop, mine, kvtransfer.head_map(self.src, dst), kvtransfer.LOCAL_CHUNK_BYTES, len(held)
        )
        try:
            await stream.start()
            async for chunk in stream.achunks():  # each as its tokens are computed
                yield kvtransfer.move_chunk(chunk, sharding)
            first, *others = await stream.first_tokens()
        except PrefillFailed as e:  # the prefill engine failed on this request and serves on
            raise PrefillError(f"{self.name}: {e}", replica_down=False) from e
        except EngineStopped as e:
            raise PrefillError(f"{self.name}: the prefill engine stopped: {e}") from e
        finally:
            stream.close()
        logprobs = first.logprobs[0] if first.logprobs else None
        prompt_logprobs = first.prompt_logprobs[1:] if first.prompt_logprobs is not None else None
        forks = tuple((o.new_token_ids[0], o.logprobs[0] if o.logprobs else None) for o in others)
        aux = None if first.draft_aux is None else np.asarray(first.draft_aux, np.float32)
        yield FirstToken(
            first.new_token_ids[0], logprobs, first.num_cached_tokens, prompt_logprobs, forks, aux
        )
