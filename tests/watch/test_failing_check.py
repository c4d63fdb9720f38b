"""A failing check fails once: its cause is logged once, repeats are counted, and the watch pauses."""

from __future__ import annotations

import logging

import torch
from torch import nn

from gradwatch import GradWatch
from gradwatch.io.sinks import read_jsonl
from gradwatch.watch.gradwatch import MAX_CONSECUTIVE_FAILURES


def broken_loss(model, batch):
    raise KeyError("labels")


def test_repeated_failures_are_logged_once_then_the_watch_pauses(tmp_path, caplog):
    model = nn.Linear(3, 1)
    with caplog.at_level(logging.DEBUG, logger="gradwatch"):
        watch = GradWatch(model, broken_loss, every=1, log_dir=str(tmp_path))
        results = [watch.step(torch.randn(4, 3)) for _ in range(20)]
    assert results == [None] * 20
    gw = [r for r in caplog.records if r.name == "gradwatch"]
    errors = [r.getMessage() for r in gw if r.levelno >= logging.ERROR]
    assert len(errors) == 2
    assert "Traceback" in errors[0]
    assert "KeyError: 'labels'" in errors[0]
    assert "Fix:" in errors[0]
    warnings_ = [r.getMessage() for r in gw if r.levelno == logging.WARNING]
    assert len(warnings_) == 1 and f"{MAX_CONSECUTIVE_FAILURES} checks in a row failed" in warnings_[0]
    debug = [r.getMessage() for r in gw if r.levelno == logging.DEBUG]
    assert [("failed again (2 times)" in m, "failed again (3 times)" in m) for m in debug] == [(True, False), (False, True)]
    assert watch.paused is not None and "KeyError" in watch.paused
    assert [a.kind for a in watch.alerts] == ["error", "paused"]
    watch.close()
    records, _ = read_jsonl(tmp_path)
    assert [r["kind"] for r in records if r["type"] == "alert"] == ["error", "paused"]

    # resume: checks run again (and fail again, counted)
    watch2 = GradWatch(model, broken_loss, every=1)
    watch2.pause("by hand")
    assert watch2.step(torch.randn(4, 3)) is None and watch2.policy.failures == 0
    watch2.resume()
    watch2.step(torch.randn(4, 3))
    assert watch2.policy.failures == 1


def test_a_step_from_inside_the_check_is_ignored_not_recursed():
    calls = []

    def reentrant_loss(model, batch):
        calls.append(watch.step(batch))  # e.g. an objective that steps an optimizer whose hook calls step()
        return model(batch).pow(2).mean()

    watch = GradWatch(nn.Linear(3, 1), reentrant_loss, every=1, coords=2, directions=1)
    report = watch.step(torch.randn(4, 3))
    assert report is not None and report.ok
    assert calls and set(calls) == {None}
    assert watch._step == 1  # the inner calls did not advance the step counter
