"""Slopes along lines: the samples of a tensor, its perturbed evaluations and central differences."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch

from gradwatch.bands import Verdict
from gradwatch.check.judging.judge import (
    NOISE_FACTOR,
)
from gradwatch.check.numerics.sampling import choose_coords, generator, rademacher_signs, tensor_seed

if TYPE_CHECKING:
    from gradwatch.options import CheckOptions


Terms = Dict[str, float]


#: Largest tensor whose direction signs are drawn in its own dtype (a dense direction per probe);
#: larger ones keep int8 signs (a mixed-dtype add costs more, but the signs take an eighth of float64's memory).
DENSE_SIGNS_MAX = 1 << 20


class Evaluator:
    """Wraps ``evaluate() -> {term: float}`` and counts calls.

    Example:
        >>> ev = Evaluator(lambda: {"loss": 1.0})
        >>> ev()["loss"], ev.count
        (1.0, 1)
    """

    def __init__(self, evaluate: Callable[[], Terms], recordable: bool = True) -> None:
        self._evaluate = evaluate
        self.count = 0
        #: Its forward may run under a recording dispatch mode (:mod:`gradwatch.check.probes.kinks`); False for
        #: a model holding ``torch.compile`` code, whose live graph a mode would throw out of dynamo's cache.
        self.recordable = recordable
        #: Its :class:`~gradwatch.check.probes.kinks.ForwardKinks`, once asked for.
        self.forward_kinks: Any = None
        #: Told which tensor the engine perturbs from now on (None: none), where the evaluation can use it
        #: (:class:`~gradwatch.check.probes.prefix.PrefixCache`).
        self.on_focus: Optional[Callable[[Optional[torch.Tensor]], None]] = None

    def focus(self, p: Optional[torch.Tensor]) -> None:
        """The engine perturbs ``p`` (alone) until the next call; None: nothing."""
        if self.on_focus is not None:
            self.on_focus(p)

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
    #: Its probe crossed a kink seen in the forward (:mod:`gradwatch.check.probes.kinks`): taken again at a
    #: step that crosses none, or excluded (``kink``).
    crossed: bool = False
    #: The step the slopes were taken at, where it is not the sample's (a wider step, :func:`widen`).
    step: Optional[float] = None


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
    #: Where the objective computes in a lower precision than the tensors (see :mod:`gradwatch.check.objective.precision`).
    coarse: Optional[str] = None
    #: In float64: a tensor no sample could resolve (a 1% error could not show) is inconclusive,
    #: ``below_resolution``, and one the objective is found flat in (bit-for-bit the same at the widest step:
    #: a zero gradient and one far below rounding look the same) is ``flat``, instead of passing; for a caller
    #: that judges them another way (check_model: on their modules alone).
    mark_unseen: bool = False
    #: The Euclidean norm of the objective's terms (``magnitude`` is their absolute sum), where the caller knows
    #: them (the module form: the products of a unit's outputs and its cotangent): the scale of the rounding a
    #: probe really carries (:func:`probable_floor`); None: unknown, only the worst case is used.
    term_norm: Optional[float] = None

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


@dataclass(frozen=True)
class TermScales:
    """Which of the objective's terms each tensor moves: the scale of the rounding its probes carry.

    An objective that is a sum of parts (the module form: each output's product with its cotangent, keys
    :func:`part_key`) is evaluated part by part, each part's total a float of its own, and its differences are
    taken part by part (:func:`rise`). A part no path of the backward graph leads to from a tensor is computed bit
    for bit alike on both sides of that tensor's probe: it adds exactly nothing to the difference, and none of its
    rounding. So a probe of the tensor carries the rounding of the parts it moves only. An own-code unit whose
    input is passed on to several called modules (an attention's ``x`` to ``q``, ``k`` and ``v``) has large parts
    no called module's output moves: its noise floor, taken over every part, hid those outputs' slopes.

    Args:
        absum: Per part, the absolute sum of its entries (``sum |o * c|``).
        sqsum: Per part, the sum of its entries' squares.
        moved: Per tensor key, the parts it reaches.

    Example:
        >>> from gradwatch.bands import Verdict
        >>> scales = TermScales(absum=(1e6, 10.0), sqsum=(1e8, 16.0), moved={"w": frozenset({1})})
        >>> base = EngineSettings(4, 0, None, (1e-7, 1e-4, 1e-2), Verdict.WRONG, True, 2.0 ** -52, 1e6 + 10.0,
        ...                       term_norm=1e4)
        >>> s = scales.settings(base, ["w"])
        >>> s.magnitude, s.term_norm
        (10.0, 4.0)
        >>> scales.settings(base, ["x"]) is base  # a tensor not traced keeps every part
        True
    """

    absum: Tuple[float, ...]
    sqsum: Tuple[float, ...]
    moved: Dict[str, frozenset]

    def settings(self, settings: EngineSettings, keys: Sequence[str]) -> EngineSettings:
        """``settings`` with the magnitude and term norm of the parts the tensors ``keys`` move (never more than
        ``settings``'s); ``settings`` itself where some key was not traced."""
        if not keys or any(k not in self.moved for k in keys):
            return settings
        parts = frozenset().union(*(self.moved[k] for k in keys))
        magnitude = min(settings.magnitude, sum(self.absum[i] for i in parts))
        norm = math.sqrt(sum(self.sqsum[i] for i in parts))
        term_norm = None if settings.term_norm is None else min(settings.term_norm, norm)
        return replace(settings, magnitude=magnitude, term_norm=term_norm)


#: The key prefix of an objective's parts (:func:`part_key`).
PART = "part:"


def part_key(i: int) -> str:
    """The key of an objective's ``i``-th part: parts are summed into one objective, judged as one (never as
    terms of their own), their differences taken part by part (:func:`rise`).

    Example:
        >>> part_key(2), parts_only({part_key(0): 1.0, part_key(1): 2.0}), parts_only({"loss": 1.0})
        ('part:2', True, False)
    """
    return f"{PART}{i}"


def parts_only(terms: Terms) -> bool:
    """True where ``terms`` are the parts of one objective (:func:`part_key`), not terms of their own."""
    return bool(terms) and all(k.startswith(PART) for k in terms)


def rise(j: Terms, j0: Terms) -> float:
    """``total(j) - total(j0)`` taken term by term: a term computed bit for bit alike at both points adds exactly
    nothing (its rounding included); for one term, exactly ``j - j0``.

    Example:
        >>> rise({"a": 1e16, "b": 1.5}, {"a": 1e16, "b": 1.0}), total({"a": 1e16, "b": 1.5}) - total({"a": 1e16, "b": 1.0})
        (0.5, 2.0)
    """
    return float(sum(j.get(k, 0.0) - j0.get(k, 0.0) for k in sorted(set(j) | set(j0))))


def total(terms: Terms) -> float:
    """Sum of the terms (in a fixed order)."""
    return float(sum(terms[k] for k in sorted(terms)))


def floor_at(settings: EngineSettings, step: float) -> float:
    """Absolute noise floor of a central difference with this step."""
    return NOISE_FACTOR * settings.eval_eps * max(settings.magnitude, 1e-30) / step + settings.jitter / step


def probable_floor(settings: EngineSettings, step: float, param_norm: float) -> Optional[float]:
    """The noise floor of a central difference with this step from rounding that does not add up in one direction;
    None where the objective's terms are unknown (``settings.term_norm``).

    :func:`floor_at` bounds the worst case: every term of the objective rounded the same way, ``eps`` times their
    absolute sum. Roundings of many terms (and of the perturbed entries) are independent: they add up as the
    Euclidean norm of the terms (``term_norm``) and of the entries' contributions to the objective
    (``param_norm``: the norm of the gradient times the tensor, entry by entry), ``sqrt(n)`` below the worst case
    for ``n`` terms of one size, with the same factor for rounding inside the ops. Used only to let a probe that
    agrees settle a tensor (see :func:`gradwatch.check.probes.reexamine.screened`), never to discount a
    disagreement.

    Example:
        >>> settings = EngineSettings(4, 0, None, (1e-7, 1e-4, 1e-2), Verdict.WRONG, True, 2.0 ** -52, 1e4,
        ...                           term_norm=10.0)
        >>> probable_floor(settings, 1e-5, 0.0) < floor_at(settings, 1e-5) / 100
        True
    """
    if settings.term_norm is None:
        return None
    return NOISE_FACTOR * settings.eval_eps * (settings.term_norm + param_norm) / step + settings.jitter / step


def usable_floor(floor: float, analytic: float, numeric: float, disagreement: float) -> bool:
    """True when a smaller step whose noise floor is ``floor`` can tell a kink from a wrong gradient: the floor is
    under 1% of the slopes, or under 30% of the disagreement to explain (slopes near zero at weights near
    zero, a ReLU unit dead at the point and crossed by the base step: the disagreement is all there is to see).

    Example:
        >>> usable_floor(1e-9, 0.0, 0.0, 4e-7), usable_floor(1e-9, 0.0, 0.0, 2e-9)
        (True, False)
    """
    return floor <= 1e-2 * max(abs(analytic), abs(numeric), 1e-300) or floor <= 0.3 * disagreement


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


def perturb(p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], sample: Sample, t: float) -> Terms:
    """Write ``θ + t·v`` into ``p`` and return the analytic linear prediction per term for the perturbation applied
    (undone by :func:`restore_line`); for probes that perturb several tensors before one evaluation."""
    return _lin(p, saved, grads, sample, t, _apply(p, saved, sample, t))


def restore_line(p: torch.Tensor, saved: torch.Tensor, sample: Sample) -> None:
    """Undo :func:`perturb` exactly."""
    _restore(p, saved, sample)


def central_probe(p, saved, grads, sample, t, evaluate) -> Tuple[Terms, Terms, Terms, Terms]:
    """Both sides of a central difference; ``p`` is written twice and restored once."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return central_probe(p, saved, grads, sample, t, evaluate)
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


def slopes_of(jp: Terms, jm: Terms, lp: Terms, lm: Terms, t: float) -> Tuple[Terms, Terms]:
    analytic = {k: (lp[k] - lm[k]) / (2 * t) for k in lp}
    numeric = {k: (jp.get(k, 0.0) - jm.get(k, 0.0)) / (2 * t) for k in lp if k != "total"}
    numeric["total"] = rise(jp, jm) / (2 * t)
    return analytic, numeric


def build_samples(name: str, p: torch.Tensor, g: torch.Tensor, settings: EngineSettings, seed: int, h: float) -> List[Sample]:
    """The coordinates and directions to probe for one tensor (seeded per tensor)."""
    gen = generator(tensor_seed(seed, name))
    shape = tuple(p.shape)
    samples: List[Sample] = []
    # An activation (the module form's ``<module>:input``) has no scale of 1 to fall back on: its entries
    # near zero at small weights sit within a step of 1's scale of every ReLU kink, so its steps follow its
    # own root-mean-square size.
    unit = unit_sample(name, p)
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


def unit_sample(name: str, p: torch.Tensor) -> float:
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
    """What :func:`batched_bases` needs from a batched evaluator (see :mod:`gradwatch.check.probes.batched`)."""

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
    """The ``(jp, jm, lp, lm)`` of :func:`central_probe` for every sample, evaluated in batches.

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


def outcome_of(sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], settings: EngineSettings) -> Outcome:
    a, n = slopes_of(*base, sample.step)
    return Outcome(a, n, floor_at(settings, sample.step))


def base_probes(name: str, p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], samples: List[Sample],
           probe_batch: Optional[BatchProbe]) -> List[Optional[Tuple[Terms, Terms, Terms, Terms]]]:
    """The base probes of ``samples`` in batches where ``probe_batch`` takes them; None each: probed in the loop."""
    got = batched_bases(name, p, saved, grads, samples, probe_batch) if probe_batch is not None and samples else None
    return list(got) if got is not None else [None] * len(samples)


def all_finite(t: torch.Tensor) -> bool:
    """True when no entry is NaN or infinite.

    A finite sum says it at once (a NaN or an infinite entry makes the sum NaN or infinite): one reduction, several
    times cheaper on a small tensor than the min/max pass, which decides where the sum is not finite (an overflow of
    finite entries included).

    Example:
        >>> all_finite(torch.tensor([1.0, 2.0])), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
        >>> all_finite(torch.tensor([3e38, 3e38])), all_finite(torch.tensor([float("inf"), -float("inf")]))
        (True, False)
    """
    if t.numel() == 0 or not t.is_floating_point():
        return True
    flat = t.detach()
    if math.isfinite(float(flat.sum())):
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(flat.reshape(-1)))).all())


#: One tensor to check: its key, its name in the report, the tensor (perturbed in place), its gradient per term.
Target = Tuple[str, str, torch.Tensor, Dict[str, torch.Tensor]]
