"""Property tests: the agreement measure and the finite differences it judges.

- ``rel_diff`` is symmetric, lies in [0, 1] and is zero exactly when the vectors are equal.
- Central differences of random smooth float64 functions (polynomials, sin/exp
  compositions) match their analytic derivatives within the bound derived from
  the step ``h``: truncation ``h**2 * max|f'''| / 6`` plus rounding ``c * eps * max|f| / h``.
- ``check_numpy`` never calls a correct gradient of such a function suspicious, and
  always catches one scaled by 2.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradwatch import Verdict, check_numpy, max_rel_error, numerical_grad, rel_diff
from gradwatch.check.numerics.differences import central_difference, default_step

EPS = float(np.finfo(np.float64).eps)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The full float64 range: subnormals (whose squares underflow) and huge values (whose squares overflow).
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
vectors = st.integers(min_value=1, max_value=12).flatmap(
    lambda n: st.tuples(hnp.arrays(np.float64, n, elements=finite), hnp.arrays(np.float64, n, elements=finite))
)


# ---------------------------------------------------------------- rel_diff


@SETTINGS
@given(vectors)
def test_rel_diff_is_symmetric_and_bounded(pair):
    a, b = pair
    d = rel_diff(a, b)
    assert d == rel_diff(b, a)
    assert 0.0 <= d <= 1.0
    assert 0.0 <= max_rel_error(a, b) <= 1.0


@SETTINGS
@given(vectors)
def test_rel_diff_is_zero_iff_equal(pair):
    a, b = pair
    assert rel_diff(a, a) == 0.0
    assert (rel_diff(a, b) == 0.0) == bool(np.array_equal(a, b))


moderate = st.floats(min_value=-1e100, max_value=1e100, allow_subnormal=False, width=64)


@SETTINGS
@given(
    st.integers(min_value=1, max_value=8).flatmap(lambda n: st.tuples(*[hnp.arrays(np.float64, n, elements=moderate)] * 2)),
    st.floats(min_value=1e-3, max_value=1e3),
)
def test_rel_diff_is_scale_invariant(pair, scale):
    a, b = pair
    assert math.isclose(rel_diff(a * scale, b * scale), rel_diff(a, b), rel_tol=1e-9, abs_tol=1e-12)


@SETTINGS
@given(vectors)
def test_short_lists_measure_like_arrays(pair):
    # Short Python lists take a pure-Python path (the engine's per-tensor summaries); it must agree with numpy's.
    a, b = pair
    la, lb = a.tolist(), b.tolist()
    for fn in (rel_diff, max_rel_error):
        fast, ref = fn(la, lb), fn(a, b)
        assert math.isclose(fast, ref, rel_tol=1e-12, abs_tol=0.0) or (fast > 0.0 and ref > 0.0 and max(fast, ref) < 1e-300)
    assert rel_diff(lb, la) == rel_diff(la, lb)
    assert (rel_diff(la, lb) == 0.0) == bool(np.array_equal(a, b))


def test_rel_diff_of_opposite_vectors_is_one():
    assert rel_diff([1.0, -2.0], [-1.0, 2.0]) == 1.0
    assert math.isnan(rel_diff([float("nan")], [1.0]))


# ---------------------------------------------------------------- central differences


coeffs = hnp.arrays(np.float64, st.integers(min_value=1, max_value=7), elements=st.floats(-3, 3, width=64))
points = st.floats(min_value=-2.0, max_value=2.0, width=64)
steps = st.floats(min_value=1e-6, max_value=1e-2, width=64)


def _poly_bound(c: np.ndarray, x: float, h: float) -> float:
    """Truncation plus rounding bound of the central difference of ``sum c_k x**k`` at ``x``."""
    r = abs(x) + h
    k = np.arange(c.size)
    third = float(np.sum(np.abs(c) * k * (k - 1) * (k - 2) * np.where(k >= 3, r ** np.maximum(k - 3, 0), 0.0)))
    size = float(np.sum(np.abs(c) * r**k))
    truncation = h * h * third / 6.0
    # Horner: ~2n roundings, relative to sum |c_k| |x|^k; plus absolute rounding in the subnormal range.
    rounding = 2 * (c.size + 2) * (EPS * size + np.finfo(np.float64).tiny) / h
    return 2.0 * (truncation + rounding)


@SETTINGS
@given(coeffs, points, steps)
def test_central_difference_of_polynomials(c, x0, h):
    x = np.array([x0])
    f = lambda: float(np.polynomial.polynomial.polyval(x[0], c))  # noqa: E731
    numeric = float(numerical_grad(f, x, eps=h)[0])
    analytic = float(np.polynomial.polynomial.polyval(x0, np.polynomial.polynomial.polyder(c)))
    assert x[0] == x0  # restored exactly
    assert abs(numeric - analytic) <= _poly_bound(c, x0, h)


@SETTINGS
@given(
    st.floats(-3, 3), st.floats(-3, 3), st.floats(-2, 2), st.floats(-2, 2), points, steps,
)
def test_central_difference_of_sin_exp_compositions(a, b, c, d, x0, h):
    """``f(x) = a sin(b x) + c exp(d x) + sin(exp(x / 2))`` against its analytic derivative."""

    def f(x):
        return a * math.sin(b * x) + c * math.exp(d * x) + math.sin(math.exp(x / 2))

    def df(x):
        return a * b * math.cos(b * x) + c * d * math.exp(d * x) + math.cos(math.exp(x / 2)) * math.exp(x / 2) / 2

    r = abs(x0) + h
    e = math.exp(r / 2)
    # |d^3/dx^3 sin(exp(x/2))| <= (e + 3 e^2 + e^3) / 8 (chain rule, |sin|, |cos| <= 1).
    third = abs(a) * abs(b) ** 3 + abs(c) * abs(d) ** 3 * math.exp(abs(d) * r) + (e + 3 * e**2 + e**3) / 8
    size = abs(a) + abs(c) * math.exp(abs(d) * r) + 1.0
    bound = 2.0 * (h * h * third / 6.0 + 8 * EPS * size / h)
    numeric = central_difference(f(x0 + h), f(x0 - h), h)
    assert abs(numeric - df(x0)) <= bound


@SETTINGS
@given(coeffs, points)
def test_default_step_balances_truncation_and_rounding(c, x0):
    h = default_step(np.float64)
    x = np.array([x0])
    numeric = float(numerical_grad(lambda: float(np.polynomial.polynomial.polyval(x[0], c)), x)[0])
    analytic = float(np.polynomial.polynomial.polyval(x0, np.polynomial.polynomial.polyder(c)))
    assert abs(numeric - analytic) <= _poly_bound(c, x0, h)


# ---------------------------------------------------------------- the judge


def _smooth_problem(seed: int, n: int):
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(n, n))
    A = A @ A.T / n
    b = rng.normal(size=n)
    freq = rng.uniform(0.5, 2.0, size=n)
    w = {"w": rng.normal(size=n)}

    def loss():
        v = w["w"]
        return float(0.5 * v @ A @ v + b @ v + np.sin(freq * v).sum() + np.log1p(np.exp(v)).sum())

    def grad():
        v = w["w"]
        return A @ v + b + freq * np.cos(freq * v) + 1.0 / (1.0 + np.exp(-v))

    return w, loss, grad


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=1, max_value=20))
def test_check_numpy_accepts_correct_and_catches_wrong_gradients(seed, n):
    w, loss, grad = _smooth_problem(seed, n)
    before = w["w"].copy()
    good = check_numpy(loss, w, {"w": grad()}, coords=4, directions=2, seed=seed)
    assert good.ok, str(good)
    assert good.tensors["w"].verdict in (Verdict.EXCELLENT, Verdict.ACCEPTABLE)
    g = grad()
    if np.linalg.norm(g) > 1e-3:
        bad = check_numpy(loss, w, {"w": 2.0 * g}, coords=n, directions=2, seed=seed)
        assert not bad.ok
        assert bad.tensors["w"].verdict in (Verdict.SUSPICIOUS, Verdict.WRONG)
    assert np.array_equal(w["w"], before)
