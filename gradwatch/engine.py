"""The sampled two-sided comparison for one tensor.

Each *sample* is a line through parameter space (one coordinate, or one
random unit direction). Along it the engine evaluates the objective at
``±t`` and compares the central difference with the analytic slope
``g·(θ(t) - θ(-t)) / 2t``, computed from the perturbation actually applied
(so rounding of ``θ + t·u`` in low precision does not count as error).

Disagreeing samples are re-examined before they count (see
:func:`classify_kink`), and every difference is judged against the
rounding-noise floor of the finite differences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .numeric import Verdict, max_rel_error, noise_floor, rel_diff
from .report import TensorCheck, diagnose
from .sampling import choose_coords, generator, rademacher, tensor_seed

Terms = Dict[str, float]
#: Rounding slack on top of one ulp of the objective, for error accumulated inside it.
NOISE_FACTOR = 32.0
#: Smaller steps tried when a sample disagrees (fractions of the base step).
KINK_SCALES = (0.1, 0.01)


class Evaluator:
    """Wraps ``evaluate() -> {term: float}`` and counts calls.

    Example:
        >>> ev = Evaluator(lambda: {"loss": 1.0})
        >>> ev()["loss"], ev.count
        (1.0, 1)
    """

    def __init__(self, evaluate: Callable[[], Terms]) -> None:
        self._evaluate = evaluate
        self.count = 0

    def __call__(self) -> Terms:
        self.count += 1
        return self._evaluate()


@dataclass
class Sample:
    """One line through parameter space: a coordinate (``index``) or a direction (``direction``)."""

    label: tuple
    step: float
    index: Optional[tuple] = None
    direction: Optional[torch.Tensor] = None


@dataclass
class Outcome:
    """Analytic and numeric slope of each term along one sample."""

    analytic: Terms
    numeric: Terms
    floor: float
    kink: bool = False


@dataclass
class EngineSettings:
    """What :func:`check_tensor` needs besides the tensor itself."""

    coords: int
    directions: int
    eps: Optional[float]
    bands: Sequence[float]
    fail_at: Verdict
    detect_kinks: bool
    eval_eps: float
    magnitude: float
    jitter: float = 0.0
    exhaustive: bool = False


def total(terms: Terms) -> float:
    """Sum of the terms (in a fixed order)."""
    return float(sum(terms[k] for k in sorted(terms)))


def floor_at(settings: EngineSettings, step: float) -> float:
    """Absolute noise floor of a central difference with this step."""
    return NOISE_FACTOR * settings.eval_eps * max(settings.magnitude, 1e-30) / step + settings.jitter / step


def _probe(p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], sample: Sample, t: float, evaluate: Evaluator) -> Tuple[Terms, Terms]:
    """Evaluate at ``θ + t·v`` and return (terms, analytic linear prediction per term); restores ``p`` exactly."""
    with torch.no_grad():
        if sample.index is not None:
            pos = sample.index
            p[pos] = saved[pos] + t
            delta = float(p[pos].double()) - float(saved[pos].double())
            try:
                terms = evaluate()
            finally:
                p[pos] = saved[pos]
            lin = {k: float(g[pos].double()) * delta for k, g in grads.items()}
        else:
            u = sample.direction
            p.copy_(saved + t * u.to(p.dtype))
            delta = p.double() - saved.double()
            try:
                terms = evaluate()
            finally:
                p.copy_(saved)
            lin = {k: float((g.double() * delta).sum()) for k, g in grads.items()}
    return terms, lin


def _central(p, saved, grads, sample, t, evaluate) -> Tuple[Terms, Terms, Terms, Terms]:
    jp, lp = _probe(p, saved, grads, sample, t, evaluate)
    jm, lm = _probe(p, saved, grads, sample, -t, evaluate)
    return jp, jm, lp, lm


def _slopes(jp: Terms, jm: Terms, lp: Terms, lm: Terms, t: float) -> Tuple[Terms, Terms]:
    analytic = {k: (lp[k] - lm[k]) / (2 * t) for k in lp}
    numeric = {k: (jp.get(k, 0.0) - jm.get(k, 0.0)) / (2 * t) for k in lp if k != "total"}
    numeric["total"] = (total(jp) - total(jm)) / (2 * t)
    return analytic, numeric


def agrees(a: float, n: float, floor: float, rel: float) -> bool:
    """True when ``|a - n|`` is within the noise floor plus ``rel`` of the magnitudes."""
    return abs(a - n) - floor <= rel * (abs(a) + abs(n))


def classify_kink(p, saved, grads, sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], j0: float, evaluate: Evaluator, settings: EngineSettings) -> bool:
    """Decide whether a disagreeing sample sits on a non-differentiable point.

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
    Scales whose noise floor exceeds 1% of the slopes are not used (they
    cannot tell).
    """
    rel = settings.bands[1]
    t0 = sample.step
    jp0, jm0, _, _ = base
    gap0 = (total(jp0) - j0) / t0 - (j0 - total(jm0)) / t0
    seen: List[Tuple[float, float, float, float, float]] = []
    for scale in KINK_SCALES:
        t = t0 * scale
        fl = floor_at(settings, t)
        jp, jm, lp, lm = _central(p, saved, grads, sample, t, evaluate)
        a, n = _slopes(jp, jm, lp, lm, t)
        if fl > 1e-2 * max(abs(a["total"]), abs(n["total"]), 1e-300):
            break
        if agrees(a["total"], n["total"], fl, rel):
            return True
        seen.append((t, fl, (total(jp) - j0) / t, (j0 - total(jm)) / t, a["total"]))
    if not seen:
        return False
    t, fl, right, left, a = seen[-1]
    gap = right - left
    if not (abs(gap) > 4 * fl and abs(gap) > 0.3 * abs(gap0)):
        return False
    if sample.index is None:
        return True
    tol = fl
    if len(seen) >= 2:
        # One-sided slopes of a function smooth on each side are linear in t: extrapolate to t = 0.
        t1, fl1, right1, left1, _ = seen[-2]
        right = right - (right1 - right) * t / (t1 - t)
        left = left - (left1 - left) * t / (t1 - t)
        tol = 2.0 * fl + fl1 * t / (t1 - t)
    lo, hi = min(left, right), max(left, right)
    return lo - tol <= a <= hi + tol


def _judged(analytic: np.ndarray, numeric: np.ndarray, floors: np.ndarray) -> float:
    if analytic.size == 0:
        return 0.0
    if not (np.all(np.isfinite(analytic)) and np.all(np.isfinite(numeric))):
        return float("nan")
    excess = np.maximum(np.abs(analytic - numeric) - floors, 0.0)
    denom = float(np.linalg.norm(analytic) + np.linalg.norm(numeric))
    if denom == 0.0:
        return 0.0
    return min(1.0, float(np.linalg.norm(excess)) / denom)


def build_samples(name: str, p: torch.Tensor, g: torch.Tensor, settings: EngineSettings, seed: int, h: float) -> List[Sample]:
    """The coordinates and directions to probe for one tensor (seeded per tensor)."""
    gen = generator(tensor_seed(seed, name))
    shape = tuple(p.shape)
    saved64 = p.detach().double()
    samples: List[Sample] = []
    k = p.numel() if settings.exhaustive else settings.coords
    for flat in choose_coords(g, k, gen).tolist() if k else []:
        pos = tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()
        scale = max(1.0, abs(float(saved64[pos])))
        samples.append(Sample(label=pos, step=h * scale, index=pos))
    if settings.directions and p.numel() > 1:
        rms = float(saved64.pow(2).mean().sqrt())
        dirs = rademacher(p.numel(), settings.directions, gen).to(p.device)
        for j in range(settings.directions):
            samples.append(Sample(label=("dir", j), step=h * max(1.0, rms), direction=dirs[j].reshape(shape)))
    return samples


def check_tensor(
    name: str,
    p: torch.Tensor,
    grads: Dict[str, torch.Tensor],
    evaluate: Evaluator,
    j0: float,
    settings: EngineSettings,
    seed: int,
) -> Tuple[TensorCheck, Dict[str, TensorCheck]]:
    """Probe one tensor and judge it.

    Args:
        name: Tensor name for the report.
        p: The tensor, perturbed in place and restored bit for bit.
        grads: Analytic gradient per term; key ``"total"`` is the full objective.
        evaluate: Objective terms at the current parameters.
        j0: Objective at the unperturbed point.
        settings: Sample sizes, step, bands and noise model.
        seed: Sampling seed.

    Returns:
        The tensor's :class:`TensorCheck` and one per term (when grads has more than ``"total"``).
    """
    saved = p.detach().clone()
    h = settings.eps if settings.eps is not None else settings.eval_eps ** (1.0 / 3.0)
    samples = build_samples(name, p, grads["total"], settings, seed, h)
    outcomes: List[Outcome] = []
    genuine_streak = 0
    try:
        for sample in samples:
            base = _central(p, saved, grads, sample, sample.step, evaluate)
            a, n = _slopes(*base, sample.step)
            fl = floor_at(settings, sample.step)
            out = Outcome(a, n, fl)
            finite = math.isfinite(a["total"]) and math.isfinite(n["total"])
            if (
                settings.detect_kinks
                and finite
                and genuine_streak < 3
                and not agrees(a["total"], n["total"], fl, settings.bands[1])
            ):
                out.kink = classify_kink(p, saved, grads, sample, base, j0, evaluate, settings)
                genuine_streak = 0 if out.kink else genuine_streak + 1
            outcomes.append(out)
    finally:
        with torch.no_grad():
            p.copy_(saved)
    main = _summarize(name, tuple(p.shape), samples, outcomes, "total", settings)
    per_term = {
        term: _summarize(name, tuple(p.shape), samples, outcomes, term, settings)
        for term in grads
        if term != "total"
    }
    return main, per_term


def _summarize(name, shape, samples: List[Sample], outcomes: List[Outcome], term: str, settings: EngineSettings) -> TensorCheck:
    coords = [(s, o) for s, o in zip(samples, outcomes) if s.index is not None]
    dirs = [(s, o) for s, o in zip(samples, outcomes) if s.index is None]

    def arrays(pairs):
        kept = [(s, o) for s, o in pairs if not o.kink]
        a = np.array([o.analytic[term] for _, o in kept], dtype=np.float64)
        n = np.array([o.numeric.get(term, 0.0) for _, o in kept], dtype=np.float64)
        f = np.array([o.floor for _, o in kept], dtype=np.float64)
        return a, n, f

    ca, cn, cf = arrays(coords)
    da, dn, df = arrays(dirs)
    judged = max(_judged(ca, cn, cf), _judged(da, dn, df))
    check = TensorCheck(
        name=name,
        shape=shape,
        rel_diff=rel_diff(ca, cn) if ca.size else 0.0,
        max_rel_error=max_rel_error(ca, cn),
        directional_rel_diff=rel_diff(da, dn) if da.size else None,
        judged_rel_diff=judged,
        noise_floor=float(max(cf.max() if cf.size else 0.0, df.max() if df.size else 0.0)),
        step=samples[0].step if samples else 0.0,
        kinks=sum(o.kink for o in outcomes),
        coords=[tuple(s.index) for s, _ in coords],
        analytic=[o.analytic[term] for _, o in coords],
        numeric=[o.numeric.get(term, 0.0) for _, o in coords],
        dir_analytic=[o.analytic[term] for _, o in dirs],
        dir_numeric=[o.numeric.get(term, 0.0) for _, o in dirs],
    )
    if not (np.all(np.isfinite(ca)) and np.all(np.isfinite(cn)) and np.all(np.isfinite(da)) and np.all(np.isfinite(dn))):
        check.inconclusive = "non-finite values in the objective or gradient along the sampled points"
        check.judged_rel_diff = float("nan")
        return check
    check.verdict = Verdict.from_value(judged, settings.bands)
    check.failed = check.verdict.is_failure(settings.fail_at)
    if check.failed:
        floor = float(np.max(np.concatenate([cf, df]))) if (cf.size + df.size) else 0.0
        check.diagnosis = diagnose(np.concatenate([ca, da]), np.concatenate([cn, dn]), floor)
    return check
