"""TrendTracker on simulated check reports: baselines, drift, thresholds, dedup, state round trip."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from gradwatch.bands import Verdict
from gradwatch.check.judging.report import CheckReport, InconclusiveKind, TensorCheck
from gradwatch.errors import ConfigError
from gradwatch.watch.trend import Alert, TrendTracker


def tc(name: str, value: float, diagnosis: str | None = None, inconclusive: str | None = None,
       kind: InconclusiveKind | None = None) -> TensorCheck:
    verdict = None if inconclusive else Verdict.from_value(value)
    if inconclusive and kind is None and "finite" in inconclusive:
        kind = InconclusiveKind.NONFINITE  # as the check sets it for these texts
    return TensorCheck(
        name=name, shape=(4,), rel_diff=value, max_rel_error=value, directional_rel_diff=value,
        judged_rel_diff=value, verdict=verdict, failed=verdict is not None and verdict.rank >= 2,
        diagnosis=diagnosis, inconclusive=inconclusive, inconclusive_kind=kind,
    )


def report(*checks: TensorCheck, **flags) -> CheckReport:
    return CheckReport(tensors={t.name: t for t in checks}, objective=flags.pop("objective", 1.0), **flags)


def feed(tracker: TrendTracker, values, name="w", start=0, every=10):
    """Update with one tensor's values; return [(step, [kinds])] of the checks that alerted."""
    out = []
    for i, v in enumerate(values):
        step = (start + i) * every
        alerts = tracker.update(step, report(tc(name, v)))
        if alerts:
            out.append((step, [a.kind for a in alerts]))
    return out


def test_flat_history_raises_nothing():
    tracker = TrendTracker()
    assert feed(tracker, [2e-10, 3e-10, 1e-10] * 20) == []
    assert tracker.baseline("w") == pytest.approx(2e-10)
    assert len(tracker.history["w"]) == 60


def test_noise_inside_excellent_band_never_drifts():
    tracker = TrendTracker()
    # rises 4 decades relative to its baseline but stays below bands[0] = 1e-7
    assert feed(tracker, [1e-12] * 3 + [5e-8] * 10) == []


def test_drift_two_decades_while_still_acceptable():
    tracker = TrendTracker()
    alerts = []
    for i, v in enumerate([1e-9, 2e-9, 1e-9, 1e-9, 3e-7, 4e-7, 5e-7]):
        alerts += tracker.update(i, report(tc("fc1.weight", v)))
    assert [(a.kind, a.step, a.severity) for a in alerts] == [("drift", 5, "warning")]
    alert = alerts[0]
    assert Verdict.from_value(alert.value) is Verdict.ACCEPTABLE
    assert alert.value == pytest.approx(3e-7) and alert.baseline == pytest.approx(1e-9)
    # issue 73: the headline says what, where and how bad; the why and what to do on their own lines
    assert alert.headline == "backward gradient drifting: fc1.weight, rel_diff 3.0e-07 vs baseline 1.0e-09 (step 5)"
    assert alert.message.split("\n")[0] == alert.headline and "baseline 1.0e-09" in alert.why
    assert "ACCEPTABLE" in alert.message and "2.5 decades" in alert.message


def test_drift_needs_a_complete_baseline():
    tracker = TrendTracker(baseline_checks=3)
    assert feed(tracker, [1e-9, 1e-5]) == []
    assert tracker.baseline("w") is None


def test_zero_baseline_counts_as_1e_12():
    tracker = TrendTracker()
    assert feed(tracker, [0.0, 0.0, 0.0, 5e-7, 5e-7]) == [(40, ["drift"])]


def test_threshold_on_wrong_with_diagnosis():
    tracker = TrendTracker()
    feed(tracker, [2.4e-10] * 3)
    diag = "analytic is 2.00x numeric (constant ratio): a factor in backward is wrong"
    alerts = tracker.update(420, report(tc("fc1.weight", 2.4e-10), tc("fc2.weight", 1e-9)))
    alerts = tracker.update(430, report(tc("fc1.weight", 3.1e-2, diagnosis=diag)))
    threshold = [a for a in alerts if a.kind == "threshold"]
    assert len(threshold) == 1
    a = threshold[0]
    assert (a.tensor, a.severity, a.step, a.value) == ("fc1.weight", "error", 430, 3.1e-2)
    assert a.headline == "WRONG backward gradient: fc1.weight, rel_diff 3.1e-02 (step 430)"
    assert a.why.startswith("judged rel_diff 3.1e-02 (WRONG") and diag in a.why
    assert a.todo.startswith("check the backward") and a.message == f"{a.headline}\nwhy: {a.why}\nwhat to do: {a.todo}"


def test_suspicious_is_a_warning():
    tracker = TrendTracker()
    (a,) = tracker.update(1, report(tc("w", 1e-3)))
    assert (a.kind, a.severity, a.baseline) == ("threshold", "warning", None)


def test_dedup_then_realert_when_worse():
    tracker = TrendTracker(alert_cooldown=100)
    assert feed(tracker, [1e-3, 2e-3, 3e-3, 5e-2, 6e-2, 2e-3, 7e-2]) == [(0, ["threshold"]), (30, ["threshold"])]


def test_realert_after_cooldown():
    tracker = TrendTracker(alert_cooldown=3)
    # alert at check 0; checks 1-3 silent; alert again at check 4, then 8
    hits = feed(tracker, [1e-3] * 10, every=1)
    assert [step for step, _ in hits] == [0, 4, 8]


def test_cooldown_zero_repeats_every_check():
    tracker = TrendTracker(alert_cooldown=0)
    assert len(feed(tracker, [1e-3] * 4)) == 4


def test_cooldown_counts_checks_of_that_tensor_only():
    tracker = TrendTracker(alert_cooldown=2)
    hits = []
    for step in range(12):
        # "a" is in every check, "b" in every third: b's cooldown advances only when b is checked
        checks = [tc("a", 1e-9)] + ([tc("b", 1e-3)] if step % 3 == 0 else [])
        hits += [(step, a.tensor) for a in tracker.update(step, report(*checks))]
    assert hits == [(0, "b"), (9, "b")]


def test_drift_dedup_realerts_at_10x():
    tracker = TrendTracker(drift_window=1, alert_cooldown=100)
    hits = feed(tracker, [1e-9] * 3 + [2e-7, 5e-7, 1.9e-6, 2e-6, 3e-6], every=1)
    assert hits == [(3, ["drift"]), (6, ["drift"])]


def test_recovery_then_relapse_alerts_again():
    tracker = TrendTracker(alert_cooldown=100)
    hits = feed(tracker, [1e-9] * 3 + [5e-2, 5e-2, 1e-9, 5e-2], every=1, name="w")
    # the rolling median (window 3) drifts one check later and stays up through the one good check
    assert hits == [(3, ["threshold"]), (4, ["drift"]), (6, ["threshold"])]
    # drift relapses too once the rolling median recovers and rises again
    tracker = TrendTracker(drift_window=1, alert_cooldown=100)
    hits = feed(tracker, [1e-9] * 3 + [5e-7, 5e-7, 1e-9, 5e-7], every=1)
    assert hits == [(3, ["drift"]), (6, ["drift"])]


def test_inconclusive_check_neither_raises_nor_clears():
    tracker = TrendTracker(alert_cooldown=100)
    tracker.update(0, report(tc("w", 1e-3)))
    assert tracker.update(1, report(tc("w", math.nan, inconclusive="objective is nondeterministic"),
                                    nondeterministic=True))[0].kind == "nondeterministic"
    assert tracker.update(2, report(tc("w", 1e-3))) == []


def test_nonfinite_objective_is_one_whole_check_alert():
    tracker = TrendTracker()
    bad = report(tc("a", math.nan, inconclusive="objective is not finite (nan)"),
                 tc("b", math.nan, inconclusive="objective is not finite (nan)"),
                 nonfinite=True, objective=math.nan, terms={"loss": math.nan, "l2": 0.1})
    (a,) = tracker.update(5, bad)
    assert (a.tensor, a.kind, a.severity) == ("*", "nonfinite", "error")
    assert "step 5" in a.message and "loss = nan" in a.message
    assert a.to_dict()["value"] == "nan"
    assert tracker.update(6, bad) == []  # deduplicated
    assert tracker.update(7, report(tc("a", 1e-9))) == []  # recovers
    assert [x.kind for x in tracker.update(8, bad)] == ["nonfinite"]  # relapse


def test_alerts_follow_the_typed_kind_not_the_wording():
    tracker = TrendTracker()
    reworded = tc("b", math.nan, inconclusive="NaN in the gradient", kind=InconclusiveKind.NONFINITE)
    alerts = tracker.update(3, report(tc("a", 1e-9), reworded, nonfinite=True))
    assert [(a.tensor, a.kind) for a in alerts] == [("b", "nonfinite")]
    # A text that happens to say "finite" but is another kind raises no NaN alert for the tensor.
    other = tc("c", math.nan, inconclusive="not resolvable by finite differences", kind=InconclusiveKind.UNRESOLVED)
    assert TrendTracker().update(3, report(tc("a", 1e-9), other)) == []


def test_nonfinite_gradient_names_the_tensor():
    tracker = TrendTracker()
    alerts = tracker.update(3, report(tc("a", 1e-9), tc("b", math.nan, inconclusive="analytic gradient has non-finite "
                                                       "values (NaN or inf)"), nonfinite=True))
    assert [(a.tensor, a.kind, a.severity) for a in alerts] == [("b", "nonfinite", "error")]
    assert alerts[0].headline == "non-finite check: b, no verdict (step 3)"
    assert alerts[0].why.startswith("analytic gradient has non-finite values")


def test_nondeterministic_whole_check():
    tracker = TrendTracker(alert_cooldown=1)
    nd = report(tc("w", math.nan, inconclusive="objective is nondeterministic (two evaluations differ by 0.1)"),
                nondeterministic=True)
    kinds = [[(a.tensor, a.kind, a.severity) for a in tracker.update(s, nd)] for s in range(4)]
    assert kinds == [[("*", "nondeterministic", "warning")], [], [("*", "nondeterministic", "warning")], []]


def test_error_alert_and_dedup():
    tracker = TrendTracker(alert_cooldown=2)
    first = tracker.error(1, RuntimeError("shape mismatch [2] vs [3]"))
    assert (first.tensor, first.kind, first.severity) == ("*", "error", "error")
    assert "RuntimeError: shape mismatch [2] vs [3]" in first.message and "loss_fn" in first.message
    assert tracker.error(2, RuntimeError("shape mismatch [2] vs [3]")) is None  # the same error again: quiet
    assert tracker.error(3, RuntimeError("shape mismatch [2] vs [3]")) is None
    assert tracker.error(4, RuntimeError("shape mismatch [2] vs [3]")) is not None  # the cooldown is over
    other = tracker.error(5, KeyError("x"), where="grad_fn")  # another error fires at once
    assert other is not None
    assert "KeyError" in other.message
    assert "grad_fn" in other.message
    assert tracker.error(6, KeyError("x"), where="grad_fn") is None
    resumed = TrendTracker(alert_cooldown=2)
    resumed.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    assert resumed.error(7, KeyError("x"), where="grad_fn") is None  # what was alerted survives a resume
    assert resumed.error(8, ValueError("y")) is not None
    tracker.update(9, report(tc("w", 1e-9)))  # a successful check clears the error state
    assert tracker.error(10, KeyError("x"), where="grad_fn") is not None


def test_summary_and_history_shape():
    tracker = TrendTracker()
    feed(tracker, [1e-9, 2e-9, 3e-3, 1e-9], every=5)
    h = tracker.history["w"][2]
    assert h == {"step": 10, "judged_rel_diff": 3e-3, "rel_diff": 3e-3, "directional_rel_diff": 3e-3,
                 "verdict": "suspicious"}
    assert tracker.summary() == {
        "w": {"first": 1e-9, "last": 1e-9, "worst": 3e-3, "verdict": "excellent", "alerts": 1, "checks": 4,
              "baseline": 2e-9}
    }
    json.dumps(tracker.summary())


def test_alert_to_dict_is_json_safe():
    a = Alert(step=1, tensor="*", kind="error", severity="error", value=math.nan, baseline=None, message="m")
    d = a.to_dict()
    lines = {"headline": "the check failed (step 1)", "why": "m",
             "todo": "look at the exception above; the check was skipped and training continues"}
    assert d == {"step": 1, "tensor": "*", "kind": "error", "severity": "error", "value": "nan", "baseline": None,
                 "message": "the check failed (step 1)\nwhy: m\nwhat to do: look at the exception above; the check "
                 "was skipped and training continues", "part": "backward", **lines}
    json.loads(json.dumps(d, allow_nan=False))


def _sequence():
    """Two tensors checked on rotating subsets, with drift, failures, recovery, NaN and errors."""
    a = [1e-9, 2e-9, 1e-9, 1e-9, 5e-7, 6e-7, 8e-6, 2e-5, 3e-3, 4e-2, 1e-9, 1e-9, 5e-2, 5e-2, 5e-2, 5e-2]
    b = [1e-10, 1e-10, 1e-10, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-10, 1e-3]
    events = []
    ia = ib = 0
    for step in range(40):
        if step == 17:
            events.append(("error", step))
        elif step in (21, 22):
            events.append(("report", step, report(tc("a", math.nan, inconclusive="objective is not finite (nan)"),
                                                  nonfinite=True, objective=math.nan)))
        elif step % 2 == 0 and ia < len(a):
            events.append(("report", step, report(tc("a", a[ia]))))
            ia += 1
        elif ib < len(b):
            events.append(("report", step, report(tc("b", b[ib]))))
            ib += 1
    return events


def _run(tracker, events):
    out = []
    for ev in events:
        if ev[0] == "error":
            alert = tracker.error(ev[1], ValueError("boom"))
            out += [alert.to_dict()] if alert else []
        else:
            out += [x.to_dict() for x in tracker.update(ev[1], ev[2])]
    return out


@pytest.mark.parametrize("split", [3, 9, 14, 20, 25])
def test_state_dict_round_trip_continues_exactly(split):
    events = _sequence()
    settings = dict(alert_cooldown=3, drift_window=2)
    whole = TrendTracker(**settings)
    expected = _run(whole, events)
    assert {a["kind"] for a in expected} == {"threshold", "drift", "nonfinite", "error"}

    first = TrendTracker(**settings)
    got = _run(first, events[:split])
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))
    resumed = TrendTracker(**settings)
    resumed.load_state_dict(state)
    got += _run(resumed, events[split:])

    assert got == expected
    assert json.dumps(resumed.history) == json.dumps(whole.history)
    assert json.dumps(resumed.summary()) == json.dumps(whole.summary())
    assert resumed.state_dict() == whole.state_dict()


def test_load_state_dict_refuses_foreign_state():
    with pytest.raises(ConfigError, match="version"):
        TrendTracker().load_state_dict({"version": 99})


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"baseline_checks": 0}, r"baseline_checks: got 0, expected an integer >= 1"),
        ({"drift_window": 1.5}, r"drift_window: got 1\.5, expected an integer >= 1"),
        ({"drift_decades": 0}, r"drift_decades: got 0, expected a number > 0"),
        ({"drift_decades": True}, r"drift_decades: got True"),
        ({"alert_cooldown": -1}, r"alert_cooldown: got -1, expected an integer >= 0"),
        ({"bands": (1e-2, 1e-4, 1e-7)}, r"bands must be three increasing positive numbers"),
    ],
)
def test_constructor_validation(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        TrendTracker(**kwargs)


def test_trend_module_is_pure():
    import ast
    import pathlib

    import gradwatch.io.headlines as headlines
    import gradwatch.watch.causes as causes
    import gradwatch.watch.trend as trend

    imported = set()
    for module in (trend, causes, headlines):  # the trends, their causes and the alerts' lines: pure, all three
        for node in ast.walk(ast.parse(pathlib.Path(module.__file__).read_text())):
            if isinstance(node, ast.Import):
                imported |= {n.name.split(".")[0] for n in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(("." * node.level) + (node.module or ""))
    assert imported <= {"__future__", "math", "re", "statistics", "dataclasses", "typing", "textwrap", "gradwatch.errors",
                        "gradwatch.bands", "gradwatch.options", "gradwatch.check.judging.report", "gradwatch.watch.causes",
                        "gradwatch.io.headlines"}


def test_a_piece_over_the_room_once_is_said_at_its_second_time_across_a_resume():
    # the first time over the room is not said (the next check takes the piece first); a run resumed from its
    # state between the two times says it at the second, as the run that went on would have
    from gradwatch.watch.trend import NotChecked

    room = NotChecked("backward", "head", "needs about 9 MB, over the room memory_budget leaves (4 MB)", "...")
    first = TrendTracker()
    assert first.not_checked(0, [room]) == []
    resumed = TrendTracker()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [a.kind for a in resumed.not_checked(1, [room])] == ["not_checked"]


def test_units_over_the_room_at_one_check_are_one_alert_of_one_cause_naming_them():
    # a Mixtral's three layers of fused experts over the room at the defaults: one cause, the room (not three alerts)
    from gradwatch.io.not_judged import unchecked_from_alerts, unchecked_lines
    from gradwatch.watch.trend import NotChecked

    def item(i: int, need: str) -> NotChecked:
        return NotChecked("backward", f"model.layers.{i}.mlp.experts", f"rows 3:6 needs about {need} MB with 8.3 MB left "
                          "to it, over the room memory_budget leaves (28.0 MB)", "form='objective' checks it",
                          f"own code of `model.layers.{i}.mlp.experts` (MixtralExperts)")

    items = [item(i, need) for i, need in enumerate(("19.9", "19.9", "21.0", "19.9"))]
    gate = NotChecked("backward", "gate", "its own code fails when it runs apart", "form='objective' checks it")
    tracker = TrendTracker()
    assert tracker.not_checked(0, items) == []  # the first time over the room: the next check takes them first
    alerts = tracker.not_checked(1, items + [gate])
    assert [(a.kind, a.tensor) for a in alerts] == [("not_checked", "gate"), ("not_checked", "model.layers.0.mlp.experts")]
    room = alerts[1]
    assert "4 units (`model.layers.0.mlp.experts`, `model.layers.1.mlp.experts`, `model.layers.2.mlp.experts` and 1 " \
           "more) not checked (backward part): one cause, the room memory_budget leaves (28.0 MB) at this check: " \
           "`model.layers.0.mlp.experts` rows 3:6 needs about 19.9 MB" in room.message, room.message
    assert room.why.endswith("`model.layers.2.mlp.experts` rows 3:6 needs about 21.0 MB with 8.3 MB left to it"), room.why
    assert room.headline.startswith("not checked (backward): 4 units"), room.headline
    assert tracker.not_checked(2, items) == []  # said once for the run, every unit
    # read back from the event files (no notes there): one line, every unit named
    lines = unchecked_lines(unchecked_from_alerts([dataclasses.asdict(room)]), 2)
    assert len(lines) == 1 and lines[0].startswith("not checked: 4 units (`model.layers.0.mlp.experts`"), lines
    one = TrendTracker()  # one unit over the room is said as before
    one.not_checked(0, items[:1])
    assert one.not_checked(1, items[:1])[0].why.startswith("own code of `model.layers.0.mlp.experts` (MixtralExperts) not")
