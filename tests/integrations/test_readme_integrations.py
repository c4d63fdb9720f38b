"""The three integration pages (plain loop, Lightning, Hugging Face; docs/getting-started/) and README.md's plain
loop are complete, runnable examples: each code block runs as written (in a temporary directory) and leaves the
files it promises."""

from __future__ import annotations

import csv
import logging

import pytest
from docs_text import page, python_blocks

from gradwatch.io.sinks import read_jsonl


def section_code(name: str) -> str:
    """The first python block of a page (``"README.md"`` or a page under docs/)."""
    blocks = python_blocks(page(name))
    assert blocks, f"no python block in {name}"
    return blocks[0]


def run(code: str, where: str, tmp_path, monkeypatch, capsys) -> str:
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__readme__"})
    return capsys.readouterr().out


def check_steps(path):
    return [r["step"] for r in read_jsonl(path)[0] if r["type"] == "check"]


@pytest.mark.parametrize("name", ["README.md", "getting-started/plain-loop.md"])
def test_plain_loop_example(name, tmp_path, monkeypatch, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        out = run(section_code(name), name, tmp_path, monkeypatch, capsys)
    assert out.strip().endswith("[]")
    steps = check_steps(tmp_path / "runs" / "exp1" / "checks.jsonl")
    assert steps[0] == 0
    assert len(steps) >= 5
    assert max(b - a for a, b in zip(steps, steps[1:])) <= 200
    assert list((tmp_path / "runs" / "exp1").glob("events.out.tfevents*"))
    [said] = [r.getMessage() for r in caplog.records if "every='auto' checks every" in r.getMessage()]
    assert "overhead_budget allows one check per" in said


def test_lightning_example(tmp_path, monkeypatch, capsys):
    pytest.importorskip("lightning")
    out = run(section_code("getting-started/lightning.md"), "getting-started/lightning.md", tmp_path, monkeypatch, capsys)
    assert out.strip().endswith("[]")
    version = tmp_path / "logs" / "lightning_logs" / "version_0"
    assert check_steps(version / "checks.jsonl") == [0, 20, 40]
    with open(version / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows if r.get("gradwatch/judged_rel_diff/net.0.weight")] == [0, 20, 40]


def test_hugging_face_example(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = run(section_code("getting-started/hugging-face.md"), "getting-started/hugging-face.md", tmp_path, monkeypatch, capsys)
    assert out.strip().endswith("[]")
    [jsonl] = list((tmp_path / "hf_out" / "runs").glob("*/checks.jsonl"))
    assert check_steps(jsonl) == [0, 5]
    assert list(jsonl.parent.glob("events.out.tfevents*"))
