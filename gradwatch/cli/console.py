"""Small printing helpers the commands share (``report``'s tables, the demo's output)."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any


def unicode_ok(stream: Any = None) -> bool:
    """Whether ``stream`` (default ``sys.stdout``) encodes Unicode, so tables may use box and block characters.

    Example:
        >>> import io
        >>> unicode_ok(io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
        False
    """
    enc = getattr(stream or sys.stdout, "encoding", None) or ""
    return "utf" in enc.lower()


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an ``s`` unless ``n`` is 1.

    Example:
        >>> plural(1, "check"), plural(3, "alert")
        ('1 check', '3 alerts')
    """
    return f"{n} {word}" + ("" if n == 1 else "s")


def runnable(program: str) -> str:
    """How to type ``program`` here: its bare name when PATH finds this environment's copy,
    else the path of the copy installed next to this Python (e.g. ``.venv/bin/tensorboard``
    after ``make demo``, which does not activate the virtual environment).

    Example:
        >>> runnable("python-that-does-not-exist")
        'python-that-does-not-exist'
    """
    sibling = Path(sys.executable).parent / program
    if not sibling.exists():
        return program
    found = shutil.which(program)
    if found and Path(found).resolve() == sibling.resolve():
        return program
    try:
        shown = os.path.relpath(sibling)
    except ValueError:  # another drive (Windows)
        shown = str(sibling)
    return shlex.quote(shown if not shown.startswith("..") else str(sibling))
