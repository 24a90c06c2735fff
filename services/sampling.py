"""The one mapping of sampling parameters and stop conditions across pdserve's interfaces.

Each `Field` is one knob, named the same everywhere: the `SamplingParams` attribute, the `GenerateRequest`
proto field (in `sampling`, in `stop`, or on the request itself), the keyword of `Client.generate` /
`build_request`, the OpenAI (and vLLM extension) body key and the `pdserve generate` flag. Every
conversion below walks `FIELDS`; a new knob is one new line here (a test checks that the table covers
every field of `SamplingParams` and of the protos).

The constraint (structured output) is a message of its own, not a knob: `set_constraint` and
`constraint_from_message` carry it, and the OpenAI front maps `response_format` and `tools` onto it.

Defaults belong to each API, not to this table: over gRPC and on the command line an unset field takes
the proto's default (temperature 0: greedy; max_tokens 0: the server's DEFAULT_MAX_TOKENS), while
`SamplingParams()` and the OpenAI API default to temperature 1 as their users expect.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.engine.sampling_params import MAX_TOKEN_IDS, Constraint, InvalidRequestError, SamplingParams

DEFAULT_MAX_TOKENS = 256  # what a GenerateRequest without max_tokens gets


@dataclasses.dataclass(frozen=True)
class Field:
    name: str  # SamplingParams attribute = proto field = Client keyword = OpenAI key
    kind: type  # float, int, bool or str (of each element when repeated)
    message: str  # where it lives in a GenerateRequest: "sampling", "stop" or "request"
    help: str
    repeated: bool = False
    optional: bool = False  # proto3 `optional`: unset means SamplingParams' default
    flag: str = ""  # the CLI flag when it is not --name-with-dashes (repeated flags are singular)
    mapping: bool = False  # token id -> `kind` (a proto map; sorted (id, value) pairs in SamplingParams)

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


FIELDS: tuple[Field, ...] = (
    Field("temperature", float, "sampling", "0 (the default here and over gRPC): greedy"),
    Field("top_p", float, "sampling", "nucleus sampling mass, (0, 1]; unset: 1", optional=True),
    Field("top_k", int, "sampling", "keep the k most likely tokens; 0: off"),
    Field("min_p", float, "sampling", "drop tokens below min_p x the top probability; 0: off"),
    Field(
        "repetition_penalty", float, "sampling", "HF-style, > 0 over prompt + output; unset: 1", optional=True
    ),
    Field("presence_penalty", float, "sampling", "OpenAI-style, [-2, 2] over the output"),
    Field("frequency_penalty", float, "sampling", "OpenAI-style, [-2, 2] over the output"),
    Field("seed", int, "sampling", "seeded sampling; unset: a random seed per request", optional=True),
    Field("logprobs", int, "sampling", "top-n logprobs per token (0: the sampled one's only)", optional=True),
    Field(
        "prompt_logprobs",
        int,
        "sampling",
        "top-n logprobs at each prompt position (0: the prompt token's own); reads no prefix cache",
        optional=True,
    ),
    Field(
        "skip_special_tokens",
        bool,
        "sampling",
        "leave special tokens out of the text (default)",
        optional=True,
    ),
    Field(
        "n", int, "sampling", "sequences from one prompt (one prefill, KV forked); unset: 1", optional=True
    ),
    Field("max_tokens", int, "request", f"tokens to generate; 0 or unset: {DEFAULT_MAX_TOKENS}"),
    Field(
        "min_tokens", int, "sampling", "tokens generated before a stop token may be (EOS held back); 0: off"
    ),
    Field(
        "logit_bias",
        float,
        "sampling",
        "TOKEN=BIAS: added to the token's logit, in [-100, 100] (repeatable)",
        mapping=True,
    ),
    Field("stop", str, "stop", "stop string, not included in the output (repeatable)", repeated=True),
    Field("stop_token_ids", int, "stop", "stop token id (repeatable)", repeated=True, flag="--stop-token-id"),
    Field(
        "allowed_token_ids",
        int,
        "sampling",
        "only these token ids may be generated (repeatable)",
        repeated=True,
        flag="--allowed-token-id",
    ),
    Field(
        "bad_words", str, "sampling", "a word never generated (repeatable)", repeated=True, flag="--bad-word"
    ),
    Field(
        "reasoning_end",
        int,
        "sampling",
        "with a constraint: the token ids that end the reasoning; the constraint applies after them",
        repeated=True,
        flag="--reasoning-end-token",
    ),
    Field("ignore_eos", bool, "stop", "keep generating past EOS"),
)
FIELD_NAMES = frozenset(f.name for f in FIELDS)


def _container(request, field: Field):
    """The message holding `field`; None for request-level fields a message does not have (PrefillRequest
    has no max_tokens: the prefill side samples one token)."""
    if field.message != "request":
        return getattr(request, field.message)
    return request if field.name in request.DESCRIPTOR.fields_by_name else None


# ---- what one request may carry -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Limits:
    """The sizes a request may carry, checked where it enters (gRPC Generate and Prefill, the OpenAI
    bodies) before anything is queued, beside SamplingParams.validate's ranges of each knob (engine.
    sampling_params.BOUNDS). A request past one is INVALID_ARGUMENT / HTTP 400 naming the field and the
    limit. Each has a daemon flag (add_limit_flags): the defaults admit what real clients send (OpenAI
    allows 4 stop strings and 128 tools; lm-evaluation-harness sends a few stop strings)."""

    max_stop_strings: int = 64
    max_stop_string_chars: int = 512
    max_stop_token_ids: int = 256
    max_bad_words: int = 256
    max_bad_word_chars: int = 256
    max_request_id_chars: int = 256  # printable ASCII without spaces (it goes into logs and KV frames)
    max_tools: int = 128
    max_chat_messages: int = 4096
    max_prompts_per_call: int = 256  # prompts of one /v1/completions call (a choice each)
    # Sequences of one request (n; vLLM has no limit): 0 is half of the engine's max_num_seqs, so one
    # request never holds every decode slot (check_fanout)
    max_n: int = dataclasses.field(
        default=0, metadata={"help": "sequences one request may ask for (n); 0: half of --max-num-seqs"}
    )
    # n x max_tokens of one request: the tokens its sequences may generate together
    max_n_tokens: int = dataclasses.field(
        default=131_072, metadata={"help": "n x max_tokens of one request with n > 1"}
    )

    def check(self, params: SamplingParams) -> None:
        """The sizes of a request's stop conditions and of its fan-out (InvalidRequestError naming the
        field)."""
        if params.n > 1:
            _at_most("n", params.n * params.max_tokens, self.max_n_tokens, "tokens in all (n x max_tokens)")
        _at_most("stop", len(params.stop), self.max_stop_strings, "stop strings")
        longest = max((len(s) for s in params.stop if isinstance(s, str)), default=0)
        _at_most("stop", longest, self.max_stop_string_chars, "characters in a stop string")
        _at_most("stop_token_ids", len(params.stop_token_ids), self.max_stop_token_ids, "stop token ids")
        _at_most("bad_words", len(params.bad_words), self.max_bad_words, "bad words")
        longest = max((len(w) for w in params.bad_words if isinstance(w, str)), default=0)
        _at_most("bad_words", longest, self.max_bad_word_chars, "characters in a bad word")

    def check_fanout(self, params: SamplingParams, max_num_seqs: int) -> None:
        """n against max_n (0: half of the engine's `max_num_seqs`, at least 1)."""
        _at_most("n", params.n, self.max_n or max(1, max_num_seqs // 2), "sequences")

    def check_request_id(self, request_id: str, field: str = "request_id") -> str:
        """A client's request id (a label in logs, responses and KV frames, never an engine key)."""
        _at_most(field, len(request_id), self.max_request_id_chars, "characters")
        if not all("!" <= c <= "~" for c in request_id):
            raise InvalidRequestError(field, "printable ASCII characters without spaces only")
        return request_id

    def check_chat(self, contents: Sequence[str], max_chars: int, field: str = "messages") -> None:
        """A chat before it is rendered: its number of messages, and the characters of their texts
        together against `max_chars` (the engine's max_prompt_chars: rendering costs CPU by the
        character)."""
        _at_most(field, len(contents), self.max_chat_messages, "messages")
        _at_most(field, sum(len(c) for c in contents), max_chars, "characters in all")


def check_knobs(
    params: SamplingParams,
    limits: Limits,
    vocab_size: int | None = None,
    max_logprobs: int | None = None,
    max_num_seqs: int | None = None,
) -> None:
    """What costs next to nothing to check of a request's parameters (its sizes and each knob's range), for a
    front to refuse a bad request on the event loop. The constraint is not read: its text grows with the
    request, so it is parsed off the loop (make_request validates it). `max_num_seqs`: the engine's, which
    bounds n (Limits.check_fanout; None: not checked here)."""
    limits.check(params)
    if max_num_seqs is not None:
        limits.check_fanout(params, max_num_seqs)
    dataclasses.replace(params, constraint=None).validate(vocab_size, max_logprobs)


def _at_most(field: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        raise InvalidRequestError(field, f"{value} {what}: the limit is {limit}")


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Limits field (--max-stop-strings ...), defaulting to Limits()'s values."""
    group = parser.add_argument_group("request limits (past one: INVALID_ARGUMENT / HTTP 400)")
    for field in dataclasses.fields(Limits):
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            type=int,
            default=field.default,
            metavar="N",
            help=f"{field.metadata.get('help', '')} (default: {field.default})".lstrip(),
        )


def limits_from_flags(args: argparse.Namespace) -> Limits:
    return Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})


# ---- GenerateRequest (and the Prefill request, which carries the same messages) ---------------------
def set_request_fields(request, values: Mapping[str, Any]):
    """Writes the given knobs into `request` (None: left unset); unknown names are a TypeError."""
    unknown = set(values) - FIELD_NAMES
    if unknown:
        raise TypeError(f"unknown sampling fields: {sorted(unknown)}")
    for field in FIELDS:
        value = values.get(field.name)
        container = _container(request, field)
        if value is None or container is None:
            continue
        if field.mapping:
            getattr(container, field.name).update(dict(value))
        elif field.repeated:
            getattr(container, field.name).extend(value)
        else:
            setattr(container, field.name, value)
    return request


def params_to_request(params: SamplingParams, request):
    """Every knob of `params` into `request`, a GenerateRequest or a PrefillRequest, the constraint too
    (the inverse of params_from_request)."""
    if params.constraint is not None:
        set_constraint(request.constraint, params.constraint)
    return set_request_fields(request, {f.name: getattr(params, f.name) for f in FIELDS})


def set_constraint(message, constraint: Constraint) -> None:
    """A Constraint into a `pdserve.v1.Constraint` message."""
    if constraint.kind == "json_object":
        message.json_object = True
    elif constraint.kind == "choice":
        message.choice.values.extend(constraint.choices)
    else:
        setattr(message, constraint.kind, constraint.value)


def constraint_from_message(message) -> Constraint | None:
    """A `pdserve.v1.Constraint` message's Constraint (None: unset)."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return Constraint("json_object") if message.json_object else None
    if kind == "choice":
        return Constraint("choice", choices=tuple(message.choice.values))
    return Constraint(kind, getattr(message, kind))


def params_from_request(request) -> SamplingParams:
    """The SamplingParams of a GenerateRequest or a PrefillRequest under the gRPC API's defaults; range
    checks happen in SamplingParams.validate (INVALID_ARGUMENT naming the field)."""
    defaults = SamplingParams()
    values = {}
    for field in FIELDS:
        container = _container(request, field)
        if container is None:
            values[field.name] = 0
        elif field.mapping:
            values[field.name] = tuple(sorted(getattr(container, field.name).items()))
        elif field.repeated:
            values[field.name] = tuple(_bounded(field, getattr(container, field.name)))
        elif field.optional and not container.HasField(field.name):
            values[field.name] = getattr(defaults, field.name)
        else:
            values[field.name] = getattr(container, field.name)
    values["max_tokens"] = values["max_tokens"] or DEFAULT_MAX_TOKENS
    return SamplingParams(**values, constraint=constraint_from_message(request.constraint))


# ---- the command line -------------------------------------------------------------------------------
def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per knob, every default unset (None): what is not given takes the gRPC API's default."""
    group = parser.add_argument_group("sampling and stop conditions")
    for field in FIELDS:
        if field.kind is bool:
            group.add_argument(
                field.cli_flag,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=field.help,
            )
        elif field.mapping:
            group.add_argument(
                field.cli_flag, dest=field.name, type=_token_value, action="append", help=field.help
            )
        elif field.repeated:
            group.add_argument(
                field.cli_flag, dest=field.name, type=field.kind, action=_AppendValue, help=field.help
            )
        else:
            group.add_argument(field.cli_flag, dest=field.name, type=field.kind, help=field.help)


class _AppendValue(argparse._AppendAction):
    """`append`, keeping a value of `--` (`--stop=--`): Python 3.11's argparse drops it as the end of the
    options and hands the action nothing."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values == []:
            values = parser._get_value(self, "--")  # (the flag's type, or its usual error)
        super().__call__(parser, namespace, values, option_string)


def add_constraint_flags(parser: argparse.ArgumentParser) -> None:
    """At most one constraint (structured output): --json-schema, --json-object, --regex, --grammar,
    --choice (repeatable)."""
    group = parser.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="SCHEMA", help="a JSON schema: its JSON text, or @FILE")
    group.add_argument("--json-object", action="store_true", default=None, help="any JSON object")
    group.add_argument("--regex", help="the output matches this regex")
    group.add_argument("--grammar", metavar="LARK", help="a Lark grammar (llguidance's dialect), or @FILE")
    group.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")


def constraint_from_flags(args: argparse.Namespace) -> Constraint | None:
    """The constraint the flags of add_constraint_flags give (None: free text); @FILE reads a file."""

    def text(value: str) -> str:
        return Path(value[1:]).read_text() if value.startswith("@") else value

    if args.json_schema is not None:
        return Constraint("json_schema", text(args.json_schema))
    if args.json_object:
        return Constraint("json_object")
    if args.regex is not None:
        return Constraint("regex", args.regex)
    if args.grammar is not None:
        return Constraint("grammar", text(args.grammar))
    if args.choice:
        return Constraint("choice", choices=tuple(args.choice))
    return None


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs given on the command line, for set_request_fields / Client.generate."""
    return {f.name: getattr(args, f.name) for f in FIELDS if getattr(args, f.name) is not None}


# ---- plain values (the OpenAI body) ------------------------------------------------------------------
def params_from_values(values: Mapping[str, Any], defaults: SamplingParams | None = None) -> SamplingParams:
    """SamplingParams from JSON-like values keyed by field name (None or missing: `defaults`).

    Types are checked here (InvalidRequestError naming the field); ranges by SamplingParams.validate."""
    out = {}
    for field in FIELDS:
        value = values.get(field.name)
        if value is None:
            continue
        if field.mapping:
            out[field.name] = _token_map(field, value)
            continue
        if field.repeated and not isinstance(value, list | tuple):
            raise InvalidRequestError(field.name, f"must be a list of {field.kind.__name__}")
        items = _bounded(field, value) if field.repeated else (value,)
        checked = tuple(_checked(field, item) for item in items)
        out[field.name] = checked if field.repeated else checked[0]
    return dataclasses.replace(defaults or SamplingParams(), **out)


def _bounded(field: Field, values):
    """A repeated field's values, refused (naming the field) before they are read one by one when there are
    more than any field may hold (MAX_TOKEN_IDS; each field's own limit is checked after)."""
    if hasattr(values, "__len__") and len(values) > MAX_TOKEN_IDS:
        raise InvalidRequestError(field.name, f"{len(values)} values: the limit is {MAX_TOKEN_IDS}")
    return values


def _token_map(field: Field, value: Any) -> tuple[tuple[int, Any], ...]:
    """A token-id map from JSON (an object with token id keys, as OpenAI's logit_bias) or (id, value)
    pairs: sorted pairs, each value of the field's kind."""
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        out = {int(token): _checked(field, v) for token, v in pairs}
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(field.name, "must map token ids to numbers") from e
    return tuple(sorted(out.items()))


def _token_value(text: str) -> tuple[int, float]:
    """TOKEN=VALUE of a map flag (--logit-bias)."""
    token, _, value = text.partition("=")
    try:
        return int(token), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not TOKEN=VALUE") from None


def _checked(field: Field, value: Any) -> Any:
    if field.kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, field.kind) or (isinstance(value, bool) and field.kind is not bool):
        raise InvalidRequestError(field.name, f"must be a {field.kind.__name__}")
    return value
