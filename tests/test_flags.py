"""The command-line compatibility rule (docs/contributing.md): every renamed or removed flag in
DEPRECATED_FLAGS still parses, on every command that has its replacement, to the configuration of the
replacement, hidden from --help, with one warning naming the replacement."""

from __future__ import annotations

import argparse
import logging

import pytest

from pdserve import cli, daemons
from pdserve.flags import DEPRECATED_FLAGS, DEPRECATIONS, log_deprecations

pytestmark = pytest.mark.fast


def _commands() -> dict[str, argparse.ArgumentParser]:
    serve = next(
        action.choices["serve"]
        for action in cli.build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    return {
        "prefill-server": daemons.prefill_parser(),
        "decode-server": daemons.decode_parser(),
        "serve": serve,
    }


def _required(parser: argparse.ArgumentParser) -> list[str]:
    return ["--port", "0"] if "--port" in parser._option_string_actions else []


@pytest.mark.parametrize("flag", DEPRECATED_FLAGS, ids=lambda f: f.old)
@pytest.mark.parametrize("command", ["prefill-server", "decode-server", "serve"])
def test_every_deprecated_flag_parses_to_its_replacement(flag, command, caplog):
    parser = _commands()[command]
    if flag.replacement[0] not in parser._option_string_actions:
        pytest.fail(f"{command} lost {flag.replacement[0]}, the replacement of {flag.old}")
    old = parser.parse_args([*_required(parser), flag.old])
    new = parser.parse_args([*_required(parser), *flag.replacement])
    warnings = vars(old).pop(DEPRECATIONS)
    assert vars(old) == vars(new)
    assert warnings == [f"{flag.old} is deprecated since {flag.since}: use {' '.join(flag.replacement)}"]
    assert flag.old not in parser.format_help()
    with caplog.at_level(logging.WARNING):
        log_deprecations(argparse.Namespace(**{DEPRECATIONS: warnings}), logging.getLogger("t"))
    assert [r.getMessage() for r in caplog.records] == warnings
