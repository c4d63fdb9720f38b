"""Steps to full coverage: K checks (every op and parameter row checked once) in training steps.

Logged once when known, in every check record (``steps_to_full``), in TensorBoard
(``gradwatch/coverage/steps_to_full``) and in ``gradwatch report``'s coverage line.
"""

from __future__ import annotations

import logging
import math

import torch
from helpers import batch, mlp, mse
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gradwatch import GradWatch
from gradwatch.cli import main
from gradwatch.io.sinks import read_jsonl


def train(watch, model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(3)
    reports = []
    for _ in range(steps):
        b = batch()
        opt.zero_grad()
        mse(model, b).backward()
        reports.append(watch.step(b))
        opt.step()
    return reports


def test_steps_to_full_against_a_hand_count(tmp_path, caplog, capsys):
    # 4 tensors, 2 a check: K = 2 checks, one every 3 steps: every tensor checked within 6 steps
    model = mlp()
    watch = GradWatch(model, mse, every=3, tensors_per_check=2, coords=2, directions=1, log_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        reports = train(watch, model, 7)
    watch.close()
    checked = [r for r in reports if r is not None]
    assert len(checked) == 3 and watch.cycle_length == math.ceil(4 / 2) == 2
    assert all(r.steps_to_full == 2 * 3 for r in checked)
    said = [r.getMessage() for r in caplog.records if "steps (K =" in r.getMessage()]
    assert said == ["gradwatch: every op and parameter row checked within about 6 steps (K = 2 checks, one every 3 steps)"]
    records, _ = read_jsonl(tmp_path / "checks.jsonl")
    assert [r["steps_to_full"] for r in records if r["type"] == "check"] == [6, 6, 6]
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("gradwatch/coverage/steps_to_full")] == [6.0, 6.0, 6.0]
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    assert "(K = 2, about 6 steps)" in capsys.readouterr().out


def test_auto_steps_to_full_is_k_times_the_interval_the_times_give():
    model = mlp()
    watch = GradWatch(model, mse, every="auto", tensors_per_check=1, coords=2, directions=1, log_dir=None)
    first = train(watch, model, 4)[0]
    assert first is not None and first.steps_to_full is None  # the first check: no step timed yet
    now = watch.check(batch())  # a check now: the schedule has a check and steps timed
    k, per = watch.cycle_length, watch.schedule.steps_per_check()
    assert k == 4 and per is not None and per > 1
    assert now is not None and now.steps_to_full == k * per
