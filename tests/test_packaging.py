"""pdserve installs as one import name: a wheel built from this tree holds the single top-level package
`pdserve` (the design card's folders as its sub-packages) and imports from outside the repository; the
import-linter contracts hold on this tree and fail on a planted violation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from pdserve.testing.packaging import REPO, lint_imports, package_folders, source_folders, stage

pytestmark = pytest.mark.fast


def test_every_package_folder_is_installed():
    """Each folder with an __init__.py under the mapped folders is a package pyproject.toml lists."""
    listed = {folder.resolve() for folder in package_folders().values()}
    for top in source_folders():
        for init in top.rglob("__init__.py"):
            assert init.parent.resolve() in listed, f"{init.parent} is not in pyproject.toml's packages"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tree's sources (the build writes nothing into the checkout)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for top in source_folders():
        shutil.copytree(top, source / top.name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
         str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (path,) = out.glob("pdserve-*.whl")
    return path


def test_wheel_installs_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"pdserve"}
    for module in ("services/client.py", "services/decode/server.py", "engine/core/scheduler.py",
                   "kvtransfer/codec.py", "v1/generation_pb2.py"):  # fmt: skip
        assert f"pdserve/{module}" in names


def test_wheel_imports_from_outside_the_repository(wheel, tmp_path):
    """Installed with --no-deps into a fresh venv that sees this interpreter's packages (grpc, jax, ...)
    but not the editable install (PYTHONPATH entries run no .pth files), `import pdserve.services.client`
    works from a folder outside the repository."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    deps = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *deps]), "PYTHONNOUSERSITE": "1"}
    code = "import pdserve.services.client as c, pdserve.engine.llm_engine; print(c.__file__)"
    run = subprocess.run([python, "-c", code], cwd=tmp_path, env=env, text=True, capture_output=True)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.strip().startswith(str(target)), out


def test_import_contracts_hold(tmp_path):
    result = lint_imports(stage(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "importer, imported, contract",
    [
        ("services/prefill/_planted.py", "pdserve.services.decode.core", "The roles meet only"),
        ("engine/core/_planted.py", "pdserve.services.client", "Calls go one way"),
        ("kvtransfer/_planted.py", "pdserve.engine.llm_engine", "Calls go one way"),
        ("services/_planted.py", "pdserve.daemons", "Calls go one way"),
        ("engine/core/_planted.py", "pdserve.engine.model_runner", "No import cycles"),
    ],
)
def test_a_planted_violation_breaks_its_contract(tmp_path, importer, imported, contract):
    staged = stage(tmp_path)
    (staged / "pdserve" / importer).write_text(f"import {imported}\n")
    result = lint_imports(staged)
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts")[-1]
    assert contract in broken, result.stdout


def test_the_command_lines_are_built_without_jax():
    """Every parser is built without importing JAX (decode-server's flags come from DecodeConfig and
    Routing, in a module of their own): `pdserve adapters` and `--help` answer at once."""
    code = (
        "import sys; from pdserve.cli import build_parser; from pdserve.daemons import decode_parser, "
        "prefill_parser; build_parser(); decode_parser(); prefill_parser(); print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
