"""Nothing unchecked without saying so: a unit the watch cannot check is an alert of its own kind, once per run.

The model's ``gate`` scales by a number its parent sets for the length of its own forward: the module form
captures the gate's inputs, but replaying the gate's own code alone raises (the scale is gone). The watch says
so with one ``not_checked`` alert (a warning) for the run, naming the unit, why, and how to check it instead;
the JSONL log and the TensorBoard events hold it, ``gradwatch report`` lists it above the tables, and
``raise_on="wrong"`` does not stop training for it. The same model whose gate keeps its scale is checked
whole: no such alert, no such line.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch
from gradwatch.cli import main


class Gate(nn.Module):
    """A Linear times a scale that only its parent's forward sets (``keep``: the scale stays set)."""

    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = 0.5 if keep else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError("Gate runs only inside Net's forward, which sets its scale")
        return self.fc(x) * self.scale


class Net(nn.Module):
    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(3, 4), Gate(keep), nn.Linear(4, 1)
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gate.scale = 0.5
        try:
            h = self.gate(torch.tanh(self.inp(x)))
        finally:
            if not self.keep:
                self.gate.scale = None
        return self.out(torch.tanh(h))


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def train(log_dir, keep: bool, steps: int = 3, state=None):
    """``steps`` checks (every=1) of the module form with ``raise_on="wrong"``; returns the watch and its reports."""
    torch.manual_seed(0)
    model = Net(keep)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reports = []
    # (no pace: under a loaded suite this small model's step can take over the pace's floor, and a paced cycle plans
    # the gate at some checks only)
    with GradWatch(model, mse, optimizer=opt, every=1, form="module", raise_on="wrong", log_dir=str(log_dir),
                   pace=None) as watch:
        if state is not None:
            watch.load_state_dict(state)
        for _ in range(steps):
            batch = (torch.randn(8, 3), torch.randn(8, 1))
            opt.zero_grad()
            mse(model, batch).backward()
            reports.append(watch.step(batch))  # raise_on="wrong" raises GradientDriftError on a matching alert
            opt.step()
    return watch, reports


@pytest.fixture(scope="module")
def unchecked(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("not_checked")
    watch, reports = train(log_dir, keep=False)
    return log_dir, watch, reports


def test_the_unit_that_cannot_be_checked_is_one_alert_naming_it_why_and_how(unchecked):
    _, watch, reports = unchecked
    assert all(r is not None for r in reports)  # raise_on="wrong" did not stop training: three checks ran
    assert all(any("`gate` (Gate, own code) not checked" in n for n in r.notes) for r in reports)  # every check's notes
    alerts = [a for a in watch.alerts if a.kind == "not_checked"]
    assert len(alerts) == 1, [a.message for a in watch.alerts]  # once for the run, not at each of the three checks
    alert = alerts[0]
    assert (alert.step, alert.tensor, alert.part, alert.severity) == (0, "gate", "backward", "warning")
    assert "its own code fails when it runs apart from the modules it calls" in alert.message  # no class named
    assert "its code says: Gate runs only inside Net's forward" in alert.message and "RuntimeError" not in alert.message
    assert "check it instead: form='objective' checks it inside the whole objective" in alert.message
    assert "gradwatch.check_backward" in alert.message
    assert [a.kind for a in watch.alerts] == ["not_checked"]  # nothing else: the model is right
    assert watch.coverage["gate.fc.weight"]["backward"] == 1.0  # the gate's Linear is checked as a unit of its own


def test_a_resumed_run_does_not_say_it_again(unchecked, tmp_path):
    _, watch, _ = unchecked
    resumed, _ = train(tmp_path, keep=False, steps=1, state=watch.state_dict())
    assert [a.kind for a in resumed.alerts] == ["not_checked"]  # the restored alert, no new one


def test_the_jsonl_record_holds_the_alert(unchecked):
    log_dir, _, _ = unchecked
    records = [json.loads(line) for line in (log_dir / "checks.jsonl").read_text().splitlines()]
    alerts = [r for r in records if r.get("type") == "alert"]
    assert [(a["kind"], a["tensor"], a["part"], a["step"]) for a in alerts] == [("not_checked", "gate", "backward", 0)]
    assert "Gate runs only inside Net's forward" in alerts[0]["message"]


@pytest.mark.parametrize("source", ["jsonl", "events"])
def test_gradwatch_report_lists_it_in_the_summary(unchecked, source, capsys):
    log_dir, _, _ = unchecked
    assert main(["report", str(log_dir), "--source", source]) == 0
    out = capsys.readouterr().out
    summary = out.split("\n\n")[0]  # the lines above the tables
    when = "never checked in the run (3 checks planned it)" if source == "jsonl" else "from step 0"  # events: no notes
    line = next(x for x in summary.splitlines() if x.startswith("not checked: `gate`"))
    assert line.startswith(f"not checked: `gate` (Gate, own code) in the backward part, {when}: its own code fails "
                           "when it runs apart from the modules it calls"), line
    assert "its code says: Gate runs only inside Net's forward" in line
    assert "— check it instead: form='objective'" in line
    assert "1 alert" in summary and "not_checked" in out
    assert main(["report", str(log_dir), "--source", source, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(e["part"], e["what"], e["checks"]) for e in doc["not_checked"]] == \
        [("backward", "gate", 3 if source == "jsonl" else None)]


def test_a_model_checked_whole_has_no_such_alert_nor_line(tmp_path, capsys):
    watch, reports = train(tmp_path, keep=True)
    assert all(not r.not_checked() for r in reports)
    assert watch.alerts == []
    assert watch.modules_checked.get("gate", 0) == 3  # the gate's own code was checked this time
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not checked" not in out and "not_checked" not in out


def test_a_part_that_cannot_run_is_said_once_and_raise_on_leaves_it(tmp_path):
    """``independence="batch"`` with a ``loss_fn`` that calls the model's layers, never the model: the part is one
    ``not_checked`` alert on ``"*"`` over two checks (its own alerts raise at any ``raise_on``; this one does not)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def by_layers(m, batch):
        return F.mse_loss(m[2](m[1](m[0](batch[0]))), batch[1])

    with GradWatch(model, by_layers, every=1, independence="batch", raise_on="wrong", log_dir=str(tmp_path)) as watch:
        for _ in range(2):
            batch = (torch.randn(8, 3), torch.randn(8, 1))
            model.zero_grad()
            by_layers(model, batch).backward()
            assert watch.step(batch) is not None
    assert [(a.kind, a.tensor, a.part) for a in watch.alerts] == [("not_checked", "*", "independence")]
    message = watch.alerts[0].message
    assert "independence not checked (independence part): loss_fn never calls the model itself" in message
    assert "check it instead: gradwatch.check_independence(model, inputs, structure=...)" in message
