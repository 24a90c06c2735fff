"""Runs import-linter's contracts (pyproject.toml) on pdserve as it installs.

grimp walks one folder per top-level package, and pdserve's sub-packages live in the repository's
top-level folders (pyproject.toml's package-dir), so the contracts are checked on a copy of the sources
laid out as the wheel is (pdserve.testing.packaging).

    .venv/bin/python scripts/lint_imports.py    # exits with lint-imports' status
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from pdserve.testing.packaging import lint_imports, stage


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="pdserve-lint-") as tmp:
        result = lint_imports(stage(Path(tmp)))
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
