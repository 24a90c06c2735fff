"""Command-line flags derived from the configuration dataclasses, and what they build.

A config field made with `engine.config.flag(default, help, ...)` is a flag: `--field-name` (or its
`flag` name), the field's type, its `help`; a bool is a pair (`--x` / `--no-x`). Every flag's parsed
default is None, so a flag not given takes the dataclass's default: each default exists once, in the
dataclass (vLLM's EngineArgs reads its help text from its fields the same way). The command lines
(pdserve/cli.py, pdserve/daemons.py) and the test launcher (pdserve.testing.launch) call down into this
module; the libraries below define no flags of their own but for the request-limit and sampling tables
of services/sampling.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.loading.sources import DEFAULT_MODEL

_TYPES = (int, float, str, bool)


def _flag_fields(cls) -> list[tuple[dataclasses.Field, type]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if "help" in f.metadata]


def _name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def add_config_flags(parser: argparse.ArgumentParser, cls, groups: dict[str, Any] | None = None) -> None:
    """One flag per flag field of dataclass `cls` (in `groups[field's group]` when it names one)."""
    for field, kind in _flag_fields(cls):
        if kind not in _TYPES:
            raise TypeError(f"{cls.__name__}.{field.name}: a flag is one of {_TYPES}, not {kind}")
        meta = field.metadata
        target = (groups or {}).get(meta.get("group"), parser)
        options: dict[str, Any] = dict(
            dest=field.name, default=None, help=f"{meta['help']} (default: {field.default})"
        )
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options.update(type=kind, choices=meta.get("choices"), metavar=meta.get("metavar"))
        target.add_argument(_name(field), *meta.get("aliases", ()), **options)


def config_from_flags(cls, args: argparse.Namespace, **values: Any):
    """`cls` from the flags given in `args` (the others: its defaults) and `values` (what the caller
    derives itself)."""
    given = {
        f.name: getattr(args, f.name) for f, _ in _flag_fields(cls) if getattr(args, f.name, None) is not None
    }
    return cls(**{**given, **values})


def config_argv(config) -> list[str]:
    """The flags that make `config` (a dataclass instance) from its class's defaults: the inverse of
    config_from_flags, for launching a daemon with a given configuration."""
    argv = []
    for field, kind in _flag_fields(type(config)):
        value = getattr(config, field.name)
        if value == field.default:
            continue
        name = _name(field)
        if kind is bool:
            argv.append(name if value else "--no-" + name.removeprefix("--"))
        else:
            argv += [name, str(value)]
    return argv


# ---- renamed flags ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeprecatedFlag:
    """A flag renamed or removed in release `since`, still taken for at least one minor release after as an
    alias of `replacement` (the flag and its value, as a command line would give them), with one warning
    naming it (docs/contributing.md's compatibility rule)."""

    old: str
    replacement: tuple[str, ...]
    since: str


DEPRECATED_FLAGS: tuple[DeprecatedFlag, ...] = (
    DeprecatedFlag("--no-kv-events", ("--kv-events", "off"), "0.1.0"),
)
DEPRECATIONS = "_deprecations"  # the Namespace attribute listing the warnings (log_deprecations logs them)


class _DeprecatedAlias(argparse.Action):
    """Parses `flag.replacement` in place of the old flag (its type and choices checked by its own action)
    and notes the warning."""

    def __init__(self, option_strings, dest, flag: DeprecatedFlag, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, help=argparse.SUPPRESS, **kwargs)
        self.flag = flag

    def __call__(self, parser, namespace, values, option_string=None):
        name, *given = self.flag.replacement
        action = parser._option_string_actions.get(name)
        if action is None:
            parser.error(f"{self.flag.old} has no replacement in this command")
        value = parser._get_values(action, given) if given else None
        action(parser, namespace, value, name)
        warnings = getattr(namespace, DEPRECATIONS, [])
        warnings.append(
            f"{self.flag.old} is deprecated since {self.flag.since}: use {' '.join(self.flag.replacement)}"
        )
        setattr(namespace, DEPRECATIONS, warnings)


def add_deprecated_flags(parser: argparse.ArgumentParser) -> None:
    """DEPRECATED_FLAGS, as aliases hidden from --help; each parses to its replacement."""
    for flag in DEPRECATED_FLAGS:
        parser.add_argument(flag.old, action=_DeprecatedAlias, flag=flag)


def log_deprecations(args: argparse.Namespace, log) -> None:
    """One warning for each deprecated flag the command line used (after logging is configured)."""
    for message in getattr(args, DEPRECATIONS, ()):
        log.warning(message)


# ---- the engine's flags ---------------------------------------------------------------------------------
def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """--model, EngineConfig's flags and the LoRA adapters to load at start."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file, HF folder or known name")
    lora = parser.add_argument_group(
        "LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors)"
    )
    add_config_flags(parser, EngineConfig, {"lora": lora})
    lora.add_argument(
        "--lora",
        action="append",
        default=[],
        type=lora_spec,
        metavar="NAME=PATH",
        help="load at start (repeatable)",
    )


def lora_spec(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
    return name, path


DEFAULT_LORA_SLOTS = 4  # --max-loras when --lora adapters are given and it is not


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of add_engine_args' flags."""
    max_loras = args.max_loras
    if max_loras is None and args.lora:
        max_loras = DEFAULT_LORA_SLOTS
    return config_from_flags(EngineConfig, args, **({} if max_loras is None else {"max_loras": max_loras}))


def load_adapters(engine, specs: list[tuple[str, str]]) -> None:
    """Loads the --lora adapters into `engine`; exits naming the one that cannot be served."""
    from pdserve.engine.boundary import Utility
    from pdserve.engine.lora import LoraLoadError

    for name, path in specs:
        try:
            engine.apply(Utility("add_adapter", (engine.read_adapter(name, path),)))
        except LoraLoadError as e:
            raise SystemExit(f"error: --lora {name}: {e}") from e
