"""A call's outputs on their way to the client: each request's outputs within the call's deadline
(`until`), the streams of a call's requests merged into its choices (`merged`), and a streamed answer's
server-sent events (`send_events`: each choice's chunks as its endpoint's ChoiceStream renders them, the
usage chunk, then `[DONE]`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple, Protocol

import grpc
from aiohttp import web

from pdserve.engine.core.output import RequestOutput
from pdserve.services.decode.errors import ServiceError
from pdserve.services.decode.openai import responses


class Chunk(NamedTuple):
    """One choice's part of a streamed chunk."""

    choice: dict
    usage: dict | None = None  # the chunk's usage (stream_options.continuous_usage_stats)
    large: bool = False  # serialized off the event loop (the prompt's logprobs: by the prompt's size)


class ChoiceStream(Protocol):
    """One choice of a streamed call (its endpoint's own: chat's role, reasoning and tool-call deltas,
    completions' echoed prompt), fed that choice's outputs in order."""

    def chunks(self, output: RequestOutput, so_far: dict | None) -> AsyncIterator[Chunk]:
        """The chunks `output` makes (maybe none); `so_far`: the choice's usage so far, when every chunk
        carries it (stream_options.continuous_usage_stats), else None."""


async def send_events(
    request: web.Request,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    rid: str,
    kind: str,
    model: str,
    options: dict,
    choice_stream: Callable[[int], ChoiceStream],
    headers: dict[str, str] | None = None,
    return_token_ids: bool = False,
) -> web.StreamResponse:
    """Server-sent chunks as `outputs` (merged: (choice index, output)) arrive, each of id `rid`, object
    `kind` and model `model`, its choices rendered by `choice_stream(index)` (one per choice); with `options`
    (stream_options) include_usage, a last chunk of no choices carrying the usage (continuous_usage_stats:
    every chunk carries its choice's so far). `headers`: the answer's own; `return_token_ids` (vLLM's
    extension): each choice's chunk carries the token ids generated since its last one. A ServiceError ends
    the stream with an error event."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **(headers or {})}
    )
    await response.prepare(request)
    created = int(time.time())
    include_usage = options.get("include_usage", True) if options else False
    continuous = include_usage and bool(options.get("continuous_usage_stats"))

    async def send(choices: list[dict], usage=None, large: bool = False):
        """One chunk; a `large` one (the prompt's logprobs) is serialized off the event loop."""
        chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        data = await asyncio.to_thread(responses.json_bytes, chunk) if large else json.dumps(chunk).encode()
        await response.write(b"data: " + data + b"\n\n")

    streams: dict[int, ChoiceStream] = {}
    finals = []
    pending: dict[int, list[int]] = {}  # token ids not yet in a chunk, by choice (`return_token_ids`)
    try:
        async for index, output in outputs:
            so_far = (
                responses.running_usage(output.num_prompt_tokens, output.num_output_tokens)
                if continuous
                else None
            )
            if output.finished:
                finals.append(output)
            stream = streams.get(index)
            if stream is None:
                stream = streams[index] = choice_stream(index)
            pending.setdefault(index, []).extend(output.new_token_ids)
            async for chunk in stream.chunks(output, so_far):
                if return_token_ids:
                    chunk.choice["token_ids"], pending[index] = pending[index], []
                await send([chunk.choice], chunk.usage, chunk.large)
        if include_usage:
            await send([], responses.usage(finals))
    except ServiceError as e:
        await response.write(
            f"data: {json.dumps({'error': {'message': e.message, 'type': 'server_error'}})}\n\n".encode()
        )
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def until(outputs, timeout_s: float):
    """`outputs` (GenerationCore.stream) within a deadline of `timeout_s` seconds; past it the stream is
    closed (the request aborted, its blocks freed) and ServiceError DEADLINE_EXCEEDED raised."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    output = await anext(outputs)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise ServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"the request's deadline ({timeout_s:g} s) passed"
                ) from None
            yield output
    finally:
        await outputs.aclose()


async def merged(streams: list, n: int = 1) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of every stream as outputs arrive: stream i's sequence j (of its `n`) is choice
    i * n + j. The first ServiceError is raised and every other stream closed (its request aborted); so are
    all when the consumer stops early."""
    if len(streams) == 1:  # (the usual call: no task)
        async for output in streams[0]:
            yield output.index, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output, None))
        except ServiceError as e:
            await queue.put((index, None, e))
        finally:
            await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, output, failure = await queue.get()
            if failure is not None:
                raise failure
            if output is None:
                running -= 1
                continue
            yield index * n + output.index, output
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
