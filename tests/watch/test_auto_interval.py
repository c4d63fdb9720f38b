"""every="auto" a user can reason about: the chosen interval is announced with its reason, max_interval caps
it (steps or time), and the records say how much of the overhead is the baseline check."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from gradwatch import ConfigError, GradWatch, GradWatchConfig
from gradwatch.io.sinks import read_jsonl
from gradwatch.watch.schedule import Schedule, parse_max_interval


def timed(schedule: Schedule, check_seconds: float, step_seconds: float) -> Schedule:
    schedule.record_check(0, check_seconds)
    for _ in range(5):
        schedule.record_step_seconds(step_seconds)
    return schedule


def test_max_interval_caps_the_auto_gap_in_steps_or_time():
    assert timed(Schedule("auto", 0.02), 1.0, 0.1).interval() == 490
    assert timed(Schedule("auto", 0.02, max_interval=100), 1.0, 0.1).interval() == 100
    assert timed(Schedule("auto", 0.02, max_interval="0.5 min"), 1.0, 0.1).interval() == 300
    assert timed(Schedule("auto", 0.02, max_interval="1 h"), 1.0, 0.1).interval() == 490  # the budget is tighter
    assert timed(Schedule(7, 0.02, max_interval=3), 1.0, 0.1).interval() == 7  # every=N is what it says


@pytest.mark.parametrize("value", ["soon", 0, -5, "1.5 steps", True, 2.5])
def test_bad_max_interval_is_refused_naming_what_is_accepted(value):
    with pytest.raises(ConfigError, match=r"max_interval: got .*'30 min'"):
        GradWatchConfig(max_interval=value)


def test_max_interval_from_yaml(tmp_path):
    from gradwatch import load_config

    path = tmp_path / "gw.yaml"
    path.write_text("every: auto\nmax_interval: 30 min\n")
    assert load_config(path).max_interval == "30 min"
    assert parse_max_interval("30 min") == (None, 1800.0) and parse_max_interval("200 steps") == (200, None)


def slow_loss(model, batch):
    return model(batch).pow(2).mean()


def test_auto_announces_its_interval_once_and_max_interval_bounds_the_gaps(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        watch = GradWatch(model, slow_loss, every="auto", overhead_budget=0.01, max_interval=4, coords=2,
                          directions=1, log_dir=str(tmp_path))
        reports = [watch.step(torch.randn(4, 8)) for _ in range(13)]  # fast steps: the budget alone would wait long
    watch.close()
    said = [r.getMessage() for r in caplog.records if "every='auto' checks every" in r.getMessage()]
    assert len(said) == 1
    assert "max_interval=4 caps it at 4 steps" in said[0]
    assert "overhead_budget" in said[0]
    steps = [i for i, r in enumerate(reports) if r is not None]
    assert steps == [0, 4, 8, 12]
    records = [r for r in read_jsonl(tmp_path)[0] if r["type"] == "check"]
    assert records[0]["overhead_fraction_after_baseline"] is None  # the baseline check itself
    for rec in records[1:]:
        assert 0 <= rec["overhead_fraction_after_baseline"] <= rec["overhead_fraction"]
    assert watch.overhead_fraction_after_baseline < watch.overhead_fraction


def test_a_long_auto_interval_is_a_warning_that_says_how_to_shorten_it(caplog):
    model = nn.Linear(4, 1)
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        watch = GradWatch(model, slow_loss, every="auto", overhead_budget=0.001)
        for _ in range(3):
            watch.step(torch.randn(2, 4))
    [record] = [r for r in caplog.records if "every='auto' checks every" in r.getMessage()]
    assert record.levelno == logging.WARNING and "set max_interval" in record.getMessage()
