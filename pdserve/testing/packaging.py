"""pdserve as it installs, laid out from a source tree.

The folders of the design card (engine/, kvtransfer/, services/) install as sub-packages of `pdserve`
through setuptools' package-dir (pyproject.toml). Tools that walk one folder per top-level package
(grimp, so import-linter: scripts/lint_imports.py) or that must import another checkout
(bench/bench_vs_commit.py) take a copy of the sources laid out as the wheel is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # this checkout, in an editable install


def _setuptools(root: Path) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]


def source_folders(root: Path = REPO) -> list[Path]:
    """The top-level folders of the tree at `root` that install as pdserve (package-dir's targets)."""
    return [root / folder for folder in _setuptools(root)["package-dir"].values()]


def package_folders(root: Path = REPO) -> dict[str, Path]:
    """Each package the tree at `root` installs -> its folder there."""
    setuptools = _setuptools(root)
    package_dir = setuptools["package-dir"]
    folders = {}
    for package in setuptools["packages"]:
        mapped = max((p for p in package_dir if package == p or package.startswith(p + ".")), key=len)
        rest = package[len(mapped) :].lstrip(".").replace(".", "/")
        folders[package] = root / package_dir[mapped] / rest
    return folders


def stage(dest: Path, root: Path = REPO) -> Path:
    """Copies the Python sources of the tree at `root` into dest as installed (dest/pdserve/engine/...);
    returns dest, ready to go first on sys.path."""
    for package, folder in package_folders(root).items():
        target = dest / package.replace(".", "/")
        target.mkdir(parents=True, exist_ok=True)
        for source in folder.glob("*.py"):
            shutil.copy2(source, target / source.name)
    return dest


def lint_imports(staged: Path, config: Path = REPO / "pyproject.toml") -> subprocess.CompletedProcess:
    """import-linter's contracts (`config`) on a staged tree; import-linter puts its working directory,
    the staged tree, first on sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache", "--config", str(config)]
    return subprocess.run(command, cwd=staged, env=env, text=True, capture_output=True)
