"""A disagreeing probe taken again at smaller steps: a kink crossed (:func:`classify_kink`), a precision too low to
tell (:func:`resolve_low_precision`), curvature (:func:`halved`). Used by :mod:`gradwatch.check.probes.reexamine`
and the engine."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from gradwatch.check.judging.judge import agrees
from gradwatch.check.probes.lines import (
    EngineSettings,
    Evaluator,
    Outcome,
    Sample,
    Terms,
    central_probe,
    floor_at,
    parts_only,
    rise,
    slopes_of,
    usable_floor,
)

#: Smaller steps tried when a sample disagrees (fractions of the base step).
KINK_SCALES = (0.1, 0.01)


#: Evaluation precisions coarser than this (float32, half) can leave a disagreement unresolved.
LOW_PRECISION_EPS = 1e-10


#: Steps (fractions of the base step) of the low-precision re-examination, see :func:`resolve_low_precision`.
LOW_PRECISION_SCALES = (0.25, 0.18, 0.13)


#: One smaller step's probe as :func:`classify_kink` keeps it: ``(t, noise floor, right slope, left slope, analytic)``.
Seen = Tuple[float, float, float, float, float]


def classify_kink(p, saved, grads, sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], j0: Terms, evaluate: Evaluator,
                  settings: EngineSettings, scales: Sequence[float] = KINK_SCALES,
                  taken: Optional[Dict[float, Tuple[Terms, Terms, Terms, Terms]]] = None) -> Optional[bool]:
    """Decide whether a disagreeing sample sits on a non-differentiable point (True), has a wrong gradient
    (False), or cannot be told (None: no smaller step is above the rounding noise).

    An equivalent of Chainer's ``detect_nondifferentiable`` built from the
    values at hand: (1) the central difference is repeated at 1/10 and 1/100
    of the step; if it then agrees with the analytic slope, the function is
    not smooth within the original step (a kink was crossed) and the
    analytic gradient is right at this point. (2) Otherwise the one-sided
    slopes ``(J(θ+t)-J(θ))/t`` and ``(J(θ)-J(θ-t))/t`` are compared: for a
    smooth function their gap shrinks in proportion to ``t``; if it does not
    shrink, ``θ`` sits exactly on a kink. For a coordinate the analytic slope
    must then lie between the one-sided slopes (extrapolated to ``t -> 0``
    so curvature does not count): a valid subgradient. A random direction
    can cross several kinks at ``θ`` at once (e.g. zero-initialized biases
    with a zero input row: every ReLU unit sits on its kink), and then the
    framework's convention (``relu'(0) = 0``) need not lie between the two
    one-sided slopes; such a line is non-differentiable and is excluded.
    Scales whose noise floor exceeds both 1% of the slopes and 30% of the
    disagreement are not used (they cannot tell; :func:`usable_floor`).
    ``scales``: the smaller steps, as fractions of the base step. ``taken``: the probes at those steps
    taken before, by scale (in one batch, or by an earlier call); those taken here are added to it.
    """
    rel = settings.bands[1]
    t0 = sample.step
    jp0, jm0, _, _ = base
    gap0 = rise(jp0, j0) / t0 - rise(j0, jm0) / t0
    a0, n0 = slopes_of(*base, t0)
    disagreement = abs(n0["total"] - a0["total"])
    seen: List[Seen] = []
    last: Tuple[Terms, Terms] = ({}, {})
    last_numeric = n0["total"]
    taken = {} if taken is None else taken
    for scale in scales:
        t = t0 * scale
        fl = floor_at(settings, t)
        if scale not in taken:
            taken[scale] = central_probe(p, saved, grads, sample, t, evaluate)
        jp, jm, lp, lm = taken[scale]
        a, n = slopes_of(jp, jm, lp, lm, t)
        if not usable_floor(fl, a["total"], n["total"], disagreement):
            break
        if agrees(a["total"], n["total"], fl, rel):
            return True
        seen.append((t, fl, rise(jp, j0) / t, rise(j0, jm) / t, a["total"]))
        last = (jp, jm)
        last_numeric = n["total"]
    if not seen:  # no smaller step can tell: at weights near zero the base step crosses kinks it cannot resolve
        return None
    t, fl, right, left, _ = seen[-1]
    gap = right - left
    if not (abs(gap) > 4 * fl and abs(gap) > 0.3 * abs(gap0)):
        # Smooth at the smaller step, or its sides within the noise. A wrong gradient of a smooth function keeps
        # its numeric slope from step to step; one that moved with the step (a kink crossed by the base step and
        # by the smaller one, the next too noisy to use) cannot be told from a wrong gradient.
        moved = abs(last_numeric - n0["total"]) > 0.3 * disagreement + fl
        return None if moved else False
    if sample.index is None:
        return True
    return subgradient(seen, last, evaluate)


def subgradient(seen: Sequence[Seen], last: Tuple[Terms, Terms], evaluate: Evaluator) -> bool:
    """True when a coordinate's analytic slope lies between the one-sided slopes at the point (a valid subgradient),
    from the smaller steps' probes ``seen`` (the last one's values ``last``, extrapolated to ``t -> 0``), or between
    the sums of each term's one-sided slopes where several terms have kinks there."""
    t, fl, right, left, a_total = seen[-1]
    tol = fl
    if len(seen) >= 2:
        # One-sided slopes of a function smooth on each side are linear in t: extrapolate to t = 0.
        t1, fl1, right1, left1, _ = seen[-2]
        right = right - (right1 - right) * t / (t1 - t)
        left = left - (left1 - left) * t / (t1 - t)
        tol = 2.0 * fl + fl1 * t / (t1 - t)
    lo, hi = min(left, right), max(left, right)
    if lo - tol <= a_total <= hi + tol:
        return True
    jp, jm = last
    if len(jp) < 2 or parts_only(jp):  # one objective's parts share its kinks: no wider range
        return False
    # Kinks of different terms at the same point (an L1 penalty on a zero weight plus a ReLU in the
    # loss) add their subdifferentials: the framework's choice then lies in the sum of each term's
    # one-sided range, which can be wider than the range of the total's one-sided slopes.
    j0_terms = evaluate()
    lo = sum(min((jp[k] - j0_terms[k]) / t, (j0_terms[k] - jm[k]) / t) for k in jp)
    hi = sum(max((jp[k] - j0_terms[k]) / t, (j0_terms[k] - jm[k]) / t) for k in jp)
    return lo - tol - fl <= a_total <= hi + tol + fl


def unresolvable(sample: Sample, analytic: float, numeric: float, settings: EngineSettings) -> bool:
    """True when a disagreeing sample cannot be re-examined in this precision.

    In float64 the smaller steps of :func:`classify_kink` have a noise floor far
    below the slopes. In float32 the base step (``eps**(1/3)``, about 5e-3)
    often crosses a ReLU/max-pool kink, and at a tenth of it the noise floor
    already exceeds 1% of the slopes: the finite differences cannot tell a
    kink from a wrong gradient. Such a sample is neither a kink nor evidence
    of an error; it leaves the tensor inconclusive instead of raising a false alarm.
    """
    if settings.eval_eps <= LOW_PRECISION_EPS:
        return False
    floor = floor_at(settings, sample.step * KINK_SCALES[0])
    return not usable_floor(floor, analytic, numeric, abs(numeric - analytic))


def resolve_low_precision(p, saved, grads, sample: Sample, analytic: float, numeric: float, j0: Terms,
                          evaluate: Evaluator, settings: EngineSettings) -> Optional[bool]:
    """Kink (True), wrong gradient (False) or cannot tell (None), for a sample :func:`unresolvable` flagged.

    The worst-case noise floor is too pessimistic to re-examine at small steps
    in float32, so the rounding noise is measured instead: the central
    difference is repeated at three nearby smaller steps. Their spread
    estimates the noise. If they agree with the analytic slope (the gap to it
    shrank to under 30%, noise included), the base step crossed a kink. If they
    agree with the base numeric slope instead, and the one-sided slopes
    agree with each other (no kink sits at the point itself, where every
    step would give the same wrong-looking central difference), the function
    is smooth there and the gradient is wrong. Anything else (the noise is
    as large as the gap, a kink at or very near the point) cannot be told apart.
    """
    gap = abs(numeric - analytic)
    slopes, one_sided = [], []
    for scale in LOW_PRECISION_SCALES:
        t = sample.step * scale
        jp, jm, lp, lm = central_probe(p, saved, grads, sample, t, evaluate)
        a_t, n_t = slopes_of(jp, jm, lp, lm, t)
        if not (math.isfinite(a_t["total"]) and math.isfinite(n_t["total"])):
            return None
        slopes.append(n_t["total"])
        one_sided.append(rise(jp, j0) / t - rise(j0, jm) / t)
    mean = float(np.mean(slopes))
    noise = 3.0 * (max(slopes) - min(slopes))
    if abs(mean - analytic) + noise < 0.3 * gap:
        return True
    smooth = abs(one_sided[-1]) + 2.0 * noise < 0.3 * gap
    if smooth and abs(mean - numeric) + noise < 0.3 * gap:
        return False
    return None


#: A float64 sample beyond the EXCELLENT band whose gap to the analytic slope shrinks to this fraction or less at
#: half the step carries curvature (a central difference's error is the third derivative times ``t^2 / 6``: a quarter
#: of it at half the step; a wrong gradient's share of the gap stays), see :func:`richardson`.
CURVATURE_SHRINK = 0.8


def richardson(out: Outcome, half: Tuple[Terms, Terms], floor: float) -> Optional[Outcome]:
    """The sample's slopes from its probes at the base step (``out``) and at half of it (``half``: analytic and
    numeric slopes, noise ``floor``), where the numeric slope's gap to the analytic one shrank as curvature's does
    (to ``CURVATURE_SHRINK`` of it or less, beyond the noise, on the same side): the Richardson value
    ``(4 n(t/2) - n(t)) / 3``, its truncation error of order ``t^4``. None where the gap stays (a wrong gradient).

    Example:
        >>> base = Outcome({"total": 1.0}, {"total": 1.0 + 4e-7}, floor=1e-12)
        >>> round(richardson(base, ({"total": 1.0}, {"total": 1.0 + 1e-7}), 2e-12).numeric["total"], 12)
        1.0
        >>> round(richardson(base, ({"total": 1.0}, {"total": 1.0 + 2.5e-7}), 2e-12).numeric["total"] - 1.0, 12)
        2e-07
        >>> richardson(base, ({"total": 1.0}, {"total": 1.0 + 3.9e-7}), 2e-12) is None
        True
    """
    a1, n1 = out.analytic["total"], out.numeric["total"]
    a2, n2 = half[0]["total"], half[1]["total"]
    if not (math.isfinite(a2) and math.isfinite(n2)):
        return None
    gap1, gap2 = n1 - a1, n2 - a2
    if abs(gap2) > CURVATURE_SHRINK * abs(gap1) + 2.0 * floor or (gap1 * gap2 < 0.0 and abs(gap2) > 2.0 * floor):
        return None
    numeric = {k: (4.0 * half[1][k] - out.numeric.get(k, 0.0)) / 3.0 for k in half[1]}
    return Outcome(half[0], numeric, (4.0 * floor + out.floor) / 3.0)


def halved(p, saved, grads, sample: Sample, out: Outcome, evaluate: Evaluator, settings: EngineSettings
           ) -> Optional[Outcome]:
    """A :func:`curved` sample taken again at half its step; its Richardson outcome (:func:`richardson`) where the gap
    was curvature's, else None (the base outcome stands)."""
    t = (out.step or sample.step) / 2.0
    probe = central_probe(p, saved, grads, sample, t, evaluate)
    return richardson(out, slopes_of(*probe, t), floor_at(settings, t))
