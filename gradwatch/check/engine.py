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
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .numeric import Verdict, max_rel_error, rel_diff
from .report import InconclusiveKind, TensorCheck, constant_ratio, diagnose
from .sampling import choose_coords, generator, rademacher_signs, tensor_seed

Terms = Dict[str, float]
#: Rounding slack on top of one ulp of the objective, for error accumulated inside it.
NOISE_FACTOR = 32.0
#: Smaller steps tried when a sample disagrees (fractions of the base step).
KINK_SCALES = (0.1, 0.01)
#: Evaluation precisions coarser than this (float32, half) can leave a disagreement unresolved.
LOW_PRECISION_EPS = 1e-10
#: Steps (fractions of the base step) of the low-precision re-examination, see :func:`resolve_low_precision`.
LOW_PRECISION_SCALES = (0.25, 0.18, 0.13)
#: Largest tensor whose direction signs are drawn in its own dtype (8 MB per direction in float64);
#: larger ones keep int8 signs (a mixed-dtype add costs twice as much, but 8x less memory).
DENSE_SIGNS_MAX = 1 << 20


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
    #: A direction given as signs ``±1`` times ``scale`` (cheaper than a float ``direction``): in the
    #: tensor's dtype, or int8 for tensors over ``DENSE_SIGNS_MAX`` entries.
    signs: Optional[torch.Tensor] = None
    scale: float = 1.0
    #: Cached: the unperturbed value at ``index`` (exact, as a Python float).
    base: Optional[float] = None
    #: Cached: analytic slope per term along the unit line (``g[index]``, or ``g·direction``).
    slope: Optional[Terms] = None
    #: Flat (row-major) position of ``index`` in the tensor, when known.
    flat: Optional[int] = None
    #: Cached while the sample is probed: the tensor last written and its element at ``index``.
    target: Optional[torch.Tensor] = None
    view: Optional[torch.Tensor] = None

    def forget(self) -> None:
        """Drop the tensors cached while probing (the sample's record stays)."""
        self.target = self.view = None


@dataclass
class Outcome:
    """Analytic and numeric slope of each term along one sample."""

    analytic: Terms
    numeric: Terms
    floor: float
    kink: bool = False
    unresolved: bool = False


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
    #: Where the objective computes in a lower precision than the tensors (see :mod:`gradwatch.check.precision`).
    coarse: Optional[str] = None


def total(terms: Terms) -> float:
    """Sum of the terms (in a fixed order)."""
    return float(sum(terms[k] for k in sorted(terms)))


def floor_at(settings: EngineSettings, step: float) -> float:
    """Absolute noise floor of a central difference with this step."""
    return NOISE_FACTOR * settings.eval_eps * max(settings.magnitude, 1e-30) / step + settings.jitter / step


def _slope(saved: torch.Tensor, grads: Dict[str, torch.Tensor], sample: Sample) -> Terms:
    """Analytic slope of each term along the sample's unit line (computed once, cached on the sample)."""
    if sample.slope is None:
        if sample.index is not None:
            vals = [float(g[sample.index]) for g in grads.values()]
        elif sample.signs is not None:
            s64 = sample.signs.reshape(-1).to(torch.float64)  # no copy when the signs are float64
            vals = [sample.scale * float(torch.dot(g.reshape(-1).to(torch.float64), s64)) for g in grads.values()]
        else:
            u64 = sample.direction.reshape(-1).to(torch.float64)
            vals = [float(torch.dot(g.reshape(-1).to(torch.float64), u64)) for g in grads.values()]
        sample.slope = dict(zip(grads, vals))
    return sample.slope


def _apply(p: torch.Tensor, saved: torch.Tensor, sample: Sample, t: float) -> Optional[float]:
    """Write ``θ + t·v`` into ``p`` (one fused pass for a direction); return the applied delta of a coordinate."""
    if sample.index is not None:
        if sample.base is None:
            sample.base = float(saved[sample.index])
        if p is sample.target:
            view = sample.view  # indexed once per sample (the view's fill_ is 3x cheaper than p[index])
        else:
            view = p[sample.index]
            sample.target, sample.view = p, view
        view.fill_(sample.base + t)
        applied = sample.base + t if p.dtype == torch.float64 else float(view)
        return applied - sample.base
    if sample.signs is not None:
        torch.add(saved, sample.signs.reshape(p.shape), alpha=t * sample.scale, out=p)
    else:
        torch.add(saved, sample.direction.to(p.dtype), alpha=t, out=p)
    return None


def _restore(p: torch.Tensor, saved: torch.Tensor, sample: Sample) -> None:
    if sample.index is not None:
        if sample.base is not None:
            view = sample.view if p is sample.target else p[sample.index]
            view.fill_(sample.base)  # exact: a Python float holds any float32/16 value
        else:
            p[sample.index] = saved[sample.index]
    else:
        p.copy_(saved)


def _lin(p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], sample: Sample, t: float, delta: Optional[float]) -> Terms:
    """Analytic linear prediction per term for the perturbation now in ``p``.

    Computed from the perturbation actually applied, so rounding of ``θ + t·v`` in low
    precision does not count as error. In float64 that rounding is ~1e-16 of ``|θ|`` and a
    direction's prediction is ``t`` times its cached slope (no pass over the tensor).
    """
    slope = _slope(saved, grads, sample)
    if delta is not None:
        return {k: s * delta for k, s in slope.items()}
    if p.dtype == torch.float64:
        return {k: s * t for k, s in slope.items()}
    d64 = (p.detach().to(torch.float64) - saved.to(torch.float64)).reshape(-1)
    return {k: float(torch.dot(g.reshape(-1).to(torch.float64), d64)) for k, g in grads.items()}


def _probe(p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], sample: Sample, t: float, evaluate: Evaluator) -> Tuple[Terms, Terms]:
    """Evaluate at ``θ + t·v`` and return (terms, analytic linear prediction per term); restores ``p`` exactly."""
    with torch.no_grad():
        try:
            delta = _apply(p, saved, sample, t)
            terms = evaluate()
            lin = _lin(p, saved, grads, sample, t, delta)
        finally:
            _restore(p, saved, sample)
    return terms, lin


def _central(p, saved, grads, sample, t, evaluate) -> Tuple[Terms, Terms, Terms, Terms]:
    """Both sides of a central difference; ``p`` is written twice and restored once."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return _central(p, saved, grads, sample, t, evaluate)
    # check_tensor probes under one no_grad: entering it per sample would cost more than the check above.
    try:
        delta = _apply(p, saved, sample, t)
        jp = evaluate()
        lp = _lin(p, saved, grads, sample, t, delta)
        delta = _apply(p, saved, sample, -t)
        jm = evaluate()
        lm = _lin(p, saved, grads, sample, -t, delta)
    finally:
        _restore(p, saved, sample)
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
    last: Tuple[Terms, Terms] = ({}, {})
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
        last = (jp, jm)
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
    if lo - tol <= a <= hi + tol:
        return True
    jp, jm = last
    if len(jp) < 2:
        return False
    # Kinks of different terms at the same point (an L1 penalty on a zero weight plus a ReLU in the
    # loss) add their subdifferentials: the framework's choice then lies in the sum of each term's
    # one-sided range, which can be wider than the range of the total's one-sided slopes.
    j0_terms = evaluate()
    lo = sum(min((jp[k] - j0_terms[k]) / t, (j0_terms[k] - jm[k]) / t) for k in jp)
    hi = sum(max((jp[k] - j0_terms[k]) / t, (j0_terms[k] - jm[k]) / t) for k in jp)
    return lo - tol - fl <= a <= hi + tol + fl


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
    return floor > 1e-2 * max(abs(analytic), abs(numeric), 1e-300)


def resolve_low_precision(p, saved, grads, sample: Sample, analytic: float, numeric: float, j0: float,
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
        jp, jm, lp, lm = _central(p, saved, grads, sample, t, evaluate)
        a_t, n_t = _slopes(jp, jm, lp, lm, t)
        if not (math.isfinite(a_t["total"]) and math.isfinite(n_t["total"])):
            return None
        slopes.append(n_t["total"])
        one_sided.append((total(jp) - j0) / t - (j0 - total(jm)) / t)
    mean = float(np.mean(slopes))
    noise = 3.0 * (max(slopes) - min(slopes))
    if abs(mean - analytic) + noise < 0.3 * gap:
        return True
    smooth = abs(one_sided[-1]) + 2.0 * noise < 0.3 * gap
    if smooth and abs(mean - numeric) + noise < 0.3 * gap:
        return False
    return None


def _judged(analytic: List[float], numeric: List[float], floors: List[float]) -> float:
    """Relative difference after discounting each sample's noise floor (0 when every gap is within it)."""
    if not analytic:
        return 0.0
    if not (all(map(math.isfinite, analytic)) and all(map(math.isfinite, numeric))):
        return float("nan")
    excess = [max(abs(a - n) - f, 0.0) for a, n, f in zip(analytic, numeric, floors)]
    denom = math.hypot(*analytic) + math.hypot(*numeric)
    if denom == 0.0:
        return 0.0
    return min(1.0, math.hypot(*excess) / denom)


def build_samples(name: str, p: torch.Tensor, g: torch.Tensor, settings: EngineSettings, seed: int, h: float) -> List[Sample]:
    """The coordinates and directions to probe for one tensor (seeded per tensor)."""
    gen = generator(tensor_seed(seed, name))
    shape = tuple(p.shape)
    samples: List[Sample] = []
    k = p.numel() if settings.exhaustive else settings.coords
    flat = choose_coords(g, k, gen) if k else torch.empty(0, dtype=torch.long)
    if flat.numel():
        # One gather and one host transfer for all coordinates (no per-coordinate indexing or sync).
        values = p.detach().reshape(-1)[flat.to(p.device)].tolist()
        flat_list = flat.tolist()
        positions = [a.tolist() for a in np.unravel_index(flat.numpy(), shape)] if shape else None
        for j, value in enumerate(values):
            pos = tuple(a[j] for a in positions) if shape else ()
            samples.append(Sample(label=pos, step=h * max(1.0, abs(value)), index=pos, base=float(value), flat=flat_list[j]))
    if settings.directions and p.numel() > 1:
        n = p.numel()
        rms = float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) / math.sqrt(n)
        dtype = p.dtype if p.is_floating_point() and n <= DENSE_SIGNS_MAX else torch.int8
        signs = rademacher_signs(n, settings.directions, gen, dtype=dtype).to(p.device)
        for j in range(settings.directions):
            samples.append(Sample(label=("dir", j), step=h * max(1.0, rms), signs=signs[j].reshape(shape), scale=1.0 / math.sqrt(n)))
    return samples


def prepare_slopes(samples: List[Sample], saved: torch.Tensor, grads: Dict[str, torch.Tensor]) -> None:
    """Fill every sample's analytic slope per term at once: one gather per term for all coordinates."""
    coords = [s for s in samples if s.index is not None and s.slope is None]
    if coords:
        shape = tuple(saved.shape)
        idx = torch.tensor([s.flat if s.flat is not None else (int(np.ravel_multi_index(s.index, shape)) if s.index else 0)
                            for s in coords], dtype=torch.long, device=saved.device)
        table = torch.stack([g.reshape(-1)[idx].to(torch.float64) for g in grads.values()]).cpu().tolist()
        for j, s in enumerate(coords):
            s.slope = {k: row[j] for k, row in zip(grads, table)}
    for s in samples:
        if s.index is None:
            _slope(saved, grads, s)


class BatchProbe:
    """What :func:`batched_bases` needs from a batched evaluator (see :mod:`gradwatch.check.batched`)."""

    def chunk(self, p: torch.Tensor) -> int:
        """How many perturbed copies of ``p`` to evaluate at once."""
        raise NotImplementedError

    def __call__(self, name: str, p: torch.Tensor, saved: torch.Tensor, stacked: torch.Tensor) -> Optional[List[Terms]]:
        """Terms at each ``stacked[i]`` put in place of ``p``; None to fall back to one evaluation each."""
        raise NotImplementedError


def batched_bases(name: str, p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], samples: List[Sample],
                  probe_batch: BatchProbe) -> Optional[List[Tuple[Terms, Terms, Terms, Terms]]]:
    """The ``(jp, jm, lp, lm)`` of :func:`_central` for every sample, evaluated in batches.

    The perturbed tensors ``θ ± t·v`` are stacked (in chunks of ``probe_batch.chunk(p)``)
    and written exactly as the loop writes them into ``p``; the analytic predictions use
    the same applied perturbations. Returns None when the evaluator declines (the caller
    then evaluates one perturbation at a time).
    """
    items = [(s, sign * s.step) for s in samples for sign in (1.0, -1.0)]
    terms: List[Terms] = []
    lins: List[Terms] = []
    size = max(1, int(probe_batch.chunk(p)))
    with torch.no_grad():
        for start in range(0, len(items), size):
            part = items[start:start + size]
            stacked = torch.empty((len(part), *p.shape), dtype=p.dtype, device=p.device)
            for row, (s, t) in zip(stacked, part):
                if s.index is not None:
                    row.copy_(saved)
                delta = _apply(row, saved, s, t)
                lins.append(_lin(row, saved, grads, s, t, delta))
                s.forget()  # the row is a temporary: keep no view of it
            got = probe_batch(name, p, saved, stacked)
            if got is None:
                return None
            terms.extend(got)
    return [(terms[2 * i], terms[2 * i + 1], lins[2 * i], lins[2 * i + 1]) for i in range(len(samples))]


def check_tensor(
    name: str,
    p: torch.Tensor,
    grads: Dict[str, torch.Tensor],
    evaluate: Evaluator,
    j0: float,
    settings: EngineSettings,
    seed: int,
    probe_batch: Optional["BatchProbe"] = None,
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
        probe_batch: Evaluates the base probes of all samples in batches (see
            :func:`batched_bases`); None, or a batch it declines, means one evaluation each.

    Returns:
        The tensor's :class:`TensorCheck` and one per term (when grads has more than ``"total"``).
    """
    saved = p.detach().clone()
    h = settings.eps if settings.eps is not None else settings.eval_eps ** (1.0 / 3.0)
    samples = build_samples(name, p, grads["total"], settings, seed, h)
    prepare_slopes(samples, saved, grads)
    outcomes: List[Outcome] = []
    bases = batched_bases(name, p, saved, grads, samples, probe_batch) if probe_batch is not None else None
    try:
        with torch.no_grad():
            _probe_all(p, saved, grads, samples, bases, outcomes, evaluate, j0, settings)
    finally:
        with torch.no_grad():
            p.copy_(saved)
        for sample in samples:
            sample.forget()
    main = _summarize(name, tuple(p.shape), samples, outcomes, "total", settings)
    per_term = {
        term: _summarize(name, tuple(p.shape), samples, outcomes, term, settings)
        for term in grads
        if term != "total"
    }
    return main, per_term


def _probe_all(p, saved, grads, samples: List[Sample], bases, outcomes: List[Outcome], evaluate: Evaluator, j0: float,
               settings: EngineSettings) -> None:
    """Probe every sample (or judge its batched base probes), re-examining disagreements; appends to ``outcomes``."""
    genuine_streak = 0
    for i, sample in enumerate(samples):
        base = bases[i] if bases is not None else _central(p, saved, grads, sample, sample.step, evaluate)
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
            if unresolvable(sample, a["total"], n["total"], settings):
                kink = resolve_low_precision(p, saved, grads, sample, a["total"], n["total"], j0, evaluate, settings)
            else:
                kink = classify_kink(p, saved, grads, sample, base, j0, evaluate, settings)
            if kink is None:
                out.unresolved = True
            else:
                out.kink = kink
                genuine_streak = 0 if out.kink else genuine_streak + 1
        outcomes.append(out)


def _summarize(name, shape, samples: List[Sample], outcomes: List[Outcome], term: str, settings: EngineSettings) -> TensorCheck:
    coords = [(s, o) for s, o in zip(samples, outcomes) if s.index is not None]
    dirs = [(s, o) for s, o in zip(samples, outcomes) if s.index is None]

    def lists(pairs):
        kept = [o for _, o in pairs if not (o.kink or o.unresolved)]
        return ([o.analytic[term] for o in kept], [o.numeric.get(term, 0.0) for o in kept], [o.floor for o in kept])

    ca, cn, cf = lists(coords)
    da, dn, df = lists(dirs)
    judged = max(_judged(ca, cn, cf), _judged(da, dn, df))
    check = TensorCheck(
        name=name,
        shape=shape,
        rel_diff=rel_diff(ca, cn) if ca else 0.0,
        max_rel_error=max_rel_error(ca, cn),
        directional_rel_diff=rel_diff(da, dn) if da else None,
        judged_rel_diff=judged,
        noise_floor=float(max(cf + df, default=0.0)),
        step=samples[0].step if samples else 0.0,
        kinks=sum(o.kink for o in outcomes),
        coords=[tuple(s.index) for s, _ in coords],
        analytic=[o.analytic[term] for _, o in coords],
        numeric=[o.numeric.get(term, 0.0) for _, o in coords],
        dir_analytic=[o.analytic[term] for _, o in dirs],
        dir_numeric=[o.numeric.get(term, 0.0) for _, o in dirs],
    )
    if not all(map(math.isfinite, ca + cn + da + dn)):
        check.inconclusive = "non-finite values in the objective or gradient along the sampled points"
        check.inconclusive_kind = InconclusiveKind.NONFINITE
        check.judged_rel_diff = float("nan")
        return check
    verdict = Verdict.from_value(judged, settings.bands)
    unresolved = sum(o.unresolved for o in outcomes)
    raw = max(rel_diff(ca, cn) if ca else 0.0, rel_diff(da, dn) if da else 0.0)
    if settings.coarse and not verdict.is_failure(settings.fail_at) and (
            unresolved or Verdict.from_value(raw, settings.bands).is_failure(settings.fail_at)):
        # Only the rounding of the low-precision part could explain the disagreement: it cannot be judged.
        check.inconclusive = (
            f"the sampled slopes disagree by {raw:.1e}, within the rounding noise of the low-precision part of "
            f"the objective ({settings.coarse}); a gradient error of that size cannot be told from it"
        )
        check.inconclusive_kind = InconclusiveKind.LOW_PRECISION
        return check
    if unresolved and not verdict.is_failure(settings.fail_at):
        # The resolvable samples pass, but some disagreed by less than this precision can resolve.
        check.inconclusive = (
            f"{unresolved} of {len(outcomes)} samples disagree by less than low-precision central differences "
            f"can resolve (a ReLU/max-pool/abs kink within the step {samples[0].step:.1e}, or a small gradient "
            "error); check with dtype=float64 (the default shadow copy) to judge them"
        )
        check.inconclusive_kind = InconclusiveKind.UNRESOLVED
        return check
    check.verdict = verdict
    check.failed = check.verdict.is_failure(settings.fail_at)
    if check.failed:
        check.diagnosis = diagnose(np.array(ca + da), np.array(cn + dn), check.noise_floor)
        check.ratio = constant_ratio(ca + da, cn + dn, check.noise_floor)
    return check
