"""A probe that disagrees, examined again: kinks, low precision, flat objectives, screening, pinpointing."""

from __future__ import annotations

import collections
import functools
import math
import threading
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gradwatch.bands import Verdict
from gradwatch.check.judging.judge import (
    agrees,
    judged_rel_diff,
)
from gradwatch.check.judging.report import InconclusiveKind, TensorCheck
from gradwatch.check.numerics.sampling import generator, rademacher_signs, tensor_seed
from gradwatch.check.probes._smaller_steps import LOW_PRECISION_EPS, unresolvable
from gradwatch.check.probes.kinks import crosses, disagrees
from gradwatch.check.probes.lines import (
    DENSE_SIGNS_MAX,
    EngineSettings,
    Evaluator,
    Outcome,
    Sample,
    Terms,
    batched_bases,
    central_probe,
    floor_at,
    outcome_of,
    probable_floor,
    rise,
    slopes_of,
    unit_sample,
)

#: Detection: a disagreeing probe whose one-sided slopes agree to this fraction of the disagreement is a wrong
#: gradient without another evaluation (:func:`smooth_sides`).
SMOOTH_SIDES = 1e-3


#: A base probe whose noise floor exceeds this fraction of its slopes is too imprecise to see a 1% error (a
#: gradient tiny against the objective, as at weights near zero): it is taken again at a wider step, see :func:`widen`.
IMPRECISE = 1e-3


#: The floor :func:`widen` aims at, as a fraction of the slope.
PRECISE = 1e-5


#: The widest step :func:`widen` takes, as a multiple of the base step.
WIDEN_MAX = 1e4


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
    if check.failed or (check.inconclusive is not None and check.inconclusive_kind is not InconclusiveKind.BELOW_RESOLUTION):
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


def smooth_sides(sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], out: Outcome, j0: Terms,
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
        >>> smooth_sides(line, smooth, Outcome({"total": 1.2}, {"total": 1.0}, floor=1e-11), {"total": 1.0}, settings)
        True
        >>> kinked = ({"total": 1.0 + 1.4e-5}, {"total": 1.0 - 0.6e-5}, {"total": 1.0e-5}, {"total": -1.0e-5})
        >>> smooth_sides(line, kinked, Outcome({"total": 1.0}, {"total": 1.0}, floor=1e-11), {"total": 1.0}, settings)
        False
    """
    a, n = out.analytic["total"], out.numeric["total"]
    if out.widened or unresolvable(sample, a, n, settings):
        return False
    jp, jm = base[0], base[1]
    t = sample.step
    right, left = rise(jp, j0) / t, rise(j0, jm) / t
    return abs(right - left) + 4.0 * out.floor <= SMOOTH_SIDES * abs(a - n)


def curved(out: Outcome, settings: EngineSettings) -> bool:
    """True when a sample of a float64 evaluation agrees only to the ACCEPTABLE band: too close for the kinks'
    re-examination (:func:`disagrees`), too far for a smooth function's central difference at the base step,
    unless the function is strongly curved there (a softmax at extreme logits: a router scaled up). :func:`halved`
    takes it again at half the step.

    Example:
        >>> settings = EngineSettings(coords=8, directions=4, eps=None, bands=(1e-7, 1e-4, 1e-2),
        ...                           fail_at=Verdict.SUSPICIOUS, detect_kinks=True, eval_eps=2.2e-16, magnitude=1.0)
        >>> curved(Outcome({"total": 0.13046807}, {"total": 0.13046817}, floor=7e-9), settings)
        True
        >>> curved(Outcome({"total": 0.13046807}, {"total": 0.130468071}, floor=7e-9), settings)
        False
    """
    if settings.eval_eps > LOW_PRECISION_EPS or out.widened or out.kink:
        return False
    a, n = out.analytic["total"], out.numeric["total"]
    if not (math.isfinite(a) and math.isfinite(n)):
        return False
    return not agrees(a, n, out.floor, settings.bands[0]) and agrees(a, n, out.floor, settings.bands[1])


def base_step(settings: EngineSettings) -> float:
    """The relative step of every probe: ``eps``, or the cube root of the evaluation's machine epsilon."""
    return settings.eps if settings.eps is not None else settings.eval_eps ** (1.0 / 3.0)


def fails_alone(out: Outcome, settings: EngineSettings) -> bool:
    """True when one sample's disagreement, judged by itself, is a failing verdict."""
    a_t, n_t = out.analytic["total"], out.numeric["total"]
    if not (math.isfinite(a_t) and math.isfinite(n_t)):
        return False
    return Verdict.from_value(judged_rel_diff([a_t], [n_t], [out.floor]), settings.bands).is_failure(settings.fail_at)


#: Detection directions of small tensors kept for the next check with the same seed (a unit test's check_model calls,
#: each with seed 0): ``(seed, shape, dtype, device) -> direction``, read only. Drawing one costs more than
#: evaluating a small model (a generator seeded, a draw, a norm, three casts).
_DRAWN: "collections.OrderedDict[Tuple[Any, ...], torch.Tensor]" = collections.OrderedDict()
_DRAWN_ENTRIES = 1 << 16  # the largest tensor whose direction is kept, in entries
_DRAWN_BYTES = 4 * 2**20  # all of them, in bytes
_DRAWN_LOCK = threading.Lock()
_drawn_bytes = 0


def _keep_drawn(key: Tuple[Any, ...], direction: torch.Tensor) -> None:
    """Keep a small tensor's detection direction (the oldest go first beyond :data:`_DRAWN_BYTES`)."""
    if direction.numel() > _DRAWN_ENTRIES:
        return
    global _drawn_bytes
    with _DRAWN_LOCK:
        if key not in _DRAWN:
            _DRAWN[key] = direction
            _drawn_bytes += direction.numel() * direction.element_size()
        while _drawn_bytes > _DRAWN_BYTES and _DRAWN:
            _, dropped = _DRAWN.popitem(last=False)
            _drawn_bytes -= dropped.numel() * dropped.element_size()


def screen_sample(name: str, p: torch.Tensor, settings: EngineSettings, seed: int, h: float) -> Optional[Sample]:
    """The detection probe of one tensor: one random unit direction (Gaussian; int8 signs for huge tensors).

    Gaussian, not signs: an error spread over entries of equal size and opposite sign cancels exactly
    along half of all sign vectors, never along a Gaussian one. A single-entry tensor gets none (its one
    coordinate is the whole check). Seeded apart from :func:`build_samples`.
    """
    n = p.numel()
    if n <= 1:
        return None
    drawn = tensor_seed(seed, name + "#screen")
    rms = float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) / math.sqrt(n)
    unit = unit_sample(name, p)
    if n <= DENSE_SIGNS_MAX and p.is_floating_point():
        key = (drawn, tuple(p.shape), p.dtype, p.device)
        direction = _DRAWN.get(key)
        if direction is None:
            # Drawn in float32 (6x faster than float64 draws; the direction used is the one stored, either way).
            z = torch.randn(n, generator=generator(drawn), dtype=torch.float32).to(torch.float64)
            z /= torch.linalg.vector_norm(z)
            direction = z.to(p.dtype).reshape(p.shape).to(p.device)
            _keep_drawn(key, direction)
        return Sample(label=("screen",), step=h * max(unit, rms), direction=direction)
    signs = rademacher_signs(n, 1, generator(drawn)).to(p.device)
    return Sample(label=("screen",), step=h * max(unit, rms), signs=signs[0].reshape(p.shape), scale=1.0 / math.sqrt(n))


def screened(out: Outcome, settings: EngineSettings) -> bool:
    """True when the detection probe's outcome settles the tensor.

    Its analytic and numeric slopes agree to the EXCELLENT band (1e-7 by default) beyond its noise floor
    (a pessimistic bound on rounding, as the judge discounts it), and that floor is under a tenth of the
    ACCEPTABLE band, so an error the full sample would call SUSPICIOUS could not hide in the noise.
    Anything else (a kink on the way, a floor too high, a real error) goes on to the full sample, judged
    exactly as without the probe. :func:`screen` also asks this of the probe with its probable floor
    (:func:`~gradwatch.check.probes.lines.probable_floor`) in place of the worst case, before any wider step.

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
    return abs(a_t - n_t) - out.floor <= settings.bands[0] * scale and out.floor <= 0.1 * settings.bands[1] * scale


def screen(p, saved, grads, sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], j0: Terms, evaluate: Evaluator,
           settings: EngineSettings, batch: Optional[Tuple[str, Any]] = None) -> Tuple[Outcome, bool]:
    """The detection probe's outcome, and whether it settles the tensor (:func:`screened`).

    A probe lost in rounding is taken again at a wider step first (:func:`widen`, as the full sample
    does). A tensor the objective does not depend on at all (a bias before a normalization) is settled
    when the objective is bit-for-bit the same on both sides of the probe at its step and at the widest
    step :func:`widen` would take, and the analytic slope is within that step's noise: flat, and found flat.
    """
    out = outcome_of(sample, base, settings)
    a_t, n_t = out.analytic["total"], out.numeric["total"]
    if not (math.isfinite(a_t) and math.isfinite(n_t)) or not settings.detect_kinks:
        return out, screened(out, settings)
    # Only where the objective's terms are known (the module form): no product over the tensor elsewhere.
    probable = probable_of(sample, settings, lambda: param_norm(saved, grads))
    if probable is not None and probable < out.floor and screened(replace(out, floor=probable), settings):
        # The worst-case floor kept it from settling; the rounding it really carries does not (see probable_floor).
        return out, True
    if n_t == 0.0 and abs(a_t) <= out.floor and set(out.analytic) == {"total"}:
        flat = flat_at_widest(p, saved, grads, sample, evaluate, settings)
        if flat is not None:
            return flat, not settings.mark_unseen or settings.eval_eps > LOW_PRECISION_EPS
        return judge_sample(p, saved, grads, sample, base, j0, evaluate, settings, batch=batch), False
    out = judge_sample(p, saved, grads, sample, base, j0, evaluate, settings, batch=batch)
    if screened(out, settings):
        return out, True
    wider = settle_wider(p, saved, grads, sample, out, j0, evaluate, settings, batch)
    return (wider, True) if wider is not None else (out, False)


def settle_wider(p, saved, grads, sample: Sample, out: Outcome, j0: Terms, evaluate: Evaluator,
                 settings: EngineSettings, batch: Optional[Tuple[str, Any]] = None) -> Optional[Outcome]:
    """The detection probe at two wider steps, where only its noise floor kept it from settling; the outcome at the
    narrower of them when both settle the tensor, else None.

    A probe along a random direction of a large tensor has a slope about ``|g| / sqrt(n)``: its floor can be under
    ``IMPRECISE`` of the slope (no widening) and still over the tenth of the ACCEPTABLE band :func:`screened` asks
    for, though its slopes agree to the EXCELLENT band. At a wider step the floor is lower, so the probe only sees
    more: the steps are chosen for a floor of a twentieth and a fortieth of the ACCEPTABLE band, and the tensor is
    settled only where the slopes agree to the EXCELLENT band at both (a kink crossed or curvature within a step
    makes them disagree; 4 evaluations, against the full sample's 20 or more). Otherwise the full sample goes on
    from the base probe, judged as before.
    """
    a, n = out.analytic["total"], out.numeric["total"]
    scale = abs(a) + abs(n)
    if out.widened or set(out.analytic) != {"total"} or not settings.detect_kinks or not scale > 0 \
            or abs(a - n) - out.floor > settings.bands[0] * scale or len(settings.bands) < 2:
        return None  # it disagrees (or cannot settle): the full sample judges it
    unit = max(1.0, abs(sample.base)) if sample.base is not None else sample.step / base_step(settings)
    factor = min(WIDEN_MAX, 0.1 * unit / sample.step, out.floor / (0.05 * settings.bands[1] * scale))
    if not factor > 1.0:
        return None
    lines = [replace(sample, step=sample.step * factor * f, target=None, view=None) for f in (1.0, 2.0)]
    got = batched_bases(batch[0], p, saved, grads, lines, batch[1]) if batch is not None else None
    probes = got if got is not None else [central_probe(p, saved, grads, line, line.step, evaluate) for line in lines]
    taken = [Outcome(*slopes_of(*probe, line.step), floor_at(settings, line.step), widened=True, step=line.step)
             for line, probe in zip(lines, probes)]
    return taken[0] if all(screened(o, settings) for o in taken) else None


def param_norm(saved: torch.Tensor, grads: Dict[str, torch.Tensor]) -> float:
    """The norm of the tensor's entries' contributions to the objective (gradient times value, entry by entry)."""
    g = grads["total"]
    return float(torch.linalg.vector_norm(g.to(torch.float64) * saved.to(torch.float64))) \
        if g.shape == saved.shape else 0.0


def flat_at_widest(p, saved, grads, sample: Sample, evaluate: Evaluator, settings: EngineSettings) -> Optional[Outcome]:
    """The outcome along ``sample`` at the widest step :func:`widen` would take when the objective is bit-for-bit
    the same on both sides there and the analytic slope is within that step's noise (the objective does not
    depend on the tensor: found flat); else None."""
    t = sample.step * min(WIDEN_MAX, 0.1 / base_step(settings))
    jp, jm, lp, lm = central_probe(p, saved, grads, sample, t, evaluate)
    a_w, _ = slopes_of(jp, jm, lp, lm, t)
    if jp == jm and abs(a_w["total"]) <= floor_at(settings, t):  # every term (every part) bit for bit alike
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
            jp, jm, lp, lm = central_probe(p, saved, grads, half, half.step, evaluate)
            a, n = slopes_of(jp, jm, lp, lm, half.step)
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


def widen(p, saved, grads, sample: Sample, a: Terms, n: Terms, floor: float, j0: Terms, evaluate: Evaluator,
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
    t = widen_step(sample, a, n, floor, settings)
    slope = max(abs(a["total"]), abs(n["total"]))
    return _linear_at(p, saved, grads, sample, t, slope, j0, evaluate, settings) if t is not None else None


def widen_step(sample: Sample, a: Terms, n: Terms, floor: float, settings: EngineSettings) -> Optional[float]:
    """The wider step :func:`widen` takes for a base probe with slopes ``a``, ``n`` and noise ``floor``; None: none.

    Example:
        >>> from gradwatch.bands import Verdict
        >>> settings = EngineSettings(4, 0, None, (1e-4, 1e-2), Verdict.WRONG, True, 2.0 ** -52, 1.0)
        >>> widen_step(Sample(label=(0,), step=1e-5, base=0.5), {"total": 1e-6}, {"total": 1e-6}, 1e-9, settings)
        0.004
    """
    slope = max(abs(a["total"]), abs(n["total"]))
    if not (slope > 0 and math.isfinite(slope)):
        return None
    scale = max(1.0, abs(sample.base)) if sample.base is not None else sample.step / (settings.eps or settings.eval_eps ** (1.0 / 3.0))
    factor = min(WIDEN_MAX, 0.1 * scale / sample.step, 4.0 * floor / (PRECISE * slope))
    return sample.step * factor if factor > 2.0 else None


#: The fractions of the wider step :func:`widen` takes the slope at.
WIDE_FRACTIONS = (1.0, 0.5, 0.25)

#: The probes of one sample at each of :data:`WIDE_FRACTIONS` of its wider step: ``(step, (jp, jm, lp, lm))``.
WideProbes = List[Tuple[float, Tuple[Terms, Terms, Terms, Terms]]]


def _linear_at(p, saved, grads, sample: Sample, t: float, slope: float, j0: Terms, evaluate: Evaluator,
               settings: EngineSettings) -> Optional[Outcome]:
    """:func:`widen` at one step ``t``, evaluated one perturbation at a time."""
    probes: WideProbes = []
    for s in (t * f for f in WIDE_FRACTIONS):
        probe = central_probe(p, saved, grads, sample, s, evaluate)
        probes.append((s, probe))
        a_s, n_s = slopes_of(*probe, s)
        if not (math.isfinite(a_s["total"]) and math.isfinite(n_s["total"])):
            return None
    return linear_from(probes, slope, j0, settings)


def linear_from(probes: WideProbes, slope: float, j0: Terms, settings: EngineSettings) -> Optional[Outcome]:
    """The Richardson slope from the probes at ``t``, ``t/2`` and ``t/4`` when the function is linear within ``t``,
    else None (see :func:`widen`); ``slope``: the larger of the base probe's slopes."""
    seen, sides = [], []
    for s, (jp, jm, lp, lm) in probes:
        a_s, n_s = slopes_of(jp, jm, lp, lm, s)
        if not (math.isfinite(a_s["total"]) and math.isfinite(n_s["total"])):
            return None
        seen.append((a_s, n_s, floor_at(settings, s)))
        sides += [rise(jp, j0) / s, rise(j0, jm) / s]
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
    return Outcome(a2, richardson, floor, widened=True, step=probes[0][0])


def needs_widening(out: Outcome, settings: EngineSettings,
                   probable: Optional[Callable[[], Optional[float]]] = None) -> bool:
    """True when a base probe's noise floor is over ``IMPRECISE`` of its slopes: :func:`widen` takes it again.

    Not where the probe's probable floor (``probable()``, :func:`probable_of`: asked only where the worst case is over
    ``IMPRECISE``) settles it as the detection probe is settled (:func:`screened` with it in place of the worst
    case): slopes that agree to the EXCELLENT band beyond the rounding the probe really carries have no error for a
    wider step to show. As in :func:`screen`, the probable floor never discounts a disagreement: a probe that
    disagrees is widened as before.

    Example:
        >>> from gradwatch.bands import Verdict
        >>> settings = EngineSettings(4, 0, None, (1e-7, 1e-4, 1e-2), Verdict.WRONG, True, 2.0 ** -52, 1.0)
        >>> out = Outcome({"total": 0.5}, {"total": 0.5}, 1e-3)
        >>> needs_widening(out, settings), needs_widening(out, settings, probable=lambda: 1e-12)
        (True, False)
        >>> needs_widening(Outcome({"total": 0.5}, {"total": 0.51}, 1e-3), settings, probable=lambda: 1e-12)
        True
    """
    a, n, fl = out.analytic["total"], out.numeric["total"], out.floor
    if not (settings.detect_kinks and math.isfinite(a) and math.isfinite(n) and fl > IMPRECISE * max(abs(a), abs(n))):
        return False
    floor = None if probable is None else probable()
    return floor is None or not (floor < fl and screened(replace(out, floor=floor), settings))


def probable_of(sample: Sample, settings: EngineSettings, norm: Callable[[], float]) -> Optional[float]:
    """A sample's probable floor (:func:`~gradwatch.check.probes.lines.probable_floor`), None where the objective's
    terms are unknown; ``norm()`` gives the tensor's :func:`param_norm` (a product over the whole tensor: called only
    where the terms are known)."""
    return None if settings.term_norm is None else probable_floor(settings, sample.step, norm())


def widened_in_batches(name: str, p, saved, grads, based: Sequence[Tuple[Sample, Outcome]], probe_batch: Any,
                       settings: EngineSettings) -> List[Optional[WideProbes]]:
    """The probes :func:`widen` takes, for every ``(sample, base outcome)`` that needs them, evaluated together in
    batches of ``probe_batch``: one :data:`WideProbes` each, None where a sample needs none, and all None when the
    batched evaluator declines (each sample then widens one evaluation at a time)."""
    wanted: List[Tuple[int, Sample, float]] = []
    norm = functools.cache(lambda: param_norm(saved, grads))  # once, and only if a probe asks for its probable floor
    for i, (sample, out) in enumerate(based):
        wider = needs_widening(out, settings, functools.partial(probable_of, sample, settings, norm))
        t = widen_step(sample, out.analytic, out.numeric, out.floor, settings) if wider else None
        if t is not None:
            wanted.append((i, sample, t))
    found: List[Optional[WideProbes]] = [None] * len(based)
    lines = [replace(sample, step=t * f, target=None, view=None) for _, sample, t in wanted for f in WIDE_FRACTIONS]
    got = batched_bases(name, p, saved, grads, lines, probe_batch) if lines else None
    if got is not None:
        k = len(WIDE_FRACTIONS)
        for j, (i, _, _) in enumerate(wanted):
            found[i] = [(lines[k * j + m].step, got[k * j + m]) for m in range(k)]
    return found


def judge_sample(p, saved, grads, sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], j0: Terms,
                  evaluate: Evaluator, settings: EngineSettings, wide: Optional[WideProbes] = None,
                  batch: Optional[Tuple[str, Any]] = None) -> Outcome:
    """One sample's outcome from its base probes; taken at a wider step where the base step is lost in rounding.

    ``wide``: the probes at the wider step, taken before (in a batch, :func:`widened_in_batches`); None: taken
    here, in one batch when ``batch`` (the tensor's name and a batched evaluator) is given and takes it.
    """
    out = outcome_of(sample, base, settings)
    if needs_widening(out, settings, lambda: probable_of(sample, settings, lambda: param_norm(saved, grads))):
        if wide is None and batch is not None:
            wide = widened_in_batches(batch[0], p, saved, grads, [(sample, out)], batch[1], settings)[0]
        if wide is not None:
            wider = linear_from(wide, max(abs(out.analytic["total"]), abs(out.numeric["total"])), j0, settings)
        else:
            wider = widen(p, saved, grads, sample, out.analytic, out.numeric, out.floor, j0, evaluate, settings)
        if wider is not None and disagrees(wider, settings) and wider.step is not None \
                and crosses(p, saved, grads, sample, wider.step, evaluate):
            # Linear-looking sides, but kinks crossed inside the wider step (seen in the forward): the base
            # probe stands, re-examined as any other.
            return out
        if wider is not None:  # smooth within a wider step: the slope there is the slope at the point
            return wider
    return out
