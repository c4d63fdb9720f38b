"""check_backward's isolating rows: a 1% error in ONE Jacobian element is caught whatever ``y_grad`` weighs it.

Besides ``<y_grad, outputs>``, every line is judged on one-hot cotangents (one per output element, up to 128 of
them) or on 128 random signed groups of output elements, from the same evaluations. Float64 checks default to
``atol=1e-6, rtol=1e-4`` (``check_double_backward``'s), others to Chainer's ``1e-5, 1e-4``.
"""

from __future__ import annotations

import pytest
import torch

import gradwatch.check.backward as backward
from gradwatch import GradientCheckError, check_backward
from gradwatch.check.backward import default_tolerances


def jacobian_off(fn, k, i, factor=0.01):
    """``fn`` whose Jacobian entry (output element ``k``, input element ``i``, flat) is ``factor`` off: the backward
    returns the true vector-Jacobian product plus ``factor * J[k, i] * gy[k]`` on input element ``i``."""

    class JacobianOff(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return fn(x).clone()

        @staticmethod
        def backward(ctx, gy):
            (x,) = ctx.saved_tensors
            x = x.detach().requires_grad_(True)
            with torch.enable_grad():
                y = fn(x)
                onehot = torch.zeros(y.numel(), dtype=y.dtype)
                onehot[k] = 1
                (row,) = torch.autograd.grad(y, x, onehot.reshape(y.shape), retain_graph=True)
                (grad,) = torch.autograd.grad(y, x, gy)
            grad = grad.contiguous().clone()
            grad.view(-1)[i] += factor * row.reshape(-1)[i] * gy.reshape(-1)[k]
            return grad

    return JacobianOff.apply


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_an_elementwise_error_under_a_small_y_grad_entry_names_the_output_element():
    x, gy = _randn(3, 4), _randn(3, 4, seed=1)
    gy[2, 3] = 1e-4  # the y_grad row sees 1% of tanh' * 1e-4: under 1e-6
    with pytest.raises(GradientCheckError) as info:
        check_backward(jacobian_off(torch.tanh, k=11, i=11), x, gy)
    msg = str(info.value)
    assert "at (2, 3) for output element (2, 3):" in msg
    assert "1 of 12 checked entries" in msg and "one-hot cotangents" in msg
    check_backward(torch.tanh, x, gy)  # the correct one passes with the same y_grad


def test_a_dense_error_under_a_small_y_grad_entry_names_the_output_element():
    a = _randn(5, 4, seed=2)
    matmul = lambda w: a @ w  # noqa: E731
    w, gy = _randn(4, 3, seed=3), _randn(5, 3, seed=4)
    gy[1, 1] = 1e-3
    # output (1, 1) = sum_j a[1, j] w[j, 1]: its entry at w[2, 1] (flat 7) is a[1, 2]
    with pytest.raises(GradientCheckError, match=r"at \(2, 1\) for output element \(1, 1\):") as info:
        check_backward(jacobian_off(matmul, k=4, i=7), w, gy)
    assert not info.value.report.ok
    check_backward(matmul, w, gy)


def test_an_error_among_many_outputs_is_found_in_its_random_group():
    a = _randn(20, 10, seed=5)  # 200 outputs: 128 random groups with random signs
    matmul = lambda w: a @ w  # noqa: E731
    w, gy = _randn(10, 10, seed=6), _randn(20, 10, seed=7)
    gy[3, 4] = 1e-4
    with pytest.raises(GradientCheckError, match=r"at \(6, 4\) for output group \d+ \([12] output elements"):
        check_backward(jacobian_off(matmul, k=3 * 10 + 4, i=6 * 10 + 4), w, gy)
    check_backward(matmul, w, gy)


def test_correct_functions_with_large_outputs_pass_at_the_float64_tolerances():
    x = torch.tensor([-4.5, -3.0, 0.1, 0.5, 2.0], dtype=torch.float64)  # erfcx(-4.5) ~ 1.2e9 beside 0.1
    check_backward(torch.special.erfcx, x, _randn(5, seed=8))
    check_backward(lambda t: 1e6 * torch.exp(t), _randn(4, 6, seed=9), _randn(4, 6, seed=10))
    check_backward(lambda t: torch.softmax(3 * t, dim=-1), _randn(10, 30, seed=11), _randn(10, 30, seed=12))
    two = lambda t: (t.exp(), 1e4 * t.sin())  # noqa: E731
    check_backward(two, _randn(40, seed=13), (_randn(40, seed=14), _randn(40, seed=15)))


def test_a_wrong_second_output_is_named_with_its_index():
    two = lambda t: (t.exp(), jacobian_off(torch.sin, k=2, i=2)(t))  # noqa: E731
    gy = (_randn(5, seed=16), _randn(5, seed=17))
    gy[1][2] = 1e-5
    with pytest.raises(GradientCheckError, match=r"at \(2,\) for output 1 element \(2,\):"):
        check_backward(two, _randn(5, seed=18), gy)


def test_float64_checks_default_to_tighter_tolerances_and_given_ones_win():
    assert default_tolerances(None, None, None, [torch.zeros(1, dtype=torch.float64)]) == (1e-6, 1e-4)
    assert default_tolerances(None, None, None, [torch.zeros(1, dtype=torch.complex128)]) == (1e-6, 1e-4)
    assert default_tolerances(None, None, None, [torch.zeros(1, dtype=torch.float64), torch.zeros(1)]) == (1e-5, 1e-4)
    assert default_tolerances(None, None, torch.float64, [torch.zeros(1)]) == (1e-6, 1e-4)
    assert default_tolerances(None, None, torch.float32, [torch.zeros(1, dtype=torch.float64)]) == (1e-5, 1e-4)
    assert default_tolerances(3e-3, None, None, [torch.zeros(1, dtype=torch.float64)]) == (3e-3, 1e-4)
    wrong = jacobian_off(torch.tanh, k=0, i=0, factor=0.5)
    x, gy = _randn(3, seed=19), _randn(3, seed=20)
    for data, kwargs, named in [(x, {}, "atol=1e-06, rtol=0.0001"),
                                (x.float(), {}, "atol=1e-05, rtol=0.0001"),
                                (x.float(), {"dtype": "float64"}, "atol=1e-06, rtol=0.0001"),
                                (x, {"atol": 1e-3, "rtol": 1e-2}, "atol=0.001, rtol=0.01")]:
        with pytest.raises(GradientCheckError) as info:
            check_backward(wrong, data, gy.to(data.dtype), **kwargs)
        assert named in str(info.value)
    check_backward(torch.tanh, x.float(), gy.float())  # float32 at Chainer's tolerances


def test_the_rows_are_capped_by_the_memory_budget(monkeypatch):
    x, gy = _randn(20, 20, seed=21), _randn(20, 20, seed=22)
    assert check_backward(torch.tanh, x, gy).notes == []
    monkeypatch.setattr(backward, "ISOLATING_BUDGET", 400 * 16)  # 16 rows of 400 elements
    report = check_backward(torch.tanh, x, gy)
    assert any(note.startswith("isolating rows: 16 instead of 128") for note in report.notes)
    with pytest.raises(GradientCheckError, match=r"output group \d+ \(25 output elements"):
        check_backward(jacobian_off(torch.tanh, k=57, i=57, factor=0.1), x, gy.index_fill(0, torch.tensor([2]), 1e-4))
    monkeypatch.setattr(backward, "ISOLATING_BUDGET", 399)  # not one row fits: the y_grad row alone
    report = check_backward(torch.tanh, x, gy)
    assert any(note.startswith("isolating rows: 0 instead of 128") for note in report.notes)


def test_a_backward_that_cannot_be_batched_is_checked_one_row_at_a_time():
    class NumpyBackward(torch.autograd.Function):
        """``sin`` whose backward leaves torch (through numpy): autograd cannot batch it."""

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.sin()

        @staticmethod
        def backward(ctx, gy):
            (x,) = ctx.saved_tensors
            grad = torch.from_numpy(gy.numpy() * x.cos().numpy())
            grad[1] *= 1.01 if gy[1] != 0 and gy.abs().sum() == gy[1].abs() else 1.0  # only for a one-hot cotangent
            return grad

    x, gy = _randn(4, seed=23), _randn(4, seed=24)
    with pytest.raises(GradientCheckError, match=r"at \(1,\) for output element \(1,\):"):
        check_backward(NumpyBackward.apply, x, gy)
