"""The house: packages by job, small modules, no private names across modules, no shims for old paths.

The layers themselves are import-linter contracts in pyproject.toml, run by `make test` (`lint-imports`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
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


def test_no_module_is_over_800_lines_and_the_facade_is_under_500():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in modules()}
    assert {p: n for p, n in sizes.items() if n > 800} == {}
    assert sizes["gradwatch/watch/gradwatch.py"] < 500, sizes["gradwatch/watch/gradwatch.py"]


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
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        source = path.read_text()
        ranks = any(s in source for s in ("torch.distributed.run", "run_two_ranks(", "devices=2", "benchmarks"))
        if ranks and _starts_processes(source) and "pytest.mark.slow" not in source:
            unmarked.append(path.name)
    assert unmarked == [], f"modules that start ranks or benchmark workers without a slow mark: {unmarked}"
