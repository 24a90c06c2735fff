"""The shapes of the OpenAI API's answers as vLLM writes them: errors, usage, logprobs, tool calls, and the
choices of responses and of streamed chunks."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import grpc
from aiohttp import web

from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import TokenLogprobs
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.services.decode.errors import ServiceError
from pdserve.services.decode.tools import ToolChoice

HTTP_STATUS = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INTERNAL: 500,
}


def error(
    status: int, message: str, kind: str, param: str | None = None, retry_after_ms: int | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    headers = {}
    if retry_after_ms is not None or status in (429, 503):  # seconds, as RFC 9110 has it
        headers["Retry-After"] = str(max(1, -(-(retry_after_ms or 1000) // 1000)))
    return web.json_response(body, status=status, headers=headers)


def service_error(e: ServiceError) -> web.Response:
    return error(HTTP_STATUS.get(e.code, 500), e.message, "server_error", retry_after_ms=e.retry_after_ms)


def invalid(e: InvalidRequestError) -> web.Response:
    """404 for an adapter not loaded here, else 400, naming the field."""
    if e.status == "NOT_FOUND":
        return error(404, str(e), "NotFoundError", e.field)
    return error(400, str(e), "invalid_request_error", e.field)


def model_not_found(name: str) -> web.Response:
    """vLLM's answer to a `model` it does not serve."""
    return error(404, f"The model `{name}` does not exist.", "NotFoundError", "model")


def usage(outputs: Sequence[RequestOutput]) -> dict:
    """OpenAI's usage object over the finished outputs of a call's choices (a completions call with several
    prompts sums them; a prompt of n sequences counts once, as vLLM's); `prompt_tokens_details.cached_tokens`
    as OpenAI and vLLM report it."""
    prompt = sum(o.num_prompt_tokens for o in outputs if o.index == 0)
    completion = sum(o.num_output_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs if o.index == 0)},
    }


def running_usage(num_prompt_tokens: int, num_output_tokens: int) -> dict:
    """The usage of one choice so far (stream_options.continuous_usage_stats)."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


PIECE_ITEMS = 256  # list items one json.dumps call encodes (json_bytes)


def json_bytes(value) -> bytes:
    """`value` as JSON, encoded a piece at a time: one json.dumps call holds the interpreter for all it
    encodes, so a large answer (prompt logprobs of n choices: megabytes) is encoded PIECE_ITEMS list items
    a call, and the event loop and the engine thread run between the calls."""
    return "".join(_json_pieces(value)).encode()


def _json_pieces(value):
    if isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + json.dumps(str(key)) + ":"
            yield from _json_pieces(item)
        yield "}"
    elif isinstance(value, list) and len(value) > PIECE_ITEMS:
        yield "["
        for start in range(0, len(value), PIECE_ITEMS):
            yield ("," if start else "") + json.dumps(value[start : start + PIECE_ITEMS])[1:-1]
        yield "]"
    else:
        yield json.dumps(value)


def memoized(decode: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
    """`decode`, remembering each single token's text: an answer's logprobs name the same tokens again and
    again (every position's top n), and rendering a large one is CPU the server's other work waits on."""
    texts: dict[int, str] = {}

    def decode_ids(ids: list[int]) -> str:
        if len(ids) != 1:
            return decode(ids)
        text = texts.get(ids[0])
        if text is None:
            text = texts[ids[0]] = decode(ids)
        return text

    return decode_ids


def chat_logprobs(entries: Sequence[TokenLogprobs], decode: Callable[[list[int]], str]) -> dict | None:
    """A chat choice's logprobs: its `content` list, each token with its top_logprobs."""
    if not entries:
        return None
    return {
        "content": [
            {
                "token": decode([lp.token_id]),
                "logprob": lp.logprob,
                "top_logprobs": [{"token": decode([t]), "logprob": v} for t, v in lp.top],
            }
            for lp in entries
        ]
    }


def completion_logprobs(
    entries: Sequence[TokenLogprobs | None],
    decode: Callable[[list[int]], str],
    token_ids: Sequence[int] = (),
) -> dict | None:
    """A completion choice's logprobs: parallel lists (with text offsets; each position's top_logprobs its
    own token's first, as vLLM writes them). With `echo`, the entries start with the prompt's, and a None
    entry (the first prompt token's: nothing before it) is null, its token taken from `token_ids`."""
    if not entries:
        return None
    tokens = [decode([lp.token_id if lp is not None else token_ids[i]]) for i, lp in enumerate(entries)]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob if lp is not None else None for lp in entries],
        "top_logprobs": [
            None if lp is None else {decode([t]): v for t, v in [(lp.token_id, lp.logprob), *lp.top]}
            for lp in entries
        ],
        "text_offset": offsets,
    }


def prompt_logprobs(entries: Sequence[TokenLogprobs | None], decode: Callable[[list[int]], str]) -> list:
    """vLLM's `prompt_logprobs`: per prompt position, null at the first, else {token id: {logprob, rank,
    decoded_token}} with the prompt's own token first, then the top n by rank."""
    out = []
    for lp in entries:
        if lp is None:
            out.append(None)
            continue
        ranked = [(lp.token_id, lp.logprob, lp.rank), *((t, v, r + 1) for r, (t, v) in enumerate(lp.top))]
        position = {}
        for token, value, rank in ranked:
            position.setdefault(
                str(token), {"logprob": value, "rank": rank, "decoded_token": decode([token])}
            )
        out.append(position)
    return out


def tool_calls(tools: ToolChoice | None, message: dict, finish: str | None, parallel: bool) -> list[dict]:
    """Parses the finished text of `message` (its content is replaced by what is left of it) into tool
    calls; none when the output stopped short of a whole call (finish "length"); the first only when the
    request said `parallel_tool_calls: false` (as vLLM filters)."""
    if tools is None or tools.mode == "none" or finish != "stop":
        return []
    try:
        message["content"], calls = tools.calls(message["content"])
    except ValueError:  # a required call that stopped short of its JSON
        return []
    return calls if parallel else calls[:1]
