"""Pure numerics: rel_diff, max_rel_error, Verdict bands, default_step, numerical_grad, CheckReport."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import gradwatch
from gradwatch import CheckReport, GradientCheckError, TensorCheck, Verdict, max_rel_error, rel_diff
from gradwatch.check.numerics.differences import default_step, machine_eps


def tutorial_rel_error(x, y):
    """The tutorial's ``rel_error``, verbatim."""
    return np.max(np.abs(x - y) / (np.maximum(1e-8, np.abs(x) + np.abs(y))))


# --- rel_diff ---------------------------------------------------------------


def test_rel_diff_matches_chapter_formula():
    rng = np.random.RandomState(0)
    for _ in range(5):
        a, b = rng.randn(7), rng.randn(7)
        expected = np.linalg.norm(a - b) / (np.linalg.norm(a) + np.linalg.norm(b))
        assert rel_diff(a, b) == pytest.approx(expected, rel=1e-12)


def test_rel_diff_known_value_and_inputs_of_any_kind():
    assert rel_diff([2.0], [1.0]) == pytest.approx(1.0 / 3.0)
    assert rel_diff(torch.tensor([2.0, 0.0]), np.array([1.0, 0.0])) == pytest.approx(1.0 / 3.0)
    # shape does not matter, only the elements
    assert rel_diff(np.ones((2, 3)), np.ones(6)) == 0.0


def test_rel_diff_is_symmetric():
    rng = np.random.RandomState(1)
    a, b = rng.randn(10), 3 * rng.randn(10)
    assert rel_diff(a, b) == rel_diff(b, a)


def test_rel_diff_zero_when_equal_and_when_both_zero():
    a = np.random.RandomState(2).randn(5)
    assert rel_diff(a, a.copy()) == 0.0
    assert rel_diff(np.zeros(4), np.zeros(4)) == 0.0


def test_rel_diff_bounded_by_one():
    a = np.array([1.0, -2.0])
    assert rel_diff(a, -a) == pytest.approx(1.0)
    assert rel_diff(a, np.zeros(2)) == pytest.approx(1.0)


def test_rel_diff_rejects_different_sizes_and_flags_nan():
    with pytest.raises(ValueError, match="equal size"):
        rel_diff([1.0, 2.0], [1.0])
    assert math.isnan(rel_diff([float("nan")], [1.0]))


# --- max_rel_error ---------------------------------------------------------


def test_max_rel_error_matches_tutorial_rel_error():
    rng = np.random.RandomState(3)
    for _ in range(5):
        x, y = rng.randn(4, 5), rng.randn(4, 5)
        x[0, 0] = y[0, 0] = 0.0  # the 1e-8 floor
        assert max_rel_error(x, y) == pytest.approx(tutorial_rel_error(x, y), rel=1e-12)


def test_max_rel_error_values():
    assert max_rel_error([1.0, 0.0], [1.0, 0.0]) == 0.0
    assert max_rel_error([2.0, 1.0], [1.0, 1.0]) == pytest.approx(1.0 / 3.0)
    # tiny absolute differences around zero are divided by the 1e-8 floor
    assert max_rel_error([1e-9], [0.0]) == pytest.approx(1e-9 / 1e-8)
    assert max_rel_error([], []) == 0.0


# --- Verdict ---------------------------------------------------------------


@pytest.mark.parametrize(
    "value, verdict",
    [
        (0.0, Verdict.EXCELLENT),
        (5e-8, Verdict.EXCELLENT),
        (1e-7, Verdict.ACCEPTABLE),
        (5e-5, Verdict.ACCEPTABLE),
        (1e-4, Verdict.SUSPICIOUS),
        (5e-3, Verdict.SUSPICIOUS),
        (1e-2, Verdict.WRONG),
        (0.5, Verdict.WRONG),
        (float("nan"), Verdict.WRONG),
        (float("inf"), Verdict.WRONG),
    ],
)
def test_verdict_default_bands(value, verdict):
    assert Verdict.from_value(value) is verdict


def test_verdict_custom_bands():
    bands = (1e-5, 1e-3, 1e-1)
    assert Verdict.from_value(5e-6, bands) is Verdict.EXCELLENT
    assert Verdict.from_value(5e-5, bands) is Verdict.ACCEPTABLE
    assert Verdict.from_value(5e-2, bands) is Verdict.SUSPICIOUS
    assert Verdict.from_value(0.2, bands) is Verdict.WRONG


def test_verdict_invalid_bands():
    with pytest.raises(ValueError, match="increasing"):
        Verdict.from_value(0.1, (1e-2, 1e-4, 1e-7))
    with pytest.raises(ValueError, match="three"):
        Verdict.from_value(0.1, (1e-4, 1e-2))


def test_verdict_order_and_failure():
    assert [v.rank for v in (Verdict.EXCELLENT, Verdict.ACCEPTABLE, Verdict.SUSPICIOUS, Verdict.WRONG)] == [0, 1, 2, 3]
    assert Verdict.SUSPICIOUS.is_failure(Verdict.SUSPICIOUS)
    assert not Verdict.SUSPICIOUS.is_failure(Verdict.WRONG)
    assert not Verdict.ACCEPTABLE.is_failure(Verdict.SUSPICIOUS)
    assert Verdict.parse("WRONG") is Verdict.WRONG
    with pytest.raises(ValueError, match="unknown verdict"):
        Verdict.parse("bad")


# --- steps -----------------------------------------------------------------


def test_default_step_is_cube_root_of_machine_eps():
    assert default_step(torch.float64) == pytest.approx(np.finfo(np.float64).eps ** (1 / 3))
    assert default_step(torch.float64) == pytest.approx(6.06e-6, rel=1e-2)
    assert default_step(torch.float32) == pytest.approx(4.92e-3, rel=1e-2)
    assert default_step(np.float64) == default_step(torch.float64)
    assert machine_eps(np.float32) == machine_eps(torch.float32)


# --- numerical_grad --------------------------------------------------------


def test_numerical_grad_chapter_example():
    x = np.array([2.0])
    g = gradwatch.numerical_grad(lambda: float(x[0] ** 2 + 3 * x[0]), x, eps=1e-3)
    assert g.shape == (1,)
    assert g[0] == pytest.approx(7.0, abs=1e-9)
    assert x[0] == 2.0  # restored exactly


def test_numerical_grad_torch_tuple_and_grad_outputs():
    torch.manual_seed(0)
    a = torch.randn(3, dtype=torch.float64)
    b = torch.randn(3, dtype=torch.float64)
    a0, b0 = a.clone(), b.clone()
    gy = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    ga, gb = gradwatch.numerical_grad(lambda: a * b + torch.sin(a), (a, b), gy)
    assert torch.allclose(ga, gy * (b + torch.cos(a)), atol=1e-8)
    assert torch.allclose(gb, gy * a, atol=1e-8)
    assert torch.equal(a, a0) and torch.equal(b, b0)


def test_numerical_grad_default_step_and_bad_eps():
    x = np.array([0.3, -1.2])
    g = gradwatch.numerical_grad(lambda: float(np.sum(x ** 3)), x)
    assert np.allclose(g, 3 * x ** 2, rtol=1e-8)
    with pytest.raises(ValueError, match="eps"):
        gradwatch.numerical_grad(lambda: float(x.sum()), x, eps=0.0)


# --- CheckReport -----------------------------------------------------------


def _net_report():
    """A real report: one tensor 2x wrong, one right."""
    params = {"good": np.array([1.0, -2.0, 0.5]), "bad": np.array([0.3, 0.7])}

    def loss():
        return float(np.sum(params["good"] ** 2) + np.sum(np.sin(params["bad"])))

    grads = {"good": 2 * params["good"], "bad": 2.0 * np.cos(params["bad"])}
    return gradwatch.check_numpy(loss, params, grads)


def test_report_fields_and_json():
    report = _net_report()
    assert not report.ok
    assert [t.name for t in report.failures] == ["bad"]
    assert report.worst.name == "bad"
    assert report.tensors["good"].verdict is Verdict.EXCELLENT
    assert report.tensors["bad"].verdict is Verdict.WRONG
    d = report.to_dict()
    text = json.dumps(d)
    back = json.loads(text)
    assert back["ok"] is False
    assert back["failures"] == ["bad"]
    assert back["tensors"]["bad"]["verdict"] == "wrong"
    assert back["tensors"]["good"]["coords"] == [[0], [1], [2]]
    assert "analytic" not in report.to_dict(samples=False)["tensors"]["bad"]


def test_report_json_with_nan_and_inconclusive():
    report = CheckReport(tensors={"w": TensorCheck(name="w", shape=(2,), rel_diff=float("nan"), max_rel_error=float("nan"),
                                                    inconclusive="objective is not finite")},
                         nonfinite=True)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["ok"] is False
    assert d["tensors"]["w"]["rel_diff"] == "nan"
    assert d["objective"] == "nan"
    assert "INCONCLUSIVE" in str(report)


def test_report_str_lists_worst_first():
    report = _net_report()
    text = str(report)
    assert "FAILED" in text
    assert "WRONG" in text and "EXCELLENT" in text
    assert "2.00x" in text
    assert text.index("bad") < text.index("good")
    ok_text = str(gradwatch.check_numpy(lambda: 1.0, {"w": np.zeros(2)}, {"w": np.zeros(2)}))
    assert "OK" in ok_text and "w" in ok_text


def test_raise_for_failures():
    report = _net_report()
    with pytest.raises(GradientCheckError) as info:
        report.raise_for_failures()
    assert info.value.report is report
    assert isinstance(info.value, AssertionError)
    msg = str(info.value)
    assert "bad" in msg
    assert "analytic" in msg
    assert "numeric" in msg
    assert "2.00x" in msg
    assert "good:" not in msg
    ok = CheckReport(tensors={})
    assert ok.raise_for_failures() is ok
