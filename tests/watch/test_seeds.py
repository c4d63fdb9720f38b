"""The seeds' own cases: the tutorial's two-layer NumPy net and sigmoid, the chapter's x^2 + 3x."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradwatch

# ---- the tutorial's code, copied ------------------------------------------------


class BrokenTwoLayerNet:
    def __init__(self, input_size, hidden_size, output_size, std=1e-4):
        self.params = {}
        self.params['W1'] = std * np.random.randn(input_size, hidden_size)
        self.params['b1'] = np.zeros(hidden_size)
        self.params['W2'] = std * np.random.randn(hidden_size, output_size)
        self.params['b2'] = np.zeros(output_size)

    def loss(self, X, y=None):
        W1, b1 = self.params['W1'], self.params['b1']
        W2, b2 = self.params['W2'], self.params['b2']
        N, D = X.shape

        # --- Forward Pass ---
        h1_score = X.dot(W1) + b1
        h1 = np.maximum(0, h1_score)  # ReLU
        scores = h1.dot(W2) + b2

        if y is None:
            return scores

        # Softmax Loss
        exp_scores = np.exp(scores)
        probs = exp_scores / np.sum(exp_scores, axis=1, keepdims=True)
        correct_logprobs = -np.log(probs[range(N), y])
        loss = np.sum(correct_logprobs) / N

        # --- Backward Pass ---
        grads = {}
        dscores = probs
        dscores[range(N), y] -= 1
        dscores /= N

        grads['W2'] = h1.T.dot(dscores)
        grads['b2'] = np.sum(dscores, axis=0)

        dhidden = dscores.dot(W2.T)
        dhidden[h1 <= 0] = 0

        # BUG IS LIKELY HERE
        grads['W1'] = X.T.dot(dhidden) * 2.0  # <--- Suspicious multiplication?
        grads['b1'] = np.sum(dhidden, axis=0)

        return loss, grads


class FixedTwoLayerNet(BrokenTwoLayerNet):
    def loss(self, X, y=None):
        W1, b1 = self.params['W1'], self.params['b1']
        W2, b2 = self.params['W2'], self.params['b2']
        N, D = X.shape

        h1_score = X.dot(W1) + b1
        h1 = np.maximum(0, h1_score)
        scores = h1.dot(W2) + b2

        if y is None:
            return scores

        exp_scores = np.exp(scores)
        probs = exp_scores / np.sum(exp_scores, axis=1, keepdims=True)
        correct_logprobs = -np.log(probs[range(N), y])
        loss = np.sum(correct_logprobs) / N

        grads = {}
        dscores = probs
        dscores[range(N), y] -= 1
        dscores /= N

        grads['W2'] = h1.T.dot(dscores)
        grads['b2'] = np.sum(dscores, axis=0)

        dhidden = dscores.dot(W2.T)
        dhidden[h1 <= 0] = 0

        # FIXED LINE:
        grads['W1'] = X.T.dot(dhidden)  # Removed * 2.0
        grads['b1'] = np.sum(dhidden, axis=0)

        return loss, grads


input_size = 4
hidden_size = 10
num_classes = 3
num_inputs = 5


def init_toy_model():
    np.random.seed(0)
    return BrokenTwoLayerNet(input_size, hidden_size, num_classes, std=1e-1)


def init_toy_data():
    np.random.seed(1)
    X = 10 * np.random.randn(num_inputs, input_size)
    y = np.array([0, 1, 2, 2, 1])
    return X, y


# ---- tests ----------------------------------------------------------------------


def test_broken_net_fails_on_w1_only_with_2x_diagnosis():
    net = init_toy_model()
    X, y = init_toy_data()
    before = {k: v.copy() for k, v in net.params.items()}
    loss, grads = net.loss(X, y)

    report = gradwatch.check_numpy(lambda: net.loss(X, y)[0], net.params, grads)

    assert not report.ok
    assert [t.name for t in report.failures] == ["W1"]
    assert report.tensors["W1"].verdict is gradwatch.Verdict.WRONG
    assert "2.00x" in report.tensors["W1"].diagnosis
    # the tutorial's numbers: W1 max relative error 3.33e-01, the others tiny
    assert report.tensors["W1"].max_rel_error == pytest.approx(1 / 3, rel=1e-3)
    for name in ("b1", "W2", "b2"):
        assert not report.tensors[name].failed
        assert report.tensors[name].max_rel_error < 1e-7
    assert "2.00x" in str(report)
    # the arrays the net reads were perturbed in place and restored bit for bit
    for k in before:
        assert np.array_equal(net.params[k], before[k])
    with pytest.raises(gradwatch.GradientCheckError, match="W1"):
        report.raise_for_failures()


def test_fixed_net_passes_below_1e_7():
    net = init_toy_model()
    X, y = init_toy_data()
    net_fixed = FixedTwoLayerNet(input_size, hidden_size, num_classes, std=1e-1)
    net_fixed.params = net.params  # as in the tutorial
    loss, grads_fixed = net_fixed.loss(X, y)

    report = gradwatch.check_numpy(lambda: net_fixed.loss(X, y)[0], net_fixed.params, grads_fixed)

    assert report.ok, str(report)
    assert set(report.tensors) == {"W1", "b1", "W2", "b2"}
    for t in report.tensors.values():
        assert t.rel_diff < 1e-7, (t.name, t.rel_diff)
        assert t.max_rel_error < 1e-7, (t.name, t.max_rel_error)
        assert t.verdict is gradwatch.Verdict.EXCELLENT
        assert t.diagnosis is None


def test_loss_fn_taking_params_and_tensors_option():
    net = init_toy_model()
    X, y = init_toy_data()
    _, grads = net.loss(X, y)
    report = gradwatch.check_numpy(lambda params: net.loss(X, y)[0], net.params, grads, tensors=["W*"])
    assert set(report.tensors) == {"W1", "W2"}
    assert [t.name for t in report.failures] == ["W1"]


def test_buggy_sigmoid_raises_naming_x0(buggy_sigmoid):
    torch.manual_seed(0)
    x = torch.randn(5, dtype=torch.float64)
    gy = torch.randn(5, dtype=torch.float64)
    with pytest.raises(gradwatch.GradientCheckError) as info:
        gradwatch.check_backward(buggy_sigmoid.apply, x, gy)
    msg = str(info.value)
    assert "x[0]" in msg
    assert "numeric" in msg and "analytic" in msg
    # float64: the tight default
    assert "eps=0.001" in msg
    assert "atol=1e-06" in msg
    assert "rtol=0.0001" in msg
    report = info.value.report
    assert report.tensors["x[0]"].failed
    # the analytic values shown are the buggy s*(1+s)*gy, the numeric ones the true derivative
    s = torch.sigmoid(x)
    assert np.allclose(report.tensors["x[0]"].analytic, (s * (1 + s) * gy).numpy(), rtol=1e-6)
    assert np.allclose(report.tensors["x[0]"].numeric, (s * (1 - s) * gy).numpy(), rtol=1e-5)


def test_correct_sigmoid_passes(correct_sigmoid):
    torch.manual_seed(0)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(5, dtype=torch.float64)
    report = gradwatch.check_backward(correct_sigmoid.apply, x, gy)
    assert report.ok
    assert not report.tensors["x[0]"].failed
    assert report.tensors["x[0]"].rel_diff < 1e-6
    assert x.grad is None  # the user's tensor is not touched


def test_buggy_sigmoid_on_float32_data_with_float64_numerics(buggy_sigmoid, correct_sigmoid):
    rng = np.random.RandomState(0)
    x = rng.randn(3, 4).astype(np.float32)
    gy = rng.randn(3, 4).astype(np.float32)
    gradwatch.check_backward(correct_sigmoid.apply, x, gy, dtype=torch.float64)
    with pytest.raises(gradwatch.GradientCheckError, match=r"x\[0\]"):
        gradwatch.check_backward(buggy_sigmoid.apply, x, gy, dtype=torch.float64)


def test_chapter_x_squared_plus_3x_at_2():
    x = np.array([2.0])
    g = gradwatch.numerical_grad(lambda: x[0] ** 2 + 3 * x[0], x, eps=1e-3)
    assert g[0] == pytest.approx(7.0, abs=1e-9)
    # torch tensor, default step
    xt = torch.tensor([2.0], dtype=torch.float64)
    gt = gradwatch.numerical_grad(lambda: xt ** 2 + 3 * xt, xt)
    assert float(gt[0]) == pytest.approx(7.0, abs=1e-8)
    assert float(xt[0]) == 2.0


def test_tutorial_square_func():
    x = np.array([5.0])
    g = gradwatch.numerical_grad(lambda: np.sum(x ** 2), x, eps=1e-5)
    assert g[0] == pytest.approx(10.0, abs=1e-6)
