"""Where the tests live: the checkout, ``tests/``, and every directory of tests below it (they mirror the package).

A test module imports a helper that another test module defines by the module's name (the names are unique across
the directories); the conftest puts every directory on ``sys.path``, and a test that starts a Python process gives it
the same path (:func:`pythonpath`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: ``tests/`` and every directory of tests below it.
DIRS: List[Path] = [TESTS] + sorted(p for p in TESTS.rglob("*") if p.is_dir() and p.name != "__pycache__"
                                    and any(p.glob("*.py")))


def pythonpath() -> str:
    """``PYTHONPATH`` for a Python process a test starts: the checkout, every directory of tests, then the caller's."""
    return os.pathsep.join([str(ROOT), *(str(d) for d in DIRS), os.environ.get("PYTHONPATH", "")])
