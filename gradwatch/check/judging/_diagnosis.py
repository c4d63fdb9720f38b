"""How analytic and numeric values disagree, in words: a constant ratio, a sign flip, a missing term.

Pure math on sampled values (numpy): :func:`diagnose` words it, :func:`constant_ratio` gives the factor.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

#: The diagnosis a straight-through or surrogate gradient gives (:func:`~gradwatch.check.judging.report.suspects`).
STRAIGHT_THROUGH = "numeric gradient is zero where analytic is not"


def constant_ratio(analytic: Union[Sequence[float], np.ndarray], numeric: Union[Sequence[float], np.ndarray], floor: float,
                   tolerance: float = 1e-2) -> Optional[float]:
    """``analytic / numeric`` when one constant factor (other than 1) explains the disagreement, else None.

    The same fit :func:`diagnose` words as "analytic is 2.00x numeric" (or a sign flip).

    Example:
        >>> constant_ratio([2.0, 4.0, -6.0], [1.0, 2.0, -3.0], floor=1e-9)
        2.0
        >>> constant_ratio([1.0, 2.0], [1.0, 2.5], floor=1e-9) is None
        True
    """
    a = np.asarray(analytic, dtype=np.float64).reshape(-1)
    n = np.asarray(numeric, dtype=np.float64).reshape(-1)
    if a.size == 0 or not (np.all(np.isfinite(a)) and np.all(np.isfinite(n))):
        return None
    zero_floor = max(floor, 1e-300)
    nn = float(n @ n)
    if nn <= 0 or np.all(np.abs(n) <= zero_floor) or np.all(np.abs(a) <= zero_floor):
        return None
    ratio = float(a @ n) / nn
    misfit = float(np.linalg.norm(a - ratio * n)) / max(float(np.linalg.norm(a)), zero_floor)
    return ratio if misfit <= tolerance and abs(ratio - 1.0) > tolerance else None


def diagnose(analytic: Sequence[float], numeric: Sequence[float], floor: float, tolerance: float = 1e-2) -> Optional[str]:
    """Say in words how analytic and numeric disagree, or None if they agree.

    Recognizes a constant ratio ("analytic is 2.00x numeric"), a sign flip,
    an analytic zero where numeric is not (detached path / missing term),
    the reverse, and otherwise names how many entries differ.

    Args:
        analytic: Analytic values (coordinates and/or directional derivatives).
        numeric: Numerical values at the same places.
        floor: Absolute noise floor of ``numeric``; smaller values count as zero.
        tolerance: Relative misfit under which a ratio counts as constant.

    Example:
        >>> diagnose([2.0, 4.0, -6.0], [1.0, 2.0, -3.0], floor=1e-9)
        'analytic is 2.00x numeric (constant ratio): a factor in backward is wrong'
        >>> diagnose([-1.0, 2.0], [1.0, -2.0], floor=1e-9)
        'sign flip: analytic is the negative of numeric'
    """
    a = np.asarray(analytic, dtype=np.float64).reshape(-1)
    n = np.asarray(numeric, dtype=np.float64).reshape(-1)
    if a.size == 0:
        return None
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(n))):
        bad = "analytic" if not np.all(np.isfinite(a)) else "numeric"
        return f"{bad} gradient has non-finite values (NaN or inf)"
    zero_floor = max(floor, 1e-300)
    a_zero = np.abs(a) <= zero_floor
    n_zero = np.abs(n) <= zero_floor
    if np.all(a_zero) and not np.all(n_zero):
        return (
            "analytic gradient is zero where numeric is not: a detached path (.detach(), .data, "
            "torch.no_grad) or a term missing from backward"
        )
    if np.all(n_zero) and not np.all(a_zero):
        return (
            f"{STRAIGHT_THROUGH}: backward produces a gradient the forward "
            "does not have (a straight-through or surrogate gradient, if by design: declare its module with "
            "surrogates=[...]), or the check objective lacks a term training differentiates (pass it as a regularizer)"
        )
    if not np.any(np.abs(a - n) > zero_floor):
        return None
    ratio = constant_ratio(a, n, floor, tolerance)
    if ratio is not None:
        if abs(ratio + 1.0) <= tolerance:
            return "sign flip: analytic is the negative of numeric"
        if ratio < 0:
            return f"sign flip and scale: analytic is {ratio:.2f}x numeric"
        return f"analytic is {ratio:.2f}x numeric (constant ratio): a factor in backward is wrong"
    partial_zero = a_zero & ~n_zero
    if np.any(partial_zero):
        return (
            f"analytic is zero at {int(partial_zero.sum())} of {a.size} sampled entries where numeric is not "
            "(part of the gradient is missing or detached)"
        )
    mism = np.abs(a - n) > zero_floor + 1e-2 * (np.abs(a) + np.abs(n))
    if np.any(mism):
        i = int(np.argmax(np.abs(a - n)))
        return (
            f"analytic differs from numeric at {int(mism.sum())} of {a.size} sampled entries, not by a constant "
            f"factor (worst: analytic {a[i]:.6g} vs numeric {n[i]:.6g})"
        )
    return "small disagreement spread over the sampled entries (accumulated error or a subtly wrong term)"
