"""The module form's joint detection probe: a unit's tensors settled together in two evaluations.

Each tensor's detection probe is applied at once (shortened so no tensor's share of the sum is too small to show
its own errors); where the sum agrees, every tensor whose share shows a tenth of the GOOD band of its own slope is
settled, with no evaluation at the point. A backward off in any one tensor, the one with the smallest share too,
makes the sum disagree: every tensor is then probed alone, as before, and the wrong one fails.
"""

from __future__ import annotations

from typing import Tuple

import pytest
import torch
from helpers import ScaledAffine
from torch import nn

from gradwatch.bands import Verdict
from gradwatch.check.modules.localize import check_module
from gradwatch.check.probes.joint import balance, joint_detect
from gradwatch.check.probes.lines import EngineSettings, Evaluator
from gradwatch.options import CheckOptions


class Affine(nn.Module):
    """A Linear with its own backward, then tanh (a smooth unit of three tensors)."""

    def __init__(self, d_in: int, d_out: int, factors: Tuple[float, float, float] = (1.0, 1.0, 1.0)) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in, dtype=torch.float64) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.randn(d_out, dtype=torch.float64) * 0.1)
        self.factors = factors

    def forward(self, x):
        return torch.tanh(ScaledAffine.apply(x, self.weight, self.bias, self.factors))


def _check(d_in: int, d_out: int, batch: int, factors=(1.0, 1.0, 1.0), seed: int = 0):
    torch.manual_seed(seed)
    unit = Affine(d_in, d_out, factors)
    x = torch.randn(batch, 16, d_in, dtype=torch.float64)
    return check_module("unit", unit, (x,), {}, CheckOptions(seed=seed), screen=True)


@pytest.mark.parametrize("d_in,d_out,batch", [(64, 96, 4), (256, 128, 2), (33, 7, 5)])
def test_a_correct_unit_is_settled_in_two_evaluations(d_in, d_out, batch):
    checked = _check(d_in, d_out, batch)
    assert checked.inconclusive is None and not checked.failed
    assert set(checked.tensors) == {"input", "weight", "bias"}
    # one joint probe, no evaluation at the point (three tensors alone took 2 + 3 x 2 = 8)
    assert checked.evaluations == 2, checked.evaluations
    for tc in checked.tensors.values():
        assert tc.verdict is not None
        assert not tc.coords
        assert len(tc.dir_analytic) == 1


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("d_in,d_out,batch", [(64, 96, 4), (33, 7, 5)])
def test_one_tensor_one_percent_off_fails_alone(which, d_in, d_out, batch):
    factors = [1.0, 1.0, 1.0]
    factors[which] = 1.01
    checked = _check(d_in, d_out, batch, tuple(factors))
    names = ["input", "weight", "bias"]
    failed = {k for k, t in checked.tensors.items() if t.failed}
    assert failed == {names[which]}, {k: (t.verdict, t.rel_diff) for k, t in checked.tensors.items()}
    assert checked.evaluations > 2  # the disagreeing sum sent every tensor to its own probe


def _settings(magnitude: float, term_norm: float) -> EngineSettings:
    return EngineSettings(4, 0, None, (1e-7, 1e-4, 1e-2), Verdict.SUSPICIOUS, True, 2.0 ** -52, magnitude=magnitude,
                          screen=True, term_norm=term_norm)


@pytest.mark.parametrize("small", [1e-2, 1e-3])
def test_the_tensor_with_the_smallest_share_is_still_caught(small):
    """A tensor whose slope is a hundredth or a thousandth of the others': balanced, its 1% error shows in the sum;
    where its slope is too small against the objective's noise even alone (a thousandth), it is left to its own
    probe, never settled."""
    torch.manual_seed(0)
    w, x = torch.randn(16, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    b, c = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)

    def f():
        return {"loss": float((w @ x).square().sum() + small * (b * c).sum())}

    y = w @ x
    grads = {"w": 2 * torch.outer(y, x), "x": 2 * w.T @ y, "b": small * c}
    settings = _settings(float(y.square().sum()), float(y.square().norm()))
    targets = [(k, k, t, {"total": grads[k]}) for k, t in (("w", w), ("x", x), ("b", b))]
    settled = sorted(joint_detect(targets, Evaluator(f), settings, 0))
    assert settled == (["b", "w", "x"] if small == 1e-2 else ["w", "x"])
    wrong = [(k, n, t, {"total": g["total"] * 1.01}) if k == "b" else (k, n, t, g) for k, n, t, g in targets]
    assert "b" not in joint_detect(wrong, Evaluator(f), settings, 0)


def test_balance_keeps_every_share_large_enough():
    contributions = [5.0, -0.01, 0.3, 6e-3]
    weights = balance(contributions)
    kept = [abs(c) * w for c, w in zip(contributions, weights) if w > 0]
    assert all(w > 0 for w in weights)  # each over a thousandth of the largest
    assert min(kept) >= 0.02 * sum(kept)
    assert balance([1.0, 1e-4]) == [1.0, 0.0]  # left for a later round
