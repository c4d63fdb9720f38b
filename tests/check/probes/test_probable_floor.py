"""The module form's detection probe settles a tensor on its probable noise floor.

The judge's floor is a worst-case bound (every term of the objective rounded the same way); at real size it is
1e-5 to 1e-2 of a probe's slope while the probe agrees to 1e-8, so nothing settled and every tensor took the full
sample. Rounding of many independent terms adds up as their Euclidean norm: on that floor a correct wide unit is
settled by one probe, and a backward a little off is still caught.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradwatch.check.modules.localize import check_module
from gradwatch.options import CheckOptions


class _Scaled(torch.autograd.Function):
    """tanh(x) * w whose input gradient is ``factor`` times the true one."""

    @staticmethod
    def forward(ctx, x, w, factor):
        y = torch.tanh(x)
        ctx.save_for_backward(y, w)
        ctx.factor = factor
        return y * w

    @staticmethod
    def backward(ctx, g):
        y, w = ctx.saved_tensors
        return g * w * (1 - y * y) * ctx.factor, (g * y).sum(dim=tuple(range(g.dim() - 1))), None


class Unit(nn.Module):
    """A wide elementwise unit, then a LayerNorm: the shape of a transformer block's pieces."""

    def __init__(self, width: int, factor: float = 1.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, dtype=torch.float64) * 0.1 + 1.0)
        self.norm = nn.LayerNorm(width, dtype=torch.float64)
        self.factor = factor

    def forward(self, x):
        return self.norm(_Scaled.apply(x, self.w, self.factor))


def _check(width: int, factor: float, batch: int = 4, seq: int = 64):
    torch.manual_seed(0)
    unit = Unit(width, factor)
    x = torch.randn(batch, seq, width, dtype=torch.float64) * 2
    return check_module("unit", unit, (x,), {}, CheckOptions(), screen=True)


@pytest.mark.parametrize("width", [256, 384])
def test_a_correct_wide_unit_is_settled_by_one_probe_per_tensor(width):
    checked = _check(width, 1.0)
    assert checked.inconclusive is None and not checked.failed
    # two evaluations at the base point and one probe (two evaluations) per tensor: the input, w, and no more
    # (on the worst-case floor alone the input went on to wider steps and the full sample: 66 and 30 evaluations)
    assert set(checked.tensors) == {"input", "w"}
    assert checked.evaluations <= 2 + 2 * len(checked.tensors) + 6, checked.evaluations
    assert all(not t.coords for t in checked.tensors.values())


@pytest.mark.parametrize("factor", [1.01, 0.9])
@pytest.mark.parametrize("width", [256, 384])
def test_a_backward_a_little_off_is_still_caught(width, factor):
    checked = _check(width, factor)
    assert checked.failed, {k: (t.verdict, t.rel_diff) for k, t in checked.tensors.items()}
    assert checked.tensors["input"].failed and not checked.tensors["w"].failed


def _wide_objective(factor: float):
    """A tensor checked on an objective whose terms are many (as the own code of a sequence parallel attention's, whose
    terms sum to 5e5 in absolute value): a worst-case floor over 1e-3 of most of its slopes, a probable floor far
    below; ``factor`` scales its analytic gradient. Returns (its judged check, the evaluations it took)."""
    from gradwatch.check.probes.engine import check_tensors
    from gradwatch.check.probes.lines import EngineSettings, Evaluator

    torch.manual_seed(0)
    p = torch.randn(4096, dtype=torch.float64)
    g = torch.randn(4096, dtype=torch.float64)
    x0 = p.clone()
    evaluate = Evaluator(lambda: {"loss": float(g @ (p - x0)) + float(torch.tanh(p).sum())})
    grad = (g + 1 - torch.tanh(p) ** 2) * factor
    settings = EngineSettings.from_options(CheckOptions(), 2.0 ** -52, 2.5e6, term_norm=50.0)
    judged = list(check_tensors([("p", "p", p, {"total": grad})], evaluate, settings, seed=0))
    return judged[0].check, evaluate.count


def test_an_agreeing_sample_on_a_worst_case_floor_over_its_slope_is_not_taken_at_a_wider_step():
    """A full sample whose slopes agree beyond its probable floor has nothing for a wider step to show: on the worst-case
    floor alone most of its 12 probes went on to 3 wider ones each (74 evaluations)."""
    check, evaluations = _wide_objective(1.0)
    assert not check.failed and str(check.verdict) == "Verdict.EXCELLENT", check
    assert evaluations <= 3 + 2 * 12, evaluations  # the base point and the base probes only


def test_a_disagreeing_sample_is_still_taken_at_a_wider_step_and_caught():
    check, evaluations = _wide_objective(1.1)
    assert check.failed, check
    assert evaluations > 3 + 2 * 12, evaluations  # the probable floor never discounts a disagreement
