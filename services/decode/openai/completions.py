"""/v1/completions (vLLM's serving_completion): a body's prompts (a string, token ids, or a list of
either: a request each, of n choices), each prompt's engine request (the model's special tokens unless
`add_special_tokens` is false), and the answer: each choice's text, with `echo` the prompt's first (and
its logprobs, which vLLM computes as the prompt's), whole or streamed."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.services.decode.openai import responses
from pdserve.services.decode.openai.protocol import token_ids
from pdserve.services.decode.openai.serving import Call, Collected, Serving
from pdserve.services.decode.openai.streams import Chunk


def completion_prompts(body: dict, max_prompts: int) -> list[str | list[int]]:
    """The completions body's `prompt`: a string, a list of token ids, or a list of either (one choice per
    prompt, in order); at most `max_prompts` of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and token_ids(prompt)):
        return [prompt]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or (token_ids(p) and p) for p in prompt)
    ):
        if len(prompt) > max_prompts:
            raise InvalidRequestError("prompt", f"{len(prompt)} prompts: the limit is {max_prompts}")
        return list(prompt)
    raise InvalidRequestError(
        "prompt", "must be a string, a list of token ids, or a non-empty list of strings or of token id lists"
    )


@dataclasses.dataclass
class CompletionCall(Call):
    echo: list[str] = dataclasses.field(default_factory=list)  # each prompt's text, with `echo`
    echo_only: bool = False  # `echo` with max_tokens 0: the prompt alone (one token is generated)


class CompletionServing(Serving):
    id_prefix, object, chunk_object, chat = "cmpl-", "text_completion", "text_completion", False

    async def prepare(self, body: dict, label: str) -> CompletionCall:
        prompts = completion_prompts(body, self.service.config.limits.max_prompts_per_call)
        echo_only = bool(body.get("echo")) and body.get("max_tokens") == 0
        asked = body
        if echo_only:
            asked = {**body, "max_tokens": 1}
        requests = []
        for prompt in prompts:
            requests.append(await self.service.prepare(lambda p=prompt: self._request(asked, p, label)))
        call = CompletionCall(body, requests, self.models.answering(requests[0]), echo_only=echo_only)
        if body.get("echo"):
            decode = self.service.engine.tokenizer.decode
            call.echo = [p if isinstance(p, str) else decode(p) for p in prompts]
        return call

    def engine_request(self, body: dict, label: str = "") -> tuple[Request, None]:
        prompt = completion_prompts(body, self.service.config.limits.max_prompts_per_call)[0]
        return self._request(body, prompt, label), None

    def encode(self, prompt: str, add_special_tokens: bool) -> list[int]:
        """A text prompt's token ids, refused past the engine's max_prompt_chars before any tokenizing."""
        max_chars = self.service.engine.config.max_prompt_chars
        if len(prompt) > max_chars:
            raise InvalidRequestError("prompt", f"longer than {max_chars} characters")
        return self.service.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def _request(self, body: dict, prompt: str | list[int], label: str) -> Request:
        """A text prompt gets the model's special tokens (its BOS), as vLLM's completions do, unless
        `add_special_tokens` is false."""
        if isinstance(prompt, str) and body.get("add_special_tokens") is False:
            prompt = self.encode(prompt, False) or prompt  # ("" stays text: the engine refuses it by name)
        return self.make_request(body, prompt, self.sampling_params(body), label, False)

    def rendered(self, prompts: list[dict]) -> list[dict]:
        return prompts

    def choices(self, call: CompletionCall, got: Collected, decode: Callable) -> list[dict]:
        """Each choice's text (the prompt's first, with `echo`). A prompt's logprobs are rendered once and
        shared by its n choices."""
        rendered: dict = {}  # (renderer, id of a prompt's entries) -> its rendering

        def once(render, entries, *args):
            """render(entries, *args), computed once for each prompt's entries."""
            key = (render, id(entries))
            if key not in rendered:
                rendered[key] = render(entries, *args)
            return rendered[key]

        choices = []
        for index, final in enumerate(got.finals):
            prompt = index // call.n  # (vLLM's choice order: prompt by prompt, its n sequences each)
            finish = final.finish_reason.value if final is not None else None
            text = "".join(got.texts[index])
            entries, ids = [] if call.echo_only else got.logprobs[index], call.requests[prompt].prompt_ids
            prompt_entries = got.prompt_lps[index]
            if call.echo and prompt_entries is not None and not entries:  # the prompt's alone: shared
                lps = once(responses.completion_logprobs, prompt_entries, decode, ids)
            else:
                if call.echo and prompt_entries is not None:  # the prompt's first
                    entries = [*prompt_entries, *entries]
                lps = responses.completion_logprobs(entries, decode, ids)
            choice = {"index": index, "finish_reason": finish, "logprobs": lps}
            if call.body.get("prompt_logprobs") is not None:
                choice["prompt_logprobs"] = once(responses.prompt_logprobs, prompt_entries or [], decode)
            choice["text"] = (call.echo[prompt] if call.echo else "") + ("" if call.echo_only else text)
            choices.append(choice)
        return choices

    def choice_stream(self, call: CompletionCall, index: int, decode: Callable) -> CompletionChoiceStream:
        return CompletionChoiceStream(call, index, decode)


class CompletionChoiceStream:
    """A streamed completion choice: its text deltas; with `echo`, the first carries the prompt (and its
    logprobs, rendered off the event loop: by the prompt's size)."""

    def __init__(self, call: CompletionCall, index: int, decode: Callable):
        self.call, self.index, self.decode = call, index, decode
        self.started = False

    async def chunks(self, output: RequestOutput, so_far: dict | None) -> AsyncIterator[Chunk]:
        call, index = self.call, self.index
        finish = output.finish_reason.value if output.finished else None
        lp = responses.completion_logprobs(output.logprobs, self.decode)
        text, large = output.text, False
        if call.echo and not self.started:  # the prompt (and its logprobs) first
            self.started = True
            text = call.echo[index // call.n] + ("" if call.echo_only else text)
            if output.prompt_logprobs is not None:
                entries = [*output.prompt_logprobs, *([] if call.echo_only else output.logprobs)]
                ids = call.requests[index // call.n].prompt_ids
                lp = await asyncio.to_thread(responses.completion_logprobs, entries, self.decode, ids)
                large = True
        elif call.echo_only:
            text, lp = "", None
        yield Chunk({"index": index, "logprobs": lp, "finish_reason": finish, "text": text}, so_far, large)
