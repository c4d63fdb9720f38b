"""Kinks seen from the forward: which non-smooth ops a probe's perturbation moves across their kinks.

Along a probe the objective is evaluated at ``θ ± t·v``. Where the forward runs a non-smooth op (ReLU,
LeakyReLU, hardtanh, abs, clamp, max/min, max-pooling, sort, comparisons) and one of its inputs changes
branch between the point and a perturbed point, the central difference straddles a kink: its slope is not
the gradient at the point, whatever the backward computes. Slopes alone tell that badly at weights near zero,
where a probe crosses many kinks at once and the one-sided slopes bend alike.

A :class:`Recorder` (a ``TorchDispatchMode``) notes, during one evaluation, each such op's *margin* (a float
tensor whose sign is the branch taken: the ReLU's input, ``x - max`` of a clamp, ``a - b`` of a maximum) or
*label* (an integer tensor: the argmax of a max-pool, the order of a sort, a comparison's result where no
margin applies). Two evaluations' records are compared entry by entry (:func:`compare`): how many entries
changed branch, and, from the margins, the smallest fraction of the step at which one did (a margin is
linear along a short probe). :func:`kink_free` uses it to shorten a disagreeing probe until it crosses no
kink, or to exclude it when no step the rounding allows is short enough.

Example:
    >>> x = torch.tensor([-1.0, 0.5, 2.0], dtype=torch.float64)
    >>> a, b = record(lambda: torch.relu(x)), record(lambda: torch.relu(x - 1.0))
    >>> c = compare(a, b)
    >>> c.count, round(c.fraction, 3)
    (1, 0.5)
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from gradwatch.check.judging.judge import agrees
from gradwatch.check.objective.dispatch_mode import EagerDispatchMode
from gradwatch.check.probes.lines import (
    EngineSettings,
    Evaluator,
    Outcome,
    Sample,
    Terms,
    central_probe,
    floor_at,
    outcome_of,
    usable_floor,
)

#: Largest number of entries one evaluation's record may hold (beyond it the forward is not recorded:
#: the slopes' own rules stand).
RECORD_LIMIT = 1 << 22
#: The fraction of the step assumed where an entry changed branch and no margin says where (a label).
UNKNOWN_FRACTION = 0.1
#: Times a probe is shortened before it is excluded.
SHORTENINGS = 4

#: One evaluation's record: ``("m", margin)`` or ``("l", label)`` per non-smooth op, in the order they ran.
Record = List[Tuple[str, torch.Tensor]]


def _margin(x: Any, c: Any = 0.0) -> Optional[torch.Tensor]:
    """``x - c`` in float32 (its sign is the branch taken), where ``x`` is a floating tensor and ``c`` a number or
    a floating tensor; None otherwise (a missing bound, a flag, an integer tensor)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or c is None or isinstance(c, bool):
        return None
    if isinstance(c, torch.Tensor) and not c.is_floating_point():
        return None
    return (x - c).detach().to(torch.float32)


def _margins(x: Any, *cs: Any) -> List[Tuple[str, torch.Tensor]]:
    """The record entries of ``x``'s margins to each of ``cs`` (those :func:`_margin` can read)."""
    return [("m", m) for m in (_margin(x, c) for c in cs) if m is not None]


def _pointwise(*bounds: int) -> Callable[..., List[Tuple[str, torch.Tensor]]]:
    """A rule for an op kinked where its first argument crosses the scalar arguments at ``bounds`` (0 when none)."""

    def rule(args: Tuple, kwargs: Dict[str, Any], out: Any) -> List[Tuple[str, torch.Tensor]]:
        return _margins(args[0], *([args[i] if len(args) > i else None for i in bounds] if bounds else [0.0]))

    return rule


def _shifted(*shifts: float) -> Callable[..., List[Tuple[str, torch.Tensor]]]:
    """A rule for an op kinked where its first argument crosses the constants ``shifts`` (hardswish's -3 and 3)."""

    def rule(args: Tuple, kwargs: Dict[str, Any], out: Any) -> List[Tuple[str, torch.Tensor]]:
        return _margins(args[0], *shifts)

    return rule


def _clamp(args: Tuple, kwargs: Dict[str, Any], out: Any) -> List[Tuple[str, torch.Tensor]]:
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    return _margins(args[0], lo, hi)


def _difference(args: Tuple, kwargs: Dict[str, Any], out: Any) -> List[Tuple[str, torch.Tensor]]:
    return _margins(args[0], args[1] if len(args) > 1 else None)


def _indices(position: int) -> Callable[..., List[Tuple[str, torch.Tensor]]]:
    """A rule reading the indices an op returns at ``position`` (``max(dim)``, a max-pool, ``sort``); for the
    same op's other overloads, the extreme's position (``max()``) or the difference (``max(a, b)``)."""

    def rule(args: Tuple, kwargs: Dict[str, Any], out: Any) -> List[Tuple[str, torch.Tensor]]:
        if isinstance(out, (tuple, list)) and len(out) > position and isinstance(out[position], torch.Tensor):
            return [("l", out[position].detach())]
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            return _difference(args, kwargs, out)
        return _arg_extreme(args, kwargs, out) if isinstance(out, torch.Tensor) else []

    rule.after = True  # type: ignore[attr-defined]
    return rule


def _arg_extreme(args: Tuple, kwargs: Dict[str, Any], out: Any) -> List[Tuple[str, torch.Tensor]]:
    """A reduction without indices (``amax``, ``amin``): the position of the extreme in each reduced group."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        return []
    dims = args[1] if len(args) > 1 else kwargs.get("dim", ())
    dims = [dims] if isinstance(dims, int) else list(dims or ())
    x = x.detach()
    if not dims or x.dim() == 0:
        return [("l", torch.argmax(x.reshape(-1)).reshape(1))]
    dims = [d % x.dim() for d in dims]
    kept = [d for d in range(x.dim()) if d not in dims]
    grouped = x.permute(*kept, *dims).reshape(*[x.shape[d] for d in kept], -1)
    return [("l", torch.argmax(grouped, dim=-1))]


def _label(args: Tuple, kwargs: Dict[str, Any], out: Any) -> List[Tuple[str, torch.Tensor]]:
    """The op's output itself (an argmax, a floor: piecewise constant)."""
    if isinstance(out, torch.Tensor):
        return [("l", out.detach().clone())]
    return []


_label.after = True  # type: ignore[attr-defined]


def _pool_without_indices(args: Tuple, kwargs: Dict[str, Any], out: Any) -> List[Tuple[str, torch.Tensor]]:
    """``max_pool2d`` where it runs without indices: they are computed beside it."""
    _, indices = torch.ops.aten.max_pool2d_with_indices.default(*args, **kwargs)
    return [("l", indices)]


_aten = torch.ops.aten
#: The non-smooth ops recorded, by overload packet, with how their branch is read.
RULES: Dict[Any, Callable[..., List[Tuple[str, torch.Tensor]]]] = {
    _aten.relu: _pointwise(), _aten.relu_: _pointwise(), _aten.leaky_relu: _pointwise(),
    _aten.leaky_relu_: _pointwise(), _aten._prelu_kernel: _pointwise(), _aten.rrelu_with_noise: _pointwise(),
    _aten.elu: _pointwise(), _aten.elu_: _pointwise(), _aten.celu: _pointwise(), _aten.selu: _pointwise(),
    _aten.abs: _pointwise(), _aten.abs_: _pointwise(), _aten.sign: _pointwise(), _aten.sgn: _pointwise(),
    _aten.threshold: _pointwise(1), _aten.threshold_: _pointwise(1),
    _aten.hardtanh: _pointwise(1, 2), _aten.hardtanh_: _pointwise(1, 2),
    _aten.hardswish: _shifted(-3.0, 3.0), _aten.hardswish_: _shifted(-3.0, 3.0),
    _aten.hardsigmoid: _shifted(-3.0, 3.0), _aten.hardsigmoid_: _shifted(-3.0, 3.0),
    _aten.hardshrink: _pointwise(1), _aten.softshrink: _pointwise(1),
    _aten.clamp: _clamp, _aten.clamp_: _clamp, _aten.clip: _clamp,
    _aten.clamp_min: _pointwise(1), _aten.clamp_min_: _pointwise(1),
    _aten.clamp_max: _pointwise(1), _aten.clamp_max_: _pointwise(1),
    _aten.maximum: _difference, _aten.minimum: _difference, _aten.fmax: _difference, _aten.fmin: _difference,
    _aten.gt: _difference, _aten.lt: _difference, _aten.ge: _difference, _aten.le: _difference,
    _aten.max: _indices(1), _aten.min: _indices(1), _aten.amax: _arg_extreme, _aten.amin: _arg_extreme,
    _aten.max_pool2d_with_indices: _indices(1), _aten.max_pool3d_with_indices: _indices(1),
    _aten.adaptive_max_pool2d: _indices(1), _aten.adaptive_max_pool3d: _indices(1),
    _aten.max_pool2d: _pool_without_indices,
    _aten.sort: _indices(1), _aten.topk: _indices(1), _aten.kthvalue: _indices(1), _aten.median: _indices(1),
    _aten.argmax: _label, _aten.argmin: _label,
    _aten.floor: _label, _aten.ceil: _label, _aten.round: _label, _aten.trunc: _label,
}


class Recorder(EagerDispatchMode):
    """Notes the branch each non-smooth op takes during one evaluation (see the module's docstring).

    Example:
        >>> with Recorder() as rec:
        ...     _ = torch.relu(torch.tensor([1.0, -1.0]))
        >>> [kind for kind, _ in rec.record]
        ['m']
    """

    def __init__(self) -> None:
        super().__init__()
        self.record: Record = []
        self.size = 0
        self.failed = False
        #: Storages whose first reading op is noted (:meth:`watch_reads`), and the op count so far.
        self.watched: Set[int] = set()
        self.first: Dict[int, int] = {}
        self.ops = 0
        #: The op count of the last recorded op (-1: none).
        self.last_op = -1

    def watch_reads(self, storages: Set[int]) -> None:
        """Also note the first op that reads each of these storages (by op count), as
        :class:`gradwatch.check.probes.prefix.PrefixCache` needs: one dispatch mode for both."""
        self.watched = set(storages)

    def __enter__(self) -> "Recorder":
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()

    def size_entries(self) -> int:
        """How many entries the record holds so far."""
        return len(self.record)

    def replay(self, entries: Record) -> None:
        """Add entries taken at the unperturbed point for a module call that was not run again (its output was
        replayed: :mod:`gradwatch.check.probes.prefix`), so that the records still line up."""
        self.record.extend(entries)

    def dispatch(self, func: Any, types: Any, args: Tuple = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if self.watched:
            note_reads(self.watched, self.first, self.ops, args, kwargs)
        self.ops += 1
        rule = RULES.get(func.overloadpacket) if not self.failed else None
        after = getattr(rule, "after", False)
        if rule is not None and not after:
            self._note(rule, args, kwargs, None)  # before the op: an in-place one (relu_) overwrites its input
        out = func(*args, **kwargs)
        if rule is not None and after:
            self._note(rule, args, kwargs, out)
        return out

    def _note(self, rule: Callable[..., List[Tuple[str, torch.Tensor]]], args: Tuple, kwargs: Dict[str, Any],
              out: Any) -> None:
        try:
            for kind, t in rule(args, kwargs, out):
                self.size += t.numel()
                self.record.append((kind, t if kind == "l" else t.reshape(-1)))
                self.last_op = self.ops - 1  # (the op being recorded was counted on entry)
        except Exception:  # noqa: BLE001 - an op this reading does not fit (a subclass, odd arguments)
            self.failed = True
        if self.size > RECORD_LIMIT:
            self.failed = True
            self.record = []


def note_reads(watched: Set[int], first: Dict[int, int], op: int, args: Tuple, kwargs: Dict[str, Any]) -> None:
    """Note ``op`` as the first read of every watched storage among the op's tensor arguments not seen before."""
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr in watched and ptr not in first:
                    first[ptr] = op


#: The recorders in effect, innermost last.
_ACTIVE: List[Recorder] = []


def active_recorder() -> Optional[Recorder]:
    """The recorder in effect (None: the forward is not being recorded)."""
    return _ACTIVE[-1] if _ACTIVE else None


def recorded(evaluate: Callable[[], Any]) -> Tuple[Any, Recorder]:
    """One call of ``evaluate`` under a :class:`Recorder`: its result, and the recorder."""
    with Recorder() as rec:
        result = evaluate()
    return result, rec


def record(evaluate: Callable[[], Any]) -> Optional[Record]:
    """The record of one call of ``evaluate``; None when it could not be taken (an op it cannot read, too large)."""
    rec = recorded(evaluate)[1]
    return None if rec.failed else rec.record


@dataclass
class Crossing:
    """How a perturbed point's record differs from the point's.

    Attributes:
        count: Entries that changed branch (-1: the records do not line up, the forward took another path).
        fraction: The smallest fraction of the step at which a margin crossed its kink (linear interpolation);
            :data:`UNKNOWN_FRACTION` where only a label says an entry changed, 0 where one sits on its kink.
    """

    count: int
    fraction: float = 1.0


def compare(base: Record, other: Record) -> Crossing:
    """Entries of ``other`` on another branch than in ``base`` (see :class:`Crossing`)."""
    if len(base) != len(other):
        return Crossing(-1, UNKNOWN_FRACTION)
    count, fraction = 0, 1.0
    for (kind, a), (kind_b, b) in zip(base, other):
        if kind != kind_b or a.shape != b.shape:
            return Crossing(-1, UNKNOWN_FRACTION)
        if kind == "l":
            changed = int((a != b).sum())
            if changed:
                count, fraction = count + changed, min(fraction, UNKNOWN_FRACTION)
            continue
        moved = torch.sign(a) != torch.sign(b)
        changed = int(moved.sum())
        if changed:
            count += changed
            a64, b64 = a[moved].to(torch.float64), b[moved].to(torch.float64)
            where = (a64 / (a64 - b64)).abs()  # where along the step each margin reached zero (0: on it already)
            fraction = min(fraction, float(where.nan_to_num(0.0).min()))
    return Crossing(count, fraction)


class ForwardKinks:
    """The records of one evaluator's forward: the unperturbed point's (taken once), and a probe's sides.

    Args:
        evaluate: The objective's evaluator (the engine perturbs parameters in place around it).
    """

    def __init__(self, evaluate: Callable[[], Terms]) -> None:
        self._evaluate = evaluate
        self._base: Optional[Record] = None
        self._tried = False
        self._last_op = -1
        self._first: Dict[int, int] = {}

    def evaluate_base(self) -> Terms:
        """Evaluate at the unperturbed point, taking its record on the way (no evaluation more later)."""
        if self._tried:
            return self._evaluate()
        terms, rec = recorded(self._evaluate)
        self._tried, self._base = True, None if rec.failed else rec.record
        self._last_op, self._first = rec.last_op, dict(rec.first)
        return terms

    def reaches(self, p: torch.Tensor) -> bool:
        """False when no recorded op ran after the forward first read ``p`` (known where the first evaluation noted
        its reads, :class:`gradwatch.check.probes.prefix.PrefixCache`): a probe of ``p`` cannot cross a kink."""
        first = self._first.get(p.untyped_storage().data_ptr()) if self._first else None
        return first is None or self._last_op >= first

    def base(self) -> Optional[Record]:
        """The record at the unperturbed point (None: not recordable); taken at the first call."""
        if not self._tried:
            self._tried = True
            self._base = record(self._evaluate)
        return self._base

    def probe(self, p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], sample: Sample,
              t: float) -> Tuple[Tuple[Terms, Terms, Terms, Terms], Optional[Crossing]]:
        """The central probe at step ``t`` (as :func:`central_probe`), and the kinks its two sides crossed."""
        base = self.base()
        records: List[Optional[Record]] = []

        def recording() -> Terms:
            terms, rec = recorded(self._evaluate)
            records.append(None if rec.failed else rec.record)
            return terms

        probe = central_probe(p, saved, grads, sample, t, recording)
        if base is None or any(r is None for r in records):
            return probe, None
        sides = [compare(base, r) for r in records if r is not None]
        if any(s.count < 0 for s in sides):
            return probe, Crossing(-1, UNKNOWN_FRACTION)
        return probe, Crossing(sum(s.count for s in sides), min(s.fraction for s in sides))


def _weakly(evaluate: Evaluator) -> Callable[[], Terms]:
    """``evaluate`` called through a weak reference: the evaluator holds its records, which must not hold it (the cycle
    kept what its closure holds, a unit's float64 cotangents, until Python's full collection came round)."""
    ref = weakref.ref(evaluate)

    def call() -> Terms:
        target = ref()
        if target is None:
            raise RuntimeError("the evaluator of these records is gone")
        return target()

    return call


def forward_kinks(evaluate: Evaluator) -> ForwardKinks:
    """The evaluator's :class:`ForwardKinks`, made at the first call."""
    found = evaluate.forward_kinks
    if not isinstance(found, ForwardKinks):
        found = ForwardKinks(_weakly(evaluate))
        if not evaluate.recordable:
            found._tried = True  # never recorded: the slopes' own rules judge every probe
        evaluate.forward_kinks = found
    return found


def kinks_of(evaluate: Evaluator) -> Optional[ForwardKinks]:
    """The evaluator's :class:`ForwardKinks`; None when its forward runs no kinked op (or was not recordable)."""
    found = forward_kinks(evaluate)
    return found if found.base() else None


def kink_free(p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], sample: Sample, out: Outcome,
              evaluate: Evaluator, settings: EngineSettings) -> Optional[Outcome]:
    """A disagreeing probe taken again where it crosses no kink seen in the forward; None when it crossed none.

    The probe is evaluated again at its step with the forward recorded. If some non-smooth op's input changed
    branch between the point and either side, the step is cut to half the smallest fraction at which one did
    (margins are linear along a short probe) and the probe is taken again, until its sides cross no kink: its
    slopes there are the outcome (marked ``crossed``), judged as any probe. Where the step that crosses none is
    lost in the rounding, the probe is ``unresolved`` (the tensor is inconclusive unless other probes decide
    it; check_model then judges it on its module alone); where none is short enough (a kink at the point
    itself, or the forward takes another path), it is excluded (``kink``). None when the forward runs no
    recorded op, could not be recorded, or the probe crossed nothing: the slopes' own rules judge it then.
    """
    kinks = kinks_of(evaluate)
    if kinks is None or not settings.detect_kinks or not kinks.reaches(p):
        return None
    a, n = out.analytic["total"], out.numeric["total"]
    disagreement = abs(a - n)
    t = sample.step
    _, crossing = kinks.probe(p, saved, grads, sample, t)
    if crossing is None or crossing.count == 0:
        return None
    for _ in range(SHORTENINGS):
        if crossing.fraction <= 0.0:
            break  # a kink at the point itself: every step crosses it
        t = t * min(0.5 * crossing.fraction, 0.5)
        if not usable_floor(floor_at(settings, t), a, n, disagreement):
            # A step this short is lost in the rounding: it could not tell the kinks from a wrong gradient.
            return Outcome(out.analytic, out.numeric, out.floor, unresolved=True, crossed=True)
        probe, crossing = kinks.probe(p, saved, grads, sample, t)
        if crossing is None:
            break
        if crossing.count == 0:
            shorter = outcome_of(replace(sample, step=t), probe, settings)
            shorter.crossed, shorter.step = True, t
            return shorter
    return Outcome(out.analytic, out.numeric, out.floor, kink=True, crossed=True)


def disagrees(out: Outcome, settings: EngineSettings) -> bool:
    """True when an outcome's slopes disagree beyond the SUSPICIOUS band (finite ones)."""
    a, n = out.analytic["total"], out.numeric["total"]
    return math.isfinite(a) and math.isfinite(n) and not agrees(a, n, out.floor, settings.bands[1])


def adopt(out: Outcome, other: Outcome) -> None:
    """Make ``out`` (a sample's outcome, held by the caller) the shorter probe's ``other``."""
    out.analytic, out.numeric, out.floor = other.analytic, other.numeric, other.floor
    out.kink, out.unresolved, out.crossed, out.step = other.kink, other.unresolved, other.crossed, other.step


def crosses(p: torch.Tensor, saved: torch.Tensor, grads: Dict[str, torch.Tensor], sample: Sample, t: float,
            evaluate: Evaluator) -> bool:
    """True when the probe at step ``t`` crosses a kink seen in the forward (False: none, or none recorded)."""
    kinks = kinks_of(evaluate)
    if kinks is None:
        return False
    _, crossing = kinks.probe(p, saved, grads, sample, t)
    return crossing is not None and crossing.count != 0

