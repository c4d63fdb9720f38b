"""check_backward on complex inputs, outputs and parameters: torch's convention (the gradient of a real
objective is d/dRe + i d/dIm), real and imaginary parts perturbed and compared, nothing cast to real."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from gradwatch import check_backward, check_double_backward
from gradwatch.errors import GradientCheckError


def complex_mul(kind: str):
    """``a * b`` whose hand-written backward is right (``none``) or has a planted error."""

    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            ga, gb = g * b.conj(), g * a.conj()
            if kind == "ten_percent":
                ga = ga * 1.1
            elif kind == "no_conjugate":
                ga = g * b
            elif kind == "swapped":
                ga = torch.complex(ga.imag, ga.real)
            return ga, gb

    return Mul.apply


def _inputs(dtype=torch.complex128):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, dtype=dtype, generator=gen) for _ in range(3)]


def test_a_correct_complex_backward_passes_with_both_parts_checked_and_no_warning():
    a, b, gy = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning: nothing is cast to real
        report = check_backward(complex_mul("none"), (a, b), gy)
    assert sorted(report.tensors) == ["x[0]", "x[1]"]
    assert report.tensors["x[0]"].shape == (3, 4, 2)  # real and imaginary parts, every element
    assert report.dtype == "complex128"


@pytest.mark.parametrize("kind", ["ten_percent", "no_conjugate", "swapped"])
def test_a_wrong_complex_backward_is_caught_and_named(kind):
    a, b, gy = _inputs()
    with pytest.raises(GradientCheckError) as err:
        check_backward(complex_mul(kind), (a, b), gy)
    message = str(err.value)
    assert "x[0]" in message and "x[1]" not in message.split("diagnosis")[0]
    assert "real and imaginary parts" in message
    assert torch.autograd.gradcheck(complex_mul(kind), (a.requires_grad_(), b.requires_grad_()),
                                    raise_exception=False) is False  # torch agrees


def test_complex64_code_checked_in_complex128_with_dtype_float64():
    a, b, gy = _inputs(torch.complex64)
    report = check_backward(complex_mul("none"), (a, b), gy, dtype=np.float64)
    assert report.dtype == "complex128"
    with pytest.raises(GradientCheckError):
        check_backward(complex_mul("no_conjugate"), (a, b), gy, dtype="float64")


def test_complex_parameters_real_outputs_and_numpy_inputs():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 4, dtype=torch.complex128))
    x = np.random.default_rng(0).standard_normal((5, 4)) + 1j * np.random.default_rng(1).standard_normal((5, 4))

    def spectral(z):  # a complex layer with a real loss (the power of its output)
        return (z @ weight).abs().pow(2).sum()

    report = check_backward(spectral, x, None, params=[weight])
    assert sorted(report.tensors) == ["params[0]", "x[0]"]

    class Wrong(torch.autograd.Function):  # |z|^2 whose backward forgets the factor 2
        @staticmethod
        def forward(ctx, z):
            ctx.save_for_backward(z)
            return z.abs().pow(2).sum()

        @staticmethod
        def backward(ctx, g):
            (z,) = ctx.saved_tensors
            return g * z

    with pytest.raises(GradientCheckError, match=r"x\[0\]"):
        check_backward(Wrong.apply, x, None)


def test_complex_mistakes_of_the_caller_get_a_clear_error():
    a, b, gy = _inputs()
    with pytest.raises(ValueError, match="needs a real loss"):
        check_backward(lambda z: (z * z).sum(), a, None)
    with pytest.raises(ValueError, match=r"y_grad\[0\] is complex"):
        check_backward(lambda z: z.abs(), a, gy)
    with pytest.raises(ValueError, match="does not check complex arrays yet: x_data\\[0\\]"):
        check_double_backward(lambda z: z * z, a, gy, a)


class ComplexNet(nn.Module):
    """A spectral-style layer: complex weights on complex data, a real head."""

    def __init__(self, mul=None) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64) / 2)
        self.out = nn.Linear(4, 1)
        self.mul = mul

    def forward(self, x):
        z = x @ self.w if self.mul is None else self.mul(self.w, x.unsqueeze(-1)).sum(-2)
        return self.out(z.abs())


def _watch_complex(model, conjugate_grad=False, checks=2):
    from gradwatch import GradWatch

    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = lambda m, b: (m(b) ** 2).mean()  # noqa: E731
    watch = GradWatch(model, loss, optimizer=opt, every=1, log_dir=None)
    gen = torch.Generator().manual_seed(0)
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", np.exceptions.ComplexWarning if hasattr(np, "exceptions") else UserWarning)
        for _ in range(checks):
            x = torch.randn(8, 4, dtype=torch.complex64, generator=gen)
            opt.zero_grad()
            loss(model, x).backward()
            if conjugate_grad:  # a classic mistake: the gradient conjugated before the step
                model.w.grad = model.w.grad.conj().resolve_conj()
            reports.append(watch.step(x))
            opt.step()
    alerts = list(watch.alerts)
    watch.close()
    return alerts, reports


def test_the_watch_checks_complex_parameters_in_both_parts():
    torch.manual_seed(0)
    alerts, reports = _watch_complex(ComplexNet())
    assert alerts == []
    assert "w" in reports[-1].tensors
    assert "w" in reports[-1].training
    assert reports[-1].tensors["w"].shape == (4, 4, 2)
    torch.manual_seed(0)
    alerts, _ = _watch_complex(ComplexNet(), conjugate_grad=True)
    assert {a.tensor for a in alerts} == {"w"} and all("training" in a.message for a in alerts)
    torch.manual_seed(0)
    alerts, _ = _watch_complex(ComplexNet(mul=complex_mul("no_conjugate")), checks=1)
    assert {a.tensor for a in alerts} == {"w"}
