"""Judging one tensor: from the slopes sampled along its lines to a :class:`TensorCheck`.

Every backward verdict is given here, whatever measured the slopes:
:func:`~gradwatch.check_model` and :func:`~gradwatch.check_numpy` (through
:func:`gradwatch.check.probes.engine.check_tensor`), the module checks of
:mod:`gradwatch.check.modules.localize`, and :func:`~gradwatch.check_backward`
(through :mod:`gradwatch.check.probes.outputs`). Each sampled line (a coordinate,
or a random direction) gives an analytic and a numeric slope and the noise
floor of the numeric one; a line found non-differentiable is *excluded*, one
whose disagreement the precision cannot resolve is *unresolved*. Two rules
turn them into a verdict:

- :class:`BandRule` (the chapter's bands; check_model, check_numpy, localize):
  the relative difference left after discounting each line's noise floor is
  placed in the bands; non-finite slopes, unresolved lines and the rounding of a
  low-precision part of the objective leave the tensor inconclusive instead.
- :class:`ToleranceRule` (Chainer's; check_backward): a line fails when
  ``|numeric - analytic| > atol + rtol * |analytic|``, and one failing line fails
  the tensor.

A tensor that gets no verdict at all (the objective is not finite or not
deterministic, its analytic gradient is not finite) is :func:`inconclusive`,
with its :class:`~gradwatch.check.judging.report.InconclusiveKind`.

Pure: floats in, :class:`TensorCheck` out; no torch evaluation happens here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from gradwatch.bands import DEFAULT_BANDS, Verdict
from gradwatch.check.judging._diagnosis import constant_ratio, diagnose
from gradwatch.check.judging.report import InconclusiveKind, TensorCheck
from gradwatch.check.numerics.differences import max_rel_error, rel_diff

#: Rounding slack on top of one ulp of the objective, for error accumulated inside it.
NOISE_FACTOR = 32.0


@dataclass
class Slope:
    """What was measured along one sampled line of a tensor.

    Attributes:
        analytic: The analytic slope (the gradient's component along the line).
        numeric: The central-difference slope.
        floor: Absolute rounding noise of ``numeric`` (``nan`` where it was not measured).
        coordinate: True for one coordinate, False for a direction (or a block of coordinates).
        label: Where: the coordinate's index, or a direction's label.
        excluded: Found non-differentiable there (a kink or jump): left out of the measures and the verdict.
        unresolved: Disagrees by less than central differences in this precision can resolve.
        failed: Out of tolerance (set for :class:`ToleranceRule`).
        alone: Judged on its own as well as with the others: the one entry a disagreeing detection probe was
            traced to (:func:`gradwatch.check.probes.reexamine.pinpoint`), whose error the other lines would dilute.

    Example:
        >>> Slope(analytic=2.0, numeric=2.0).coordinate
        True
    """

    analytic: float
    numeric: float
    floor: float = 0.0
    coordinate: bool = True
    label: tuple = ()
    excluded: bool = False
    unresolved: bool = False
    failed: bool = False
    alone: bool = False
    #: The probe crossed a kink seen in the forward and was taken again at a shorter step that crosses none.
    crossed: bool = False


@dataclass(frozen=True)
class BandRule:
    """The chapter's bands, applied to the noise-discounted relative difference (see :func:`judged_rel_diff`).

    Attributes:
        bands: Upper bounds of excellent, acceptable and suspicious.
        fail_at: The verdict at which a tensor fails.
        coarse: Where the objective computes in a lower precision than the tensors (words), if anywhere:
            a disagreement only that rounding could explain leaves the tensor inconclusive.
    """

    bands: Sequence[float] = DEFAULT_BANDS
    fail_at: Verdict = Verdict.SUSPICIOUS
    coarse: Optional[str] = None


@dataclass(frozen=True)
class ToleranceRule:
    """Chainer's rule: a line passes when ``|numeric - analytic| <= atol + rtol * |analytic|``."""

    atol: float
    rtol: float


Rule = Union[BandRule, ToleranceRule]


def agrees(analytic: float, numeric: float, floor: float, rel: float) -> bool:
    """True when ``|analytic - numeric|`` is within the noise floor plus ``rel`` of the magnitudes.

    Example:
        >>> agrees(1.0, 1.0 + 1e-9, floor=0.0, rel=1e-4), agrees(1.0, 2.0, floor=0.0, rel=1e-4)
        (True, False)
    """
    return abs(analytic - numeric) - floor <= rel * (abs(analytic) + abs(numeric))


def judged_rel_diff(analytic: Sequence[float], numeric: Sequence[float], floors: Sequence[float]) -> float:
    """Relative difference after discounting each line's noise floor (0 when every gap is within it).

    Example:
        >>> judged_rel_diff([1.0, 2.0], [1.0, 2.0 + 1e-9], [1e-8, 1e-8])
        0.0
        >>> round(judged_rel_diff([2.0], [1.0], [0.0]), 4)
        0.3333
    """
    if not analytic:
        return 0.0
    if not (all(map(math.isfinite, analytic)) and all(map(math.isfinite, numeric))):
        return float("nan")
    excess = [max(abs(a - n) - f, 0.0) for a, n, f in zip(analytic, numeric, floors)]
    denom = math.hypot(*analytic) + math.hypot(*numeric)
    if denom == 0.0:
        return 0.0
    return min(1.0, math.hypot(*excess) / denom)


def allowed_jitter(eps: float, magnitude: float) -> float:
    """How far two evaluations of the same point may differ by rounding alone (objective of ``magnitude``)."""
    return NOISE_FACTOR * eps * max(magnitude, 1e-30)


def base_point(first: float, second: float, allowed: float) -> Tuple[float, Optional[InconclusiveKind], Optional[str]]:
    """Judge two evaluations of the objective at the unperturbed point, before any slope is taken.

    Returns:
        ``(jitter, kind, why)``: their difference, and when no tensor can be judged,
        :attr:`~InconclusiveKind.NONFINITE` (both not finite) or
        :attr:`~InconclusiveKind.NONDETERMINISTIC` (they differ by more than ``allowed``) with the words.

    Example:
        >>> base_point(1.0, 1.0, 1e-12)
        (0.0, None, None)
        >>> base_point(1.0, 1.5, 1e-12)[1].value
        'nondeterministic'
    """
    jitter = abs(first - second)
    if not (math.isfinite(first) or math.isfinite(second)):
        return jitter, InconclusiveKind.NONFINITE, f"objective is not finite ({first})"
    if not math.isfinite(jitter) or jitter > allowed:
        return jitter, InconclusiveKind.NONDETERMINISTIC, f"objective is nondeterministic (two evaluations differ by {jitter:.3g})"
    return jitter, None, None


def inconclusive(name: str, shape: Sequence[int], kind: InconclusiveKind, why: str) -> TensorCheck:
    """A tensor with no verdict: why in words (``inconclusive``) and as a kind (``inconclusive_kind``).

    Example:
        >>> t = inconclusive("w", (2,), InconclusiveKind.NONFINITE, "objective is not finite (nan)")
        >>> t.verdict is None, t.inconclusive_kind.value, t.failed
        (True, 'nonfinite', False)
    """
    return TensorCheck(name=name, shape=tuple(shape), rel_diff=float("nan"), max_rel_error=float("nan"),
                       inconclusive=why, inconclusive_kind=kind)


def judge(name: str, shape: Sequence[int], slopes: Sequence[Slope], rule: Rule, step: float) -> TensorCheck:
    """The :class:`TensorCheck` of one tensor from its sampled lines, under ``rule``.

    The measures (``rel_diff`` and ``max_rel_error`` over the coordinates, ``directional_rel_diff``
    over the directions, ``noise_floor``) leave out excluded and unresolved lines; the per-sample
    lists keep every line. A failing tensor gets a ``diagnosis`` and, when one constant factor
    explains the disagreement, its ``ratio``.

    Args:
        name: The tensor's name in the report.
        shape: Its shape.
        slopes: One :class:`Slope` per sampled line, coordinates and directions in any order.
        rule: :class:`BandRule` or :class:`ToleranceRule`.
        step: The finite-difference step (reported).

    Example:
        >>> lines = [Slope(2.0, 1.0, label=(0,)), Slope(4.0, 2.0, label=(1,))]
        >>> t = judge("w", (2,), lines, BandRule(), step=1e-5)
        >>> t.verdict.value, t.ratio, t.diagnosis
        ('wrong', 2.0, 'analytic is 2.00x numeric (constant ratio): a factor in backward is wrong')
    """
    kept = [s for s in slopes if not (s.excluded or s.unresolved)]
    ca = [s.analytic for s in kept if s.coordinate]
    cn = [s.numeric for s in kept if s.coordinate]
    da = [s.analytic for s in kept if not s.coordinate]
    dn = [s.numeric for s in kept if not s.coordinate]
    coords = [s for s in slopes if s.coordinate]
    dirs = [s for s in slopes if not s.coordinate]
    check = TensorCheck(
        name=name,
        shape=tuple(shape),
        rel_diff=rel_diff(ca, cn) if ca else 0.0,
        max_rel_error=max_rel_error(ca, cn),
        directional_rel_diff=rel_diff(da, dn) if da else None,
        noise_floor=float(max((s.floor for s in kept if math.isfinite(s.floor)), default=0.0)),
        step=step,
        kinks=sum(s.excluded or s.crossed for s in slopes),
        coords=[tuple(s.label) for s in coords],
        analytic=[s.analytic for s in coords],
        numeric=[s.numeric for s in coords],
        dir_analytic=[s.analytic for s in dirs],
        dir_numeric=[s.numeric for s in dirs],
    )
    if isinstance(rule, ToleranceRule):
        return _by_tolerance(check, slopes, kept, rule)
    return _by_bands(check, slopes, kept, rule, step)


def _by_bands(check: TensorCheck, slopes: Sequence[Slope], kept: List[Slope], rule: BandRule, step: float) -> TensorCheck:
    def of(coordinate: bool) -> Tuple[List[float], List[float], List[float]]:
        part = [s for s in kept if s.coordinate == coordinate]
        return [s.analytic for s in part], [s.numeric for s in part], [s.floor for s in part]

    (ca, cn, cf), (da, dn, df) = of(True), of(False)
    check.judged_rel_diff = max([judged_rel_diff(ca, cn, cf), judged_rel_diff(da, dn, df)]
                                + [judged_rel_diff([s.analytic], [s.numeric], [s.floor]) for s in kept if s.alone])
    if not all(map(math.isfinite, ca + cn + da + dn)):
        check.inconclusive = "non-finite values in the objective or gradient along the sampled points"
        check.inconclusive_kind = InconclusiveKind.NONFINITE
        check.judged_rel_diff = float("nan")
        return check
    verdict = Verdict.from_value(check.judged_rel_diff, rule.bands)
    unresolved = sum(s.unresolved for s in slopes)
    raw = max(check.rel_diff, check.directional_rel_diff or 0.0)
    if rule.coarse and not verdict.is_failure(rule.fail_at) and (
            unresolved or Verdict.from_value(raw, rule.bands).is_failure(rule.fail_at)):
        # Only the rounding of the low-precision part could explain the disagreement: it cannot be judged.
        check.inconclusive = (
            f"the sampled slopes disagree by {raw:.1e}, within the rounding noise of the low-precision part of "
            f"the objective ({rule.coarse}); a gradient error of that size cannot be told from it"
        )
        check.inconclusive_kind = InconclusiveKind.LOW_PRECISION
        return check
    if not verdict.is_failure(rule.fail_at) and math.isfinite(raw) and raw > rule.bands[-1] and _swamped(kept, rule):
        # Only the noise floors excuse a disagreement in the WRONG band, and no line resolves a 1% error: the
        # rounding of central differences in this precision is larger than the slopes themselves (a float32
        # objective summed over a large output), so the lines could not have shown an error. That is not agreement.
        check.inconclusive = (
            f"the sampled slopes disagree by {raw:.1e} (relative), by less than central differences in this "
            f"precision can resolve (a noise floor of {check.noise_floor:.1e} against slopes of "
            f"{max((abs(s.analytic) + abs(s.numeric) for s in kept), default=0.0):.1e}): an error of that size "
            "cannot be told from the rounding; in float32 check with dtype=float64 (the default shadow copy) to judge it"
        )
        check.inconclusive_kind = InconclusiveKind.BELOW_RESOLUTION
        return check
    if unresolved and not verdict.is_failure(rule.fail_at):
        # The resolvable samples pass, but some disagreed by less than this precision can resolve.
        check.inconclusive = (
            f"{unresolved} of {len(slopes)} samples disagree by less than low-precision central differences "
            f"can resolve (a ReLU/max-pool/abs kink within the step {step:.1e}, where a smaller step is lost in "
            "the objective's rounding: gradients tiny against the objective, as at weights near zero; or a small "
            "gradient error); in float32 check with dtype=float64 (the default shadow copy) to judge them"
        )
        check.inconclusive_kind = InconclusiveKind.UNRESOLVED
        return check
    check.verdict = verdict
    check.failed = verdict.is_failure(rule.fail_at)
    if check.failed:
        _explain(check, ca + da, cn + dn, check.noise_floor)
    return check


def _swamped(kept: Sequence[Slope], rule: BandRule) -> bool:
    """True when every line's noise floor is as large as the WRONG band of its own slopes: none could show an
    error of that size (a line with a floor that was not measured resolves)."""
    return bool(kept) and all(math.isfinite(s.floor) and s.floor >= rule.bands[-1] * (abs(s.analytic) + abs(s.numeric))
                              for s in kept)


def _by_tolerance(check: TensorCheck, slopes: Sequence[Slope], kept: List[Slope], rule: ToleranceRule) -> TensorCheck:
    check.judged_rel_diff = rel_diff([s.analytic for s in kept], [s.numeric for s in kept])
    bad = any(s.failed for s in slopes)
    check.verdict = Verdict.WRONG if bad else Verdict.from_value(check.judged_rel_diff)
    if check.verdict in (Verdict.SUSPICIOUS, Verdict.WRONG) and not bad:
        check.verdict = Verdict.ACCEPTABLE  # within the caller's atol/rtol
    check.failed = bad
    if bad:
        _explain(check, [s.analytic for s in slopes], [s.numeric for s in slopes], rule.atol)
    return check


def _explain(check: TensorCheck, analytic: List[float], numeric: List[float], floor: float) -> None:
    """A failing tensor's diagnosis in words, and its constant ratio when one explains it."""
    check.diagnosis = diagnose(analytic, numeric, floor)
    check.ratio = constant_ratio(analytic, numeric, floor)
