"""The "Code layout" table (docs/reference/layout.md) names real files, and the gates it names run in `make test`."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout_rows():
    text = (ROOT / "docs" / "reference" / "layout.md").read_text()
    section = text.split("# Code layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 6, section
    return rows


def test_every_file_the_layout_names_exists_where_it_says():
    named = 0
    for row in layout_rows():
        where, what = row.split("|")[1:3]
        folders = [f for f in re.findall(r"`([\w/]+/)`", where)]
        files_in_where = re.findall(r"`([\w/]+\.py)`", where)
        for f in files_in_where:  # `gradwatch/options.py`, `config.py`: beside the first named file
            path = ROOT / f if "/" in f else ROOT / "gradwatch" / f
            assert path.is_file(), f"docs/reference/layout.md names {f} but {path} does not exist"
            named += 1
        for folder in folders:
            assert (ROOT / folder).is_dir(), folder
            for f in re.findall(r"`(\w+\.py)`", what):
                assert (ROOT / folder / f).is_file(), f"docs/reference/layout.md puts {f} in {folder}, which has no such file"
                named += 1
    assert named >= 25


def test_every_module_of_the_package_is_in_the_layout():
    listed = {m for row in layout_rows() for m in re.findall(r"`(\w+)\.py`", row)}
    for sub in ("check", "plan", "watch", "parallel", "io", "cli"):
        for path in (ROOT / "gradwatch" / sub).rglob("*.py"):
            if path.stem != "__init__":
                assert path.stem in listed, f"gradwatch/{sub}/{path.name} is missing from the Code layout table (docs/reference/layout.md)"


def test_make_test_runs_the_gates_before_the_tests():
    recipe = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    lines = [line.strip() for line in recipe.splitlines()[1:]]
    assert [i for i, line in enumerate(lines) if "ruff check" in line] == [0], recipe
    assert "mypy gradwatch" in lines[1] and "lint-imports" in lines[2] and "pytest" in lines[4], recipe
    assert lines[3] == "$(PY) tests/browser.py install", recipe  # Chromium for the browser test, where missing
    hooks = (ROOT / ".pre-commit-config.yaml").read_text()
    assert "ruff" in hooks and "mypy" in hooks
