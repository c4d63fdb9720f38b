"""The house: packages by job, small modules, no private names across modules, no shims for old paths.

The layers themselves are import-linter contracts in pyproject.toml, run by `make test` (`lint-imports`).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradwatch"


def modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_check_keeps_a_handful_of_modules_at_its_top_and_the_rest_in_packages_by_job():
    top = sorted(p.name for p in (PACKAGE / "check").glob("*.py"))
    assert top == ["__init__.py", "backward.py", "model.py"], top
    packages = sorted(p.name for p in (PACKAGE / "check").iterdir() if (p / "__init__.py").is_file())
    assert packages == ["higher_order", "independence", "judging", "modules", "numerics", "objective", "probes", "replay", "update"]


def test_the_watch_keeps_ten_modules_at_its_top_its_parts_in_a_package_and_ranks_below_it():
    top = sorted(p.name for p in (PACKAGE / "watch").glob("*.py"))
    assert len(top) <= 10, top
    assert (PACKAGE / "watch" / "parts" / "__init__.py").is_file()
    parts = {p.stem for p in (PACKAGE / "watch" / "parts").glob("*.py")}
    assert {"backward", "training", "inner", "independence", "update", "context"} <= parts, parts
    assert (PACKAGE / "parallel" / "__init__.py").is_file()


def test_no_module_is_over_600_lines_and_the_facade_is_under_400():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in modules()}
    assert {p: n for p, n in sizes.items() if n > 600} == {}
    assert sizes["gradwatch/watch/gradwatch.py"] < 400, sizes["gradwatch/watch/gradwatch.py"]


def test_no_function_is_over_80_lines():
    # counted from its `def` to its last line, docstring included; a nested function counts on its own and in its parent
    long = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    assert long == {}


#: A measured figure: a number with a unit of memory or time, or a count of parameters ("20.8M").
FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?\s?(?:[kKMG]i?B|ms|µs|us|s|M)(?![\w])")


def _prose(docstring: str) -> str:
    """A docstring's text above its examples (an example's output is the function's, not a measurement)."""
    return re.split(r"\n\s*Examples?:", docstring, maxsplit=1)[0]


def test_no_docstring_or_comment_quotes_a_measured_figure():
    # figures belong to the docs pages that own them (docs/costs.md, docs/guides/); docstrings say what and why
    found = []
    for path in modules():
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                found += [f"{path.relative_to(ROOT)} {getattr(node, 'name', '')}: {m.group(0)}"
                          for m in FIGURE.finditer(_prose(doc))]
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                found += [f"{path.relative_to(ROOT)}:{token.start[0]}: {m.group(0)}" for m in FIGURE.finditer(token.string)]
    assert found == []


def test_the_figure_pattern_finds_figures_and_leaves_words_alone():
    assert [m.group(0) for m in FIGURE.finditer("took 0.25 s, 46 MB and 1.5 ms at 20.8M parameters; 4 KiB")] == [
        "0.25 s", "46 MB", "1.5 ms", "20.8M", "4 KiB"]
    assert FIGURE.findall("float32's 2 ranks, K = 3 checks, version 1.2, 3 samples of 2 Ms") == []


def test_no_assert_in_the_tests_joins_three_conditions_without_a_message():
    # a failure must say which condition broke: split them, or give the assert a message
    joined = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert) and node.msg is None and _conditions(node.test) >= 3:
                joined.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert joined == []


def _conditions(test: ast.expr) -> int:
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return sum(_conditions(v) for v in test.values)
    return 1


def test_the_tests_mirror_the_package():
    # a test module lives in the directory that mirrors the package it tests (tests/check/probes/ for
    # gradwatch/check/probes/, ...); at the top, those of the top-level modules and of the checkout itself
    tests = ROOT / "tests"
    packages = {p.parent.relative_to(PACKAGE) for p in PACKAGE.rglob("__init__.py")}
    dirs = {p.parent.relative_to(tests) for p in tests.rglob("test_*.py")}
    assert sorted(map(str, dirs - packages)) == []  # no directory of tests without its package
    assert sorted(map(str, packages - dirs)) == []  # no package without its tests
    checkout = {"structure", "layout", "docs_code", "examples"}
    top = {p.stem.removeprefix("test_") for p in tests.glob("test_*.py")}
    assert sorted(top - checkout - {p.stem for p in PACKAGE.glob("*.py")}) == []


def test_no_private_name_is_imported_across_modules():
    crossing = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradwatch"):
                crossing += [f"{path.relative_to(ROOT)}: from {node.module} import {a.name}"
                             for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossing == []


def test_the_import_layers_are_kept():
    # The contracts in pyproject.toml, checked as `make test` checks them.
    linter = Path(sys.executable).with_name("lint-imports")
    if not linter.exists():
        pytest.skip("import-linter is not installed in this environment (the test extra installs it)")
    out = subprocess.run([str(linter)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "0 broken" in out.stdout


def _starts_processes(source: str) -> bool:
    """A test module that starts Python processes: ranks (torchrun, a launcher), the CLI, a benchmark's workers."""
    return any(s in source for s in ("subprocess.run(", "subprocess.Popen(", "run_two_ranks(", "._spawn(",
                                     "faults.run(", "mp.spawn(", "start_processes("))


def test_the_slow_marker_is_registered_and_every_module_that_starts_ranks_or_benchmarks_carries_it():
    """`make test ARGS="-m 'not slow'"` leaves out what is slow: the marker is registered (pytest would only warn
    about an unknown one) and the modules whose tests start ranks or a benchmark's workers carry it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("slow:") for m in markers), markers
    unmarked = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        source = path.read_text()
        ranks = any(s in source for s in ("torch.distributed.run", "run_two_ranks(", "devices=2", "benchmarks"))
        if ranks and _starts_processes(source) and "pytest.mark.slow" not in source:
            unmarked.append(path.name)
    assert unmarked == [], f"modules that start ranks or benchmark workers without a slow mark: {unmarked}"
