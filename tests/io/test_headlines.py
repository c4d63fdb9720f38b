"""Messages a person reads at a glance (issue 73, item 3): every alert's headline says what, where and how bad in at
most 120 characters, then why, then what to do, each on its own line, in the alert, its record and ``gradwatch
report``. The autouse fixture in ``conftest.py`` checks every alert the suite raises in its own processes; these
build the longest kinds with the longest names (a fused expert's, a 200-character module path), which no run of the
suite's small models reaches, and read back records written before alerts had the three lines."""

from __future__ import annotations

import json
import math

import pytest

from gradwatch.bands import Verdict
from gradwatch.check.judging.report import CheckReport, NotChecked, TensorCheck, TrainingCheck
from gradwatch.cli import main
from gradwatch.io.headlines import ELLIPSIS, MAX_HEADLINE, line, shorten
from gradwatch.watch.alerts import alert_from_dict
from gradwatch.watch.trend import Alert, TrendTracker

EXPERT = "model.layers.17.mlp.experts.gate_up_proj[expert 103]"
DEEP = ".".join(f"encoder_stage_{i}" for i in range(13)) + ".attention.output_projection.weight"  # 267 characters


def wrong(name: str) -> TensorCheck:
    return TensorCheck(name, (4,), 0.3, 0.3, judged_rel_diff=0.32, verdict=Verdict.WRONG,
                       diagnosis="analytic differs from numeric at 3 of 8 sampled entries, not by a constant factor")


def lines_ok(alert: Alert) -> None:
    head, why, todo = alert.message.split("\n")
    assert head == alert.headline and 0 < len(head) <= MAX_HEADLINE, (len(head), head)
    assert why == f"why: {alert.why}"
    assert todo == f"what to do: {alert.todo}"
    assert alert.why
    assert alert.todo


def test_shortening_keeps_the_start_the_layer_and_the_tensor():
    assert len(DEEP) > 200
    for name in (EXPERT, DEEP, "x" * 300, "a.b", "blocks.1.act:input[3:5]"):
        for room in (12, 30, 60, 119):
            short = shorten(name, room)
            assert len(short) <= room and (short == name or ELLIPSIS in short), (name, room, short)
    assert shorten(EXPERT, 40) == "model.layers.17…gate_up_proj[expert 103]"
    assert shorten(DEEP, 60).startswith("encoder_stage_0") and shorten(DEEP, 60).endswith("output_projection.weight")
    assert shorten(DEEP, 80).endswith("attention.output_projection.weight")
    assert line("WRONG backward gradient", EXPERT, "rel_diff 3.2e-01", 4) == (
        f"WRONG backward gradient: {EXPERT}, rel_diff 3.2e-01 (step 4)")  # a name that fits is whole


def test_the_longest_kinds_with_the_longest_names_fit_and_keep_the_whole_name_below():
    tracker = TrendTracker()
    big = 10 ** 9  # a step with many digits
    report = CheckReport(tensors={DEEP: wrong(DEEP), EXPERT: wrong(EXPERT)})
    report.training = {DEEP: TrainingCheck(name=DEEP, shape=(4,), judged_rel_diff=0.5, verdict=Verdict.WRONG)}
    alerts = tracker.update(big, report)
    alerts += tracker.not_checked(big, [NotChecked("backward", DEEP, "its own code raised " + "x" * 200, "form='objective'"),
                                        NotChecked("inner", EXPERT, "no double backward", "check_double_backward")])
    alerts.append(tracker.error(big, RuntimeError("y" * 300 + "\nsecond line"), where=f"regularizer '{DEEP}'"))
    alerts += [Alert(big, DEEP, "surrogate", "error", 1.0, None, f"{DEEP} at step {big}: undeclared — declare it"),
               Alert(big, DEEP, "independence", "error", 0.5, None, f"step {big}: documents independence broken: x"),
               Alert(big, DEEP, "drift", "warning", 1e-3, 1e-9, f"{DEEP} at step {big}: drifted — look"),
               Alert(big, DEEP, "nonfinite", "error", math.nan, None, f"{DEEP} at step {big}: NaN — look"),
               Alert(big, DEEP, "threshold", "error", 0.3, None, "m", "training", 300, [DEEP] * 300),
               Alert(big, DEEP, "some_new_kind", "warning", 0.1, None, "m", "update")]
    assert {a.kind for a in alerts} >= {"threshold", "not_checked", "error", "surrogate", "independence", "drift",
                                        "nonfinite"}
    for alert in alerts:
        lines_ok(alert)
        assert f"(step {big})" in alert.headline, alert.headline
    by_name = [a for a in alerts if a.kind == "threshold" and a.count == 1]
    assert len(by_name) == 3  # each tensor's, the training one too
    for alert in by_name:
        assert ELLIPSIS in alert.headline or alert.tensor == EXPERT
        assert alert.headline.startswith("WRONG ") and "rel_diff" in alert.headline
        assert alert.tensor in alert.why or alert.tensor in alert.headline  # the whole name is still said
    error = next(a for a in alerts if a.kind == "error")
    assert error.headline.startswith("check raised RuntimeError in regulariz") and error.headline.endswith(
        f"{ELLIPSIS} (step {big})")


def test_update_part_headlines_and_a_round_trip():
    alerts = [Alert(3, "*", "clipping", "error", math.nan, None, "step 3 (update): x — y", "update",
                    headline=line("clipping", f"{7} parameter groups scaled differently", "", 3)),
              Alert(3, "*", "tie", "error", math.nan, None, "step 3 (update): tied — tie them", "update",
                    headline=line("tied weights now separate tensors", f"{DEEP} and {EXPERT}", "", 3))]
    for alert in alerts:
        lines_ok(alert)
        again = alert_from_dict(json.loads(json.dumps(alert.to_dict())))
        assert again.to_dict() == alert.to_dict()  # the three lines come back as they were
    assert alerts[0].headline == "clipping: 7 parameter groups scaled differently (step 3)"


def test_gradwatch_report_derives_the_lines_of_an_old_record_and_prints_them_indented(tmp_path, capsys):
    old = {"type": "alert", "time": 0.0, "step": 40, "tensor": EXPERT, "kind": "threshold", "severity": "error",
           "value": 0.21, "baseline": None, "part": "backward",
           "message": f"{EXPERT} at step 40: judged rel_diff 2.1e-01 (WRONG, band >= 1e-02) — check the backward"}
    check = {"type": "check", "time": 0.0, "step": 40, "tensors": {EXPERT: {
        "judged_rel_diff": 0.21, "rel_diff": 0.21, "verdict": "wrong"}}}
    (tmp_path / "checks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (check, old)))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, text in enumerate(out) if text.strip().startswith("WRONG backward gradient:"))
    assert out[head] == f"  WRONG backward gradient: {EXPERT}, rel_diff 2.1e-01 (step 40)"
    assert out[head + 1] == "      why: judged rel_diff 2.1e-01 (WRONG, band >= 1e-02)"
    assert out[head + 2] == "      what to do: check the backward"
    assert main(["report", str(tmp_path), "--format", "json"]) == 0
    [alert] = json.loads(capsys.readouterr().out)["alerts"]
    assert alert["message"] == old["message"] and alert["todo"] == "check the backward"  # the record as written


@pytest.mark.parametrize("message", ["step 1: x\nwhy: y\nwhat to do: z", "step 1: x — z"])
def test_a_message_given_on_three_lines_or_one_reads_the_same(message):
    alert = Alert(1, "*", "error", "error", math.nan, None, message)
    lines_ok(alert)
    assert alert.todo == "z"
