"""Sinks: JSONL and TensorBoard written from the same records, read back from real files."""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import gradwatch
from gradwatch import CheckReport, GradWatchError, TensorCheck, Verdict
from gradwatch.io.records import check_record, run_record, scalars_from_check
from gradwatch.io.sinks import (
    JsonlSink,
    LogDirError,
    LoggingSink,
    Sink,
    SinkSet,
    TensorBoardSink,
    build_sinks,
    read_jsonl,
)
from gradwatch.watch.trend import Alert


def real_report(seed: int) -> CheckReport:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    batch = (torch.randn(6, 3), torch.randn(6, 1))
    return gradwatch.check_model(model, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), batch)


def bad_report() -> CheckReport:
    t = TensorCheck("0.weight", (4, 3), rel_diff=0.33, max_rel_error=0.5, directional_rel_diff=0.3,
                    judged_rel_diff=0.33, verdict=Verdict.WRONG, failed=True)
    return CheckReport(tensors={t.name: t}, objective=float("nan"))


def load_events(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def event_files(log_dir):
    return [f for f in os.listdir(log_dir) if f.startswith("events.out.tfevents")]


def write_run(log_dir):
    """Three checks (the last with two alerts) through build_sinks; returns the SinkSet records."""
    sinks = build_sinks(log_dir)
    sinks.write_run(run_record({"every": 10}, gradwatch.__version__))
    checks = []
    for i, step in enumerate((10, 20, 30)):
        report = bad_report() if step == 30 else real_report(i)
        rec = check_record(step, report, seconds=0.01 * (i + 1), overhead_fraction=0.001 * (i + 1),
                           coverage={"0.weight": 4 * (i + 1)})
        alerts = []
        if step == 30:
            alerts = [
                Alert(30, "0.weight", "band", "error", 0.33, None, "0.weight: WRONG (rel_diff 3.30e-01)"),
                Alert(30, "0.weight", "drift", "warning", 0.33, 1e-9, "0.weight drifted from 1e-09"),
            ]
        sinks.write_check(rec, alerts)
        checks.append((rec, len(alerts)))
    sinks.close()
    return checks


def test_tensorboard_scalars_equal_jsonl_values(tmp_path):
    checks = write_run(tmp_path)
    assert len(event_files(tmp_path)) == 1  # one writer, one event file
    records, warnings = read_jsonl(tmp_path / "checks.jsonl")
    assert warnings == []
    assert [r["type"] for r in records] == ["run", "check", "check", "check", "alert", "alert"]
    jsonl_checks = {r["step"]: r for r in records if r["type"] == "check"}
    assert set(jsonl_checks) == {10, 20, 30}

    acc = load_events(tmp_path)
    tags = set(acc.Tags()["scalars"])
    documented = {
        "gradwatch/summary/rel_diff_median", "gradwatch/summary/rel_diff_p95", "gradwatch/summary/rel_diff_max",
        "gradwatch/overhead/seconds", "gradwatch/overhead/fraction", "gradwatch/alerts/count",
    }
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        for metric in ("rel_diff", "directional_rel_diff", "max_rel_error", "judged_rel_diff"):
            documented.add(f"gradwatch/{metric}/{name}")
    documented.discard("gradwatch/directional_rel_diff/2.bias")  # one element: no directions sampled
    assert documented <= tags
    assert all(tag.startswith("gradwatch/") for tag in tags)

    n_compared = 0
    for rec, alert_count in checks:
        step = rec["step"]
        expected = dict(scalars_from_check(jsonl_checks[step]))
        expected["gradwatch/alerts/count"] = float(alert_count)
        for tag, value in expected.items():
            events = [e for e in acc.Scalars(tag) if e.step == step]
            assert len(events) == 1, (tag, step)
            assert math.isclose(events[0].value, value, rel_tol=1e-6, abs_tol=1e-30), (tag, step)
            assert events[0].wall_time == pytest.approx(jsonl_checks[step]["time"])
            n_compared += 1
    assert n_compared > 40
    # nothing written for a tensor that was not checked at a step
    assert {e.step for e in acc.Scalars("gradwatch/rel_diff/2.bias")} == {10, 20}
    assert [e.value for e in acc.Scalars("gradwatch/alerts/count")] == [0.0, 0.0, 2.0]


def test_alert_text_and_custom_scalars_layout(tmp_path):
    write_run(tmp_path)
    acc = load_events(tmp_path)
    tensor_tags = acc.Tags()["tensors"]
    assert "gradwatch/alerts/text_summary" in tensor_tags
    texts = acc.Tensors("gradwatch/alerts/text_summary")
    assert [e.step for e in texts] == [30, 30]
    decoded = [e.tensor_proto.string_val[0].decode() for e in texts]
    assert "`band`" in decoded[0]
    assert "`0.weight`" in decoded[0]
    assert "WRONG (rel_diff" in decoded[0]
    assert "drifted" in decoded[1]

    assert "custom_scalars__config__" in tensor_tags
    from tensorboard.plugins.custom_scalar import layout_pb2

    [event] = acc.Tensors("custom_scalars__config__")  # written once
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    [category] = layout.category
    assert category.title == "gradwatch"
    regexes = {r for chart in category.chart for r in chart.multiline.tag}
    assert "gradwatch/rel_diff/.*" in regexes and "gradwatch/alerts/count" in regexes


def test_two_sinks_on_one_dir_share_one_writer(tmp_path):
    a = TensorBoardSink(tmp_path)
    b = TensorBoardSink(tmp_path)
    assert a.writer is b.writer
    a.close()
    rec = check_record(1, bad_report(), seconds=0.1, overhead_fraction=None)
    b.write_check(rec, 0)  # still open: b holds it
    b.close()
    assert len(event_files(tmp_path)) == 1


def test_external_writer_is_used_and_not_closed(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    sinks = build_sinks(None, writer=writer)
    assert [type(s).__name__ for s in sinks] == ["JsonlSink", "TensorBoardSink", "LoggingSink"]
    sinks.write_check(check_record(3, bad_report(), seconds=0.1, overhead_fraction=None), [])
    sinks.close()
    writer.add_scalar("user/loss", 1.0, 3)  # still usable: gradwatch did not close it
    writer.close()
    assert len(event_files(tmp_path)) == 1
    assert (tmp_path / "checks.jsonl").exists()
    tags = load_events(tmp_path).Tags()["scalars"]
    assert "gradwatch/rel_diff/0.weight" in tags and "user/loss" in tags


def test_build_sinks_without_log_dir_is_logging_only():
    sinks = build_sinks(None)
    assert [type(s) for s in sinks] == [LoggingSink]


def test_jsonl_is_flushed_per_record(tmp_path):
    sink = JsonlSink(tmp_path / "run" / "checks.jsonl")  # creates the directory
    sink.write({"type": "run", "time": 0.0, "version": "x", "options": {}})
    # readable by another reader before close (a SIGKILL now would lose nothing)
    assert json.loads((tmp_path / "run" / "checks.jsonl").read_text()) == {
        "type": "run", "time": 0.0, "version": "x", "options": {},
    }
    sink.write({"type": "check", "value": float("nan")})
    sink.close()
    line = (tmp_path / "run" / "checks.jsonl").read_text().splitlines()[1]
    assert json.loads(line) == {"type": "check", "value": "nan"}  # never a bare NaN


def test_jsonl_appends_across_sinks(tmp_path):
    for step in (1, 2):
        sink = JsonlSink(tmp_path)  # a directory means <dir>/checks.jsonl
        sink.write({"type": "check", "step": step})
        sink.close()
    records, _ = read_jsonl(tmp_path)
    assert [r["step"] for r in records] == [1, 2]


def test_read_jsonl_tolerates_truncated_last_line_and_garbage(tmp_path):
    path = tmp_path / "checks.jsonl"
    path.write_text('{"type": "run"}\nnot json at all\n[1, 2]\n\n{"type": "check", "step": 1}\n{"type": "check", "st')
    records, warnings = read_jsonl(path)
    assert records == [{"type": "run"}, {"type": "check", "step": 1}]
    assert len(warnings) == 3
    assert "line 2: not valid JSON" in warnings[0]
    assert "line 3: expected a JSON object" in warnings[1]
    assert "line 6: truncated last line" in warnings[2]
    assert all(str(path) in w for w in warnings)


def test_read_jsonl_after_crash_mid_write(tmp_path):
    write_run(tmp_path)
    path = tmp_path / "checks.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 25])  # killed in the middle of the last alert
    records, warnings = read_jsonl(path)
    assert [r["type"] for r in records] == ["run", "check", "check", "check", "alert"]
    assert len(warnings) == 1 and "truncated last line" in warnings[0]


def test_unwritable_log_dir_fails_at_construction_naming_the_path(tmp_path):
    (tmp_path / "afile").write_text("a regular file, not a directory")
    bad = tmp_path / "afile" / "logs"
    with pytest.raises(LogDirError) as info:
        build_sinks(bad)
    assert str(bad) in str(info.value)
    assert isinstance(info.value, GradWatchError) and isinstance(info.value, OSError)
    with pytest.raises(LogDirError, match="afile"):
        JsonlSink(bad / "checks.jsonl")
    with pytest.raises(LogDirError, match="afile"):
        TensorBoardSink(bad)


class Exploding(Sink):
    def write_check(self, record, alert_count):
        raise OSError(28, "No space left on device")

    def write_alert(self, record):
        raise OSError(28, "No space left on device")


def test_failing_sink_does_not_stop_the_others(tmp_path, caplog):
    good = JsonlSink(tmp_path / "checks.jsonl")
    sinks = SinkSet([Exploding(), good])
    alert = Alert(1, "w", "band", "error", 1.0, None, "w: WRONG")
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for step in (1, 2, 3):
            sinks.write_check(check_record(step, bad_report(), seconds=0.1, overhead_fraction=None), [alert])
    sinks.close()
    warnings = [r for r in caplog.records if r.name == "gradwatch" and "Exploding" in r.getMessage()]
    assert len(warnings) == 1  # logged once
    assert "No space left on device" in warnings[0].getMessage()
    records, _ = read_jsonl(tmp_path)
    assert [r["type"] for r in records] == ["check", "alert"] * 3


def test_logging_sink_levels(caplog):
    sinks = SinkSet([LoggingSink()])
    alerts = [
        Alert(5, "w", "band", "error", 1.0, None, "w: WRONG"),
        Alert(5, "b", "drift", "warning", 1e-3, 1e-9, "b drifted"),
    ]
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        sinks.write_check(check_record(5, bad_report(), seconds=0.1, overhead_fraction=0.02), alerts)
    by_msg = {r.getMessage(): r.levelno for r in caplog.records}
    assert by_msg[alerts[0].message] == logging.ERROR  # its headline, why and what to do (issue 73)
    assert by_msg[alerts[1].message] == logging.WARNING and "why: b drifted" in alerts[1].message
    [line] = [m for m in by_msg if m.startswith("gradwatch step 5")]
    assert by_msg[line] == logging.INFO
    assert "FAILED" in line
    assert "2 alerts" in line


def test_real_trend_alert_if_available(tmp_path):
    trend = pytest.importorskip("gradwatch.watch.trend")
    if not hasattr(trend, "Alert"):
        pytest.skip("gradwatch.watch.trend.Alert not defined yet")
    alert = trend.Alert(step=4, tensor="w", kind="band", severity="error", value=0.5, baseline=None, message="m")
    sinks = build_sinks(tmp_path, tensorboard=False)
    sinks.write_check(check_record(4, bad_report(), seconds=0.1, overhead_fraction=None), [alert])
    sinks.close()
    records, _ = read_jsonl(tmp_path)
    assert records[-1]["type"] == "alert"
    assert records[-1]["message"] == alert.message
    assert records[-1]["step"] == 4
    assert (records[-1]["headline"], records[-1]["why"]) == (alert.headline, "m")  # the three lines kept (issue 73)


def test_records_survive_sigkill(tmp_path):
    import signal
    import subprocess
    import sys

    code = (
        "import os, signal, sys\n"
        "from gradwatch.io.sinks import JsonlSink\n"
        "sink = JsonlSink(sys.argv[1])\n"
        "for step in range(3):\n"
        "    sink.write({'type': 'check', 'step': step})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    records, warnings = read_jsonl(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2] and warnings == []
