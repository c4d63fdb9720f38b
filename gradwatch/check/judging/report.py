"""Check results: :class:`TensorCheck`, :class:`TrainingCheck`, :class:`CheckReport`, and their text.

Pure data and formatting; no torch evaluation happens here. What a check could not check (:class:`NotChecked`,
:func:`not_checked_in`) is read off its notes in this package's ``_not_checked``; the words of a disagreement
(:data:`STRAIGHT_THROUGH`) come from its ``_diagnosis``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from gradwatch.bands import Verdict
from gradwatch.check.judging._diagnosis import STRAIGHT_THROUGH
from gradwatch.check.judging._not_checked import OVER_ROOM, NotChecked, not_checked_in
from gradwatch.errors import GradientCheckError


class InconclusiveKind(str, Enum):
    """Why a tensor got no verdict, as a typed field (``TensorCheck.inconclusive_kind``); the text says it in words.

    Example:
        >>> InconclusiveKind.NONFINITE.value
        'nonfinite'
    """

    NONFINITE = "nonfinite"  #: NaN or inf in the objective or a gradient
    NONDETERMINISTIC = "nondeterministic"  #: two evaluations of the same point differ
    LOW_PRECISION = "low_precision"  #: within the rounding of a part of the objective computed in lower precision
    UNRESOLVED = "unresolved"  #: some samples differ by less than central differences can resolve
    BELOW_RESOLUTION = "below_resolution"  #: no sample could show a 1% error: the gradient is lost in rounding
    FLAT = "flat"  #: the objective is bit-for-bit the same at the widest step: the gradient is zero, or far below rounding
    NOT_REACHED = "not_reached"  #: an expert no token of the check's batch was routed to (not counted as checked)


@dataclass
class TensorCheck:
    """Result of checking one parameter tensor (or one input of ``check_backward``).

    Attributes:
        name: Parameter name from ``named_parameters()`` (or ``"x[0]"`` for inputs).
        shape: Shape of the tensor.
        rel_diff: ``rel_diff`` of analytic vs numeric over the sampled coordinates.
        max_rel_error: Element-wise worst case over the sampled coordinates.
        directional_rel_diff: ``rel_diff`` over the random directions (None if none were used).
        judged_rel_diff: The larger of the two relative differences after discounting
            the finite-difference noise floor; it decides the verdict.
        verdict: Band of ``judged_rel_diff``; None when the check is inconclusive.
        failed: True when the verdict is at or beyond the report's ``fail_at``.
        noise_floor: Absolute error the central differences can carry from rounding.
        step: Finite-difference step used.
        kinks: Sampled points found non-differentiable and excluded from the verdict.
        diagnosis: What a person should check next, when the tensor failed.
        ratio: Analytic over numeric, when the tensor failed and one constant factor explains it
            (:func:`constant_ratio`; the diagnosis then says "analytic is 2.00x numeric").
        inconclusive: Why no verdict could be given (non-finite values, nondeterminism), in words.
        inconclusive_kind: The same as an :class:`InconclusiveKind` (what alerts and localization read).
        coords: Indices of the sampled coordinates.
        analytic: Analytic gradient at ``coords``.
        numeric: Numerical gradient at ``coords``.
        dir_analytic: Analytic directional derivatives.
        dir_numeric: Numerical directional derivatives.

    Example:
        >>> t = TensorCheck(name="w", shape=(2,), rel_diff=0.0, max_rel_error=0.0)
        >>> t.verdict is None
        True
    """

    name: str
    shape: tuple
    rel_diff: float
    max_rel_error: float
    directional_rel_diff: Optional[float] = None
    judged_rel_diff: float = 0.0
    verdict: Optional[Verdict] = None
    failed: bool = False
    noise_floor: float = 0.0
    step: float = 0.0
    kinks: int = 0
    diagnosis: Optional[str] = None
    inconclusive: Optional[str] = None
    coords: List[tuple] = field(default_factory=list)
    analytic: List[float] = field(default_factory=list)
    numeric: List[float] = field(default_factory=list)
    dir_analytic: List[float] = field(default_factory=list)
    dir_numeric: List[float] = field(default_factory=list)
    ratio: Optional[float] = None
    inconclusive_kind: Optional[InconclusiveKind] = None

    def to_dict(self, samples: bool = True) -> Dict[str, Any]:
        """JSON-serializable dict (``samples=False`` drops the per-coordinate values)."""
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["verdict"] = self.verdict.value if self.verdict is not None else None
        d["inconclusive_kind"] = self.inconclusive_kind.value if self.inconclusive_kind is not None else None
        d["coords"] = [list(c) for c in self.coords]
        for key in ("rel_diff", "max_rel_error", "directional_rel_diff", "judged_rel_diff"):
            d[key] = json_float(d[key])
        if not samples:
            for key in ("coords", "analytic", "numeric", "dir_analytic", "dir_numeric"):
                d.pop(key)
        else:
            for key in ("analytic", "numeric", "dir_analytic", "dir_numeric"):
                d[key] = [json_float(v) for v in d[key]]
        return d


@dataclass
class TrainingCheck:
    """The training part of a check for one tensor: the live ``.grad`` against the objective's gradient.

    The objective's gradient is recomputed the way training computed it (live model, its dtype
    and device, the same dropout masks and autocast state; see :mod:`gradwatch.check.replay.reference`) and
    compared with the gradient training applied over every element.

    Attributes:
        name: Parameter name.
        shape: Shape of the tensor.
        dtype: Precision training computed in (the autocast dtype, else the parameter's).
        tolerance: Relative difference that rounding alone can cause in ``dtype``; within it, 0.
        rel_diff: ``||live - objective|| / (||live|| + ||objective||)`` over all elements.
        max_rel_error: Element-wise worst case.
        judged_rel_diff: ``rel_diff``, or 0 when within ``tolerance``; it decides the verdict.
        verdict: Band of ``judged_rel_diff``; None when inconclusive.
        failed: True when the verdict is at or beyond the report's ``fail_at``.
        ratio: Training's gradient over the objective's, when a constant ratio (or ratio plus
            a multiple of the parameter) explains the difference.
        param_coef: The coefficient ``b`` of ``b * p`` in that explanation (an L2 term is ``b / 2``).
        diagnosis: What differs, in words a person acts on.
        inconclusive: Why no verdict was given (replay not verified, non-finite ``.grad``).
        live_grad: False when the parameter had no ``.grad``.

    Example:
        >>> TrainingCheck(name="w", shape=(2,)).verdict is None
        True
    """

    name: str
    shape: tuple
    dtype: str = "float32"
    tolerance: float = 0.0
    rel_diff: float = float("nan")
    max_rel_error: float = float("nan")
    judged_rel_diff: float = float("nan")
    verdict: Optional[Verdict] = None
    failed: bool = False
    ratio: Optional[float] = None
    param_coef: Optional[float] = None
    diagnosis: Optional[str] = None
    inconclusive: Optional[str] = None
    live_grad: bool = True

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serializable dict (non-finite numbers as ``"nan"``/``"inf"`` strings)."""
        d = {f.name: getattr(self, f.name) for f in _TRAINING_FIELDS}  # plain values: no asdict's deep copies
        d["shape"] = list(self.shape)
        d["verdict"] = self.verdict.value if self.verdict is not None else None
        for key in ("tolerance", "rel_diff", "max_rel_error", "judged_rel_diff", "ratio", "param_coef"):
            d[key] = json_float(d[key])
        return d

    def describe(self) -> str:
        """One line on this tensor's training verdict, for failure messages."""
        verdict = self.verdict.value.upper() if self.verdict is not None else "INCONCLUSIVE"
        text = (f"{self.name} (training): {verdict} (rel_diff {_fmt(self.rel_diff)} of the live .grad against the "
                f"objective's gradient, {self.dtype} tolerance {self.tolerance:.0e})")
        extra = self.diagnosis or self.inconclusive
        return f"{text}; {extra}" if extra else text


#: :class:`TrainingCheck`'s fields, read once (its ``to_dict`` runs for every judged tensor of every check).
_TRAINING_FIELDS = fields(TrainingCheck)


@dataclass
class CheckReport:
    """Everything one gradient check found.

    Attributes:
        tensors: Parameter name -> :class:`TensorCheck`, in model order.
        fail_at: Verdict at which a tensor counts as failing.
        dtype: Dtype the objective was evaluated in (``"float64"`` for the shadow copy).
        objective: Value of the check objective at the current parameters.
        terms: Value of each term of the objective (``"loss"``, regularizers, ``"weight_decay"``).
        evaluations: Number of objective evaluations the check made.
        verdict_evaluations: Of ``evaluations``, those made before every tensor's verdict was known.
        seconds: Wall time of the check (localization included).
        verdict_seconds: Of ``seconds``, the time until every tensor's verdict (pass or fail) was known
            (detection first: the failing tensors' full samples come after it), plus the module checks of
            the tensors the whole objective could not resolve, which need nothing of those full samples.
        localize_seconds: Of ``seconds``, the time after the verdict spent on what failed: the failing
            tensors' full samples (their diagnosis) and, with ``check_model(localize=True)``, each module
            alone; 0 when nothing failed.
        seed: Sampling seed (re-running with it samples the same coordinates).
        nondeterministic: The objective gave two different values at the same point.
        nonfinite: The objective or a gradient was NaN or infinite.
        notes: Warnings a person should read (decoupled weight decay, kinks, ...).
        term_checks: With ``per_term=True``: term -> tensor name -> :class:`TensorCheck`.
        dropout: What the backward check switched off (dropout modules, functional dropout calls
            per forward) and what randomness stayed on, reseeded (:class:`gradwatch.check.objective.functional_dropout.DropoutRecord`).
        precision: On a shadow copy: what precision the objective really computed in
            (:meth:`gradwatch.check.objective.precision.ShadowPrecision.summary`, plus the base ``step``).
        form: Which form of the backward part ran: ``"objective"`` (the whole objective on a
            float64 copy of the model, or in place) or ``"module"`` (each module alone on its
            captured inputs, :mod:`gradwatch.check.modules.module_form`), chosen against ``memory_budget``.
        memory: The memory budget's figures for this check (:meth:`gradwatch.plan.memory.MemoryMeter.summary`).
        probed: Module form: ``(parameter name, rows)`` for each parameter a checked piece probed (rows: None
            for all, ``(first, end)``, or a tensor of row indices), and ``(module name, "code")`` for each
            module whose own code a checked unit held (read by :class:`gradwatch.plan.coverage.Coverage`).
        pieces: Module form: the pieces checked (``"lm_head[0:256]"``), in order.
        unfit: Module form: the pieces given to this check that did not fit the room it had (the next check of
            one process takes them first).
        later: Module form: the pieces given to this check that its time could not hold (one process: a paced cycle
            gives them to the next checks).
        piece_seconds: Module form: unit name -> ``(seconds, rows)``, the time its checked pieces took and the rows
            they covered (0 for a piece checked whole); summed over the ranks that checked parts of it. Shard by shard,
            the ranks share the next check's whole pieces out by these (:func:`gradwatch.plan.shards.assign`).
        steps_to_full: Training steps within which every op and parameter row is checked: K checks, one every
            ``every`` steps (``every="auto"``: the interval the measured check and step times give; None before).
        training_rows: The training part's weights judged by a block of rows: name -> ``(first, end)``
            (their gradient does not fit the room whole, :mod:`gradwatch.check.replay.rows`).
        training_items: The step's objective of a cut step (several micro-batches or ranks): ``{"rule": what is
            counted, "equal": each micro-batch weighed 1/k, "counts": each rank's micro-batch counts}``
            (:mod:`gradwatch.watch.step_objective`); None for an uncut step.
        training_window: A partial accumulation window the step was found to be: ``{"micro_batches": n, "window": K,
            "scale": training's gradient over the step objective's}`` (every micro-batch divided by ``K`` where the step
            has ``n < K``; the training verdicts are then judged against the objective's gradient times ``n / K``,
            :mod:`gradwatch.check.replay.window`); None otherwise.
        causes: Filled by a watch's trends: each cause that explained several failing tensors of a part at this
            check, new or said before (:meth:`gradwatch.watch.causes.Causes.record`: its tensors here, its count and
            last step in the run).
        independence: The independence part's :class:`gradwatch.check.independence.check.IndependenceReport` (a watch
            with ``independence=``), or None.
        surrogates: Modules whose gradient is a surrogate by design (``surrogates=``, torch's fake quantizers):
            the objective was cut there (:mod:`gradwatch.check.objective.surrogate`), their own parameters not compared.

    Example:
        >>> report = CheckReport(tensors={})
        >>> report.ok, report.failures, report.worst
        (True, [], None)
    """

    tensors: Dict[str, TensorCheck]
    fail_at: Verdict = Verdict.SUSPICIOUS
    dtype: str = "float64"
    objective: float = float("nan")
    terms: Dict[str, float] = field(default_factory=dict)
    evaluations: int = 0
    verdict_evaluations: int = 0
    seconds: float = 0.0
    verdict_seconds: float = 0.0
    localize_seconds: float = 0.0
    seed: Optional[int] = None
    nondeterministic: bool = False
    nonfinite: bool = False
    notes: List[str] = field(default_factory=list)
    term_checks: Dict[str, Dict[str, TensorCheck]] = field(default_factory=dict)
    localized: List[Any] = field(default_factory=list)
    training: Dict[str, TrainingCheck] = field(default_factory=dict)
    training_note: Optional[str] = None
    dropout: Any = None
    precision: Dict[str, Any] = field(default_factory=dict)
    form: str = "objective"
    memory: Dict[str, Any] = field(default_factory=dict)
    probed: List[Tuple[str, Any]] = field(default_factory=list)
    pieces: List[str] = field(default_factory=list)
    unfit: List[str] = field(default_factory=list)
    later: List[str] = field(default_factory=list)
    piece_seconds: Dict[str, Tuple[float, int]] = field(default_factory=dict)
    steps_to_full: Optional[int] = None
    independence: Any = None
    training_rows: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    surrogates: List[str] = field(default_factory=list)
    training_items: Optional[Dict[str, Any]] = None
    training_window: Optional[Dict[str, Any]] = None
    causes: List[Dict[str, Any]] = field(default_factory=list)

    def spent(self, unit: str, seconds: float, rows: int) -> None:
        """Add ``seconds`` of checking ``unit``'s pieces, and the ``rows`` they covered, to :attr:`piece_seconds`."""
        before = self.piece_seconds.get(unit, (0.0, 0))
        self.piece_seconds[unit] = (before[0] + seconds, before[1] + rows)

    def not_checked(self) -> List["NotChecked"]:
        """What this check could not check, why, and how to check it instead (:func:`not_checked_in` of its notes)."""
        return not_checked_in(self.notes, self.training_note, bool(self.training))

    @property
    def training_failures(self) -> List[TrainingCheck]:
        """Tensors whose training verdict is ``fail_at`` or worse, worst first."""
        return sorted((t for t in self.training.values() if t.failed), key=lambda t: t.judged_rel_diff, reverse=True)

    @property
    def failures(self) -> List[TensorCheck]:
        """Tensors whose verdict is ``fail_at`` or worse, worst first."""
        return sorted((t for t in self.tensors.values() if t.failed), key=_badness, reverse=True)

    @property
    def ok(self) -> bool:
        """True when neither part failed (backward, training) and the check was conclusive (finite, deterministic)."""
        return not self.failures and not self.training_failures and not self.nonfinite and not self.nondeterministic

    @property
    def worst(self) -> Optional[TensorCheck]:
        """The tensor with the largest judged relative difference (None if nothing was judged)."""
        judged = [t for t in self.tensors.values() if t.verdict is not None]
        return max(judged, key=_badness) if judged else None

    @property
    def kinks(self) -> int:
        """Total number of sampled points found non-differentiable."""
        return sum(t.kinks for t in self.tensors.values())

    def to_dict(self, samples: bool = True) -> Dict[str, Any]:
        """JSON-serializable summary (``json.dumps(report.to_dict())`` works)."""
        worst = self.worst
        return {
            "ok": self.ok,
            "form": self.form,
            "memory": dict(self.memory),
            "fail_at": self.fail_at.value,
            "dtype": self.dtype,
            "objective": json_float(self.objective),
            "terms": {k: json_float(v) for k, v in self.terms.items()},
            "evaluations": self.evaluations,
            "seconds": self.seconds,
            "verdict_seconds": self.verdict_seconds,
            "verdict_evaluations": self.verdict_evaluations,
            "localize_seconds": self.localize_seconds,
            "seed": self.seed,
            "nondeterministic": self.nondeterministic,
            "nonfinite": self.nonfinite,
            "kinks": self.kinks,
            "worst": worst.name if worst is not None else None,
            "failures": [t.name for t in self.failures],
            "notes": list(self.notes),
            "precision": dict(self.precision),
            "tensors": {name: t.to_dict(samples) for name, t in self.tensors.items()},
            "term_checks": {
                term: {name: t.to_dict(samples) for name, t in checks.items()}
                for term, checks in self.term_checks.items()
            },
            "localized": [c.to_dict() if hasattr(c, "to_dict") else c for c in self.localized],
            "training": {name: t.to_dict() for name, t in self.training.items()},
            "training_note": self.training_note,
            "training_items": self.training_items,
            "training_window": self.training_window,
            "training_failures": [t.name for t in self.training_failures],
            "dropout": self.dropout.to_dict() if hasattr(self.dropout, "to_dict") else self.dropout,
        }

    def raise_for_failures(self) -> "CheckReport":
        """Raise :class:`GradientCheckError` if the report is not ok; return self otherwise.

        Example:
            >>> CheckReport(tensors={}).raise_for_failures().ok
            True
        """
        if not self.ok:
            raise GradientCheckError(self.failure_message(), report=self)
        return self

    def failure_message(self) -> str:
        """Text naming each failing tensor with its values and diagnosis."""
        lines = []
        if self.nonfinite:
            lines.append(f"the check objective or a gradient is not finite (objective = {self.objective!r})")
        if self.nondeterministic:
            lines.append(
                "the objective is nondeterministic: two evaluations at the same parameters differ, "
                "so numerical gradients cannot be trusted (unseeded randomness, or a module the check "
                "could not switch to deterministic behaviour)"
            )
        for t in self.failures:
            lines.append("(backward) " + describe_failure(t))
        for tc in self.training_failures:
            lines.append(tc.describe())
        lines.extend(_localized_lines(self.localized, failed_only=True))
        return "gradient check failed:\n" + "\n".join(f"  - {line}" for line in lines)

    def __str__(self) -> str:
        rows = sorted(self.tensors.values(), key=_badness, reverse=True)
        header = ("tensor", "verdict", "judged", "rel_diff", "dir_rel_diff", "max_rel_err", "kinks", "diagnosis")
        table = [header]
        for t in rows:
            verdict = t.verdict.value.upper() if t.verdict is not None else "INCONCLUSIVE"
            table.append(
                (
                    t.name,
                    verdict,
                    _fmt(t.judged_rel_diff),
                    _fmt(t.rel_diff),
                    _fmt(t.directional_rel_diff),
                    _fmt(t.max_rel_error),
                    str(t.kinks),
                    t.diagnosis or t.inconclusive or "",
                )
            )
        widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
        lines = []
        for r in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + ("  " + r[-1] if r[-1] else ""))
        status = "OK" if self.ok else "FAILED"
        summary = (
            f"gradwatch check: {status} ({len(self.tensors)} tensors, {self.evaluations} evaluations, "
            f"{self.seconds:.3f}s, dtype {self.dtype}, {self.form} form, objective {self.objective:.6g}"
        )
        if self.kinks:
            summary += f", {self.kinks} kinks excluded"
        summary += ")"
        extra = []
        if self.nonfinite:
            extra.append("objective or gradients not finite: no verdict")
        if self.nondeterministic:
            extra.append("objective is nondeterministic: gradients not judged")
        extra.extend(self.notes)
        if any(t.verdict is not None for t in rows):
            extra.append("judged = rel_diff beyond the finite-difference noise floor; it decides the verdict")
        return "\n".join([summary, *lines, *_localized_lines(self.localized), *self._training_lines(),
                          *("note: " + e for e in extra)])

    def _training_lines(self) -> List[str]:
        """The training part as a table: the live ``.grad`` against the objective's gradient."""
        if not self.training:
            return [f"training: {self.training_note}"] if self.training_note else []
        rows = sorted(self.training.values(), key=lambda t: -1.0 if t.verdict is None else t.judged_rel_diff, reverse=True)
        table = [("tensor", "training", "judged", "rel_diff", "tolerance", "diagnosis")]
        for t in rows:
            verdict = t.verdict.value.upper() if t.verdict is not None else "INCONCLUSIVE"
            table.append((t.name, verdict, _fmt(t.judged_rel_diff), _fmt(t.rel_diff), f"{t.tolerance:.0e}",
                          t.diagnosis or t.inconclusive or ""))
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
        out = ["training part (live .grad vs the objective's gradient" + (f"; {self.training_note}" if self.training_note else "") + "):"]
        for r in table:
            out.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + ("  " + r[-1] if r[-1] else ""))
        return out


def _localized_lines(localized: List[Any], failed_only: bool = False) -> List[str]:
    """``localized: ...`` lines for module-local checks (failing modules first)."""
    if not localized:
        return []
    failed = [c for c in localized if getattr(c, "failed", False)]
    if not failed:
        return [] if failed_only else [f"localized: no module fails alone ({len(localized)} checked)"]
    return [f"localized: {c.summary() if hasattr(c, 'summary') else c}" for c in failed]


def worse(kept: Optional[TensorCheck], new: TensorCheck) -> TensorCheck:
    """The check a tensor is reported with when several checks of one step judged it (blocks of its rows in the
    module form, or ranks' shares): a failing one, then one whose values are not finite, then a judged one, then the
    larger judged difference.

    Example:
        >>> ok = TensorCheck("w", (4, 2), rel_diff=0.0, max_rel_error=0.0, verdict=Verdict.EXCELLENT)
        >>> bad = TensorCheck("w", (4, 2), rel_diff=0.06, max_rel_error=0.2, verdict=Verdict.WRONG, failed=True,
        ...                   judged_rel_diff=0.06)
        >>> worse(worse(None, bad), ok) is bad and worse(ok, bad) is bad
        True
    """
    if kept is None:
        return new

    def rank(tc: TensorCheck) -> Tuple[bool, bool, bool, float]:
        return (tc.failed, tc.inconclusive_kind is InconclusiveKind.NONFINITE, tc.verdict is not None,
                tc.judged_rel_diff if math.isfinite(tc.judged_rel_diff) else math.inf)

    return new if rank(new) > rank(kept) else kept


def _badness(t: TensorCheck) -> float:
    if t.verdict is None:
        return -1.0
    v = t.judged_rel_diff
    return v if math.isfinite(v) else float("inf")


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.2e}"


def json_float(value: Optional[float]) -> Any:
    """A float for strict JSON: non-finite values become ``"nan"``/``"inf"``/``"-inf"``.

    Example:
        >>> json_float(float("inf")), json_float(0.5), json_float(None)
        ('inf', 0.5, None)
    """
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def describe_failure(t: TensorCheck, limit: int = 4) -> str:
    """One paragraph on a failing tensor: the worst coordinates with both values, and the diagnosis."""
    parts = [
        f"{t.name}: {t.verdict.value.upper() if t.verdict else 'INCONCLUSIVE'} "
        f"(rel_diff {_fmt(t.rel_diff)}, directional {_fmt(t.directional_rel_diff)}, "
        f"max_rel_error {_fmt(t.max_rel_error)}, noise floor {t.noise_floor:.1e})"
    ]
    if t.coords:
        a, n = np.asarray(t.analytic), np.asarray(t.numeric)
        order = np.argsort(-np.abs(a - n))[:limit]
        shown = ", ".join(f"{tuple(t.coords[i])}: analytic {a[i]:.6g} vs numeric {n[i]:.6g}" for i in order)
        parts.append(f"worst coordinates {shown}")
    if t.dir_analytic:
        parts.append(
            "directions: analytic "
            + ", ".join(f"{v:.6g}" for v in t.dir_analytic[:limit])
            + " vs numeric "
            + ", ".join(f"{v:.6g}" for v in t.dir_numeric[:limit])
        )
    if t.diagnosis:
        parts.append(t.diagnosis)
    return "; ".join(parts)


def suspects(report: Any) -> Tuple[List[str], List[str]]:
    """An undeclared straight-through in a check: ``(modules, tensors)`` it explains, both empty when none.

    The sign of one is a failing tensor whose numeric gradient is zero where the analytic one is not
    (:data:`STRAIGHT_THROUGH`: backward passes a gradient the forward does not
    have). The module is named by the module form (a failing ``<module>:input``) or by the report's
    localization (its failing modules whose input has that sign); every failing tensor inside a named module (a VQ codebook whose
    gradient the straight-through's ``.detach()`` cuts) is explained by it too.

    Example:
        >>> t = TensorCheck(name="quant:input", shape=(2,), rel_diff=1.0, max_rel_error=1.0, failed=True,
        ...                 diagnosis=STRAIGHT_THROUGH + ": ...")
        >>> suspects(CheckReport(tensors={"quant:input": t}))
        (['quant'], ['quant:input'])
    """
    failing = [t for t in report.tensors.values() if t.failed]
    signed = [t.name for t in failing if t.diagnosis and t.diagnosis.startswith(STRAIGHT_THROUGH)]
    if not signed:
        return [], []
    modules = [n.rsplit(":", 1)[0] for n in signed if n.endswith(":input") or n.endswith(":output")]
    modules += [c.name for c in report.localized if getattr(c, "failed", False) and any(
        t.failed and t.diagnosis and t.diagnosis.startswith(STRAIGHT_THROUGH) for t in c.tensors.values())]
    modules = list(dict.fromkeys(modules))
    explained = [t.name for t in failing if t.name in signed or any(
        t.name.startswith(m + ".") or t.name.startswith(m + ":") for m in modules)]
    return modules, explained


__all__ = ["OVER_ROOM", "STRAIGHT_THROUGH", "CheckReport", "InconclusiveKind", "NotChecked", "TensorCheck", "TrainingCheck",
           "describe_failure", "json_float", "not_checked_in", "suspects", "worse"]
