"""check_backward with Chainer's semantics: every example on the seed page, plus failing variants."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradientCheckError, check_backward


@pytest.fixture
def rng():
    return np.random.RandomState(0)


def _wrong_mul(scale):
    """``x1 * x2`` whose backward of x2 is multiplied by ``scale``."""

    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, gy):
            a, b = ctx.saved_tensors
            return gy * b, scale * gy * a

    return Mul.apply


def test_one_input(rng):
    x = rng.randn(3, 4)
    gy = rng.randn(3, 4)
    report = check_backward(torch.tanh, x, gy)
    assert list(report.tensors) == ["x[0]"]
    assert report.ok
    with pytest.raises(GradientCheckError, match=r"x\[0\]"):
        check_backward(lambda a: torch.tanh(a).detach() + a, x, gy)


def test_several_inputs_tuple(rng):
    x1, x2, gy = rng.randn(3, 4), rng.randn(3, 4), rng.randn(3, 4)
    report = check_backward(_wrong_mul(1.0), (x1, x2), gy)
    assert list(report.tensors) == ["x[0]", "x[1]"]
    with pytest.raises(GradientCheckError) as info:
        check_backward(_wrong_mul(3.0), (x1, x2), gy)
    msg = str(info.value)
    assert "x[1]" in msg and "x[0]" not in msg
    assert info.value.report.tensors["x[1]"].failed
    assert not info.value.report.tensors["x[0]"].failed
    assert "3.00x" in msg


def test_loss_with_y_grad_none(rng):
    x1, x2 = rng.randn(5, 3), rng.randn(5, 3)
    report = check_backward(lambda a, b: F.mse_loss(a, b), (x1, x2), None)
    assert report.ok and set(report.tensors) == {"x[0]", "x[1]"}
    with pytest.raises(GradientCheckError, match=r"x\[1\]"):
        check_backward(lambda a, b: _wrong_mul(-1.0)(a, b).sum(), (x1, x2), None)


def test_several_outputs_tuple_of_y_grads(rng):
    x = rng.randn(4)
    gy1, gy2 = rng.randn(4), rng.randn(4)
    report = check_backward(lambda a: (a.exp(), 2 * a.sin()), x, (gy1, gy2))
    assert report.ok
    # the second output's gradient is actually used: break only that output's backward
    with pytest.raises(GradientCheckError, match=r"x\[0\]"):
        check_backward(lambda a: (a.exp(), 2 * a.sin().detach() + a), x, (gy1, gy2))
    # a None y_grad skips that output
    check_backward(lambda a: (a.exp(), a.sin().detach() + a), x, (gy1, None))


def test_module_params():
    torch.manual_seed(0)
    lin = nn.Linear(4, 2).double()
    rng = np.random.RandomState(1)
    x, gy = rng.randn(3, 4), rng.randn(3, 2)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    report = check_backward(lin, x, gy, params=(lin.weight, lin.bias))
    assert set(report.tensors) == {"x[0]", "params[0]", "params[1]"}
    assert report.ok
    assert lin.weight.grad is None and lin.bias.grad is None
    assert torch.equal(lin.weight, w0) and torch.equal(lin.bias, b0)
    # a module as params: named after its parameters
    report = check_backward(lin, x, gy, params=lin)
    assert set(report.tensors) == {"x[0]", "weight", "bias"}


class _WrongWeightGrad(torch.autograd.Function):
    """``x @ w.T`` whose weight gradient is doubled."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        return gy @ w, 2.0 * gy.t() @ x


class _BadLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 4, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(2, dtype=torch.float64))

    def forward(self, x):
        return _WrongWeightGrad.apply(x, self.weight) + self.bias


def test_wrong_param_gradient_names_the_parameter():
    torch.manual_seed(0)
    mod = _BadLinear()
    rng = np.random.RandomState(2)
    x, gy = rng.randn(3, 4), rng.randn(3, 2)
    with pytest.raises(GradientCheckError) as info:
        check_backward(mod, x, gy, params=(mod.weight, mod.bias))
    msg = str(info.value)
    assert "params[0]" in msg
    assert "params[1]" not in msg
    assert "x[0]" not in msg
    assert "2.00x" in msg
    with pytest.raises(GradientCheckError) as info:
        check_backward(mod, x, gy, params=mod)
    assert "weight" in str(info.value)
    assert not info.value.report.tensors["bias"].failed
    # parameters are put back after the check
    assert mod.weight.dtype == torch.float64 and mod.weight.grad is None


def test_lambda(rng):
    x1, x2, gy = rng.randn(2, 3), rng.rand(2, 3) + 0.5, rng.randn(2, 3)
    report = check_backward(lambda a, b: a / b + torch.log(b), (x1, x2), gy)
    assert report.ok and len(report.tensors) == 2


def test_integer_inputs_are_ignored(rng):
    x = rng.randn(5, 3)
    idx = np.array([4, 0, 2])
    gy = rng.randn(3, 3)
    report = check_backward(lambda a, i: a[i] * 2.0, (x, idx), gy)
    assert list(report.tensors) == ["x[0]"]
    # torch integer tensors too
    report = check_backward(lambda a, i: a[i] * 2.0, (torch.tensor(x), torch.tensor(idx)), torch.tensor(gy))
    assert list(report.tensors) == ["x[0]"]


def test_no_grads_skips_inputs(rng):
    x1, x2, gy = rng.randn(3), rng.randn(3), rng.randn(3)
    # x[1]'s backward is wrong, but no_grads skips it
    report = check_backward(_wrong_mul(5.0), (x1, x2), gy, no_grads=[False, True])
    assert list(report.tensors) == ["x[0]"]
    with pytest.raises(GradientCheckError):
        check_backward(_wrong_mul(5.0), (x1, x2), gy, no_grads=[False, False])
    with pytest.raises(ValueError, match="one flag per input"):
        check_backward(_wrong_mul(1.0), (x1, x2), gy, no_grads=[True])


def test_numpy_arrays_and_torch_tensors_agree(rng):
    x, gy = rng.randn(3, 3), rng.randn(3, 3)
    r_np = check_backward(torch.sigmoid, x, gy)
    xt = torch.tensor(x)
    r_t = check_backward(torch.sigmoid, xt, torch.tensor(gy))
    assert r_np.ok and r_t.ok
    assert np.allclose(r_np.tensors["x[0]"].analytic, r_t.tensors["x[0]"].analytic)
    assert torch.equal(xt, torch.tensor(x))  # the input is not perturbed


def test_dtype_float64_with_float32_data(buggy_sigmoid):
    rng = np.random.RandomState(3)
    x = rng.randn(4, 5).astype(np.float32)
    gy = rng.randn(4, 5).astype(np.float32)
    torch.manual_seed(0)
    lin = nn.Linear(5, 5)
    report = check_backward(lambda a: torch.tanh(lin(a)), x, gy, params=(lin.weight, lin.bias), dtype=torch.float64)
    assert report.ok and report.dtype == "float64"
    assert lin.weight.dtype == torch.float32  # swapped back
    with pytest.raises(GradientCheckError):
        check_backward(lambda a: buggy_sigmoid.apply(lin(a)), x, gy, params=(lin.weight, lin.bias), dtype=torch.float64)


def test_large_input_is_sampled_with_directions():
    torch.manual_seed(0)
    x = torch.randn(50, 50, dtype=torch.float64)
    gy = torch.randn(50, 50, dtype=torch.float64)
    report = check_backward(torch.tanh, x, gy)
    t = report.tensors["x[0]"]
    assert len(t.coords) < x.numel() and len(t.dir_analytic) > 0
    assert report.ok


def test_relu_at_zero_is_a_kink_not_a_failure():
    x = torch.tensor([0.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    gy = torch.tensor([1.0, 2.0, 3.0, -1.0], dtype=torch.float64)
    report = check_backward(F.relu, x, gy)
    assert report.ok
    t = report.tensors["x[0]"]
    assert t.kinks == 2
    # The measures leave the kinks out (the central difference there is half the one-sided slopes)...
    assert t.rel_diff < 1e-8
    assert t.judged_rel_diff < 1e-8
    assert t.verdict.value == "excellent"
    # ...while the per-sample lists keep every entry.
    assert len(t.analytic) == len(t.numeric) == 4


def test_argument_errors(rng):
    x = rng.randn(3)
    with pytest.raises(ValueError, match="eps must be > 0"):
        check_backward(torch.tanh, x, x, eps=0)
    with pytest.raises(ValueError, match="y_grad=None"):
        check_backward(torch.tanh, x, None)
    with pytest.raises(ValueError, match="shape"):
        check_backward(torch.tanh, x, rng.randn(4))
    with pytest.raises(TypeError, match="params"):
        check_backward(torch.tanh, x, x, params=(torch.zeros(2),))
