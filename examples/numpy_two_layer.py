"""Find the bug in a hand-written NumPy backprop with ``gradwatch.check_numpy``.

The network is the gradient-checking tutorial's ``BrokenTwoLayerNet``: a
two-layer ReLU net with a softmax loss whose backward multiplies the ``W1``
gradient by 2. ``check_numpy`` perturbs the arrays the net reads in place
(two-sided differences at sampled coordinates and random directions),
restores them bit for bit, and reports per tensor: only ``W1`` fails, and the
diagnosis says "analytic is 2.00x numeric". The fixed net passes with every
relative difference below 1e-7.

    python examples/numpy_two_layer.py
"""

from __future__ import annotations

import numpy as np

import gradwatch


class BrokenTwoLayerNet:
    """The tutorial's net; ``fixed=True`` removes the ``* 2.0`` on the W1 gradient."""

    def __init__(self, input_size, hidden_size, output_size, std=1e-4, fixed=False):
        self.params = {
            "W1": std * np.random.randn(input_size, hidden_size),
            "b1": np.zeros(hidden_size),
            "W2": std * np.random.randn(hidden_size, output_size),
            "b2": np.zeros(output_size),
        }
        self.fixed = fixed

    def loss(self, X, y):
        W1, b1 = self.params["W1"], self.params["b1"]
        W2, b2 = self.params["W2"], self.params["b2"]
        N = X.shape[0]

        h1 = np.maximum(0, X.dot(W1) + b1)  # ReLU
        scores = h1.dot(W2) + b2
        exp_scores = np.exp(scores)
        probs = exp_scores / np.sum(exp_scores, axis=1, keepdims=True)
        loss = np.sum(-np.log(probs[range(N), y])) / N

        grads = {}
        dscores = probs
        dscores[range(N), y] -= 1
        dscores /= N
        grads["W2"] = h1.T.dot(dscores)
        grads["b2"] = np.sum(dscores, axis=0)
        dhidden = dscores.dot(W2.T)
        dhidden[h1 <= 0] = 0
        grads["W1"] = X.T.dot(dhidden) * (1.0 if self.fixed else 2.0)  # the bug
        grads["b1"] = np.sum(dhidden, axis=0)
        return loss, grads


def main() -> int:
    np.random.seed(0)
    net = BrokenTwoLayerNet(4, 10, 3, std=1e-1)
    np.random.seed(1)
    X = 10 * np.random.randn(5, 4)
    y = np.array([0, 1, 2, 2, 1])

    print("== broken net ==")
    _, grads = net.loss(X, y)
    report = gradwatch.check_numpy(lambda: net.loss(X, y)[0], net.params, grads)
    print(report)
    print("failing tensors:", ", ".join(t.name for t in report.failures))

    print()
    print("== fixed net (same weights) ==")
    fixed = BrokenTwoLayerNet(4, 10, 3, std=1e-1, fixed=True)
    fixed.params = net.params
    _, grads = fixed.loss(X, y)
    report_fixed = gradwatch.check_numpy(lambda: fixed.loss(X, y)[0], fixed.params, grads)
    print(report_fixed)
    worst = max(t.rel_diff for t in report_fixed.tensors.values())
    print(f"largest rel_diff: {worst:.2e}")

    caught = [t.name for t in report.failures] == ["W1"]
    return 0 if caught and report_fixed.ok and worst < 1e-7 else 1


if __name__ == "__main__":
    raise SystemExit(main())
