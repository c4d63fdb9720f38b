"""Reliability: a watched training run is bit-identical to an unwatched one.

Two runs of 300 steps from the same seed, one with GradWatch checking every
10 steps and one without, on a model with dropout, BatchNorm, an LSTM and SGD
with momentum and weight decay: final parameters, buffers, optimizer state and
the next values of the torch, numpy and ``random`` generators must be equal
bit for bit (``torch.equal``), in shadow mode, in place (``dtype=None``) and
under ``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

import random
from typing import Any, Dict, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch

STEPS = 300
EVERY = 10


class Net(nn.Module):
    """Dropout, BatchNorm and an LSTM: every source of hidden state a check could disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.3)
        self.lstm = nn.LSTM(6, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, time, 3)
        b, t, _ = x.shape
        h = self.embed(x).reshape(b * t, 6)
        h = self.drop(torch.tanh(self.bn(h))).reshape(b, t, 6)
        out, _ = self.lstm(h)
        return self.head(out[:, -1])


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _batch() -> tuple:
    # Drawn from all three generators, so a check that disturbed any of them changes the data.
    x = torch.randn(8, 4, 3) + float(np.random.randn()) * 0.01 + random.random() * 0.01
    y = torch.randint(0, 2, (8,))
    return x, y


def _train(watch_options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    watch = None
    if watch_options is not None:
        watch = GradWatch(model, loss_fn, optimizer=opt, every=EVERY, log_dir=None, coords=2, directions=1,
                          tensors_per_check=3, **watch_options)
    reports = 0
    for _ in range(STEPS):
        batch = _batch()
        opt.zero_grad()
        loss_fn(model, batch).backward()
        if watch is not None and watch.step(batch) is not None:
            reports += 1
        opt.step()
    if watch is not None:
        watch.close()
    state = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "opt": opt.state_dict(),
        "training": [m.training for m in model.modules()],
        "lstm_dropout": model.lstm.dropout,
        "next_torch": torch.rand(4),
        "next_numpy": np.random.rand(4),
        "next_random": [random.random() for _ in range(4)],
        "reports": reports,
        "alerts": [] if watch is None else [a.message for a in watch.alerts],
    }
    return state


def _assert_identical(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    for key in ("params", "grads", "buffers"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}[{name}] differs"
    oa, ob = a["opt"], b["opt"]
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for idx in oa["state"]:
        for k, v in oa["state"][idx].items():
            w = ob["state"][idx][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, f"optimizer state {idx}.{k} differs"
    assert a["training"] == b["training"] and a["lstm_dropout"] == b["lstm_dropout"]
    assert torch.equal(a["next_torch"], b["next_torch"]), "torch RNG stream differs"
    assert np.array_equal(a["next_numpy"], b["next_numpy"]), "numpy RNG stream differs"
    assert a["next_random"] == b["next_random"], "random RNG stream differs"


@pytest.fixture(scope="module")
def unwatched(one_thread) -> Dict[str, Any]:
    return _train(None)


@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
def test_watched_run_is_bit_identical(unwatched, dtype):
    watched = _train({"dtype": dtype})
    assert watched["reports"] == STEPS // EVERY
    assert watched["alerts"] == []
    _assert_identical(unwatched, watched)


@pytest.mark.slow
def test_bit_identical_under_deterministic_algorithms(unwatched):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        plain = _train(None)
        watched = _train({"dtype": None})
    finally:
        torch.use_deterministic_algorithms(before)
    assert watched["reports"] == STEPS // EVERY
    _assert_identical(plain, watched)
    _assert_identical(unwatched, plain)  # the flag changes nothing on CPU for these ops


def test_lstm_dropout_probability_restored_after_checks():
    torch.manual_seed(0)
    model = nn.LSTM(3, 4, num_layers=2, dropout=0.25, batch_first=True)
    fn = lambda m, b: m(b)[0].pow(2).mean()  # noqa: E731
    with GradWatch(model, fn, every=1, coords=2, directions=1, log_dir=None) as watch:
        for _ in range(3):
            x = torch.randn(2, 5, 3)
            model.zero_grad()
            fn(model, x).backward()
            assert watch.step(x) is not None
            assert model.dropout == 0.25 and model.training
