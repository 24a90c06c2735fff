"""Runs import-linter's contracts (pyproject.toml) on pdserve as it installs.

grimp walks one folder per top-level package, and pdserve's sub-packages live in the repository's
top-level folders (pyproject.toml's package-dir), so the contracts are checked on a copy of the sources
laid out as the wheel is (pdserve.testing.packaging.stage).

    .venv/bin/python scripts/lint_imports.py    # exits with lint-imports' status
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.testing.packaging import REPO, stage


def lint(staged: Path, config: Path = REPO / "pyproject.toml") -> subprocess.CompletedProcess:
    """lint-imports on a staged tree (import-linter puts its working directory first on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache", "--config", str(config)]
    return subprocess.run(command, cwd=staged, env=env, text=True, capture_output=True)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="pdserve-lint-") as tmp:
        result = lint(stage(Path(tmp)))
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
