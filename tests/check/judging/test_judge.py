"""One judging core (gradwatch.check.judging.judge): every check gives its verdicts through it, so they say the same things.

check_model and check_numpy (through the engine), localize's module checks and check_backward all
build their TensorCheck with :func:`gradwatch.check.judging.judge.judge`; a tensor without a verdict is
:func:`gradwatch.check.judging.judge.inconclusive` with a typed kind.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.bands import Verdict
from gradwatch.check.judging.judge import BandRule, Slope, ToleranceRule, base_point, judge
from gradwatch.check.judging.report import InconclusiveKind
from gradwatch.check.modules.localize import check_module
from gradwatch.options import CheckOptions


class Drifting(nn.Module):
    """A module whose output changes with every call (state outside buffers): not a function of its inputs."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return (x @ self.weight) * (1.0 + 1e-3 * self.calls)


def test_localize_says_a_module_that_changes_between_calls_is_nondeterministic():
    torch.manual_seed(0)
    res = check_module("drift", Drifting(), (torch.randn(4, 3, dtype=torch.float64),), {}, CheckOptions())
    assert set(res.tensors) == {"input", "weight"}
    for t in res.tensors.values():
        assert t.inconclusive_kind is InconclusiveKind.NONDETERMINISTIC
        assert t.verdict is None and not t.failed
        assert "nondeterministic" in t.inconclusive
    assert not res.failed


def test_check_numpy_and_check_model_say_nondeterministic_with_the_same_kind():
    rng = np.random.default_rng(0)
    w = {"w": rng.normal(size=3)}
    noise = iter(np.linspace(0.0, 1.0, 1000))
    report = gradwatch.check_numpy(lambda: float((w["w"] ** 2).sum() + next(noise)), w, {"w": 2 * w["w"]})
    assert report.nondeterministic and not report.ok
    assert report.tensors["w"].inconclusive_kind is InconclusiveKind.NONDETERMINISTIC

    model = nn.Linear(3, 1)
    counter = iter(range(1000))
    report = gradwatch.check_model(model, lambda m, b: m(b).sum() + 1e-3 * next(counter), torch.randn(4, 3))
    assert report.nondeterministic
    assert {t.inconclusive_kind for t in report.tensors.values()} == {InconclusiveKind.NONDETERMINISTIC}


class TwiceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        return 2.0 * gy * x.cos()


def test_check_backward_names_the_constant_ratio_as_check_model_does():
    x = np.random.default_rng(0).normal(size=(3, 4))
    gy = np.ones((3, 4))
    with pytest.raises(gradwatch.GradientCheckError) as err:
        gradwatch.check_backward(TwiceBackward.apply, x, gy)
    t = err.value.report.tensors["x[0]"]
    assert t.failed and t.verdict is gradwatch.Verdict.WRONG
    assert t.ratio == pytest.approx(2.0, rel=1e-3)
    assert "2.00x numeric" in t.diagnosis


def test_the_tolerance_rule_fails_a_tensor_on_one_line_and_leaves_out_excluded_lines():
    lines = [Slope(1.0, 1.0, label=(0,)), Slope(5.0, -3.0, label=(1,), excluded=True),
             Slope(2.0, 2.1, label=(2,), failed=True)]
    t = judge("x", (3,), lines, ToleranceRule(atol=1e-5, rtol=1e-4), step=1e-3)
    assert t.failed
    assert t.verdict is gradwatch.Verdict.WRONG
    assert t.kinks == 1
    assert t.rel_diff == pytest.approx(gradwatch.rel_diff([1.0, 2.0], [1.0, 2.1]))  # the kink left out
    assert t.analytic == [1.0, 5.0, 2.0]  # the per-sample lists keep every line
    within = judge("x", (3,), [Slope(1.0, 1.001, label=(0,))], ToleranceRule(atol=1e-2, rtol=0.0), step=1e-3)
    assert not within.failed and within.verdict is gradwatch.Verdict.ACCEPTABLE  # the caller's tolerance rules


def test_the_band_rule_says_why_a_tensor_gets_no_verdict():
    nonfinite = judge("w", (2,), [Slope(1.0, math.nan, label=(0,))], BandRule(), step=1e-5)
    assert nonfinite.inconclusive_kind is InconclusiveKind.NONFINITE and math.isnan(nonfinite.judged_rel_diff)
    unresolved = judge("w", (2,), [Slope(1.0, 1.0, label=(0,)), Slope(1.0, 1.2, label=(1,), unresolved=True)],
                       BandRule(), step=1e-3)
    assert unresolved.inconclusive_kind is InconclusiveKind.UNRESOLVED and "1 of 2 samples" in unresolved.inconclusive
    coarse = judge("w", (1,), [Slope(1.0, 1.001, floor=1e-2, label=(0,))], BandRule(coarse="a float32 matmul"),
                   step=1e-3)
    assert coarse.inconclusive_kind is InconclusiveKind.LOW_PRECISION and "float32 matmul" in coarse.inconclusive
    judged = judge("w", (1,), [Slope(1.0, 1.001, floor=1e-2, label=(0,))], BandRule(), step=1e-3)
    assert judged.verdict is gradwatch.Verdict.EXCELLENT and judged.judged_rel_diff == 0.0  # within the noise floor


def test_the_base_point_tells_not_finite_from_nondeterministic():
    assert base_point(math.nan, math.nan, 1e-12)[1] is InconclusiveKind.NONFINITE
    assert base_point(1.0, math.nan, 1e-12)[1] is InconclusiveKind.NONDETERMINISTIC
    jitter, kind, why = base_point(1.0, 1.0 + 1e-15, 1e-12)
    assert kind is None
    assert why is None
    assert jitter == pytest.approx(1e-15, rel=0.2)


def test_a_disagreement_only_the_noise_floor_excuses_is_not_agreement():
    """Every line's floor above its slopes (float32 over a large output): inconclusive, never EXCELLENT."""
    lost = [Slope(0.0, 0.13, floor=129.0, coordinate=False, label=("d", 0)),
            Slope(0.0, -0.06, floor=129.0, coordinate=False, label=("d", 1))]
    t = judge("emb.weight", (8000, 256), lost, BandRule(), step=1e-3)
    assert t.verdict is None and not t.failed
    assert t.inconclusive_kind is InconclusiveKind.BELOW_RESOLUTION
    assert "1.3e+02" in t.inconclusive and "dtype=float64" in t.inconclusive
    # One line that resolves (its floor far below its slopes) and agrees: the tensor is judged, a lost
    # coordinate of a zero gradient beside it notwithstanding.
    resolved = [Slope(0.18, 0.18 + 1e-12, floor=1e-9, coordinate=False, label=("d", 0)),
                Slope(-1.6e-17, 0.0, floor=1e-9, coordinate=True, label=(3,))]
    assert judge("head.bias", (4,), resolved, BandRule(), step=1e-6).verdict is Verdict.EXCELLENT
    # Lost lines that agree closely: the floor was pessimistic, the agreement stands.
    agreeing = [Slope(0.13, 0.13 + 1e-9, floor=129.0, coordinate=False, label=("d", 0))]
    assert judge("w", (3,), agreeing, BandRule(), step=1e-3).verdict is Verdict.EXCELLENT


def test_float32_module_check_of_a_dropped_rare_row_is_inconclusive_and_float64_finds_it():
    """A custom backward that drops a rare row's gradient, checked at its real size (8,000 x 256, batch 8 x 128):
    in float32 the floor (about 130) swamps slopes of about 0.1, so it is not judged; float64 says WRONG."""
    from pathlib import Path

    from gradwatch.check.modules.own_code import RowsInPlace
    from gradwatch.cli import commands

    rare_drop = commands.load_bench(Path(__file__).resolve().parents[3] / "benchmarks" / "real_size.py").RareDropEmbedding
    verdicts = {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        block = RowsInPlace(rare_drop(8000, 256, rare_from=None), torch.arange(7750, 8000), dtype)
        ids = torch.randint(0, 7000, (8, 128))
        ids[0, 0] = 7995  # seen once in the batch: its gradient is dropped
        t = check_module("tok", block, (ids,), {}, CheckOptions(), restore=False, screen=True).tensors["block"]
        verdicts[dtype] = (t.verdict, t.inconclusive_kind)
    assert verdicts[torch.float32] == (None, InconclusiveKind.BELOW_RESOLUTION), verdicts
    assert verdicts[torch.float64] == (Verdict.WRONG, None), verdicts


@pytest.mark.parametrize("kind", ["ratio", "l2", "scattered", "zero"])
def test_a_diagnosis_read_a_chunk_at_a_time_says_what_the_whole_tensor_says(monkeypatch, kind):
    """A failing tensor's diagnosis reads its gradients in float64 a chunk at a time (no float64 copy of a big
    embedding's): across chunk boundaries it finds the same ratio, coefficient, count and worst entry."""
    from gradwatch.check.judging import training_judge

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1000, generator=g)
    param = torch.randn(1000, generator=g)
    live = {"ratio": ref * 3, "l2": ref + 0.1 * param, "zero": torch.zeros(1000),
            "scattered": ref + torch.where(torch.arange(1000) % 97 == 5, 2.0, 0.0)}[kind]
    whole = training_judge.judge_training("w", live, ref, param, torch.float32)
    monkeypatch.setattr(training_judge, "CHUNK", 7)
    cut = training_judge.judge_training("w", live, ref, param, torch.float32)
    assert cut.failed and whole.failed
    assert cut.diagnosis == whole.diagnosis, (cut.diagnosis, whole.diagnosis)
    assert cut.ratio == pytest.approx(whole.ratio, rel=1e-12, abs=0) if whole.ratio is not None else cut.ratio is None
    assert (cut.param_coef is None) == (whole.param_coef is None)
    if kind == "scattered":
        assert "at 11 of 1000 entries" in cut.diagnosis, cut.diagnosis
