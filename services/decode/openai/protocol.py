"""What every OpenAI request body (and vLLM's extensions to it) carries, read into what the engine takes:
the key types, the fields refused by name, the sampling knobs through services.sampling's one mapping, and
the constraint. A chat's messages are read in `chat`, a completion's prompts in `completions`. Every
refusal is an InvalidRequestError naming the body key.

A field vLLM serves and pdserve does not yet is refused by name (UNSUPPORTED) rather than ignored: a
client that sends it would otherwise get a different computation than it asked for, silently. Keys
pdserve does not know at all are ignored, as vLLM ignores them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from pdserve.engine.sampling_params import Constraint, InvalidRequestError, SamplingParams
from pdserve.services.sampling import FIELD_NAMES, params_from_values

DEFAULT_MAX_TOKENS = {False: 16, True: 256}  # completions, chat: OpenAI's defaults

# The JSON types of the body keys read here, besides services.sampling's knobs (params_from_values checks
# those): a key of another type is a 400 naming it before anything reads it.
BODY_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "messages": (list,),
    "prompt": (str, list),
    "stream": (bool,),
    "stream_options": (dict,),
    "n": (int,),
    "best_of": (int,),
    "echo": (bool,),
    "logprobs": (bool, int),
    "top_logprobs": (int,),
    "max_completion_tokens": (int,),
    "response_format": (dict,),
    "structured_outputs": (dict,),
    "tools": (list,),
    "tool_choice": (str, dict),
    "parallel_tool_calls": (bool,),
    "add_generation_prompt": (bool,),
    "continue_final_message": (bool,),
    "add_special_tokens": (bool,),
    "chat_template_kwargs": (dict,),
    "lora_adapter": (str,),
    "cache_salt": (str,),  # vLLM's: a tenant's prefix-cache salt
    "return_token_ids": (bool,),  # vLLM's: each choice (and streamed chunk) carries its token ids
    "resume_token_ids": (list,),  # pdserve's: the output already relayed (check_resumption)
    "user": (str,),
    "guided_json": (str, dict),
    "guided_regex": (str,),
    "guided_grammar": (str,),
    "guided_choice": (list,),
}
_JSON_NAMES = {str: "a string", list: "a list", dict: "an object", bool: "a boolean", int: "an integer"}

# Fields of vLLM's API that pdserve does not serve yet: refused when set to anything but their default.
UNSUPPORTED: dict[str, str] = {
    "suffix": "is not supported",
    "use_beam_search": "beam search is not supported",
    "chat_template": "a chat template in the request is not accepted: the model's own renders",
}


def check_types(body: dict) -> None:
    """The types of the keys read here (InvalidRequestError naming the first of another type)."""
    for key, kinds in BODY_TYPES.items():
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise InvalidRequestError(key, "must be " + " or ".join(_JSON_NAMES[k] for k in kinds))


def check_fields(body: dict) -> None:
    """The fields refused by name: those not served (UNSUPPORTED), and combinations vLLM refuses too."""
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False, 0, [], {}):
            raise InvalidRequestError(key, why)
    if body.get("best_of") not in (None, 1):  # (vLLM 0.12 dropped it; 0.11 refused it past 1)
        raise InvalidRequestError("best_of", "only best_of=1 is supported")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise InvalidRequestError("stream_options", "only with stream: true")
    if body.get("stream") and body.get("prompt_logprobs") is not None:
        raise InvalidRequestError("prompt_logprobs", "not with stream: true (as vLLM)")


# ---- sampling ----------------------------------------------------------------------------------------
def sampling_params(body: dict, chat: bool, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """OpenAI fields (and vLLM's extensions: top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos)
    -> SamplingParams through services.sampling's one mapping; OpenAI's own shapes are normalised first.
    Type errors become InvalidRequestError naming the field; the defaults are OpenAI's (temperature 1) but
    for those of `defaults` (the model's generation config: engine.loading.sources.generation_defaults)."""
    return dataclasses.replace(knobs(body, chat, defaults), constraint=constraint(body))


def knobs(body: dict, chat: bool, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """sampling_params without the constraint (whose text grows with the body: it is read off the event
    loop)."""
    defaults = defaults or {}
    values = {**defaults, **{name: body[name] for name in FIELD_NAMES if body.get(name) is not None}}
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    logprobs = body.get("logprobs")
    if body.get("top_logprobs") is not None:  # chat: logprobs is a bool, top_logprobs the count
        values["logprobs"] = body["top_logprobs"] if logprobs else None
    elif isinstance(logprobs, bool):
        values["logprobs"] = 0 if logprobs else None
    if body.get("echo") and values.get("logprobs") is not None and values.get("prompt_logprobs") is None:
        values["prompt_logprobs"] = values["logprobs"]  # the echoed prompt's logprobs, as vLLM computes them
    default = DEFAULT_MAX_TOKENS[chat]
    given = body.get("max_completion_tokens") or body.get("max_tokens")
    values["max_tokens"] = given or defaults.get("max_tokens") or default
    return params_from_values(values)


# ---- structured output -------------------------------------------------------------------------------
# vLLM's `structured_outputs` keys -> Constraint kinds; its older guided_* keys (removed in vLLM 0.12) are
# read as deprecated aliases of the same
STRUCTURED = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "guided_choice": "choice",
}


def constraint(body: dict) -> Constraint | None:
    """OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"schema": ...}}), vLLM's `structured_outputs` ({"json" | "regex" | "grammar" | "choice" |
    "json_object": ...}) or one of its guided_* keys; at most one of them; None: free text."""
    given = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise InvalidRequestError("response_format", "type must be text, json_object or json_schema")
        if kind == "json_object":
            given.append(("response_format", Constraint("json_object")))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequestError("response_format", "json_schema.schema must be a JSON object")
            given.append(("response_format", Constraint("json_schema", json.dumps(schema))))
    outputs = body.get("structured_outputs") or {}
    if outputs.get("json_object"):
        given.append(("structured_outputs", Constraint("json_object")))
    for key in STRUCTURED:
        if outputs.get(key) is not None:
            given.append(("structured_outputs", _structured("structured_outputs", key, outputs[key])))
    for alias, key in GUIDED.items():
        if body.get(alias) is not None:
            given.append((alias, _structured(alias, key, body[alias])))
    if len(given) > 1:
        raise InvalidRequestError(
            given[1][0], "at most one of response_format, structured_outputs and guided_*"
        )
    return given[0][1] if given else None


def _structured(field: str, key: str, value: Any) -> Constraint:
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidRequestError(field, f"{key} must be a list of strings")
        return Constraint("choice", choices=tuple(value))
    if key == "json" and isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise InvalidRequestError(
            field, f"{key} must be a string" + (" or an object" if key == "json" else "")
        )
    return Constraint(STRUCTURED[key], value)


def constraint_field(body: dict) -> str:
    """The body key a request's constraint came from (for naming it in a refusal)."""
    if body.get("response_format") is not None and body["response_format"].get("type") != "text":
        return "response_format"
    if body.get("structured_outputs"):
        return "structured_outputs"
    return next((k for k in GUIDED if body.get(k) is not None), "response_format")


def check_resumption(body: dict) -> None:
    """`resume_token_ids` (pdserve's extension, GenerateRequest.resume_token_ids: the output a client or
    proxy already relayed of this call from a server that went away) is a list of token ids, for a call of
    one prompt (the engine checks the rest)."""
    resumed = body.get("resume_token_ids")
    if resumed is None:
        return
    if not token_ids(resumed):
        raise InvalidRequestError("resume_token_ids", "must be a list of token ids")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not token_ids(prompt) and len(prompt) > 1:
        raise InvalidRequestError("resume_token_ids", "a call of one prompt resumes (one request)")


def token_ids(value: Any) -> bool:
    """Whether `value` is a list of token ids (integers, not booleans)."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
