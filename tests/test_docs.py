"""Docs that match the code: every dotted module reference (`engine.…`, `services.…`, `kvtransfer.…`,
`pdserve.…`) in the Markdown docs, in the docstrings and comments of the .py files and in the .proto
comments resolves against the installed package, every path from the repository's root they name
(a file or a folder) exists, and every `--flag` the docs name is one a parser accepts.

References resolve without importing the package's heavy modules: the package folders come from
importlib's specs, modules from the files under them, attributes from the modules' syntax trees (a
module's top-level names, then a class's members). A reference that starts `engine.` and goes on with a
member of `LLMEngine` rather than a module is an engine object in prose (`engine.generate(...)`); one of
`pdserve.v1` may be a message's full name in the protos (`pdserve.v1.Constraint`).

Flags are checked where the docs run a program: a command line of `pdserve`, `decode-server` or
`prefill-server` against their argparse parsers (pdserve/cli.py, pdserve/daemons.py, deprecated aliases
included); a bench script's (`python bench/NAME.py ...`) against the flags its source defines; a flag
alone in backticks against pdserve's, tests/conftest.py's, those of the bench scripts its section names
and OTHER_TOOLS. Command lines in fenced or indented blocks and in backticks count; those of other
programs (pip, docker, kubectl, pytest, vllm, ...) are not checked.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".venv", ".git", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache"}
GENERATED = ("pdserve/v1/",)  # protoc output: its comments are the protos'

# Flags of programs other than pdserve's that the docs name alone in backticks, each with whose it is.
OTHER_TOOLS = {
    "--durations": "pytest",
    "--xla_cpu_": "XLA's CPU flags (a prefix)",
    "--use-server-token-count": "aiperf",
    "--total-queued-requests-metric": "the gateway's endpoint picker",
    "--kv-cache-usage-percentage-metric": "the gateway's endpoint picker",
    "--lora-info-metric": "the gateway's endpoint picker",
}

REF = re.compile(r"(?<![\w./\-])(?:pdserve|engine|services|kvtransfer)(?:\.[A-Za-z_]\w*)+")
# a path from the repository's root (a file or a folder); globs and `{a,b}` forms are left alone
PATH = re.compile(
    r"(?<![\w./\-])((?:engine|services|kvtransfer|pdserve|bench|scripts|tests|deploy|docs|protos)"
    r"(?:/[\w.\-]+)+)/?(?![\w*{\-])"
)
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*")  # deploy/overlays/NAME
FILE_SUFFIXES = {"py", "md", "proto", "sh", "yaml", "toml", "json", "txt"}
FLAG = re.compile(r"(?<![\w\-])--[a-z][\w\-]*")


# ---------------------------------------------------------------- the texts


def _files(suffix: str) -> list[Path]:
    found = []
    for path in REPO.rglob(f"*{suffix}"):
        rel = path.relative_to(REPO)
        venvs = any(part.startswith(".venv") for part in rel.parts)  # .venv-compat, .venv-vllm, ...
        if venvs or SKIP_DIRS & set(rel.parts) or str(rel).startswith(GENERATED):
            continue
        found.append(path)
    return sorted(found)


def _py_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    source = path.read_text()
    texts = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                texts += [(node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return texts


def _proto_texts(path: Path) -> list[tuple[int, str]]:
    return [
        (i, line.split("//", 1)[1]) for i, line in enumerate(path.read_text().splitlines(), 1) if "//" in line
    ]


def _md_texts(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text().splitlines(), 1))


@functools.cache
def _texts() -> dict[str, list[tuple[int, str]]]:
    texts = {}
    for path in _files(".md"):
        texts[str(path.relative_to(REPO))] = _md_texts(path)
    for path in _files(".py"):
        texts[str(path.relative_to(REPO))] = _py_texts(path)
    for path in _files(".proto"):
        texts[str(path.relative_to(REPO))] = _proto_texts(path)
    return texts


# ---------------------------------------------------------------- module references


@functools.cache
def _roots() -> dict[str, Path]:
    """Each top-level package of the installed layout -> its folder (pdserve.engine is engine/, ...)."""
    roots = {"pdserve": Path(importlib.util.find_spec("pdserve").submodule_search_locations[0])}
    for name in ("engine", "services", "kvtransfer"):
        spec = importlib.util.find_spec(f"pdserve.{name}")  # imports pdserve (light), not the package
        roots[name] = Path(spec.submodule_search_locations[0])
    return roots


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _bound_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a block of statements binds (into if/try/with blocks, not into functions)."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for inner in getattr(node, block, []):
                    names.update(
                        _bound_names(inner.body if isinstance(inner, ast.ExceptHandler) else [inner])
                    )
    return names


def _module_names(files: list[Path]) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for path in files:
        names.update(_bound_names(_tree(path).body))
    return names


def _class_members(cls: ast.ClassDef) -> set[str]:
    """A class's attributes: its body's names and what its methods assign to self."""
    members = set(_bound_names(cls.body))
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        members.update(
            leaf.attr
            for target in targets
            for leaf in ast.walk(target)
            if isinstance(leaf, ast.Attribute)
            and isinstance(leaf.value, ast.Name)
            and leaf.value.id in ("self", "cls")
        )
    return members


def _module_files(folder: Path, name: str) -> tuple[list[Path], Path | None]:
    """(the source files of module `name` in `folder`: .py and .pyi stub, its folder if a package)."""
    package = folder / name
    if (package / "__init__.py").exists():
        return [package / "__init__.py"], package
    files = [p for p in (folder / f"{name}.py", folder / f"{name}.pyi") if p.exists()]
    return files, None


@functools.cache
def _engine_object_members() -> frozenset[str]:
    """What `engine.<name>` names in prose when it is no module: the members of the class LLMEngine and of
    its bases (engine.offline's OfflineAPI)."""
    classes = {
        node.name: node
        for path in _roots()["engine"].rglob("*.py")
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.ClassDef)
    }
    members: set[str] = set()
    todo = ["LLMEngine"]
    while todo:
        cls = classes.get(todo.pop())
        if cls is not None:
            members |= _class_members(cls)
            todo += [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases]
    return frozenset(members)


def resolve(reference: str) -> str | None:
    """None when `reference` names a module of the installed package or an attribute of one (a
    top-level name, or a member of a class), else why it does not."""
    parts = reference.split(".")
    prefixed = parts[0] == "pdserve"
    if prefixed and len(parts) > 1 and parts[1] in ("engine", "services", "kvtransfer"):
        parts = parts[1:]
    folder = _roots()[parts[0]]
    files = [folder / "__init__.py"]
    i = 1
    while i < len(parts) and folder is not None:
        sub_files, sub_folder = _module_files(folder, parts[i])
        if not sub_files:
            break
        files, folder, i = sub_files, sub_folder, i + 1
    if i == len(parts):
        return None
    name = parts[i]
    names = _module_names(files)
    if folder is not None and folder.name == "v1" and folder.parent.name == "pdserve":
        # `pdserve.v1.Constraint`: a message's full name in the protos, defined in one of the stubs
        names = _module_names(sorted(folder.glob("*_pb2.pyi"))) | names
    where = ".".join(parts[:i])
    if name not in names:
        if i == 1 and parts[0] == "engine" and not prefixed and name in _engine_object_members():
            return None  # an engine object: `engine.generate(...)`, `engine.loras.load(...)`
        return f"{where} has no module or attribute {name!r}"
    node = names[name]
    if i + 1 == len(parts) or not isinstance(node, ast.ClassDef):
        return None  # deeper than a class's members is not checked
    member = parts[i + 1]
    # the class and the bases this module defines; a base from elsewhere may hold anything
    classes = [node]
    for base in node.bases:
        defined = names.get(base.id) if isinstance(base, ast.Name) else None
        if not isinstance(defined, ast.ClassDef):
            return None
        classes.append(defined)
    if not any(member in _class_members(cls) for cls in classes):
        return f"{where}.{name} has no member {member!r}"
    return None


def _references():
    for file, lines in _texts().items():
        for line, text in lines:
            for match in REF.finditer(text):
                reference = match.group()
                if reference.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                    continue  # a file name (`engine.py`), not a module
                yield file, line, reference


def test_every_dotted_module_reference_resolves():
    stale = [
        f"{file}:{line}: {reference}: {why}"
        for file, line, reference in _references()
        if (why := resolve(reference)) is not None
    ]
    assert not stale, "stale module references:\n" + "\n".join(stale)


def repository_paths(text: str) -> list[str]:
    """The paths from the repository's root that a text names (placeholders such as NAME left out)."""
    paths = [match.group(1).rstrip(".") for match in PATH.finditer(text)]
    return [p for p in paths if not any(PLACEHOLDER.fullmatch(part.split(".")[0]) for part in p.split("/"))]


def test_every_repository_path_named_exists():
    stale = [
        f"{file}:{line}: {path}"
        for file, lines in _texts().items()
        for line, text in lines
        for path in repository_paths(text)
        if not (REPO / path).exists()
    ]
    assert not stale, "paths that do not exist:\n" + "\n".join(stale)


def test_paths_are_found_in_prose():
    text = (
        "see engine/core/scheduler.py, deploy/overlays/cpu/ and engine/sampler.py. Not deploy/overlays/NAME"
    )
    assert repository_paths(text) == ["engine/core/scheduler.py", "deploy/overlays/cpu", "engine/sampler.py"]
    assert not (REPO / "engine/sampler.py").exists()  # moved to engine/model/


@pytest.mark.parametrize(
    "reference",
    [
        "engine.sampler",  # moved to engine.model.sampler
        "pdserve.engine.model.sampler.NoSuchThing",
        "services.decode.openai.server.nothing_here",
        "engine.core.request.Request.no_such_field",
        "kvtransfer.no_such_module",
        "pdserve.no_such_module",
    ],
)
def test_a_stale_reference_does_not_resolve(reference):
    assert resolve(reference) is not None


@pytest.mark.parametrize(
    "reference",
    [
        "engine.model.sampler",
        "pdserve.engine.core.request.Request.cache_salt",  # assigned in __init__
        "kvtransfer.KVLayout",  # re-exported by the package
        "pdserve.v1.prefill_pb2.PrefillRequest",  # from the .pyi stub
        "pdserve.testing.launch.TEST_ENGINE",
        "engine.generate",  # an engine object in prose
    ],
)
def test_a_live_reference_resolves(reference):
    assert resolve(reference) is None


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        in_code ^= line.lstrip().startswith("```")
        if not in_code and (heading := re.match(r"#+ (.*)", line)):
            slug = _slug(heading.group(1))
            repeat = next(i for i in range(len(anchors) + 1) if (f"{slug}-{i}" if i else slug) not in anchors)
            anchors.add(f"{slug}-{repeat}" if repeat else slug)
    return anchors


def link_problems(path: Path) -> list[str]:
    """Relative links of a Markdown file whose file or heading does not exist."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"\w+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            problems.append(f"{target}: no such heading")
    return problems


@pytest.mark.parametrize("path", _files(".md"), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    problems = link_problems(path)
    assert not problems, f"{path.relative_to(REPO)}: " + "; ".join(problems)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Part\n\n## Part\n")
    doc = tmp_path / "b.md"
    doc.write_text(
        "[ok](a.md#part-1) [ok](a.md#title) [bad](a.md#gone) [bad](gone.md) [web](https://x.org/y)"
    )
    assert link_problems(doc) == ["a.md#gone: no such heading", "gone.md: no such file"]


def test_a_heading_anchor_is_githubs():
    assert _slug("A quantized KV cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | int8`, issue 35)") == (
        "a-quantized-kv-cache---kv-cache-dtype-fp8_e4m3--fp8_e5m2--int8-issue-35"
    )


# ---------------------------------------------------------------- flags


def _parser_flags(parser: argparse.ArgumentParser, found: set[str]) -> set[str]:
    for action in parser._actions:
        found.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _parser_flags(sub, found)
    return found


@functools.cache
def pdserve_flags() -> frozenset[str]:
    """Every flag of pdserve (all subcommands), decode-server and prefill-server, deprecated included."""
    from pdserve import cli, daemons
    from pdserve.flags import DEPRECATED_FLAGS

    found = _parser_flags(cli.build_parser(), set())
    _parser_flags(daemons.prefill_parser(), found)
    _parser_flags(daemons.decode_parser(), found)
    return frozenset(found | {flag.old for flag in DEPRECATED_FLAGS})


@functools.cache
def script_flags(path: Path) -> frozenset[str]:
    """The flags a script defines: string literals of its add_argument/addoption calls."""
    found = set()
    for node in ast.walk(_tree(path)):
        is_flag_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if is_flag_call and node.func.attr in ("add_argument", "addoption"):
            found.update(
                arg.value
                for arg in node.args
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")
            )
    return frozenset(found)


def _script(word: str) -> Path | None:
    """The bench script a command runs: a path from the repository or a name inside bench/."""
    for candidate in (REPO / word, REPO / "bench" / Path(word).name):
        if candidate.suffix == ".py" and candidate.exists():
            return candidate
    return None


PDSERVE_PROGRAMS = {"pdserve", "decode-server", "prefill-server"}
CONFTEST = REPO / "tests" / "conftest.py"


def _command_flags(command: str) -> tuple[str, set[str] | None, list[str]]:
    """(the program, the flags it accepts or None when it is not one this test checks, the flags used)."""
    words = command.split()
    while words and re.fullmatch(r"\w+=\S*", words[0]):
        words = words[1:]  # VAR=value
    if not words:
        return "", None, []
    program = words[0].rsplit("/", 1)[-1]
    rest = words[1:]
    if re.fullmatch(r"python3?(\.\d+)?", program) and rest:
        if rest[0] == "-m" and len(rest) > 1 and rest[1] in ("pdserve", "pdserve.cli"):
            program, rest = "pdserve", rest[2:]
        elif rest[0].endswith(".py"):
            script = _script(rest[0])
            if script is None:
                return rest[0], set(), []  # a script that does not exist: every flag is stale
            if script.parent.name == "bench":
                return rest[0], set(script_flags(script)), FLAG.findall(" ".join(rest[1:]))
    if program in PDSERVE_PROGRAMS:
        return program, set(pdserve_flags()), FLAG.findall(" ".join(rest))
    return program, None, []


def _commands(code: str) -> list[tuple[int, str]]:
    """(line offset, command) of each command of a code block or span: lines joined at a trailing
    backslash, split at &&, ||, ; and |, a `# comment` cut; a piece that starts with a flag or an option
    bracket (`[--rate R | --concurrency N]`) goes on the command before it."""
    commands: list[tuple[int, str]] = []
    offset, pending = 0, ""
    for number, line in enumerate(code.splitlines()):
        if not pending:
            offset = number
        line = line.split(" #", 1)[0]
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        for piece in re.split(r"&&|\|\||;|\|", line):
            piece = piece.strip()
            if piece.startswith(("-", "[")) and commands and commands[-1][0] == offset:
                commands[-1] = (offset, f"{commands[-1][1]} {piece}")
            elif piece:
                commands.append((offset, piece))
    return commands


def _paragraphs(text: str):
    """(first line, kind, text) of a Markdown file's fenced blocks ("code") and paragraphs ("prose")."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            yield i + 2, "code", "\n".join(lines[i + 1 : j])
            i = j + 1
        elif lines[i].strip():
            j = i
            while j < len(lines) and lines[j].strip() and not lines[j].lstrip().startswith("```"):
                j += 1
            indented = lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip())
            yield i + 1, "code" if indented else "prose", "\n".join(lines[i:j])
            i = j
        else:
            i += 1


def _sections(text: str) -> dict[int, str]:
    """Line -> the text of the Markdown section (from a heading of level 1 or 2 to the next) it lies in."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"##? ", line)] + [len(lines)]
    starts = [0, *starts] if not starts or starts[0] != 0 else starts
    found = {}
    for start, end in zip(starts, starts[1:], strict=False):
        section = "\n".join(lines[start:end])
        found.update({line: section for line in range(start + 1, end + 2)})
    return found


def _known_alone(flag: str, section: str) -> bool:
    """A flag alone in backticks: pdserve's, a bench script's the section names, or another tool's."""
    if flag in pdserve_flags() or flag in script_flags(CONFTEST):
        return True
    if any(flag.startswith(prefix) for prefix in OTHER_TOOLS):
        return True
    for name in re.findall(r"[\w/]*bench_\w+\.py|[\w/]*distill_\w+\.py", section):
        script = _script(name)
        if script is not None and flag in script_flags(script):
            return True
    return False


def doc_flag_problems(text: str) -> list[tuple[int, str]]:
    """(line, what is wrong) for every flag of a Markdown text that no parser accepts."""
    problems = []
    sections = _sections(text)
    for first, kind, block in _paragraphs(text):
        if kind == "code":
            spans = [(0, block)]
        else:
            spans = [(m.start(), m.group(1)) for m in re.finditer(r"`([^`]+)`", block)]
        for offset, span in spans:
            line = first + block.count("\n", 0, offset)
            if kind == "prose" and FLAG.match(span.strip()):
                flag = FLAG.match(span.strip()).group()
                if not _known_alone(flag, sections[first]):
                    problems.append((line, f"{flag}: no parser accepts it"))
                continue
            for command_line, command in _commands(span):
                program, accepted, used = _command_flags(command)
                if accepted is None:
                    continue
                problems += [
                    (line + command_line, f"{flag}: {program} does not accept it")
                    for flag in used
                    if flag not in accepted
                ]
    return problems


@pytest.mark.parametrize("path", _files(".md"), ids=lambda p: str(p.relative_to(REPO)))
def test_every_flag_in_the_docs_is_accepted(path):
    problems = doc_flag_problems(path.read_text())
    assert not problems, "\n".join(f"{path.relative_to(REPO)}:{line}: {why}" for line, why in problems)


def test_a_stale_flag_fails():
    text = (
        "Run `decode-server --port 8000 --no-such-flag 3`.\n\n"
        "The cap is `--max-logprobs` (20).\n\n"
        "```\nprefill-server \\\n  --port 1 --gone-flag\n```\n\n"
        "`.venv/bin/python bench/bench_lora.py --rounds 5 --not-a-lora-flag`\n\n"
        "`pdserve bench --server ADDR [--rate R | --gone-rate N]`\n\n"
        "Indented:\n\n    .venv/bin/decode-server --port 1 \\\n        --gone-again 2\n"
    )
    found = [(line, why.split(":")[0]) for line, why in doc_flag_problems(text)]
    assert found == [
        (1, "--no-such-flag"),
        (3, "--max-logprobs"),
        (6, "--gone-flag"),
        (10, "--not-a-lora-flag"),
        (12, "--gone-rate"),
        (16, "--gone-again"),
    ]


def test_live_flags_and_other_tools_pass():
    text = (
        "`decode-server --port 8000 --max-model-len 4096` and `pdserve bench --help`.\n\n"
        "`pip install --no-index --find-links wheels pdserve`; `kubectl run x --rm -it`.\n\n"
        "Run tests with `--durations=25`.\n"
    )
    assert doc_flag_problems(text) == []
