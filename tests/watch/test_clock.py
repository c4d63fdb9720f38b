"""Steps to full coverage: K checks (every op and parameter row checked once) in training steps.

Logged once when known, in every check record (``steps_to_full``), in TensorBoard
(``gradwatch/coverage/steps_to_full``) and in ``gradwatch report``'s coverage line.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

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
    assert k == 4
    assert per is not None
    assert per > 1
    assert now is not None and now.steps_to_full == k * per


def test_steps_to_full_at_the_default_budget_against_a_hand_count(tmp_path, caplog):
    # every="auto" at the default 2% overhead_budget: a check every ceil(C * 0.98 / (0.02 * S)) steps (C: the mean of
    # the checks' seconds, from the records; S: the median step, timed here between watch.step calls as the watch
    # times it), and K of them
    model = mlp()
    watch = GradWatch(model, mse, tensors_per_check=1, coords=2, directions=1, log_dir=tmp_path)
    assert watch.schedule.every == "auto" and watch.schedule.overhead_budget == 0.02
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(3)
    step_seconds, returned = [], None
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        for i in range(5):
            b = batch()
            opt.zero_grad()
            mse(model, b).backward()
            time.sleep(0.05)  # a training step of about 50 ms
            if returned is not None:
                step_seconds.append(time.perf_counter() - returned)
            watch.step(b)
            returned = time.perf_counter()
            now = watch.check(b) if i == 4 else None  # a check asked for: one more check time, the steps timed
            opt.step()
            if i == 1:  # said as soon as known: at the first step timed after the first check
                first = [r.getMessage() for r in caplog.records if "checked within about" in r.getMessage()]
    watch.close()
    assert not watch.alerts
    records, _ = read_jsonl(tmp_path / "checks.jsonl")
    seconds = [r["seconds"] for r in records if r["type"] == "check"]
    assert len(seconds) == 2  # the baseline check at the first step and the one asked for
    per = math.ceil(statistics.fmean(seconds) * 0.98 / (0.02 * statistics.median(step_seconds)))
    hand = watch.cycle_length * per
    assert watch.cycle_length == 4
    assert now is not None
    assert now.steps_to_full is not None
    assert abs(now.steps_to_full - hand) <= max(watch.cycle_length, 0.05 * hand), (now.steps_to_full, hand)
    said = [r.getMessage() for r in caplog.records if "checked within about" in r.getMessage()]
    assert len(first) == 1
    assert said[0] == first[0]
    assert " at the 2% overhead_budget (K = 4 checks, one every " in first[0]
    assert said[-1] == (f"gradwatch: every op and parameter row checked within about {now.steps_to_full} steps at the 2% "
                        f"overhead_budget (K = 4 checks, one every {now.steps_to_full // 4} steps)")
