"""The sampled two-sided comparison for one tensor.

Each *sample* is a line through parameter space (one coordinate, or one
random unit direction). Along it the engine evaluates the objective at
``±t`` and compares the central difference with the analytic slope
``g·(θ(t) - θ(-t)) / 2t``, computed from the perturbation actually applied
(so rounding of ``θ + t·u`` in low precision does not count as error).

Disagreeing samples are re-examined before they count (see
:func:`classify_kink`); :mod:`gradwatch.check.judge` then judges the slopes
against the rounding-noise floor of the finite differences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from .judge import NOISE_FACTOR, BandRule, Slope, agrees, allowed_jitter, base_point, inconclusive, judge, judged_rel_diff
from .numeric import Verdict
from .report import InconclusiveKind, TensorCheck
from .sampling import choose_coords, generator, rademacher_signs, tensor_seed

if TYPE_CHECKING:
    from ..options import CheckOptions

Terms = Dict[str, float]
#: Smaller steps tried when a sample disagrees (fractions of the base step).
KINK_SCALES = (0.1, 0.01)
#: Detection: a disagreeing probe whose one-sided slopes agree to this fraction of the disagreement is a wrong
#: gradient without another evaluation (:func:`smooth_sides`).
SMOOTH_SIDES = 1e-3
#: Evaluation precisions coarser than this (float32, half) can leave a disagreement unresolved.
LOW_PRECISION_EPS = 1e-10
#: Steps (fractions of the base step) of the low-precision re-examination, see :func:`resolve_low_precision`.
LOW_PRECISION_SCALES = (0.25, 0.18, 0.13)
#: A base probe whose noise floor exceeds this fraction of its slopes is too imprecise to see a 1% error (a
#: gradient tiny against the objective, as at weights near zero): it is taken again at a wider step, see :func:`widen`.
IMPRECISE = 1e-3
#: The floor :func:`widen` aims at, as a fraction of the slope.
PRECISE = 1e-5
#: The widest step :func:`widen` takes, as a multiple of the base step.
WIDEN_MAX = 1e4
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
    #: Judged on its own too (the entry :func:`pinpoint` traced a disagreement to).
    alone: bool = False
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
    #: Taken at a wider step (:func:`widen`): linear within it, so no kink to re-examine.
    widened: bool = False
    #: The objective was bit-for-bit the same on both sides at the widest step (:func:`flat_at_widest`).
    flat: bool = False


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
    #: Detection first (:func:`screen_sample`): one random direction per tensor, the full sample only
    #: where it does not agree to the EXCELLENT band (check_model; the training hook's cycle samples every time).
    screen: bool = False
    #: Where the objective computes in a lower precision than the tensors (see :mod:`gradwatch.check.precision`).
    coarse: Optional[str] = None
    #: In float64: a tensor no sample could resolve (a 1% error could not show) is inconclusive,
    #: ``below_resolution``, and one the objective is found flat in (bit-for-bit the same at the widest step:
    #: a zero gradient and one far below rounding look the same) is ``flat``, instead of passing; for a caller
    #: that judges them another way (check_model: on their modules alone).
    mark_unseen: bool = False

    @property
    def detection_first(self) -> bool:
        """A detection probe comes before the full sample (``screen``, unless every entry is probed anyway)."""
        return self.screen and not self.exhaustive

    @classmethod
    def from_options(cls, opts: CheckOptions, eval_eps: float, magnitude: float, **extra: Any) -> EngineSettings:
        """The settings a :class:`~gradwatch.options.CheckOptions` asks for, at this precision and magnitude."""
        return cls(coords=opts.coords, directions=opts.directions, eps=opts.eps, bands=opts.bands,
                   fail_at=opts.fail_verdict, detect_kinks=opts.detect_kinks, eval_eps=eval_eps, magnitude=magnitude,
                   **extra)


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
            u64 = cast(torch.Tensor, sample.direction).reshape(-1).to(torch.float64)
            vals = [float(torch.dot(g.reshape(-1).to(torch.float64), u64)) for g in grads.values()]
        sample.slope = dict(zip(grads, vals))
    return sample.slope


def _apply(p: torch.Tensor, saved: torch.Tensor, sample: Sample, t: float) -> Optional[float]:
    """Write ``θ + t·v`` into ``p`` (one fused pass for a direction); return the applied delta of a coordinate."""
    if sample.index is not None:
        if sample.base is None:
            sample.base = float(saved[sample.index])
        if p is sample.target:
            view = cast(torch.Tensor, sample.view)  # indexed once per sample (the view's fill_ is 3x cheaper than p[index])
        else:
            view = p[sample.index]
            sample.target, sample.view = p, view
        view.fill_(sample.base + t)
        applied = sample.base + t if p.dtype == torch.float64 else float(view)
        return applied - sample.base
    if sample.signs is not None:
        torch.add(saved, sample.signs.reshape(p.shape), alpha=t * sample.scale, out=p)
    else:
        torch.add(saved, cast(torch.Tensor, sample.direction).to(p.dtype), alpha=t, out=p)
    return None


def _restore(p: torch.Tensor, saved: torch.Tensor, sample: Sample) -> None:
    if sample.index is not None:
        if sample.base is not None:
            view = cast(torch.Tensor, sample.view) if p is sample.target else p[sample.index]
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


def _probe(p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], sample: Sample, t: float,
           evaluate: Evaluator) -> Tuple[Terms, Terms]:
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


def classify_kink(p, saved, grads, sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], j0: float, evaluate: Evaluator,
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
    gap0 = (total(jp0) - j0) / t0 - (j0 - total(jm0)) / t0
    a0, n0 = _slopes(*base, t0)
    disagreement = abs(n0["total"] - a0["total"])
    seen: List[Tuple[float, float, float, float, float]] = []
    last: Tuple[Terms, Terms] = ({}, {})
    last_numeric = n0["total"]
    taken = {} if taken is None else taken
    for scale in scales:
        t = t0 * scale
        fl = floor_at(settings, t)
        if scale not in taken:
            taken[scale] = _central(p, saved, grads, sample, t, evaluate)
        jp, jm, lp, lm = taken[scale]
        a, n = _slopes(jp, jm, lp, lm, t)
        if not usable_floor(fl, a["total"], n["total"], disagreement):
            break
        if agrees(a["total"], n["total"], fl, rel):
            return True
        seen.append((t, fl, (total(jp) - j0) / t, (j0 - total(jm)) / t, a["total"]))
        last = (jp, jm)
        last_numeric = n["total"]
    if not seen:  # no smaller step can tell: at weights near zero the base step crosses kinks it cannot resolve
        return None
    t, fl, right, left, a_total = seen[-1]
    gap = right - left
    if not (abs(gap) > 4 * fl and abs(gap) > 0.3 * abs(gap0)):
        # Smooth at the smaller step, or its sides within the noise. A wrong gradient of a smooth function keeps
        # its numeric slope from step to step; one that moved with the step (a kink crossed by the base step and
        # by the smaller one, the next too noisy to use) cannot be told from a wrong gradient.
        moved = abs(last_numeric - n0["total"]) > 0.3 * disagreement + fl
        return None if moved else False
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
    if lo - tol <= a_total <= hi + tol:
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


def usable_floor(floor: float, analytic: float, numeric: float, disagreement: float) -> bool:
    """True when a smaller step whose noise floor is ``floor`` can tell a kink from a wrong gradient: the floor is
    under 1% of the slopes, or under 30% of the disagreement to explain (slopes near zero at weights near
    zero, a ReLU unit dead at the point and crossed by the base step: the disagreement is all there is to see).

    Example:
        >>> usable_floor(1e-9, 0.0, 0.0, 4e-7), usable_floor(1e-9, 0.0, 0.0, 2e-9)
        (True, False)
    """
    return floor <= 1e-2 * max(abs(analytic), abs(numeric), 1e-300) or floor <= 0.3 * disagreement


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


def build_samples(name: str, p: torch.Tensor, g: torch.Tensor, settings: EngineSettings, seed: int, h: float) -> List[Sample]:
    """The coordinates and directions to probe for one tensor (seeded per tensor)."""
    gen = generator(tensor_seed(seed, name))
    shape = tuple(p.shape)
    samples: List[Sample] = []
    # An activation (the module form's ``<module>:input``) has no scale of 1 to fall back on: its entries
    # near zero at small weights sit within a step of 1's scale of every ReLU kink, so its steps follow its
    # own root-mean-square size.
    unit = _unit(name, p)
    k = p.numel() if settings.exhaustive else settings.coords
    flat = choose_coords(g, k, gen) if k else torch.empty(0, dtype=torch.long)
    if flat.numel():
        # One gather and one host transfer for all coordinates (no per-coordinate indexing or sync).
        values = p.detach().reshape(-1)[flat.to(p.device)].tolist()
        flat_list = flat.tolist()
        positions = [a.tolist() for a in np.unravel_index(flat.numpy(), shape)] if shape else None
        for j, value in enumerate(values):
            pos = tuple(a[j] for a in positions) if positions is not None else ()
            samples.append(Sample(label=pos, step=h * max(unit, abs(value)), index=pos, base=float(value), flat=flat_list[j]))
    if settings.directions and p.numel() > 1:
        n = p.numel()
        rms = float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) / math.sqrt(n)
        dtype = p.dtype if p.is_floating_point() and n <= DENSE_SIGNS_MAX else torch.int8
        signs = rademacher_signs(n, settings.directions, gen, dtype=dtype).to(p.device)
        for j in range(settings.directions):
            samples.append(Sample(label=("dir", j), step=h * max(unit, rms), signs=signs[j].reshape(shape), scale=1.0 / math.sqrt(n)))
    return samples


def _unit(name: str, p: torch.Tensor) -> float:
    """The scale a step falls back on: 1, or an activation's own root-mean-square size when below 1."""
    if name.endswith(":input") or ":output" in name:
        rms_all = float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) / math.sqrt(max(1, p.numel()))
        return min(1.0, rms_all) if rms_all > 0 else 1.0
    return 1.0


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

    def wants(self, name: str) -> bool:
        """True when tensor ``name`` should be tried in batches."""
        return True

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


@dataclass
class Detection:
    """A tensor's detection probe (:func:`detect`): one random direction, judged before any other sample.

    Attributes:
        sample: The probe's line (its direction is dropped once the tensor's verdict no longer needs it).
        outcome: Its slopes, taken at a wider step where the base step is lost in rounding, re-examined
            for a kink where they disagree beyond the SUSPICIOUS band.
        settled: Analytic and numeric agree to the EXCELLENT band (:func:`screened`): the tensor passes
            on this probe alone.
        confirmed: They disagree beyond the failing band with no kink or rounding to explain it (a smooth
            function whose gradient is wrong along the probe): the tensor fails on this probe alone, and the
            full sample (for the diagnosis) can come after every other tensor's verdict.
    """

    sample: Sample
    outcome: Outcome
    settled: bool = False
    confirmed: bool = False


def detect(name: str, p: torch.Tensor, grads: Dict[str, torch.Tensor], evaluate: Evaluator, j0: float,
           settings: EngineSettings, seed: int, probe_batch: Optional[BatchProbe] = None) -> Optional[Detection]:
    """The detection probe of one tensor, judged; None when it has none (one entry: its coordinate is the check).

    ``p`` is perturbed in place and restored bit for bit.
    """
    first = screen_sample(name, p, settings, seed, _base_step(settings))
    if first is None:
        return None
    saved = p.detach().clone()
    try:
        with torch.no_grad():
            prepare_slopes([first], saved, grads)
            base = _bases(name, p, saved, grads, [first], probe_batch)[0] \
                or _central(p, saved, grads, first, first.step, evaluate)
            out, settled = screen(p, saved, grads, first, base, j0, evaluate, settings)
            found = Detection(first, out, settled=settled)
            if not settled and _needs_reexamination(out, settings):
                alone = set(out.analytic) == {"total"} and _fails_alone(out, settings)
                found.confirmed = alone and smooth_sides(first, base, out, j0, settings)
                batch = (name, probe_batch) if probe_batch is not None else None
                taken: Dict[float, Tuple[Terms, Terms, Terms, Terms]] = {}
                if alone and not found.confirmed:
                    # One smaller step: a wrong gradient of a smooth function keeps its disagreement there, with
                    # one-sided slopes that agree; a kink crossed at the base step is left behind or bends one
                    # side, and one at the point keeps the sides apart at every step.
                    _reexamine(p, saved, grads, first, base, out, j0, evaluate, settings, scales=KINK_SCALES[:1],
                               batch=batch, taken=taken)
                    found.confirmed = not (out.kink or out.unresolved)
                if not found.confirmed:  # a kink may explain it: every smaller step, as the full sample takes them
                    out.kink = out.unresolved = False
                    _reexamine(p, saved, grads, first, base, out, j0, evaluate, settings, batch=batch, taken=taken)
    finally:
        with torch.no_grad():
            p.copy_(saved)
        first.forget()
    if found.settled or found.confirmed:
        first.direction = first.signs = None  # judged: the full sample only needs its slopes
    first.alone = found.confirmed
    return found


def check_tensor(
    name: str,
    p: torch.Tensor,
    grads: Dict[str, torch.Tensor],
    evaluate: Evaluator,
    j0: float,
    settings: EngineSettings,
    seed: int,
    probe_batch: Optional["BatchProbe"] = None,
    detected: Optional[Detection] = None,
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
        detected: The tensor's :func:`detect` taken before (detection first): settled, it is the whole
            check; otherwise the full sample goes on from it. None: taken here when ``settings.screen``.

    Returns:
        The tensor's :class:`TensorCheck` and one per term (when grads has more than ``"total"``).
    """
    if detected is None and settings.detection_first:
        detected = detect(name, p, grads, evaluate, j0, settings, seed, probe_batch)
    samples: List[Sample] = [detected.sample] if detected is not None else []
    outcomes: List[Outcome] = [detected.outcome] if detected is not None else []
    unseen = unseen_flat = detected is not None and detected.outcome.flat and not detected.settled
    if (detected is None or not detected.settled) and not unseen:
        saved = p.detach().clone()
        h = _base_step(settings)
        try:
            with torch.no_grad():
                rest = build_samples(name, p, grads["total"], settings, seed, h)
                prepare_slopes(rest, saved, grads)
                _probe_all(p, saved, grads, rest, _bases(name, p, saved, grads, rest, probe_batch), outcomes, evaluate,
                           j0, settings, genuine=int(detected is not None and detected.confirmed))
                samples += rest
                if detected is not None and unexplained(outcomes[0], settings) \
                        and not _summarize(name, tuple(p.shape), samples, outcomes, "total", settings).failed:
                    entry = pinpoint(p, saved, grads, detected.sample, evaluate, settings, h, _unit(name, p))
                    if entry is not None:
                        prepare_slopes([entry], saved, grads)
                        samples.append(entry)
                        _probe_all(p, saved, grads, [entry], None, outcomes, evaluate, j0, settings)
                if settings.mark_unseen and settings.detect_kinks and settings.eval_eps <= LOW_PRECISION_EPS \
                        and not resolves(outcomes, settings):
                    # (In float32 a 1% error is often below what any step resolves; there the judge's rules stand.)
                    line = next((s_ for s_ in samples if s_.index is None and (s_.direction is not None
                                                                              or s_.signs is not None)), None)
                    flat = flat_at_widest(p, saved, grads, line, evaluate, settings) if line is not None else None
                    unseen, unseen_flat = True, flat is not None
        finally:
            with torch.no_grad():
                p.copy_(saved)
            for sample in samples:
                sample.forget()
    main = _summarize(name, tuple(p.shape), samples, outcomes, "total", settings)
    if unseen:
        below_resolution(main, flat=unseen_flat)
    per_term = {
        term: _summarize(name, tuple(p.shape), samples, outcomes, term, settings)
        for term in grads
        if term != "total"
    }
    return main, per_term


def resolves(outcomes: Sequence[Outcome], settings: EngineSettings) -> bool:
    """True when some sample taken as it is (no kink, not unresolved, finite) could show an error of the WRONG
    band: its noise floor is under ``bands[2]`` (1%) of its slopes. Also True when none is taken as it is (the
    judge says why) or a slope is not finite (the judge calls that nonfinite).

    Example:
        >>> settings = EngineSettings(coords=8, directions=4, eps=None, bands=(1e-7, 1e-4, 1e-2),
        ...                           fail_at=Verdict.SUSPICIOUS, detect_kinks=True, eval_eps=2.2e-16, magnitude=1.0)
        >>> resolves([Outcome({"total": 1e-10}, {"total": 0.0}, floor=1e-9)], settings)
        False
        >>> resolves([Outcome({"total": 1e-3}, {"total": 1e-3}, floor=1e-9)], settings)
        True
    """
    kept = [o for o in outcomes if not (o.kink or o.unresolved)]
    if not kept:
        return True
    for o in kept:
        a, n = o.analytic["total"], o.numeric["total"]
        if not (math.isfinite(a) and math.isfinite(n)) or o.floor <= settings.bands[2] * max(abs(a), abs(n)):
            return True
    return False


def below_resolution(check: TensorCheck, flat: bool = False) -> None:
    """Mark a passing tensor that no sample could resolve (:func:`resolves`) as inconclusive, not as agreeing;
    ``flat``: the objective did not move at all at the widest step (:func:`flat_at_widest`)."""
    if check.failed or check.inconclusive is not None:
        return
    slopes = [abs(v) for v in check.analytic + check.numeric + check.dir_analytic + check.dir_numeric]
    check.verdict = None
    if flat:
        check.inconclusive = (
            "the objective is bit-for-bit the same on both sides of a probe 10,000x the base step: the gradient "
            f"is zero (a bias before a normalization) or far below the objective's rounding (analytic slopes up to "
            f"{max(slopes, default=0.0):.1e}); check_model, and the watch in one process, judge it on its module alone"
        )
        check.inconclusive_kind = InconclusiveKind.FLAT
        return
    check.inconclusive = (
        f"the gradient is lost in the objective's rounding: slopes up to {max(slopes, default=0.0):.1e} against a "
        f"noise floor of {check.noise_floor:.1e} at every step tried (a 1% error could not show; weights near "
        "zero make a layer's gradient tiny against the objective); check_model, and the watch in one process, "
        "judge it on its module alone"
    )
    check.inconclusive_kind = InconclusiveKind.BELOW_RESOLUTION


def smooth_sides(sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], out: Outcome, j0: float,
                 settings: EngineSettings) -> bool:
    """True when the probe's own one-sided slopes rule out a kink as the cause of its disagreement.

    A kink crossed on one side of the point bends that side's slope by twice what it moves the central
    difference, so the two one-sided slopes ``(J(θ+t)-J(θ))/t`` and ``(J(θ)-J(θ-t))/t`` differ by twice the
    disagreement. Kinks at the point itself (every unit of a zero input row on its kink, with a zero bias)
    keep them apart by a sum of terms of mixed signs, which can come out small but rarely to
    ``SMOOTH_SIDES`` (1e-3) of the disagreement. For a smooth function they differ by the curvature times
    ``t`` (about 6e-6 in float64) and the rounding. Where they agree to ``SMOOTH_SIDES`` of the disagreement
    (their noise included), what disagrees is the gradient, with no evaluation more; otherwise the probe is
    taken again at smaller steps. Not in low precision, where the one-sided slopes are too noisy
    (:func:`unresolvable`).

    Example:
        >>> settings = EngineSettings(coords=8, directions=4, eps=None, bands=(1e-7, 1e-4, 1e-2),
        ...                           fail_at=Verdict.SUSPICIOUS, detect_kinks=True, eval_eps=2.2e-16, magnitude=1.0)
        >>> line = Sample(label=("screen",), step=1e-5)
        >>> smooth = ({"total": 1.0 + 1e-5}, {"total": 1.0 - 1e-5}, {"total": 1.2e-5}, {"total": -1.2e-5})
        >>> smooth_sides(line, smooth, Outcome({"total": 1.2}, {"total": 1.0}, floor=1e-11), 1.0, settings)
        True
        >>> kinked = ({"total": 1.0 + 1.4e-5}, {"total": 1.0 - 0.6e-5}, {"total": 1.0e-5}, {"total": -1.0e-5})
        >>> smooth_sides(line, kinked, Outcome({"total": 1.0}, {"total": 1.0}, floor=1e-11), 1.0, settings)
        False
    """
    a, n = out.analytic["total"], out.numeric["total"]
    if out.widened or unresolvable(sample, a, n, settings):
        return False
    jp, jm = base[0], base[1]
    t = sample.step
    right, left = (total(jp) - j0) / t, (j0 - total(jm)) / t
    return abs(right - left) + 4.0 * out.floor <= SMOOTH_SIDES * abs(a - n)


def _base_step(settings: EngineSettings) -> float:
    """The relative step of every probe: ``eps``, or the cube root of the evaluation's machine epsilon."""
    return settings.eps if settings.eps is not None else settings.eval_eps ** (1.0 / 3.0)


def _fails_alone(out: Outcome, settings: EngineSettings) -> bool:
    """True when one sample's disagreement, judged by itself, is a failing verdict."""
    a_t, n_t = out.analytic["total"], out.numeric["total"]
    if not (math.isfinite(a_t) and math.isfinite(n_t)):
        return False
    return Verdict.from_value(judged_rel_diff([a_t], [n_t], [out.floor]), settings.bands).is_failure(settings.fail_at)


def screen_sample(name: str, p: torch.Tensor, settings: EngineSettings, seed: int, h: float) -> Optional[Sample]:
    """The detection probe of one tensor: one random unit direction (Gaussian; int8 signs for huge tensors).

    Gaussian, not signs: an error spread over entries of equal size and opposite sign cancels exactly
    along half of all sign vectors, never along a Gaussian one. A single-entry tensor gets none (its one
    coordinate is the whole check). Seeded apart from :func:`build_samples`.
    """
    n = p.numel()
    if n <= 1:
        return None
    gen = generator(tensor_seed(seed, name + "#screen"))
    rms = float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) / math.sqrt(n)
    unit = _unit(name, p)
    if n <= DENSE_SIGNS_MAX and p.is_floating_point():
        z = torch.randn(n, generator=gen, dtype=torch.float64)
        z /= torch.linalg.vector_norm(z)
        return Sample(label=("screen",), step=h * max(unit, rms), direction=z.to(p.dtype).reshape(p.shape).to(p.device))
    signs = rademacher_signs(n, 1, gen).to(p.device)
    return Sample(label=("screen",), step=h * max(unit, rms), signs=signs[0].reshape(p.shape), scale=1.0 / math.sqrt(n))


def screened(out: Outcome, settings: EngineSettings) -> bool:
    """True when the detection probe's outcome settles the tensor.

    Its analytic and numeric slopes agree to the EXCELLENT band (1e-7 by default), and its noise floor
    (a pessimistic bound on rounding) is under a tenth of the ACCEPTABLE band, so an error the full
    sample would call SUSPICIOUS could not hide in the noise. Anything else (a kink on the way, a floor
    too high, a real error) goes on to the full sample, judged exactly as without the probe.

    Example:
        >>> settings = EngineSettings(coords=8, directions=4, eps=None, bands=(1e-7, 1e-4, 1e-2),
        ...                           fail_at=Verdict.SUSPICIOUS, detect_kinks=True, eval_eps=2.2e-16, magnitude=1.0)
        >>> screened(Outcome({"total": 1.0}, {"total": 1.0 + 1e-9}, floor=1e-9), settings)
        True
        >>> screened(Outcome({"total": 1.0}, {"total": 1.0001}, floor=1e-9), settings)
        False
    """
    if set(out.analytic) != {"total"}:
        return False  # per-term checks keep their full sample
    a_t, n_t = out.analytic["total"], out.numeric["total"]
    scale = abs(a_t) + abs(n_t)
    if not (math.isfinite(a_t) and math.isfinite(n_t)) or scale == 0.0:
        return False
    return abs(a_t - n_t) <= settings.bands[0] * scale and out.floor <= 0.1 * settings.bands[1] * scale


def screen(p, saved, grads, sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], j0: float, evaluate: Evaluator,
           settings: EngineSettings) -> Tuple[Outcome, bool]:
    """The detection probe's outcome, and whether it settles the tensor (:func:`screened`).

    A probe lost in rounding is taken again at a wider step first (:func:`widen`, as the full sample
    does). A tensor the objective does not depend on at all (a bias before a normalization) is settled
    when the objective is bit-for-bit the same on both sides of the probe at its step and at the widest
    step :func:`widen` would take, and the analytic slope is within that step's noise: flat, and found flat.
    """
    out = _outcome(sample, base, settings)
    a_t, n_t = out.analytic["total"], out.numeric["total"]
    if not (math.isfinite(a_t) and math.isfinite(n_t)) or not settings.detect_kinks:
        return out, screened(out, settings)
    if n_t == 0.0 and abs(a_t) <= out.floor and set(out.analytic) == {"total"}:
        flat = flat_at_widest(p, saved, grads, sample, evaluate, settings)
        if flat is not None:
            return flat, not settings.mark_unseen or settings.eval_eps > LOW_PRECISION_EPS
        return _judge_sample(p, saved, grads, sample, base, j0, evaluate, settings), False
    out = _judge_sample(p, saved, grads, sample, base, j0, evaluate, settings)
    return out, screened(out, settings)


def flat_at_widest(p, saved, grads, sample: Sample, evaluate: Evaluator, settings: EngineSettings) -> Optional[Outcome]:
    """The outcome along ``sample`` at the widest step :func:`widen` would take when the objective is bit-for-bit
    the same on both sides there and the analytic slope is within that step's noise (the objective does not
    depend on the tensor: found flat); else None."""
    t = sample.step * min(WIDEN_MAX, 0.1 / _base_step(settings))
    jp, jm, lp, lm = _central(p, saved, grads, sample, t, evaluate)
    a_w, _ = _slopes(jp, jm, lp, lm, t)
    if total(jp) == total(jm) and abs(a_w["total"]) <= floor_at(settings, t):
        return Outcome(a_w, {"total": 0.0}, floor_at(settings, t), flat=True)
    return None


def unexplained(out: Outcome, settings: EngineSettings) -> bool:
    """True when the detection probe disagrees beyond its noise floor by more than the EXCELLENT band, with
    no kink or unresolved step to explain it: an error diluted along a dense direction (one wrong entry
    among many) that the full sample's coordinates may have missed; :func:`pinpoint` looks for it.
    """
    a_t, n_t = out.analytic["total"], out.numeric["total"]
    if out.kink or out.unresolved or not (math.isfinite(a_t) and math.isfinite(n_t)):
        return False
    return abs(a_t - n_t) - out.floor > settings.bands[0] * (abs(a_t) + abs(n_t))


def pinpoint(p, saved, grads, sample: Sample, evaluate: Evaluator, settings: EngineSettings, step: float,
             unit: float) -> Optional[Sample]:
    """The entry that the detection probe's disagreement comes from, found by halving; None when it fades.

    The probe's direction is cut into two halves of its entries (in row-major order), each probed as a
    unit direction of its own; the disagreement along the whole direction is the sum of the halves'
    (each weighted by its share of the direction's norm), so the half with the larger weighted excess over
    its noise floor holds the largest error. Repeated down to one entry: ``4 * log2(numel)`` evaluations,
    spent only where the probe disagreed and the full sample did not fail. The entry comes back as a
    coordinate sample, judged like any other (kinks re-examined), at a coordinate's step (``step`` relative
    to ``max(unit, |θ_i|)``, as :func:`build_samples` takes it); its label names it.
    """
    if sample.direction is None:
        return None
    d = sample.direction.reshape(-1)
    lo, hi = 0, d.numel()
    while hi - lo > 1:
        mid = (lo + hi) // 2
        best: Optional[Tuple[float, int, int]] = None
        for a_, b_ in ((lo, mid), (mid, hi)):
            part = torch.zeros_like(d)
            part[a_:b_] = d[a_:b_]
            norm = float(torch.linalg.vector_norm(part, dtype=torch.float64))
            if norm == 0.0:
                continue
            half = Sample(label=("block", a_, b_), step=sample.step, direction=(part / norm).reshape(p.shape))
            jp, jm, lp, lm = _central(p, saved, grads, half, half.step, evaluate)
            a, n = _slopes(jp, jm, lp, lm, half.step)
            excess = norm * (abs(a["total"] - n["total"]) - floor_at(settings, half.step))
            if math.isfinite(excess) and excess > 0 and (best is None or excess > best[0]):
                best = (excess, a_, b_)
        if best is None:
            return None  # both halves within their noise: the disagreement was spread too thin to follow
        lo, hi = best[1], best[2]
    shape = tuple(p.shape)
    pos = tuple(int(i) for i in np.unravel_index(lo, shape)) if shape else ()
    value = float(saved.reshape(-1)[lo])
    return Sample(label=pos, step=step * max(unit, abs(value)), index=pos, base=value, flat=lo, alone=True)


def _outcome(sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], settings: EngineSettings) -> Outcome:
    a, n = _slopes(*base, sample.step)
    return Outcome(a, n, floor_at(settings, sample.step))


def _bases(name: str, p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], samples: List[Sample],
           probe_batch: Optional[BatchProbe]) -> List[Optional[Tuple[Terms, Terms, Terms, Terms]]]:
    """The base probes of ``samples`` in batches where ``probe_batch`` takes them; None each: probed in the loop."""
    got = batched_bases(name, p, saved, grads, samples, probe_batch) if probe_batch is not None and samples else None
    return list(got) if got is not None else [None] * len(samples)


def all_finite(t: torch.Tensor) -> bool:
    """True when no entry is NaN or infinite: one min/max pass (NaN propagates), 5x cheaper than ``isfinite``.

    Example:
        >>> all_finite(torch.tensor([1.0, 2.0])), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
    """
    if t.numel() == 0 or not t.is_floating_point():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(t.detach().reshape(-1)))).all())


@dataclass
class Judged:
    """One tensor's outcome from :func:`check_tensors`.

    Attributes:
        key: The caller's key for the tensor.
        check: Its :class:`TensorCheck`.
        per_term: One check per term of the objective (when the gradients have more than ``"total"``).
        before_sampling: Why no slope was taken at all (the objective at the base point is not finite
            or not deterministic, or the analytic gradient is not finite); None when it was sampled.
    """

    key: str
    check: TensorCheck
    per_term: Dict[str, TensorCheck] = field(default_factory=dict)
    before_sampling: Optional[InconclusiveKind] = None


#: One tensor to check: its key, its name in the report, the tensor (perturbed in place), its gradient per term.
Target = Tuple[str, str, torch.Tensor, Dict[str, torch.Tensor]]


def check_tensors(targets: Sequence[Target], evaluate: Evaluator, settings: EngineSettings, seed: int,
                  probe_batch: Optional[BatchProbe] = None,
                  on_verdict: Optional[Callable[[], None]] = None) -> Iterator[Judged]:
    """Judge a set of tensors of one objective: the base point first, then :func:`check_tensor` for each.

    The objective is evaluated twice at the unperturbed point: if the two values are not finite, or differ
    by more than rounding allows (:func:`gradwatch.check.judge.base_point`), no tensor can be judged and
    each is inconclusive with that kind. Otherwise their difference (the jitter) joins the noise floor.
    A tensor whose analytic gradient is not finite is inconclusive without sampling.

    Detection first (``settings.screen``): every tensor's verdict comes before any diagnosis. A tensor
    whose probe settles it passes; one whose probe disagrees where nothing explains it but a wrong
    gradient (:class:`Detection` ``confirmed``) fails, and its full sample (which says how: a constant
    ratio, a sign, a missing term) is taken after every other tensor's verdict, so a buggy model's
    verdict costs about what a correct one's does. Those tensors are yielded last.

    Args:
        targets: ``(key, name, tensor, {term: gradient})`` per tensor (``"total"`` is the full objective).
        evaluate: Objective terms at the current parameters.
        settings: Sample sizes, step, bands and noise model (``jitter`` is measured here).
        seed: Sampling seed.
        probe_batch: Evaluates the base probes of each tensor it ``wants`` in batches.
        on_verdict: Called once every tensor's verdict (pass or fail) is known, before the failing
            tensors' full samples.

    Yields:
        A :class:`Judged` per tensor (a caller keeps those judged before an evaluation raised).
    """
    j_a, j_b = evaluate(), evaluate()
    jitter, kind, why = base_point(total(j_a), total(j_b), allowed_jitter(settings.eval_eps, settings.magnitude))
    if kind is not None:
        for key, name, p, _ in targets:
            yield Judged(key, inconclusive(name, tuple(p.shape), kind, str(why)), before_sampling=kind)
        if on_verdict is not None:
            on_verdict()
        return
    settings = replace(settings, jitter=jitter)
    j0 = total(j_a)
    failing: List[Tuple[str, str, torch.Tensor, Dict[str, torch.Tensor], Optional[BatchProbe], Detection]] = []
    for key, name, p, grads in targets:
        if not all(all_finite(t) for t in grads.values()):
            why = "analytic gradient has non-finite values (NaN or inf)"
            yield Judged(key, inconclusive(name, tuple(p.shape), InconclusiveKind.NONFINITE, why),
                         before_sampling=InconclusiveKind.NONFINITE)
            continue
        batch = probe_batch if probe_batch is not None and probe_batch.wants(key) else None
        detected = detect(name, p, grads, evaluate, j0, settings, seed, batch) if settings.detection_first else None
        if detected is not None and detected.confirmed:
            failing.append((key, name, p, grads, batch, detected))
            continue
        main, per_term = check_tensor(name, p, grads, evaluate, j0, settings, seed, probe_batch=batch, detected=detected)
        yield Judged(key, main, per_term)
    if on_verdict is not None:
        on_verdict()
    for key, name, p, grads, batch, detected in failing:
        try:
            main, per_term = check_tensor(name, p, grads, evaluate, j0, settings, seed, probe_batch=batch,
                                          detected=detected)
        except BaseException:
            # The verdict stands without its diagnosis: the probe alone, judged.
            yield Judged(key, _summarize(name, tuple(p.shape), [detected.sample], [detected.outcome], "total", settings))
            raise
        yield Judged(key, main, per_term)


def _probe_all(p, saved, grads, samples: List[Sample], bases, outcomes: List[Outcome], evaluate: Evaluator, j0: float,
               settings: EngineSettings, genuine: int = 0) -> None:
    """Probe every sample (or judge its batched base probes), re-examining disagreements; appends to ``outcomes``.

    After three disagreements in a row found genuine (``genuine`` of them before these samples), the rest
    are taken as they are (a wrong gradient disagrees everywhere; re-examining every sample would only
    repeat it).
    """
    genuine_streak = genuine
    for i, sample in enumerate(samples):
        base = bases[i] if bases is not None and bases[i] is not None else _central(p, saved, grads, sample, sample.step, evaluate)
        out = _judge_sample(p, saved, grads, sample, base, j0, evaluate, settings)
        if genuine_streak < 3 and _needs_reexamination(out, settings):
            kink = _reexamine(p, saved, grads, sample, base, out, j0, evaluate, settings)
            if kink is not None:
                genuine_streak = 0 if kink else genuine_streak + 1
        outcomes.append(out)


def _judge_sample(p, saved, grads, sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], j0: float,
                  evaluate: Evaluator, settings: EngineSettings) -> Outcome:
    """One sample's outcome from its base probes; taken at a wider step where the base step is lost in rounding."""
    out = _outcome(sample, base, settings)
    a, n, fl = out.analytic["total"], out.numeric["total"], out.floor
    if settings.detect_kinks and math.isfinite(a) and math.isfinite(n) and fl > IMPRECISE * max(abs(a), abs(n)):
        wider = widen(p, saved, grads, sample, out.analytic, out.numeric, fl, j0, evaluate, settings)
        if wider is not None:  # smooth within a wider step: the slope there is the slope at the point
            return wider
    return out


def _needs_reexamination(out: Outcome, settings: EngineSettings) -> bool:
    """True when a sample disagrees beyond the SUSPICIOUS band at its base step (a kink may explain it)."""
    a, n = out.analytic["total"], out.numeric["total"]
    return settings.detect_kinks and not out.widened and math.isfinite(a) and math.isfinite(n) \
        and not agrees(a, n, out.floor, settings.bands[1])


def _reexamine(p, saved, grads, sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], out: Outcome, j0: float,
               evaluate: Evaluator, settings: EngineSettings, scales: Sequence[float] = KINK_SCALES,
               batch: Optional[Tuple[str, BatchProbe]] = None,
               taken: Optional[Dict[float, Tuple[Terms, Terms, Terms, Terms]]] = None) -> Optional[bool]:
    """Kink (True), wrong gradient (False) or cannot tell (None) for a disagreeing sample; marked on ``out``.

    ``scales``: the smaller steps of :func:`classify_kink`; ``batch``: the tensor's name and a batched
    evaluator, to take those not yet ``taken`` in one batch; ``taken``: the probes at smaller steps so far, by
    scale (kept for a later call on the same sample).
    """
    a, n = out.analytic["total"], out.numeric["total"]
    if unresolvable(sample, a, n, settings):
        kink = resolve_low_precision(p, saved, grads, sample, a, n, j0, evaluate, settings)
    else:
        taken = {} if taken is None else taken
        missing = [scale for scale in scales if scale not in taken]
        if batch is not None and missing:
            scaled = [replace(sample, step=sample.step * scale) for scale in missing]
            got = _bases(batch[0], p, saved, grads, scaled, batch[1])
            taken.update((scale, probe) for scale, probe in zip(missing, got) if probe is not None)
        kink = classify_kink(p, saved, grads, sample, base, j0, evaluate, settings, scales=scales, taken=taken)
    if kink is None:
        out.unresolved = True
    else:
        out.kink = kink
    return kink


def widen(p, saved, grads, sample: Sample, a: Terms, n: Terms, floor: float, j0: float, evaluate: Evaluator,
          settings: EngineSettings) -> Optional[Outcome]:
    """The sample at a wider step, for a base probe lost in the objective's rounding; None when it cannot be had.

    The base step is matched to the parameter's own scale (``eps^(1/3) * max(1, |θ|)``). Where the gradient is
    tiny against the objective (weights near zero: a last layer's gradient scales with the activations feeding
    it), the central difference at that step is mostly rounding, and a 1% error is lost in it. The step is
    widened until the floor is ``PRECISE`` of the slope (at most ``WIDEN_MAX`` times the base step and a tenth
    of the parameter's scale; narrower wider steps, tried first, passed the tests below with kinks inside:
    their noise allows more), and the slope is taken at ``t``, ``t/2`` and ``t/4``: they must agree within
    their noise and 5e-5 of the slope, and so must the one-sided slopes on both sides at each step (the
    function is linear within the wider step: no kink crossed, no curvature; what the wider step sees is the
    slope at the point). The Richardson value of ``t`` and ``t/2`` is then the numeric slope. Where they do
    not agree (a ReLU unit's kink within ``t``), or its floor is still over 1e-3 of the slope, the base probe
    stands.
    """
    slope = max(abs(a["total"]), abs(n["total"]))
    if not (slope > 0 and math.isfinite(slope)):
        return None
    scale = max(1.0, abs(sample.base)) if sample.base is not None else sample.step / (settings.eps or settings.eval_eps ** (1.0 / 3.0))
    factor = min(WIDEN_MAX, 0.1 * scale / sample.step, 4.0 * floor / (PRECISE * slope))
    return _linear_at(p, saved, grads, sample, sample.step * factor, slope, j0, evaluate, settings) if factor > 2.0 else None


def _linear_at(p, saved, grads, sample: Sample, t: float, slope: float, j0: float, evaluate: Evaluator,
               settings: EngineSettings) -> Optional[Outcome]:
    """:func:`widen` at one step ``t``: the Richardson slope when the function is linear within ``t``, else None."""
    seen, sides = [], []
    for s in (t, t / 2, t / 4):
        jp, jm, lp, lm = _central(p, saved, grads, sample, s, evaluate)
        a_s, n_s = _slopes(jp, jm, lp, lm, s)
        if not (math.isfinite(a_s["total"]) and math.isfinite(n_s["total"])):
            return None
        seen.append((a_s, n_s, floor_at(settings, s)))
        sides += [(total(jp) - j0) / s, (j0 - total(jm)) / s]
    # Linear within the wider step: the one-sided slopes on both sides at every step agree (a kink crossed on
    # one side bends one of them; kinks far inside the step leave the central differences agreeing with each
    # other but not the sides), and so do the central differences.
    values = [n_s["total"] for _, n_s, _ in seen]
    noise = 2.0 * (seen[0][2] + seen[2][2])
    if max(values) - min(values) > noise + 5e-5 * slope or max(sides) - min(sides) > 2.0 * noise + 1e-4 * slope:
        return None
    (_, n1, f1), (a2, n2, f2) = seen[0], seen[1]
    richardson = {k: (4.0 * n2[k] - n1[k]) / 3.0 for k in n2}
    floor = (4.0 * f2 + f1) / 3.0
    if floor > 1e-3 * max(abs(a2["total"]), abs(richardson["total"])):
        return None  # still lost in the rounding: the tests above could not see a kink
    return Outcome(a2, richardson, floor, widened=True)


def _summarize(name, shape, samples: List[Sample], outcomes: List[Outcome], term: str, settings: EngineSettings) -> TensorCheck:
    """One term's slopes along every sample, judged by the bands (see :func:`gradwatch.check.judge.judge`)."""
    slopes = [
        Slope(analytic=o.analytic[term], numeric=o.numeric.get(term, 0.0), floor=o.floor, coordinate=s.index is not None,
              label=tuple(s.index) if s.index is not None else s.label, excluded=o.kink, unresolved=o.unresolved,
              alone=s.alone)
        for s, o in zip(samples, outcomes)
    ]
    rule = BandRule(bands=settings.bands, fail_at=settings.fail_at, coarse=settings.coarse)
    return judge(name, shape, slopes, rule, step=samples[0].step if samples else 0.0)
