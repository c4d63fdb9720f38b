"""Records: shapes, JSON safety, TensorBoard scalar tags."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch import CheckReport, TensorCheck, Verdict
from gradwatch.io.records import (
    alert_record,
    check_record,
    custom_scalars_layout,
    run_record,
    scalars_from_check,
    to_jsonable,
)
from gradwatch.watch.trend import Alert


def make_report(nan: bool = False) -> CheckReport:
    a = TensorCheck(
        "fc.weight", (3, 4), rel_diff=1e-9, max_rel_error=3e-9, directional_rel_diff=2e-9,
        judged_rel_diff=2e-9, verdict=Verdict.EXCELLENT, noise_floor=1e-12,
    )
    b = TensorCheck(
        "fc.bias", (3,), rel_diff=float("nan") if nan else 0.4, max_rel_error=float("inf") if nan else 0.9,
        directional_rel_diff=None, judged_rel_diff=0.4, verdict=Verdict.WRONG, failed=True, kinks=1,
        diagnosis="analytic is 2.00x numeric (constant ratio): a factor in backward is wrong",
    )
    return CheckReport(
        tensors={a.name: a, b.name: b}, objective=1.5, terms={"loss": 1.5}, evaluations=40, seed=7,
        notes=["a note"],
    )


TOP_KEYS = {
    "type", "step", "time", "seconds", "overhead_fraction", "evaluations", "objective", "terms", "dtype",
    "seed", "ok", "nondeterministic", "nonfinite", "kinks", "notes", "tensors", "summary", "coverage",
    "training", "training_note", "training_items", "training_window", "form", "memory", "check_counts", "cycle_length",
    "steps_to_full", "pieces", "independence", "causes",
}
TENSOR_KEYS = {
    "rel_diff", "directional_rel_diff", "max_rel_error", "judged_rel_diff", "verdict", "kinks",
    "noise_floor", "diagnosis", "inconclusive", "inconclusive_kind", "ratio", "shape", "form",
}


def test_check_record_shape():
    rec = check_record(100, make_report(), seconds=0.25, overhead_fraction=0.03, coverage={"fc.weight": 5},
                       wall_time=123.0)
    assert set(rec) == TOP_KEYS
    assert rec["type"] == "check"
    assert rec["step"] == 100
    assert rec["time"] == 123.0
    assert rec["ok"] is False
    assert rec["kinks"] == 1
    assert rec["seed"] == 7
    assert rec["coverage"] == {"fc.weight": 5}
    assert rec["form"] == "objective" and rec["memory"] == {}
    for t in rec["tensors"].values():
        assert set(t) == TENSOR_KEYS
    w = rec["tensors"]["fc.weight"]
    assert w["verdict"] == "excellent"
    assert w["shape"] == [3, 4]
    assert w["rel_diff"] == 1e-9
    assert rec["tensors"]["fc.bias"]["directional_rel_diff"] is None
    assert rec["summary"]["rel_diff_max"] == 0.4
    assert rec["summary"]["rel_diff_median"] == pytest.approx((1e-9 + 0.4) / 2)
    assert rec["summary"]["rel_diff_p95"] == pytest.approx(1e-9 + 0.95 * (0.4 - 1e-9))
    json.dumps(rec, allow_nan=False)


def test_check_record_nonfinite_values_are_strings_and_skipped_in_summary():
    report = make_report(nan=True)
    report.objective = float("-inf")
    rec = check_record(1, report, seconds=float("nan"), overhead_fraction=None)
    text = json.dumps(rec, allow_nan=False)  # would raise on a bare NaN
    assert rec["tensors"]["fc.bias"]["rel_diff"] == "nan"
    assert rec["tensors"]["fc.bias"]["max_rel_error"] == "inf"
    assert rec["objective"] == "-inf" and rec["seconds"] == "nan"
    assert rec["summary"]["rel_diff_max"] == 1e-9  # only the finite one
    assert rec["coverage"] == {}
    assert json.loads(text) == rec


def test_summary_none_without_finite_values():
    rec = check_record(1, CheckReport(tensors={}), seconds=0.1, overhead_fraction=None)
    assert rec["summary"] == {"rel_diff_median": None, "rel_diff_p95": None, "rel_diff_max": None,
                              "training_rel_diff_max": None}
    assert [tag for tag, _ in scalars_from_check(rec)] == ["gradwatch/overhead/seconds"]


def test_check_record_from_real_check_model():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    batch = (torch.randn(5, 3), torch.randn(5, 2))
    report = gradwatch.check_model(model, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), batch)
    rec = check_record(0, report, seconds=report.seconds, overhead_fraction=None)
    assert set(rec["tensors"]) == {"weight", "bias"}
    assert rec["ok"] is True
    json.dumps(rec, allow_nan=False)


def test_scalars_from_check_tags_and_values():
    rec = check_record(5, make_report(), seconds=0.25, overhead_fraction=0.03)
    scalars = dict(scalars_from_check(rec))
    expected = {
        "gradwatch/rel_diff/fc.weight", "gradwatch/directional_rel_diff/fc.weight",
        "gradwatch/max_rel_error/fc.weight", "gradwatch/judged_rel_diff/fc.weight",
        "gradwatch/rel_diff/fc.bias", "gradwatch/max_rel_error/fc.bias", "gradwatch/judged_rel_diff/fc.bias",
        "gradwatch/summary/rel_diff_median", "gradwatch/summary/rel_diff_p95", "gradwatch/summary/rel_diff_max",
        "gradwatch/overhead/seconds", "gradwatch/overhead/fraction",
        "gradwatch/log10_judged_rel_diff/fc.weight", "gradwatch/log10_judged_rel_diff/fc.bias",
    }
    assert set(scalars) == expected  # bias has no directional value: skipped
    assert scalars["gradwatch/rel_diff/fc.bias"] == 0.4
    for name in ("fc.weight", "fc.bias"):  # log10 of the judged value, a judged 0 at the floor
        judged = rec["tensors"][name]["judged_rel_diff"]
        want = -16.0 if judged == 0 else math.log10(judged)
        assert scalars[f"gradwatch/log10_judged_rel_diff/{name}"] == pytest.approx(want)
    assert scalars["gradwatch/overhead/fraction"] == 0.03
    assert all(isinstance(v, float) and math.isfinite(v) for v in scalars.values())


def test_scalars_skip_nonfinite():
    rec = check_record(5, make_report(nan=True), seconds=0.25, overhead_fraction=None)
    tags = {tag for tag, _ in scalars_from_check(rec)}
    assert "gradwatch/rel_diff/fc.bias" not in tags
    assert "gradwatch/max_rel_error/fc.bias" not in tags
    assert "gradwatch/overhead/fraction" not in tags


def test_alert_record():
    alert = Alert(7, "fc.bias", "band", "error", float("inf"), None, "fc.bias: WRONG")
    rec = alert_record(alert, wall_time=1.0)
    lines = {"headline": "band (backward): fc.bias, value inf (step 7)", "why": "fc.bias: WRONG",
             "todo": "look at the tensors and the step it names: gradwatch report <run> lists each check's verdicts"}
    assert rec == {  # the message is the three lines, each a field of its own too (issue 73)
        "type": "alert", "time": 1.0, "step": 7, "tensor": "fc.bias", "kind": "band", "severity": "error",
        "value": "inf", "baseline": None, "part": "backward", **lines,
        "message": "{headline}\nwhy: {why}\nwhat to do: {todo}".format(**lines),
    }
    assert list(rec)[:2] == ["type", "time"]
    json.dumps(rec, allow_nan=False)


def test_alert_record_duck_typed_without_to_dict():
    class Plain:
        step, tensor, kind, severity, value, baseline, message = 2, "w", "drift", "warning", 0.1, 0.01, "m"

    rec = alert_record(Plain())
    assert rec["kind"] == "drift"
    assert rec["baseline"] == 0.01
    assert isinstance(rec["time"], float)
    assert rec["message"] == "m" and rec["why"] == "m"  # its own message kept; the three lines derived (issue 73)
    assert rec["headline"] == "backward gradient drifting: w, rel_diff 1.0e-01 vs baseline 1.0e-02 (step 2)"


def test_run_record_makes_options_jsonable():
    rec = run_record({"every": 10, "dtype": torch.float64, "fail_at": Verdict.SUSPICIOUS, "bands": (1e-7, 1e-4)},
                     "0.1.0", wall_time=2.0)
    assert rec == {
        "type": "run", "time": 2.0, "version": "0.1.0",
        "options": {"every": 10, "dtype": "float64", "fail_at": "suspicious", "bands": [1e-7, 1e-4]},
    }


def test_custom_scalars_layout():
    layout = custom_scalars_layout(["fc.weight"])
    assert list(layout) == ["gradwatch"]
    charts = layout["gradwatch"]
    regexes = {r for kind, tags in charts.values() for r in tags if kind == "Multiline"}
    assert len(charts) == 11 and len(regexes) == 12  # the two log10 charts share the band edges
    for tag in ("gradwatch/log10_judged_rel_diff/fc.weight", "gradwatch/training/log10_judged_rel_diff/fc.weight",
                "gradwatch/bands/log10_excellent",
                "gradwatch/rel_diff/fc.weight", "gradwatch/directional_rel_diff/fc.weight",
                "gradwatch/max_rel_error/fc.weight", "gradwatch/judged_rel_diff/fc.weight",
                "gradwatch/training/rel_diff/fc.weight", "gradwatch/training/judged_rel_diff/fc.weight",
                "gradwatch/summary/rel_diff_p95", "gradwatch/overhead/seconds", "gradwatch/alerts/count"):
        assert any(re.fullmatch(r, tag) for r in regexes), tag


def test_to_jsonable():
    import numpy as np

    assert to_jsonable({"a": np.float32(1.5), "b": np.int64(2), "c": [float("-inf")], "d": np.bool_(True)}) == {
        "a": 1.5, "b": 2, "c": ["-inf"], "d": True,
    }


def test_tensor_records_carry_the_typed_kind_and_ratio():
    import math as _math

    from gradwatch.check.judging.report import CheckReport, InconclusiveKind, TensorCheck
    from gradwatch.io.records import check_record

    nan = TensorCheck(name="a", shape=(2,), rel_diff=_math.nan, max_rel_error=_math.nan, inconclusive="NaN",
                      inconclusive_kind=InconclusiveKind.NONFINITE)
    off = TensorCheck(name="b", shape=(2,), rel_diff=0.3, max_rel_error=0.3, ratio=2.0)
    rec = check_record(3, CheckReport(tensors={"a": nan, "b": off}), seconds=0.1, overhead_fraction=0.01)
    assert rec["tensors"]["a"]["inconclusive_kind"] == "nonfinite" and rec["tensors"]["a"]["ratio"] is None
    assert rec["tensors"]["b"]["inconclusive_kind"] is None and rec["tensors"]["b"]["ratio"] == 2.0
