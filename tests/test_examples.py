"""Run each example as a subprocess with the test interpreter (the venv's python) and check its output.

To add an example: append its file name to ``EXAMPLES`` and, optionally, the
strings its output must contain to ``EXPECTED_OUTPUT``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = ROOT / "examples"

EXAMPLES = [
    "numpy_two_layer.py",
    "custom_function.py",
]

EXPECTED_OUTPUT = {
    "numpy_two_layer.py": [
        "== broken net ==",
        "FAILED",
        "analytic is 2.00x numeric",
        "failing tensors: W1\n",
        "== fixed net (same weights) ==",
        "gradwatch check: OK",
    ],
    "custom_function.py": [
        "caught: check_backward: gradients disagree (eps=0.001, atol=1e-06, rtol=0.0001)",
        "x[0]",
        "numeric",
        "analytic",
        "== CorrectSigmoid ==",
        "passed:",
        "gradwatch check: OK",
    ],
}


def _python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return sys.executable or str(venv)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name, tmp_path):
    path = EXAMPLES_DIR / name
    assert path.is_file(), f"{path} is missing"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [_python(), str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{out}"
    assert "Traceback" not in out, out
    for expected in EXPECTED_OUTPUT.get(name, []):
        assert expected in proc.stdout, f"{name}: {expected!r} not in output:\n{proc.stdout}"


def test_examples_have_docstrings():
    import ast

    for name in EXAMPLES:
        tree = ast.parse((EXAMPLES_DIR / name).read_text())
        doc = ast.get_docstring(tree)
        assert doc and len(doc) > 80, f"{name} needs a module docstring explaining what it shows"
