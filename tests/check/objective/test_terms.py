"""The check objective includes every regularization term: L2 in NumPy nets, regularizers, weight decay."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from gradwatch import check_model, check_numpy

# ---- NumPy: an L2 term in the loss that the hand-written gradient forgets -----------------


class L2TwoLayerNet:
    """Softmax two-layer net with ``0.5 * reg * (||W1||^2 + ||W2||^2)`` in the loss (cs231n style)."""

    def __init__(self, reg: float, grad_includes_reg: bool, seed: int = 0):
        rng = np.random.RandomState(seed)
        self.params = {
            "W1": 0.5 * rng.randn(4, 6),
            "b1": 0.1 * rng.randn(6),
            "W2": 0.5 * rng.randn(6, 3),
            "b2": 0.1 * rng.randn(3),
        }
        self.reg = reg
        self.grad_includes_reg = grad_includes_reg

    def data_loss(self, X, y):
        p = self.params
        h = np.tanh(X.dot(p["W1"]) + p["b1"])
        scores = h.dot(p["W2"]) + p["b2"]
        scores = scores - scores.max(axis=1, keepdims=True)
        probs = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
        return -np.log(probs[range(len(y)), y]).mean(), (h, probs)

    def reg_loss(self):
        return 0.5 * self.reg * (np.sum(self.params["W1"] ** 2) + np.sum(self.params["W2"] ** 2))

    def loss(self, X, y):
        p = self.params
        data, (h, probs) = self.data_loss(X, y)
        loss = data + self.reg_loss()
        N = len(y)
        dscores = probs.copy()
        dscores[range(N), y] -= 1
        dscores /= N
        grads = {"W2": h.T.dot(dscores), "b2": dscores.sum(0)}
        dh = dscores.dot(p["W2"].T) * (1 - h ** 2)
        grads["W1"] = X.T.dot(dh)
        grads["b1"] = dh.sum(0)
        if self.grad_includes_reg:
            grads["W1"] += self.reg * p["W1"]
            grads["W2"] += self.reg * p["W2"]
        return loss, grads


def _data(seed=1):
    rng = np.random.RandomState(seed)
    return rng.randn(10, 4), rng.randint(0, 3, 10)


@pytest.mark.parametrize("reg", [0.05, 0.5])
def test_numpy_l2_forgotten_in_gradient_flags_the_weights(reg):
    X, y = _data()
    net = L2TwoLayerNet(reg, grad_includes_reg=False)
    _, grads = net.loss(X, y)
    report = check_numpy(lambda: net.loss(X, y)[0], net.params, grads)
    assert not report.ok
    assert {t.name for t in report.failures} == {"W1", "W2"}
    for name in ("W1", "W2"):
        assert report.tensors[name].diagnosis
    assert not report.tensors["b1"].failed and not report.tensors["b2"].failed


@pytest.mark.parametrize("reg", [0.05, 0.5])
def test_numpy_l2_added_to_gradient_passes(reg):
    X, y = _data()
    net = L2TwoLayerNet(reg, grad_includes_reg=True)
    _, grads = net.loss(X, y)
    report = check_numpy(lambda: net.loss(X, y)[0], net.params, grads)
    assert report.ok, str(report)
    assert all(t.rel_diff < 1e-7 for t in report.tensors.values())


def test_numpy_regularizers_argument_adds_the_term():
    """``loss_fn`` gives the data loss only; the L2 term comes in through ``regularizers``."""
    X, y = _data()
    net = L2TwoLayerNet(0.5, grad_includes_reg=True)
    _, grads = net.loss(X, y)
    data_only = check_numpy(lambda: net.data_loss(X, y)[0], net.params, grads)
    assert {t.name for t in data_only.failures} == {"W1", "W2"}
    report = check_numpy(lambda: net.data_loss(X, y)[0], net.params, grads,
                         regularizers={"l2": lambda p: net.reg_loss()})
    assert report.ok, str(report)
    assert set(report.terms) == {"loss", "l2"}
    assert report.terms["l2"] == pytest.approx(net.reg_loss())
    assert report.objective == pytest.approx(net.data_loss(X, y)[0] + net.reg_loss())


# ---- torch: regularizers and weight decay in check_model ---------------------------------


def mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def hand_grad(l2: float = 0.0):
    """Hand-written gradient of ``mse`` (+ ``l2 * ||p||^2`` when ``l2`` is given)."""

    def grad_fn(model, batch):
        x, y = batch
        r = model(x) - y
        n = r.numel()
        return {
            "weight": (2.0 / n) * r.t() @ x + 2 * l2 * model.weight,
            "bias": (2.0 / n) * r.sum(0) + 2 * l2 * model.bias,
        }

    return grad_fn


@pytest.fixture
def linear():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.mul_(4.0)
    batch = (torch.randn(10, 3), torch.randn(10, 1))
    return model, batch


def test_regularizers_l2_is_a_term_of_the_objective(linear):
    model, batch = linear
    report = check_model(model, mse, batch, regularizers={"l2": 1e-3})
    assert report.ok
    assert set(report.terms) == {"loss", "l2"}
    expected_l2 = 1e-3 * sum(float(p.detach().double().pow(2).sum()) for p in model.parameters())
    assert report.terms["l2"] == pytest.approx(expected_l2, rel=1e-9)
    assert report.objective == pytest.approx(report.terms["loss"] + report.terms["l2"], rel=1e-12)


def test_hand_gradient_missing_the_regularizer_fails(linear):
    model, batch = linear
    bad = check_model(model, mse, batch, regularizers={"l2": 0.1}, grad_fn=hand_grad(0.0))
    assert "weight" in {t.name for t in bad.failures}
    good = check_model(model, mse, batch, regularizers={"l2": 0.1}, grad_fn=hand_grad(0.1))
    assert good.ok, str(good)
    # a callable regularizer works the same way
    good = check_model(model, mse, batch, grad_fn=hand_grad(0.1),
                       regularizers={"mine": lambda m: 0.1 * sum(p.pow(2).sum() for p in m.parameters())})
    assert good.ok and "mine" in good.terms


def test_sgd_weight_decay_is_taken_from_the_optimizer(linear):
    model, batch = linear
    wd = 0.2
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=wd)
    report = check_model(model, mse, batch, optimizer=opt)
    assert report.ok
    assert set(report.terms) == {"loss", "weight_decay"}
    expected = 0.5 * wd * sum(float(p.detach().double().pow(2).sum()) for p in model.parameters())
    assert report.terms["weight_decay"] == pytest.approx(expected, rel=1e-9)
    # a hand gradient without the decay fails; with wd * p (what SGD adds) it passes
    assert not check_model(model, mse, batch, optimizer=opt, grad_fn=hand_grad(0.0)).ok
    assert check_model(model, mse, batch, optimizer=opt, grad_fn=hand_grad(wd / 2)).ok


def test_weight_decay_per_param_group(linear):
    model, batch = linear
    opt = torch.optim.SGD([{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias]}], lr=0.1)
    report = check_model(model, mse, batch, optimizer=opt)
    expected = 0.5 * 0.1 * float(model.weight.detach().double().pow(2).sum())
    assert report.terms["weight_decay"] == pytest.approx(expected, rel=1e-9)


def test_per_term_checks(linear):
    model, batch = linear
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01)
    report = check_model(model, mse, batch, regularizers={"l2": 1e-3}, optimizer=opt, per_term=True)
    assert report.ok
    assert set(report.term_checks) == {"loss", "l2", "weight_decay"}
    for term, checks in report.term_checks.items():
        assert set(checks) == {"weight", "bias"}, term
        for t in checks.values():
            assert not t.failed and t.verdict is not None
    # the l2 term's own slopes are 2 * coef * p at the sampled coordinates
    w = model.weight.detach().double()
    l2w = report.term_checks["l2"]["weight"]
    for idx, a, n in zip(l2w.coords, l2w.analytic, l2w.numeric):
        assert a == pytest.approx(2e-3 * float(w[idx]), rel=1e-9)
        assert n == pytest.approx(2e-3 * float(w[idx]), rel=1e-5)
    assert "l2" in json.loads(json.dumps(report.to_dict()))["term_checks"]


def test_adamw_decoupled_decay_is_left_out_with_a_warning(linear):
    model, batch = linear
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    with pytest.warns(UserWarning, match="decoupled weight decay"):
        report = check_model(model, mse, batch, optimizer=opt)
    assert report.ok
    assert "weight_decay" not in report.terms
    assert any("decoupled" in note and "AdamW" in note for note in report.notes)
    assert "decoupled" in str(report)


def test_adam_coupled_weight_decay_is_included(linear):
    model, batch = linear
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = check_model(model, mse, batch, optimizer=opt)
    assert "weight_decay" in report.terms and report.notes == []
