"""What a check did not judge is written as what it is: no scalar that reads as agreement, and the reason.

A tensor whose backward result is inconclusive (its analytic gradient is infinite: ``sqrt`` at 0) and a check
whose training part judged nothing (``watch.step`` before the first backward): TensorBoard holds no metric for
them (a 0 there charts as agreement and reads back as "excellent"), the JSONL record has no judged value, and
``gradwatch report`` says "not judged" with the reason from either source.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch
from gradwatch.cli import main
from gradwatch.io import not_judged


class SqrtAtZero(nn.Module):
    """A linear layer plus ``sqrt(b)`` with ``b = 0``: a finite loss whose gradient in ``b`` is infinite."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.sqrt(self.b)


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three checks; the first before any backward (the training part has no .grad to judge). ``b`` stays at 0
    (the optimizer trains ``fc`` only), so every check finds its gradient infinite."""
    log_dir = tmp_path_factory.mktemp("not_judged")
    torch.manual_seed(0)
    model = SqrtAtZero()
    opt = torch.optim.SGD(model.fc.parameters(), lr=0.01)
    reports = []
    with GradWatch(model, mse, optimizer=opt, every=1, log_dir=str(log_dir)) as watch:
        for step in range(3):
            batch = (torch.randn(8, 3), torch.randn(8, 1))
            opt.zero_grad()
            if step > 0:
                mse(model, batch).backward()
            reports.append(watch.step(batch))
            opt.step()
    return log_dir, reports


def test_the_checks_did_not_judge_b_nor_the_first_training_part(run):
    _, reports = run
    assert all(r.tensors["b"].verdict is None and "non-finite" in r.tensors["b"].inconclusive for r in reports)
    assert all(r.tensors["fc.weight"].verdict is not None for r in reports)
    assert reports[0].training == {} and "no watched parameter has a .grad yet" in reports[0].training_note
    assert reports[1].training  # judged once there was a .grad


def test_tensorboard_has_no_metric_for_what_was_not_judged_and_says_why_as_text(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, _ = run
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert not [t for t in scalars if t.endswith("/b") and not t.startswith("gradwatch/training/")], sorted(scalars)
    assert [e.value for e in acc.Scalars("gradwatch/judged_rel_diff/fc.weight")] == [0.0, 0.0, 0.0]
    tag = next(t for t in acc.Tags()["tensors"] if t.split("/text_summary")[0] == not_judged.TEXT_TAG)
    texts = {e.step: [it for raw in e.tensor_proto.string_val for it in not_judged.from_text(raw.decode())]
             for e in acc.Tensors(tag)}
    assert sorted(texts) == [0, 1, 2]
    assert ("training", not_judged.WHOLE, "no watched parameter has a .grad yet (watch.step or check before the "
            "first backward)") in texts[0]
    assert all(("backward", "b", "analytic gradient has non-finite values (NaN or inf)") in items for items in texts.values())


def test_the_jsonl_record_holds_no_judged_value_for_b(run):
    log_dir, _ = run
    checks = [json.loads(line) for line in (log_dir / "checks.jsonl").read_text().splitlines()]
    checks = [c for c in checks if c.get("type") == "check"]
    assert len(checks) == 3
    for c in checks:
        assert c["tensors"]["b"]["verdict"] is None and c["tensors"]["b"]["judged_rel_diff"] is None
        assert c["tensors"]["fc.weight"]["judged_rel_diff"] == 0.0


@pytest.mark.parametrize("source", ["jsonl", "events"])
def test_gradwatch_report_says_not_judged_with_the_reason_never_a_verdict(run, source, capsys):
    log_dir, _ = run
    assert main(["report", str(log_dir), "--source", source]) == 0
    out = capsys.readouterr().out
    assert "not judged: backward `b`, at 3 checks: analytic gradient has non-finite values (NaN or inf)" in out
    assert ("not judged: the training part, at 1 check: no watched parameter has a .grad yet (watch.step or "
            "check before the first backward)") in out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["b"])
    # three checks, no verdict
    assert row[1] == "3"
    assert "excellent" not in row
    assert row[-1] == "???"
    assert main(["report", str(log_dir), "--source", source, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {(r["part"], r["tensor"], r["checks"]) for r in doc["not_judged"]} == {("backward", "b", 3), ("training", "*", 1)}
