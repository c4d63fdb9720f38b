"""Test a custom ``torch.autograd.Function`` with ``gradwatch.check_backward``.

``BuggySigmoid`` is the tutorial's sigmoid whose backward uses
``s * (1 + s)`` instead of ``s * (1 - s)``. ``check_backward`` (Chainer's
semantics: inputs, ``y_grad``, ``eps``/``atol``/``rtol``) compares its
backward with two-sided numerical gradients and raises
``gradwatch.GradientCheckError`` naming the input ``x[0]`` with numeric vs
analytic values; ``CorrectSigmoid`` passes. The data are float32 (as in
training) and ``dtype=torch.float64`` runs the numerical side in double
precision.

    python examples/custom_function.py
"""

from __future__ import annotations

import numpy as np
import torch
from torch.autograd import Function

import gradwatch


class BuggySigmoid(Function):
    @staticmethod
    def forward(ctx, input):
        output = 1.0 / (1.0 + torch.exp(-input))
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        return output * (1.0 + output) * grad_output  # bug: should be (1 - output)


class CorrectSigmoid(Function):
    @staticmethod
    def forward(ctx, input):
        output = 1.0 / (1.0 + torch.exp(-input))
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        return output * (1.0 - output) * grad_output


def main() -> int:
    rng = np.random.RandomState(0)
    x = rng.randn(5).astype(np.float32)
    gy = rng.randn(5).astype(np.float32)

    print("== BuggySigmoid ==")
    caught = False
    try:
        gradwatch.check_backward(BuggySigmoid.apply, x, gy, dtype=torch.float64)
        print("not caught?!")
    except gradwatch.GradientCheckError as err:
        caught = True
        print("caught:", err)

    print()
    print("== CorrectSigmoid ==")
    report = gradwatch.check_backward(CorrectSigmoid.apply, x, gy, dtype=torch.float64)
    print("passed:")
    print(report)
    return 0 if caught and report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
