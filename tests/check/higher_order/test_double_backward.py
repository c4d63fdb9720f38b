"""``check_double_backward`` (Chainer's semantics): second-order gradients against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_tanh

from gradwatch import GradientCheckError, check_backward, check_double_backward


def data(seed: int = 0, n: int = 5):
    g = np.random.default_rng(seed)
    return g.standard_normal(n), g.standard_normal(n), g.standard_normal(n)


def test_correct_double_backward_passes_float32_code_checked_in_float64():
    x, gy, ggx = (a.astype(np.float32) for a in data())
    report = check_double_backward(make_tanh(), x, gy, ggx, dtype=np.float64)
    assert sorted(report.tensors) == ["x[0]", "x[1]"]  # x, then y_grad
    assert report.ok


@pytest.mark.parametrize("x_error, g_error, named", [(1.2, 1.0, "x[0]"), (1.0, 1.2, "x[1]"), (1.01, 1.0, "x[0]")])
def test_wrong_double_backward_is_caught_and_named(x_error, g_error, named):
    x, gy, ggx = data()
    bad = make_tanh(x_error, g_error)
    check_backward(bad, x, gy, dtype=np.float64)  # the first backward is right
    with pytest.raises(GradientCheckError) as err:
        check_double_backward(bad, x, gy, ggx, dtype=np.float64)
    failed = [name for name, t in err.value.report.tensors.items() if t.failed]
    assert failed == [named] and named in str(err.value)


def test_params_second_order_checked_and_a_wrong_one_named():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2, dtype=torch.float64)
    x, gy = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    ggx = torch.randn(4, 3, dtype=torch.float64)
    ggp = [torch.randn_like(p) for p in lin.parameters()]
    report = check_double_backward(lambda x: torch.tanh(lin(x)), x, gy, ggx, params=lin, params_grad_grad=ggp)
    assert report.ok and {"params[0]", "params[1]"} <= set(report.tensors)
    bad = make_tanh(1.2)
    with pytest.raises(GradientCheckError) as err:
        check_double_backward(lambda x: bad(lin(x)), x, gy, ggx, params=lin, params_grad_grad=ggp)
    assert {n for n, t in err.value.report.tensors.items() if t.failed} >= {"params[0]", "x[0]"}


def test_bad_arguments_name_what_is_expected():
    x, gy, ggx = data()
    with pytest.raises(ValueError, match="x_grad_grad must have one entry per floating input"):
        check_double_backward(torch.tanh, x, gy, (ggx, ggx))
    with pytest.raises(ValueError, match="params_grad_grad must have one entry per parameter"):
        check_double_backward(torch.tanh, x, gy, ggx, params=torch.nn.Linear(5, 5))


def test_the_readme_example_runs():
    from docs_text import page, python_blocks

    first, second = python_blocks(page("getting-started/custom-function.md"))[:2]
    ns: dict = {}
    exec(compile(first, "docs/getting-started/custom-function.md", "exec"), ns)
    ns["test_my_sigmoid_backward"]()
    ns["rng"] = np.random.RandomState(0)
    exec(compile(second, "docs/getting-started/custom-function.md", "exec"), ns)  # raises on a wrong double backward


def test_float64_defaults_catch_a_one_percent_error_in_one_element():
    x, gy, ggx = (torch.tensor(a) for a in data(n=40))
    check_double_backward(make_tanh(1.0, element=7), x, gy, ggx)  # the correct one passes at the tight defaults
    with pytest.raises(GradientCheckError, match="x\\[0\\]"):
        check_double_backward(make_tanh(1.01, element=7), x, gy, ggx)


def test_a_backward_that_is_zero_by_definition_is_checked():
    # sgn's backward is an efficient zero tensor (no storage): its double backward is checked, not an error
    x, gy, ggx = (torch.tensor(a) for a in data())
    report = check_double_backward(torch.sgn, x, gy, ggx)
    assert report.ok
