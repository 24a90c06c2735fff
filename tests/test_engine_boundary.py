"""The daemons read nothing of the engine past its boundary: in services/ and pdserve/, every attribute read
on an engine (a name or attribute ending in `engine`) is one of LLMEngine's public methods and properties
or one of the facts it publishes (PUBLIC_FIELDS); its runner, scheduler, adapter registry and the other
parts it is built from are reached only through its commands (engine.boundary) and those methods.
pdserve/testing's probes measure the engine's insides on purpose and are left out."""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.fast

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the facts an engine publishes as plain attributes (read-only by convention): its configuration, its
# tokenizer, its model (config and tokenizer), its mesh (where arriving KV is placed), whether it stalled
PUBLIC_FIELDS = {"config", "tokenizer", "model", "mesh", "stalled"}


def _public_surface() -> set[str]:
    from pdserve.engine.llm_engine import LLMEngine

    return {name for name in dir(LLMEngine) if not name.startswith("_")} | PUBLIC_FIELDS


def _engine_reads(path: pathlib.Path):
    """(line, owner, attribute) of every `<...engine>.<attribute>` in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        if name.endswith("engine"):
            yield node.lineno, name, node.attr


def _daemon_sources():
    for folder in ("services", "pdserve"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).parts
            if parts[:2] in (("pdserve", "v1"), ("pdserve", "testing")):
                continue
            yield path


def test_the_daemons_read_only_the_engines_public_surface():
    public = _public_surface()
    leaks = [
        f"{path.relative_to(ROOT)}:{line}: {owner}.{attr}"
        for path in _daemon_sources()
        for line, owner, attr in _engine_reads(path)
        if attr not in public
    ]
    assert not leaks, "engine internals read past the boundary:\n" + "\n".join(leaks)


def test_the_check_sees_a_leak(tmp_path):
    """The check itself: a read of the engine's scheduler is found, a public method is not."""
    source = tmp_path / "leak.py"
    source.write_text("def f(loop):\n    loop.engine.scheduler.kv\n    loop.engine.stats()\n")
    reads = [(owner, attr) for _, owner, attr in _engine_reads(source)]
    assert reads == [("engine", "scheduler"), ("engine", "stats")]
    assert "scheduler" not in _public_surface() and "stats" in _public_surface()
