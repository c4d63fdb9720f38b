"""GradWatch in a real training loop: late bugs, false alarms, sinks, resume, configs, rotation, errors.

No mocks: real models, real optimizers, real TensorBoard event files read
back with tensorboard's ``EventAccumulator``, real ``checks.jsonl``.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import gradwatch
from gradwatch import GradientDriftError, GradWatch
from gradwatch.io.records import scalars_from_check
from gradwatch.io.sinks import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

EVERY = 5
SCALE_AT = 30  # the first layer's weights grow after this step's optimizer update
STEPS = 45  # checks at 0, 5, ..., 40: two checks after the crossing at 35 and 40


# ---------------------------------------------------------------------------- the late-bug model
class LateBugSiLU(torch.autograd.Function):
    """``x * sigmoid(x)``; backward is right for ``|x| < 3`` and (unless ``fixed``) wrong beyond.

    The bug: beyond 3 the backward returns the derivative of the sigmoid,
    ``s(1 - s)``, instead of the SiLU's ``s + x s (1 - s)`` (a copy-paste slip).
    """

    @staticmethod
    def forward(ctx, x, fixed):
        ctx.save_for_backward(x)
        ctx.fixed = fixed
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        d = s + x * s * (1 - s)
        if not ctx.fixed:
            d = torch.where(x.abs() < 3, d, s * (1 - s))
        return grad * d, None


class Act(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed

    def forward(self, x):
        return LateBugSiLU.apply(x, self.fixed)


def make_model(fixed: bool = False, *, batchnorm: bool = False, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), Act(fixed)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(8))
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(8, 3))
    return nn.Sequential(*layers)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def batches(n: int, seed: int = 1):
    """Inputs in [-1, 1]^4: with the default init |W x + b| <= 2.5 < 3 until the weights are scaled."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.rand(32, 4, generator=g) * 2 - 1, torch.randint(0, 3, (32,), generator=g)


def train(model, watch, steps, *, scale_at=SCALE_AT, start=0, lr=0.01, weight_decay=0.0, data=None, l2=0.0):
    """A plain loop (``l2``: that L2 term in the training loss); returns {step: report} for the steps that ran a check."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
    data = list(batches(steps)) if data is None else data
    reports = {}
    for step in range(start, steps):
        batch = data[step]
        opt.zero_grad()
        loss = loss_fn(model, batch)
        if l2:
            loss = loss + l2 * sum(p.pow(2).sum() for p in model.parameters())
        loss.backward()
        report = watch.step(batch)
        if report is not None:
            reports[step] = report
        opt.step()
        if step == scale_at:
            with torch.no_grad():
                model[0].weight.mul_(6.0)
    return reports


def first_layer_input_max(model, data) -> float:
    with torch.no_grad():
        return max(float(model[0](x).abs().max()) for x, _ in data)


# ---------------------------------------------------------------------------- 1. the late bug
def test_late_bug_alerts_after_crossing_on_every_channel(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gradwatch")
    model = make_model(fixed=False)
    data = list(batches(STEPS))
    collected = []
    watch = GradWatch(model, loss_fn, every=EVERY, log_dir=str(tmp_path), on_alert=collected.append)
    reports = train(model, watch, STEPS, data=data)
    watch.close()

    assert sorted(reports) == list(range(0, STEPS, EVERY))
    assert first_layer_input_max(model, data) > 3  # the crossing really happened
    assert watch.alerts, "no alert after the activation inputs crossed |x| = 3"
    assert all(a.step > SCALE_AT for a in watch.alerts), [(a.step, a.tensor, a.kind) for a in watch.alerts]
    first_checks_after = [s for s in sorted(reports) if s > SCALE_AT][:2]
    # one alert names the activation's module, the first layer (upstream of it) listed under it (issue 73: it was an
    # alert on each of the first layer's tensors)
    hits = [a for a in watch.alerts if "0.weight" in a.tensors and a.kind in ("threshold", "drift")]
    assert hits
    assert hits[0].step in first_checks_after
    assert hits[0].tensor == "1"
    alert = hits[0]
    assert collected == watch.alerts  # on_alert got every alert, in order

    # Python logging
    logged = [r for r in caplog.records if r.name == "gradwatch" and r.levelno >= logging.WARNING]
    assert any(alert.message in r.getMessage() for r in logged)

    # JSONL
    records, warnings = read_jsonl(tmp_path)
    assert warnings == []
    jsonl_alerts = [r for r in records if r["type"] == "alert"]
    assert [(r["step"], r["tensor"], r["kind"]) for r in jsonl_alerts] == [
        (a.step, a.tensor, a.kind) for a in watch.alerts
    ]
    assert jsonl_alerts[watch.alerts.index(alert)]["message"] == alert.message

    # TensorBoard text
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    texts = acc.Tensors("gradwatch/alerts/text_summary")
    decoded = [(e.step, e.tensor_proto.string_val[0].decode()) for e in texts]
    assert len(decoded) == len(watch.alerts)
    assert any(step == alert.step and "`1`" in text and alert.message in text for step, text in decoded)
    counts = {e.step: e.value for e in acc.Scalars("gradwatch/alerts/count")}
    assert counts[alert.step] >= 1 and all(v == 0 for s, v in counts.items() if s <= SCALE_AT)


def test_late_bug_raise_on_wrong_raises_after_logging(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="gradwatch")
    model = make_model(fixed=False)
    collected = []
    watch = GradWatch(model, loss_fn, every=EVERY, raise_on="wrong", log_dir=str(tmp_path), on_alert=collected.append)
    with pytest.raises(GradientDriftError) as info:
        train(model, watch, STEPS)
    watch.close()
    err = info.value
    assert err.alerts and all(a.kind == "threshold" and a.step > SCALE_AT for a in err.alerts)
    assert any("0.weight" in a.tensors for a in err.alerts)  # under the activation's one alert (issue 73)
    assert "raise_on='wrong'" in str(err)
    # everything was written before the raise
    for a in err.alerts:
        assert a in watch.alerts and a in collected
        assert any(a.message in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    records, _ = read_jsonl(tmp_path)
    assert {r["message"] for r in records if r["type"] == "alert"} >= {a.message for a in err.alerts}


# ---------------------------------------------------------------------------- 2. no false alarm
def test_correct_activation_no_alert_in_200_steps_with_dropout_batchnorm_l2(caplog):
    caplog.set_level(logging.WARNING, logger="gradwatch")
    model = make_model(fixed=True, batchnorm=True, dropout=0.3)
    watch = GradWatch(model, loss_fn, every=EVERY, coords=4, directions=2, regularizers={"l2": 1e-4})
    # the same run as the late bug (weights scaled up mid-run), but with the right backward; training's
    # loss has the objective's L2 term (the training part would see it missing otherwise)
    reports = train(model, watch, 200, scale_at=100, lr=0.05, weight_decay=0.0, l2=1e-4)
    watch.close()
    assert len(reports) == 200 // EVERY
    assert watch.alerts == []
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert all(r.ok for r in reports.values())
    assert all(r.terms.keys() == {"loss", "l2"} for r in reports.values())
    # both verdicts ran on every check: the live .grad (with dropout masks replayed) is the objective's
    names = {n for n, _ in model.named_parameters()}
    assert all(set(r.training) == names for r in reports.values())
    assert all(t.verdict is gradwatch.Verdict.EXCELLENT for r in reports.values() for t in r.training.values())
    assert set(watch.check_counts.values()) == {200 // EVERY}


# ---------------------------------------------------------------------------- 3. event files
DOCUMENTED_SCALARS = (
    "gradwatch/summary/rel_diff_median",
    "gradwatch/summary/rel_diff_p95",
    "gradwatch/summary/rel_diff_max",
    "gradwatch/alerts/count",
    "gradwatch/overhead/seconds",
    "gradwatch/overhead/fraction",
)


def test_manual_check_keeps_a_fixed_grid_but_resets_auto(tmp_path):
    model = make_model(fixed=True)
    data = list(batches(21))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fixed = GradWatch(model, loss_fn, every=5, coords=2, directions=1)
    scheduled = []
    for step in range(21):
        opt.zero_grad()
        loss_fn(model, data[step]).backward()
        if step == 7:
            assert fixed.check(data[step]) is not None  # on request, between scheduled checks
        if fixed.step(data[step]) is not None:
            scheduled.append(step)
        opt.step()
    assert scheduled == [0, 5, 10, 15, 20]

    auto = GradWatch(model, loss_fn, every="auto", coords=2, directions=1)
    auto.step(data[0])
    auto.check(data[1], global_step=6)
    assert auto.schedule.last_check_step == 6


def test_event_file_holds_documented_tags_with_jsonl_values(tmp_path):
    model = make_model(fixed=True)
    with GradWatch(model, loss_fn, every=3, log_dir=str(tmp_path)) as watch:
        train(model, watch, 10, scale_at=-1)
    assert len([f for f in os.listdir(tmp_path) if f.startswith("events.out.tfevents")]) == 1

    records, warnings = read_jsonl(tmp_path)
    assert warnings == []
    assert records[0]["type"] == "run" and records[0]["options"]["every"] == 3
    checks = {r["step"]: r for r in records if r["type"] == "check"}
    assert sorted(checks) == [0, 3, 6, 9]

    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = set(DOCUMENTED_SCALARS)
    for name, _ in model.named_parameters():
        for metric in ("rel_diff", "directional_rel_diff", "max_rel_error"):
            expected.add(f"gradwatch/{metric}/{name}")
    assert expected <= tags, expected - tags

    compared = 0
    for step, rec in checks.items():
        values = dict(scalars_from_check(rec))
        values["gradwatch/alerts/count"] = 0.0
        assert expected <= set(values)
        for tag in expected:
            [event] = [e for e in acc.Scalars(tag) if e.step == step]
            assert math.isclose(event.value, values[tag], rel_tol=1e-6, abs_tol=1e-30), (tag, step)
            compared += 1
        assert rec["tensors"].keys() == dict(model.named_parameters()).keys()
    assert compared == len(expected) * len(checks)
    assert all(e.value > 0 for e in acc.Scalars("gradwatch/overhead/fraction"))
    assert "custom_scalars__config__" in acc.Tags()["tensors"]
    assert len(acc.Tensors("custom_scalars__config__")) == 1


# ---------------------------------------------------------------------------- 5. resume
def _run_split(split_at, serialize, _unused=None):
    """Late-bug run; when ``split_at`` is set, the watch is saved and replaced by a new one there."""
    model = make_model(fixed=False)
    data = list(batches(STEPS))
    kwargs = dict(every=4, tensors_per_check=2, alert_cooldown=1)
    watch = GradWatch(model, loss_fn, **kwargs)
    if split_at is None:
        reports = train(model, watch, STEPS, data=data)
    else:
        reports = train(model, watch, split_at, data=data)
        state = watch.state_dict()
        watch.close()
        if serialize == "json":
            state = json.loads(json.dumps(state, allow_nan=False))
        else:
            buf = io.BytesIO()
            torch.save(state, buf)
            buf.seek(0)
            state = torch.load(buf, weights_only=True)
        watch = GradWatch(model, loss_fn, **kwargs)
        watch.load_state_dict(state)
        # the same optimizer state: plain SGD without momentum keeps none
        reports.update(train(model, watch, STEPS, start=split_at, data=data))
    watch.close()
    return watch, reports


@pytest.fixture(scope="module")
def uninterrupted():
    return _run_split(None, None, None)


@pytest.mark.parametrize("serialize, split_at", [("json", 22), ("torch", 34)])
def test_resumed_run_continues_as_if_uninterrupted(serialize, split_at, uninterrupted):
    """Split before the bug shows, or between its first alerts and their deduplicated repeats."""
    whole, whole_reports = uninterrupted
    split, split_reports = _run_split(split_at, serialize, None)
    assert sorted(split_reports) == sorted(whole_reports) == list(range(0, STEPS, 4))
    assert {s: sorted(r.tensors) for s, r in split_reports.items()} == {s: sorted(r.tensors) for s, r in whole_reports.items()}
    assert {s: r.seed for s, r in split_reports.items()} == {s: r.seed for s, r in whole_reports.items()}
    assert split.history == whole.history
    assert split.check_counts == whole.check_counts
    assert split.tracker.summary() == whole.tracker.summary()
    assert whole.alerts, "the late bug must raise alerts for this comparison to mean something"
    # one alert at the first check after the crossing, naming the activation's module with the first layer under it,
    # updated at the later checks (issue 73: it was a threshold alert on each tensor, then drift alerts)
    assert [(a.step, a.kind, a.tensor, a.tensors) for a in whole.alerts] == [(32, "threshold", "1", ["0.weight", "0.bias"])]
    assert [c["last_step"] for c in whole.tracker.causes] == [c["last_step"] for c in split.tracker.causes] == [40]
    assert [a.to_dict() for a in split.alerts] == [a.to_dict() for a in whole.alerts]
    assert all(isinstance(a.value, float) for a in split.alerts)
    assert split.state_dict()["checks"] == whole.state_dict()["checks"]
    assert split.schedule.last_check_step == whole.schedule.last_check_step


def test_resumed_alerts_keep_float_values_after_json():
    model = make_model(fixed=True)
    calls = {"n": 0}

    def flaky(m, b):
        calls["n"] += 1
        raise ValueError("boom")

    watch = GradWatch(model, flaky, every=1)
    assert watch.step(next(batches(1))) is None
    [alert] = watch.alerts
    assert alert.kind == "error" and math.isnan(alert.value)
    state = json.loads(json.dumps(watch.state_dict(), allow_nan=False))
    again = GradWatch(model, flaky, every=1)
    again.load_state_dict(state)
    assert isinstance(again.alerts[0].value, float) and math.isnan(again.alerts[0].value)


# ---------------------------------------------------------------------------- 6. configs
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_constructs_and_runs(path):
    model = make_model(fixed=True)
    watch = GradWatch.from_config(path, model=model, loss_fn=loss_fn, every=3)
    assert watch.config.every == 3
    reports = train(model, watch, 7, scale_at=-1)
    watch.close()
    assert sorted(reports) == [0, 3, 6]
    assert watch.alerts == []


def test_from_config_overrides_win_and_objects_pass_through():
    model = make_model(fixed=True)
    collected = []
    watch = GradWatch.from_config(ROOT / "configs" / "strict.yaml", model=model, loss_fn=loss_fn, every=3,
                                  coords=2, on_alert=collected.append)
    assert (watch.config.every, watch.config.coords, watch.config.raise_on) == (3, 2, "suspicious")
    assert watch.on_alert is not None
    with pytest.raises(gradwatch.ConfigError, match="evry"):
        GradWatch.from_config(ROOT / "configs" / "strict.yaml", model=model, loss_fn=loss_fn, evry=3)


# ---------------------------------------------------------------------------- 7. schedule and rotation
def test_every_n_checks_at_deterministic_steps():
    model = make_model(fixed=True)
    with GradWatch(model, loss_fn, every=4) as watch:
        reports = train(model, watch, 13, scale_at=-1)
    assert sorted(reports) == [0, 4, 8, 12]


def test_rotation_covers_every_tensor_before_any_third_check():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    assert len(list(model.parameters())) == 6
    batch = (torch.randn(8, 3), torch.randint(0, 2, (8,)))
    watch = GradWatch(model, loss_fn, every=1, tensors_per_check=2, coords=2, directions=1)
    seeds, seen = [], []
    for i in range(9):
        report = watch.step(batch)
        assert len(report.tensors) == 2
        seeds.append(report.seed)
        seen.append(sorted(report.tensors))
        cov = watch.check_counts
        assert max(cov.values()) - min(cov.values()) <= 1, (i, cov)
    watch.close()
    assert len(set(seeds)) == len(seeds)  # a fresh sampling seed per check
    assert watch.check_counts == {n: 3 for n, _ in model.named_parameters()}
    assert sorted(sum(seen[:3], [])) == sorted(n for n, _ in model.named_parameters())


def test_auto_schedule_runs_first_step_and_then_spaces_checks():
    model = make_model(fixed=True)
    with GradWatch(model, loss_fn, every="auto", overhead_budget=0.01) as watch:
        reports = train(model, watch, 20, scale_at=-1)
    assert 0 in reports
    assert len(reports) < 20
    assert watch.schedule.interval() > 1


# ---------------------------------------------------------------------------- 8. errors keep training alive
def test_loss_fn_raising_during_check_is_an_error_alert_and_training_goes_on(caplog):
    caplog.set_level(logging.INFO, logger="gradwatch")
    model = make_model(fixed=True)
    broken = {"on": True}

    def check_loss(m, b):
        if broken["on"]:
            raise RuntimeError("shape mismatch in my loss")
        return loss_fn(m, b)

    collected = []
    watch = GradWatch(model, check_loss, every=2, on_alert=collected.append)
    data = list(batches(6))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    results = []
    for step, batch in enumerate(data):
        if step == 3:
            broken["on"] = False
        opt.zero_grad()
        loss_fn(model, batch).backward()
        results.append(watch.step(batch))
        opt.step()
    watch.close()
    assert results[0] is None and results[2] is None  # the checks raised
    assert results[4] is not None and results[4].ok  # later checks work
    assert [(a.kind, a.tensor, a.severity) for a in watch.alerts] == [("error", "*", "error")]
    assert collected == watch.alerts
    assert "RuntimeError: shape mismatch in my loss" in watch.alerts[0].message
    assert "(in loss_fn)" in watch.alerts[0].message  # raised in the training part's replay, named all the same
    text = caplog.text
    assert "Traceback" in text
    assert "shape mismatch in my loss" in text
    assert "training goes on" in text


def test_regularizer_raising_in_a_check_is_named_in_the_alert():
    model = make_model(fixed=True)

    def l2(m):
        raise KeyError("no such parameter: 'encoder.weight'")

    watch = GradWatch(model, loss_fn, regularizers={"l2": l2}, every=1, log_dir=None)
    batch = next(iter(batches(1)))
    loss_fn(model, batch).backward()  # training's own loss; the check's objective adds the broken term
    assert watch.step(batch) is None
    watch.close()
    assert [(a.kind, a.severity) for a in watch.alerts] == [("error", "error")]
    assert "(in regularizer 'l2')" in watch.alerts[0].message and "encoder.weight" in watch.alerts[0].message


def test_on_alert_raising_is_logged_and_training_goes_on(caplog, buggy_sigmoid):
    caplog.set_level(logging.INFO, logger="gradwatch")

    class Sig(nn.Module):
        def forward(self, x):
            return buggy_sigmoid.apply(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Sig(), nn.Linear(6, 3))
    calls = []

    def on_alert(alert):
        calls.append(alert)
        raise KeyError("my alert handler is broken")

    watch = GradWatch(model, loss_fn, every=1, alert_cooldown=0, on_alert=on_alert)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reports = []
    for batch in batches(3):
        opt.zero_grad()
        loss_fn(model, batch).backward()
        reports.append(watch.step(batch))
        opt.step()
    watch.close()
    assert all(r is not None and not r.ok for r in reports)
    assert calls and calls == watch.alerts
    assert any("0.weight" in a.tensors and a.kind == "threshold" for a in calls)  # under its module's alert (issue 73)
    assert "on_alert callback raised" in caplog.text and "my alert handler is broken" in caplog.text


def test_step_leaves_training_untouched():
    """A check changes no parameter, gradient, buffer or RNG stream of the live run."""
    model = make_model(fixed=True, batchnorm=True, dropout=0.5)
    batch = next(batches(1))
    loss_fn(model, batch).backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    with GradWatch(model, loss_fn, every=1) as watch:
        assert watch.step(batch) is not None
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    assert model.training and model[3].training


def test_a_state_from_a_newer_gradwatch_is_refused_with_its_version():
    from gradwatch.errors import GradWatchError
    from gradwatch.io.runs import RunNotFound
    from gradwatch.parallel.coordinator import DistributedCheckError

    model = nn.Linear(3, 1)
    watch = GradWatch(model, lambda m, b: m(b).sum(), log_dir=None, every=1)
    state = watch.state_dict()
    watch.load_state_dict(state)  # its own version loads
    with pytest.raises(ValueError, match="version 99"):
        watch.load_state_dict({**state, "version": 99})
    watch.close()
    assert issubclass(DistributedCheckError, GradWatchError) and issubclass(RunNotFound, GradWatchError)
