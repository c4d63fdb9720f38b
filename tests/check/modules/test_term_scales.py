"""A tensor's probes carry the rounding of the objective's parts it moves, not of every part.

The module form's objective is the sum of a unit's outputs times their cotangents. An own-code unit passes its
input on to the modules it calls (an attention's ``x`` to ``q``, ``k`` and ``v``): those parts are large and no
called module's output moves them. Taken whole, their rounding hid a called module's output whose slope is small
(sequence-parallel attention's ``q``: a slope of 4e-4 under a floor of 2e-6), which then took the full sample and
wider steps (73 evaluations, 0.6-0.9 s at 20.8M). Evaluated part by part, a part the probe does not move cancels
exactly, and the noise floor counts the parts it moves.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradwatch.check.modules.localize import check_module
from gradwatch.options import CheckOptions


class _Off(torch.autograd.Function):
    """0.01 * tanh(w) * z, whose gradient in ``w`` is ``factor`` times the true one."""

    @staticmethod
    def forward(ctx, w, z, factor):
        ctx.save_for_backward(w, z)
        ctx.factor = factor
        return 0.01 * torch.tanh(w) * z

    @staticmethod
    def backward(ctx, g):
        w, z = ctx.saved_tensors
        return g * 0.01 * (1 - torch.tanh(w) ** 2) * z * ctx.factor, None, None


class PassesOn(nn.Module):
    """Gives its input on (a large part no parameter moves) and a small part of its own parameter."""

    def __init__(self, size: int, factor: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(size, dtype=torch.float64))
        self.register_buffer("z", torch.randn(size, dtype=torch.float64))
        self.factor = factor

    def forward(self, x):
        return x * 1.0, x * 2.0, _Off.apply(self.w, self.z, self.factor)


def _check(factor: float, passed: int = 1 << 19):
    torch.manual_seed(0)
    unit = PassesOn(4096, factor)
    x = torch.randn(passed, dtype=torch.float64) * 30
    return check_module("unit", unit, (x,), {}, CheckOptions(), screen=True)


def test_a_parameter_beside_a_large_passed_on_input_is_settled_by_its_probe():
    checked = _check(1.0)
    assert checked.inconclusive is None and not checked.failed, checked
    assert set(checked.tensors) == {"input", "w"}
    # the joint probe of both tensors, then one for w alone: with every part's rounding, w took its full sample
    # and wider steps (109 evaluations)
    assert checked.evaluations <= 6, checked.evaluations


@pytest.mark.parametrize("factor", [1.01, 0.9])
def test_a_gradient_a_little_off_beside_it_is_still_caught(factor):
    checked = _check(factor)
    assert checked.failed and checked.tensors["w"].failed and not checked.tensors["input"].failed, checked
