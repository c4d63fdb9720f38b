"""Hostile inputs: each one gets a clear message, and training goes on when it can."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import batch, mlp, mse
from torch import nn

from gradwatch import ConfigError, GradWatch, load_config
from gradwatch.io.sinks import read_jsonl


def train(model, watch, loss_fn, batches):
    """A plain SGD loop; returns the reports (None when no check ran or it was skipped)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reports = []
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(model, b)
        if torch.isfinite(loss).all():
            loss.sum().backward()
        reports.append(watch.step(b))
        opt.step()
    return reports


# ---------------------------------------------------------------- losses


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
def test_nonfinite_loss_alerts_and_training_continues(bad, dtype):
    model = mlp()
    watch = GradWatch(model, mse, every=1, log_dir=None, coords=2, directions=1, dtype=dtype)
    x, y = batch()
    reports = train(model, watch, mse, [(x * bad, y), (x, y)])
    first, second = reports
    assert first is not None
    assert first.nonfinite
    assert not first.ok
    assert all(t.verdict is None and "not finite" in t.inconclusive for t in first.tensors.values())
    nonfinite = [a for a in watch.alerts if a.kind == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0].severity == "error"
    assert "not finite" in nonfinite[0].message and "loss = " in nonfinite[0].message
    assert second is not None and second.ok  # the next check runs and passes
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_non_scalar_loss_names_the_shape(caplog):
    model = mlp()
    watch = GradWatch(model, lambda m, b: m(b[0]), every=1, log_dir=None, coords=2)
    with caplog.at_level(logging.ERROR, logger="gradwatch"):
        reports = train(model, watch, mse, [batch(), batch()])
    assert reports == [None, None]  # skipped, training went on
    assert watch.alerts and watch.alerts[0].kind == "error"
    msg = watch.alerts[0].message
    assert "must return a scalar" in msg
    assert "(6, 1)" in msg
    assert "training continues" in msg
    assert "(6, 1)" in caplog.text


def test_loss_fn_that_raises_is_an_error_alert_and_training_continues():
    batches = [batch(), batch()]

    def flaky(model, b):  # the first batch lacks what loss_fn looks for: every evaluation of it raises
        if b is batches[0]:
            raise KeyError("'labels' not in batch")
        return mse(model, b)

    model = mlp()
    watch = GradWatch(model, flaky, every=1, log_dir=None, coords=2)
    reports = train(model, watch, mse, batches)
    assert reports[0] is None
    assert reports[1] is not None
    assert reports[1].ok
    (alert,) = watch.alerts
    assert alert.kind == "error" and alert.tensor == "*"
    assert "KeyError" in alert.message and "labels" in alert.message


def test_loss_fn_raising_with_raise_on_still_does_not_kill_training():
    model = mlp()

    def boom(m, b):
        raise RuntimeError("boom")

    watch = GradWatch(model, boom, every=1, log_dir=None, raise_on="wrong")
    assert train(model, watch, mse, [batch()]) == [None]
    assert watch.alerts[0].kind == "error"


@pytest.mark.parametrize("where", ["tracker", "record"])
def test_gradwatch_raising_after_its_check_is_an_error_alert_and_never_reaches_training(where, monkeypatch, tmp_path):
    # a bug of gradwatch's own after the check (its trends, its record): injected, since none is known to raise
    from gradwatch.watch import runner, trend

    def broken(*args, **kwargs):
        raise IndexError(f"injected: {where} broke")

    if where == "tracker":
        monkeypatch.setattr(trend.TrendTracker, "update", broken)
    else:
        monkeypatch.setattr(runner, "check_record", broken)
    model, plain = mlp(), mlp()
    plain.load_state_dict(model.state_dict())
    watch = GradWatch(model, mse, every=1, log_dir=tmp_path, coords=2, raise_on="wrong")
    batches = [batch(), batch()]
    assert train(model, watch, mse, batches[:1]) == [None]  # the check's report is not given: its recording failed
    errors = [a for a in watch.alerts if a.kind == "error"]
    assert len(errors) == 1
    assert "IndexError" in errors[0].message
    assert f"injected: {where} broke" in errors[0].message
    monkeypatch.undo()
    (report,) = train(model, watch, mse, batches[1:])
    assert report is not None and report.ok  # the next check runs and is recorded
    train(plain, GradWatch(plain, mse, every=1000, log_dir=None), mse, batches)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))  # training as unwatched
    records, _ = read_jsonl(tmp_path / "checks.jsonl")
    assert [r["step"] for r in records if r["type"] == "check"] == [1], records  # the failed check: an alert record
    assert any(r["type"] == "alert" and r["kind"] == "error" and r["step"] == 0 for r in records), records


def test_empty_batch_is_reported_not_raised():
    model = mlp()
    watch = GradWatch(model, mse, every=1, log_dir=None, coords=2)
    x, y = batch()
    reports = train(model, watch, mse, [(x[:0], y[:0]), (x, y)])
    assert reports[0] is None or not reports[0].ok
    assert watch.alerts and "step 0" in watch.alerts[0].message
    assert reports[1] is not None and reports[1].ok


# ---------------------------------------------------------------- parameters


class Tricky(nn.Module):
    """Frozen layer, integer parameter and buffer, and an embedding tied to the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.offsets = nn.Parameter(torch.tensor([1, 2]), requires_grad=False)

    def forward(self, idx):
        self.steps += 1
        return self.out(torch.tanh(self.frozen(self.emb(idx)))) + 0 * self.offsets.sum()


@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
def test_frozen_integer_and_tied_parameters(dtype):
    torch.manual_seed(0)
    model = Tricky()
    fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    frozen_before = {n: p.clone() for n, p in model.frozen.named_parameters()}
    watch = GradWatch(model, fn, every=1, log_dir=None, coords=4, directions=2, dtype=dtype)
    batches = [(torch.randint(0, 5, (6,)), torch.randint(0, 5, (6,))) for _ in range(3)]
    reports = train(model, watch, fn, batches)
    assert all(r is not None and r.ok for r in reports), [str(r) for r in reports]
    assert list(reports[0].tensors) == ["emb.weight"]  # tied: once; frozen and integer: not checked
    assert watch.check_counts == {"emb.weight": 3}
    assert int(model.steps) == 3  # only the training forwards counted; checks put the buffer back
    assert model.offsets.dtype == torch.long
    for n, p in model.frozen.named_parameters():
        assert torch.equal(p, frozen_before[n])
    assert model.out.weight is model.emb.weight


def test_all_parameters_frozen_fails_at_construction():
    model = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable floating-point parameters"):
        GradWatch(model, mse)


@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
def test_parameters_that_change_shape_between_checks(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    watch = GradWatch(model, mse, every=1, log_dir=None, coords=3, directions=1, dtype=dtype)
    assert train(model, watch, mse, [batch()])[0].ok
    model[0] = nn.Linear(3, 7)  # grown: same names, new shapes
    model[2] = nn.Linear(7, 1)
    report = train(model, watch, mse, [batch()])[0]
    assert report is not None and report.ok
    assert report.tensors["0.weight"].shape == (7, 3)
    assert watch.alerts == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
def test_parameters_on_different_devices(dtype):
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 4).cuda()
            self.b = nn.Linear(4, 1)  # stays on the CPU

        def forward(self, x):
            return self.b(torch.tanh(self.a(x.cuda())).cpu())

    torch.manual_seed(0)
    model = Split()
    watch = GradWatch(model, mse, every=1, log_dir=None, coords=3, directions=1, dtype=dtype)
    reports = train(model, watch, mse, [batch(), batch()])
    assert all(r is not None and r.ok for r in reports)
    assert model.a.weight.device.type == "cuda" and model.b.weight.device.type == "cpu"


# ---------------------------------------------------------------- batch types


@dataclasses.dataclass
class DataBatch:
    x: torch.Tensor
    y: torch.Tensor


class CustomBatch:
    def __init__(self, x, y):
        self.x, self.y = x, y


Pair = collections.namedtuple("Pair", "x y")


def _get(b, key):
    if isinstance(b, dict):
        return b[key]
    if hasattr(b, key):
        return getattr(b, key)
    return b[0 if key == "x" else 1]


@pytest.mark.parametrize("kind", ["dict", "tuple", "list", "namedtuple", "dataclass", "custom"])
@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
def test_batch_types_reach_loss_fn_with_their_type(kind, dtype):
    x, y = batch()
    the_batch = {
        "dict": {"x": x, "y": y},
        "tuple": (x, y),
        "list": [x, y],
        "namedtuple": Pair(x, y),
        "dataclass": DataBatch(x, y),
        "custom": CustomBatch(x, y),
    }[kind]
    seen = []

    def fn(model, b):
        seen.append(b)
        return F.mse_loss(model(_get(b, "x")), _get(b, "y"))

    model = mlp()
    watch = GradWatch(model, fn, every=1, log_dir=None, coords=2, directions=1, dtype=dtype)
    report = train(model, watch, fn, [the_batch])[0]
    assert report is not None and report.ok
    assert {type(b) for b in seen} == {type(the_batch)}
    if dtype is None or kind == "custom":
        assert all(b is the_batch for b in seen)  # untouched: the very object
    else:
        cast = [b for b in seen if b is not the_batch]
        assert cast and all(_get(b, "x").dtype == torch.float64 for b in cast)
    assert _get(the_batch, "x").dtype == torch.float32  # the caller's batch is never modified


# ---------------------------------------------------------------- configuration


def test_every_zero_is_a_config_error():
    with pytest.raises(ConfigError, match=r"every: got 0, expected an integer >= 1 or 'auto'"):
        GradWatch(mlp(), mse, every=0)


@pytest.mark.parametrize("value", ["sometimes", "excellent", 3])
def test_invalid_raise_on_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"raise_on: got .*expected 'off' \(never\), 'wrong' or 'suspicious'"):
        GradWatch(mlp(), mse, raise_on=value)


def test_unknown_option_is_a_config_error():
    with pytest.raises(ConfigError, match="did you mean 'every'"):
        GradWatch(mlp(), mse, evry=5)


@pytest.mark.parametrize("text, kind", [("- every: 5\n- coords: 2\n", "list"), ("just a string\n", "str"), ("42\n", "int")])
def test_yaml_that_is_not_a_mapping(tmp_path, text, kind):
    path = tmp_path / "gw.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"gw.yaml: expected a mapping of option: value at the top level, got {kind}"):
        load_config(path)
    with pytest.raises(ConfigError, match="expected a mapping"):
        GradWatch.from_config(path, model=mlp(), loss_fn=mse)


def test_read_jsonl_skips_garbage_lines(tmp_path):
    good = [{"type": "run"}, {"type": "check", "step": 0}, {"type": "check", "step": 10}]
    lines = [
        json.dumps(good[0]),
        "this is not json",
        json.dumps(good[1]),
        "[1, 2, 3]",
        "\x00\x01\xff garbage",
        "",
        json.dumps(good[2]),
        '{"type": "check", "st',  # truncated by a crash
    ]
    path = tmp_path / "checks.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape"))
    records, warnings = read_jsonl(tmp_path)
    assert records == good
    assert len(warnings) == 4
    assert "line 2: not valid JSON" in warnings[0]
    assert "line 4: expected a JSON object, got list" in warnings[1]
    assert "line 5: not valid JSON" in warnings[2]
    assert "line 8: truncated last line" in warnings[3]
    assert all(str(path) in w for w in warnings)


def test_read_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "nope.jsonl")
