"""The README's three integration sections (plain loop, Lightning, Hugging Face) are complete, runnable
examples: each code block runs as written (in a temporary directory) and leaves the files it promises."""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path

import pytest

from gradwatch.io.sinks import read_jsonl

README = Path(__file__).resolve().parents[1] / "README.md"


def section_code(heading: str) -> str:
    text = README.read_text()
    start = text.index(f"\n### {heading}\n")
    end = text.find("\n### ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start:end], re.S)
    assert blocks, f"no python block under {heading!r}"
    return blocks[0]


def run(code: str, where: str, tmp_path, monkeypatch, capsys) -> str:
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md ({where})", "exec"), {"__name__": "__readme__"})
    return capsys.readouterr().out


def check_steps(path):
    return [r["step"] for r in read_jsonl(path)[0] if r["type"] == "check"]


def test_plain_loop_example(tmp_path, monkeypatch, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        out = run(section_code("A plain training loop"), "plain loop", tmp_path, monkeypatch, capsys)
    assert out.strip().endswith("[]")
    steps = check_steps(tmp_path / "runs" / "exp1" / "checks.jsonl")
    assert steps[0] == 0 and len(steps) >= 5 and max(b - a for a, b in zip(steps, steps[1:])) <= 200
    assert list((tmp_path / "runs" / "exp1").glob("events.out.tfevents*"))
    [said] = [r.getMessage() for r in caplog.records if "every='auto' checks every" in r.getMessage()]
    assert "overhead_budget allows one check per" in said


def test_lightning_example(tmp_path, monkeypatch, capsys):
    pytest.importorskip("lightning")
    out = run(section_code("PyTorch Lightning"), "Lightning", tmp_path, monkeypatch, capsys)
    assert out.strip().endswith("[]")
    version = tmp_path / "logs" / "lightning_logs" / "version_0"
    assert check_steps(version / "checks.jsonl") == [0, 20, 40]
    with open(version / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows if r.get("gradwatch/judged_rel_diff/net.0.weight")] == [0, 20, 40]


def test_hugging_face_example(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = run(section_code("Hugging Face Trainer"), "Hugging Face", tmp_path, monkeypatch, capsys)
    assert out.strip().endswith("[]")
    [jsonl] = list((tmp_path / "hf_out" / "runs").glob("*/checks.jsonl"))
    assert check_steps(jsonl) == [0, 5]
    assert list(jsonl.parent.glob("events.out.tfevents*"))
