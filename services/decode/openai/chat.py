"""/v1/chat/completions (vLLM's serving_chat): a chat's messages read (content parts, tool fields) and
rendered by the model's template with the body's template arguments and tools; its engine request (a
required or named tool call forced as a constraint, a thinking model's reasoning left free of it); and its
answer: a message with the reasoning split out (services.decode.openai.reasoning) and tool calls parsed
(services.decode.tools), or streamed as a role chunk, then reasoning, content and tool-call deltas."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.services.decode.core import GenerationCore
from pdserve.services.decode.openai import reasoning, responses
from pdserve.services.decode.openai.models import ServedModels
from pdserve.services.decode.openai.serving import Call, Collected, Serving
from pdserve.services.decode.openai.streams import Chunk
from pdserve.services.decode.tool_formats import detect, marked_by_special_tokens
from pdserve.services.decode.tools import ToolChoice, ToolStream, tool_choice

# ---- messages and template arguments ------------------------------------------------------------------
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_RESERVED_TEMPLATE_KEYS = ("messages", "tools", "documents", "tokenize", "chat_template")


def content_text(content: Any, field: str = "messages") -> str:
    """A message's content as the template's text: a string, or OpenAI's list of parts whose text parts
    are joined with newlines (what vLLM gives templates that take strings). Parts of other types (images,
    audio) are refused by name: pdserve serves text models."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequestError(field, "content must be a string or a list of content parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        key = TEXT_PARTS.get(kind)
        if key is None:
            raise InvalidRequestError(
                field, f"content part of type {kind!r}: this model takes text parts only"
            )
        if not isinstance(part.get(key), str | None):
            raise InvalidRequestError(field, f"a {kind} part's {key} must be a string")
        if part.get(key) is not None:
            texts.append(part[key])
    return "\n".join(texts)


def chat_messages(body: dict) -> list[dict]:
    """The body's messages as the chat template takes them: role, text content, and the tool fields
    templates read."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(_message_ok(m) for m in messages):
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content}")
    out = []
    for m in messages:
        message = {"role": m.get("role", "user"), "content": content_text(m.get("content"))}
        message.update({k: m[k] for k in ("tool_calls", "tool_call_id", "name") if k in m})
        out.append(message)
    return out


def _message_ok(m) -> bool:
    """A chat message: content (text or parts), or an assistant's tool calls (content null)."""
    if not isinstance(m, dict):
        return False
    content = m.get("content")
    return isinstance(content, str | list) or (content is None and isinstance(m.get("tool_calls"), list))


def message_size(m: dict) -> str:
    """What a template message gives the template to render, as text (its size is what rendering costs)."""
    calls = m.get("tool_calls")
    return str(m.get("role", "")) + (m.get("content") or "") + (json.dumps(calls) if calls else "")


def chat_template_args(body: dict) -> dict[str, Any]:
    """The template's arguments beside the messages: `add_generation_prompt` (default true),
    `continue_final_message` (the last message left open for the model to continue; default false; not
    both), and `chat_template_kwargs` (variables such as `enable_thinking`; they may also set the two)."""
    extra = dict(body.get("chat_template_kwargs") or {})
    for key in _RESERVED_TEMPLATE_KEYS:
        if key in extra:
            raise InvalidRequestError("chat_template_kwargs", f"{key!r} cannot be set there")
    add = extra.pop("add_generation_prompt", body.get("add_generation_prompt", True))
    cont = extra.pop("continue_final_message", body.get("continue_final_message", False))
    if not isinstance(add, bool) or not isinstance(cont, bool):
        raise InvalidRequestError(
            "chat_template_kwargs", "add_generation_prompt and continue_final_message are booleans"
        )
    if add and cont:
        raise InvalidRequestError(
            "continue_final_message", "cannot be true with add_generation_prompt (set it to false)"
        )
    return {"add_generation_prompt": add, "continue_final_message": cont, **extra}


# ---- the endpoint ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class ChatCall(Call):
    tools: ToolChoice | None = None  # the chat's tools and tool_choice (None: none)


class ChatServing(Serving):
    """`tool_call_parser`: the format of the model's own tool calls (services.decode.tool_formats;
    "auto": its chat template's). `reasoning_parser`: how a thinking model's reasoning is split out of
    the content (services.decode.openai.reasoning; None: it is not)."""

    id_prefix, object, chunk_object, chat = "chatcmpl-", "chat.completion", "chat.completion.chunk", True

    def __init__(
        self,
        service: GenerationCore,
        models: ServedModels,
        sampling_defaults: Mapping[str, Any],
        timeout_s: float,
        tool_call_parser: str = "auto",
        reasoning_parser: str | None = None,
    ):
        if reasoning_parser is not None and reasoning_parser not in reasoning.PARSERS:
            raise ValueError(f"reasoning parser {reasoning_parser!r}: one of {reasoning.PARSERS}")
        super().__init__(service, models, sampling_defaults, timeout_s)
        self.reasoning_parser = reasoning_parser
        tokenizer = service.engine.tokenizer
        self.markers = reasoning.marker_ids(tokenizer)  # (<think>, </think>) ids, if tokens
        self.tool_format = detect(tokenizer.chat_template) if tool_call_parser == "auto" else tool_call_parser
        self.tool_markers_special = marked_by_special_tokens(self.tool_format, tokenizer)

    async def prepare(self, body: dict, label: str) -> ChatCall:
        if body.get("echo"):
            raise InvalidRequestError("echo", "is served by /v1/completions only")
        tools = tool_choice(body, self.tool_format, self.service.config.limits.max_tools)
        request = await self.service.prepare(lambda: self._request(body, tools, label))
        return ChatCall(body, [request], self.models.answering(request), tools)

    def engine_request(self, body: dict, label: str = "") -> tuple[Request, ToolChoice | None]:
        tools = tool_choice(body, self.tool_format, self.service.config.limits.max_tools)
        return self._request(body, tools, label), tools

    def prompt_ids(self, body: dict, tools: ToolChoice | None) -> list[int]:
        """The chat's prompt: its messages rendered by the model's template with the body's template
        arguments (and `tools`: the chat's tools, given to the template)."""
        tokenizer, max_chars = self.service.engine.tokenizer, self.service.engine.config.max_prompt_chars
        messages = chat_messages(body)
        self.service.config.limits.check_chat([message_size(m) for m in messages], max_chars)
        template_args = chat_template_args(body)
        if tools is not None:
            template_args["tools"] = tools.template_tools
        return tokenizer.encode_chat(messages, max_chars=max_chars, **template_args)

    def _request(self, body: dict, tools: ToolChoice | None, label: str) -> Request:
        params = self.sampling_params(body)
        forced = tools.constraint() if tools is not None else None
        if forced is not None:
            if params.constraint is not None:
                raise InvalidRequestError("tool_choice", "a required or named call and a response_format")
            params = dataclasses.replace(params, constraint=forced)
        if tools is not None and tools.mode == "auto" and self.tool_markers_special:
            params = dataclasses.replace(params, skip_special_tokens=False)
        ids = self.prompt_ids(body, tools)
        if self.reasoning_parser is not None and params.constraint is not None:  # constrain the answer only
            params = dataclasses.replace(
                params, reasoning_end=reasoning.constraint_waits_for(ids, self.markers)
            )
        return self.make_request(body, ids, params, label, forced is not None)

    def rendered(self, prompts: list[dict]) -> dict:
        return prompts[0]

    def choices(self, call: ChatCall, got: Collected, decode: Callable) -> list[dict]:
        """Each choice's message; its tool calls parsed from the content (after the reasoning)."""
        choices = []
        for index, final in enumerate(got.finals):
            finish = final.finish_reason.value if final is not None else None
            text = "".join(got.texts[index])
            lps = responses.chat_logprobs(got.logprobs[index], decode)
            choice = {"index": index, "finish_reason": finish, "logprobs": lps}
            choice["message"] = message = {"role": "assistant", "content": text}
            if self.reasoning_parser is not None:  # (tool calls are read in the content only)
                message["reasoning"], message["content"] = reasoning.split(self.reasoning_parser, text)
            calls = responses.tool_calls(
                call.tools, message, finish, call.body.get("parallel_tool_calls", True)
            )
            if calls:
                choice["finish_reason"] = "tool_calls"
                message["tool_calls"] = calls
            choices.append(choice)
        return choices

    def answer_fields(self, call: ChatCall, got: Collected, decode: Callable) -> dict:
        """vLLM's prompt_logprobs of a chat: the answer's, not each choice's."""
        if call.body.get("prompt_logprobs") is None:
            return {}
        return {"prompt_logprobs": responses.prompt_logprobs(got.prompt_lps[0] or [], decode)}

    def choice_stream(self, call: ChatCall, index: int, decode: Callable) -> ChatChoiceStream:
        return ChatChoiceStream(call, index, decode, self.reasoning_parser)


class ChatChoiceStream:
    """A streamed chat choice: the role chunk when its first token arrives (as vLLM), then its reasoning
    in chunks of its own (with a reasoning parser), then its content, or with tools
    services.decode.tools.ToolStream's deltas (the last carrying the finish)."""

    def __init__(self, call: ChatCall, index: int, decode: Callable, reasoning_parser: str | None):
        self.call, self.index, self.decode = call, index, decode
        self.started = False
        self.thinking = reasoning.ReasoningSplit(reasoning_parser) if reasoning_parser is not None else None
        self.tools = ToolStream(call.tools) if call.tools is not None else None

    async def chunks(self, output: RequestOutput, so_far: dict | None) -> AsyncIterator[Chunk]:
        index = self.index
        if not self.started:
            self.started = True
            role = {"index": index, "delta": {"role": "assistant", "content": ""}}
            usage = responses.running_usage(output.num_prompt_tokens, 0) if so_far is not None else None
            yield Chunk({**role, "logprobs": None, "finish_reason": None}, usage)
        finish = output.finish_reason.value if output.finished else None
        lp = responses.chat_logprobs(output.logprobs, self.decode)
        text = output.text
        if self.thinking is not None:  # reasoning first, in its own chunks
            thought, text = self.thinking.feed(text)
            if output.finished:
                more = self.thinking.finish()
                thought, text = thought + more[0], text + more[1]
            if thought:
                delta = {"index": index, "delta": {"reasoning": thought}, "logprobs": lp}
                yield Chunk({**delta, "finish_reason": None}, so_far)
                lp = None
            if not text and finish is None:  # (nothing of the content yet)
                return
        if self.tools is not None:  # one chunk per delta; the last carries the finish
            deltas = self.tools.feed(text)
            if output.finished:
                more, finish = self.tools.finish(finish)
                deltas += more
            if not self.call.body.get("parallel_tool_calls", True):  # the first call's deltas only
                deltas = [d for d in deltas if all(c.get("index") == 0 for c in d.get("tool_calls", []))]
            deltas = deltas or [{}]
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                choice = {"index": index, "delta": delta, "logprobs": lp if i == 0 else None}
                yield Chunk({**choice, "finish_reason": finish if last else None}, so_far)
            return
        choice = {"index": index, "logprobs": lp, "finish_reason": finish}
        choice["delta"] = {"content": text} if text else {}
        yield Chunk(choice, so_far)
