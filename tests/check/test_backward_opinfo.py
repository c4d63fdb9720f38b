"""check_backward on what PyTorch's operator database (OpInfo) showed: false alarms, errors, and 1%-off mutants.

The full comparison with gradcheck is ``benchmarks/opinfo.py``; these are the cases it found, on small
inputs (the whole module runs in a few seconds).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradwatch import GradientCheckError, check_backward


def one_element_off(fn, index, which=0, factor=1.01):
    """``fn`` whose backward is the true vector-Jacobian product with element ``index`` of input ``which`` x factor."""

    class OneOff(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            ctx.save_for_backward(*xs)
            return fn(*xs).clone()

        @staticmethod
        def backward(ctx, gy):
            xs = [x.detach().requires_grad_(True) for x in ctx.saved_tensors]
            with torch.enable_grad():
                grads = list(torch.autograd.grad(fn(*xs), xs, gy))
            grads[which] = grads[which].contiguous().clone()
            grads[which].view(-1)[index] *= factor
            return tuple(grads)

    return OneOff.apply


def _data(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _element(grad_shape, seed):
    """An element whose gradient is not tiny (a 1% error there is above the default atol)."""
    return int(torch.randint(0, int(np.prod(grad_shape)), (1,), generator=torch.Generator().manual_seed(seed)))


LAYOUT_AND_ACTIVATIONS = {
    "transpose": lambda a: a.transpose(0, 1),
    "permute": lambda a: a.permute(2, 0, 1),
    "softmax": lambda a: torch.softmax(a, dim=-1),
    "sigmoid": torch.sigmoid,
    "leaky_relu": lambda a: F.leaky_relu(a, 0.1),
    "elu": F.elu,
}


@pytest.mark.parametrize("name", sorted(LAYOUT_AND_ACTIVATIONS))
def test_one_element_one_percent_off_is_caught(name):
    fn = LAYOUT_AND_ACTIVATIONS[name]
    x = _data((3, 4, 5))
    gy = _data(tuple(fn(x).shape), seed=1)
    assert check_backward(fn, x, gy).ok  # the correct op passes
    with torch.enable_grad():
        xg = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(xg), xg, gy)
    # an element with a gradient well above atol / 0.01
    big = torch.nonzero(g.abs().reshape(-1) > 0.05).reshape(-1)
    index = int(big[_element(big.shape, 2)])
    with pytest.raises(GradientCheckError) as info:
        check_backward(one_element_off(fn, index), x, gy)
    failing = [k for k, (a, n) in enumerate(zip(info.value.report.tensors["x[0]"].analytic,
                                                 info.value.report.tensors["x[0]"].numeric))
               if abs(a - n) > 1e-5 + 1e-4 * abs(a)]
    assert failing == [index]  # exactly the wrong element, at its place


@pytest.mark.parametrize("name", ["transpose", "sigmoid"])
def test_one_element_off_in_a_large_input_is_caught_by_its_block(name):
    """Above 2048 elements not every element is probed alone: the random blocks still hold every element."""
    fn = LAYOUT_AND_ACTIVATIONS[name]
    x = _data((60, 60))
    gy = _data((60, 60), seed=1)
    with torch.enable_grad():
        xg = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(xg), xg, gy)
    # a middling element: not among the largest gradients that are probed one by one
    order = torch.argsort(g.abs().reshape(-1))
    index = int(order[len(order) // 2])
    report = check_backward(fn, x, gy)
    assert index not in [r * 60 + c for r, c in report.tensors["x[0]"].coords]
    assert len(report.tensors["x[0]"].dir_analytic) == 512
    with pytest.raises(GradientCheckError, match=r"x\[0\].*random blocks"):
        check_backward(one_element_off(fn, index), x, gy)


def test_huge_output_elsewhere_is_no_false_alarm():
    """special.erfcx: erfcx(-4.5) ~ 1.2e9 sits next to outputs ~0.1; their changes are not lost in its rounding."""
    x = np.array([-4.4678, 0.8013, 5.2492, 6.3369, -3.8974, 1.5297])
    gy = np.random.RandomState(0).randn(6)
    report = check_backward(torch.special.erfcx, x, gy)
    assert report.ok and report.tensors["x[0]"].kinks == 0  # every entry passes at eps itself


@pytest.mark.parametrize("fn", [torch.floor, torch.round, lambda a: torch.round(a, decimals=3)], ids=["floor", "round", "round3"])
def test_jumps_within_the_step_are_excluded(fn):
    """Steps of a staircase within eps of a point: the analytic zero is right there, not a detached path."""
    x = np.array([2.0004, -1.4996, 0.5003, 1.0000001, 0.12345])
    gy = np.array([1.0, -2.0, 0.5, 3.0, 1.5])
    report = check_backward(fn, x, gy)
    assert report.ok and report.tensors["x[0]"].kinks >= 2
    # a real bug beside the staircase is still caught
    with pytest.raises(GradientCheckError):
        check_backward(lambda a: fn(a) + 2.0 * a.detach() + a, x, gy)


def test_empty_inputs_have_nothing_to_check():
    """linalg.vecdot and linalg.pinv on empty inputs (OpInfo's first samples) ended in numpy TypeErrors."""
    a, b = np.zeros((0,)), np.zeros((0,))
    report = check_backward(torch.linalg.vecdot, (a, b), np.array(1.5))
    assert report.ok and report.tensors == {}
    a, b = np.zeros((3, 0)), np.zeros((3, 0))
    report = check_backward(lambda p, q: torch.linalg.pinv(p @ q.mT), (a, b), np.ones((3, 3)))
    assert report.ok and report.tensors == {}
    # an empty input beside a non-empty one: the non-empty one is checked, the empty one left out
    x, e = np.random.RandomState(0).randn(4), np.zeros((0, 2))
    report = check_backward(lambda u, v: u.sin() + v.sum(), (x, e), np.ones(4))
    assert list(report.tensors) == ["x[0]"] and report.ok
    with pytest.raises(GradientCheckError, match=r"x\[0\]"):
        check_backward(lambda u, v: u.sin().detach() + u + v.sum(), (x, e), np.ones(4))


def test_undefined_on_both_sides_is_not_a_failure():
    """NaN analytic and NaN numeric agree (numpy's equal_nan, as Chainer); -inf inputs are not moved by a step."""
    base = np.array([-7.5824, 2.0])
    report = check_backward(lambda b, e: b ** e, (base, np.array([0.5, 0.5])), np.array([1.0, 1.0]))
    assert report.ok
    assert report.tensors["x[0]"].kinks == 1  # the NaN element
    x = np.array([[1.0, -np.inf, 0.5], [-np.inf, -np.inf, 2.0]])
    gy = np.array([[0.3, -1.0, 2.0], [1.0, 0.5, -0.7]])
    assert check_backward(lambda a: torch.softmax(a, dim=-1), x, gy).ok


@pytest.mark.parametrize("dtype", [np.float64, np.dtype("float64"), "float64", torch.float64, np.float32, "float32"])
def test_numpy_dtypes(dtype, buggy_sigmoid):
    rng = np.random.RandomState(3)
    x = rng.randn(3, 4).astype(np.float32)
    gy = rng.randn(3, 4).astype(np.float32)
    tol = {} if "64" in str(dtype) else {"atol": 1e-3, "rtol": 1e-2}
    report = check_backward(torch.tanh, x, gy, dtype=dtype, **tol)
    assert report.ok and report.dtype == ("float64" if "64" in str(dtype) else "float32")
    with pytest.raises(GradientCheckError):
        check_backward(buggy_sigmoid.apply, x, gy, dtype=dtype, **tol)


def test_bad_dtype_is_named():
    x = np.zeros(3)
    with pytest.raises(ValueError, match="int32"):
        check_backward(torch.tanh, x, x, dtype=np.int32)
    with pytest.raises(TypeError, match="dtype must be a floating dtype.*object"):
        check_backward(torch.tanh, x, x, dtype=object())


def test_a_one_percent_error_the_y_grad_weighs_little_is_caught_by_the_one_hot_rows():
    """A 1% error in an element whose gradient (for this y_grad) is 1e-4 is 1e-6 on the y_grad row, at the
    float64 atol; the one-hot cotangent on the output element it comes from sees the whole Jacobian entry
    (x[2, 1] reaches the transpose's output element (1, 2) alone), 1% off."""
    x = _data((4, 5))
    gy = _data((5, 4), seed=1)
    gy[1, 2] = 1e-4  # transpose: the gradient of x[2, 1] is gy[1, 2]
    index = 2 * 5 + 1
    with pytest.raises(GradientCheckError, match=r"at \(2, 1\) for output element \(1, 2\): numeric 1 vs analytic 1.01"):
        check_backward(one_element_off(LAYOUT_AND_ACTIVATIONS["transpose"], index), x, gy)
    # The y_grad row alone would not see it: its error is 1e-6 against Chainer's float32 atol of 1e-5.
    with pytest.raises(GradientCheckError, match=r"output element \(1, 2\)"):
        check_backward(one_element_off(LAYOUT_AND_ACTIVATIONS["transpose"], index), x, gy, atol=1e-5)
