"""Per-tensor history, baselines and drift: turn a stream of check reports into alerts.

Pure state: no torch evaluation, no I/O, no sinks, no hook. Every decision uses ``TensorCheck.judged_rel_diff`` (the
noise-discounted value that decides the verdict). :meth:`TrendTracker.state_dict` is plain JSON, so a resumed run
continues its trends and its alert deduplication exactly. What the alerts say, and what is said once for the run (one
cause of many failing tensors, what a check could not check), is :mod:`gradwatch.watch.causes`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from gradwatch.bands import DEFAULT_BANDS, Verdict
from gradwatch.check.judging.report import (
    CheckReport,
    InconclusiveKind,
    NotChecked,
    TensorCheck,
    json_float,
    suspects,
)
from gradwatch.errors import ConfigError, error_key
from gradwatch.io.headlines import alert_lines, joined
from gradwatch.options import trend_options
from gradwatch.watch.causes import (
    NEVER_GIVEN,
    WHOLE_CHECK,
    Causes,
    Gaps,
    drift_message,
    error_message,
    message,
    named_modules,
    nondeterministic_message,
    nonfinite_message,
    not_checked_message,
    straight_through_message,
    tensor_nonfinite_message,
    threshold_message,
)

#: Alert kinds, in the order they are reported within one check.
ALERT_KINDS = ("threshold", "drift", "nonfinite", "nondeterministic", "not_checked", "error")
#: The two verdicts of a check, each with its own history, baselines and alerts.
PARTS = ("backward", "training")
_STATE_VERSION = 1
_ZERO_BASELINE = 1e-12


@dataclass
class Alert:
    """Something a person should look at, found by :class:`TrendTracker`.

    Attributes:
        step: Training step of the check.
        tensor: Parameter name, or ``"*"`` for the whole check (nondeterministic,
            non-finite objective, a check that raised).
        kind: ``"threshold"``, ``"drift"``, ``"nonfinite"``, ``"nondeterministic"``, ``"error"``, ``"paused"``,
            ``"surrogate"`` (an undeclared straight-through; the tensor is its module, once per run),
            ``"independence"`` (an output depends on an input it must not; the tensor is the module where
            it starts, see :mod:`gradwatch.watch.parts.independence`), and of the training part ``"partial_window"`` (a
            step of a partial accumulation window, its ``.grad`` the step's objective's times ``n / K``) or
            ``"unjudged"`` (its micro-batches were not handed to the watch; once for the run), both on ``"*"``
            (see :mod:`gradwatch.watch.parts._accumulation`), ``"term_weight"`` (a term of the loss weighted otherwise than
            the step's objective weighs it, on ``"*"``, once for the run; :mod:`gradwatch.watch.parts._term_weights`), and
            ``"not_checked"`` (a unit or a part a check could not check, once per run for each thing and reason; the
            tensor is the unit, or ``"*"`` for a whole part: a warning, never a failed verdict, see
            :meth:`TrendTracker.not_checked`).
        severity: ``"error"`` (WRONG threshold, nonfinite, error) or ``"warning"``.
        value: The value that triggered it (judged rel_diff, rolling median for drift,
            the objective for whole-check alerts, the scale for a partial window; ``nan`` when there is none).
        baseline: The tensor's baseline judged rel_diff, when established.
        message: Its three lines: :attr:`headline`, ``why: ...`` and ``what to do: ...`` (composed when it is built
            from the words given here: a one-line message's `` — `` sets what to do apart).
        part: Which verdict raised it: ``"backward"`` (the backward formulas against finite
            differences), ``"training"`` (the live ``.grad`` against the objective's gradient),
            ``"independence"``, or for a ``not_checked`` alert also ``"inner"`` (a module's double backward).
        count: The tensors it is about: 1, or for one cause of many failing tensors (:mod:`gradwatch.watch.causes`:
            its ``tensor`` is then the module named, or ``"*"``) how many it explains at its check (later checks that
            find the cause again say theirs, and its last step, in their records' ``causes``: :attr:`TrendTracker.causes`).
        tensors: The names of those tensors (one cause's; empty for an alert about one tensor or none).
        headline: What, where and how bad, at most 120 characters (a long tensor name shortened in its middle);
            ``why`` and ``todo``: why, and what to do (:mod:`gradwatch.io.headlines`; derived when not given).

    Example:
        >>> a = Alert(step=3, tensor="w", kind="drift", severity="warning", value=1e-5,
        ...           baseline=1e-9, message="w drifted")
        >>> a.to_dict()["value"], a.to_dict()["baseline"], a.part
        (1e-05, 1e-09, 'backward')
        >>> a.message.splitlines()[0]
        'backward gradient drifting: w, rel_diff 1.0e-05 vs baseline 1.0e-09 (step 3)'
    """

    step: int
    tensor: str
    kind: str
    severity: str
    value: float
    baseline: Optional[float]
    message: str
    part: str = "backward"
    count: int = 1
    tensors: List[str] = field(default_factory=list)
    headline: str = ""
    why: str = ""
    todo: str = ""

    def __post_init__(self) -> None:
        self.headline, self.why, self.todo = alert_lines(asdict(self))
        self.message = joined(self.headline, self.why, self.todo)

    @property
    def names(self) -> List[str]:
        """The tensors it is about: one cause's :attr:`tensors`, else ``[tensor]``.

        Example:
            >>> Alert(0, "fc", "threshold", "error", 0.3, None, "m", count=2, tensors=["fc.weight", "w"]).names
            ['fc.weight', 'w']
        """
        return list(self.tensors) or [self.tensor]

    def to_dict(self) -> Dict[str, Any]:
        """JSON-safe dict; non-finite numbers become ``"nan"``, ``"inf"``, ``"-inf"``; ``count`` and ``tensors`` only
        for one cause of several tensors."""
        d = asdict(self)
        d["value"] = json_float(self.value)
        d["baseline"] = json_float(self.baseline)
        if not self.tensors:
            for key in ("count", "tensors"):
                d.pop(key)
        return d


def _series_json(series: Mapping[str, List[Dict[str, Any]]]) -> Dict[str, List[Dict[str, Any]]]:
    """A part's history as plain JSON: its records' rel_diffs through ``json_float`` (non-finite ones as strings)."""
    floats = ("judged_rel_diff", "rel_diff", "directional_rel_diff")  # the training part's records have no directional
    return {name: [{**r, **{k: json_float(r[k]) for k in floats if k in r}} for r in records] for name, records in series.items()}


def _series_from_json(state: Mapping[str, Any], directional: bool) -> Dict[str, List[Dict[str, Any]]]:
    """Inverse of :func:`_series_json` (``directional``: the backward part's records, with their directional value)."""

    def record(r: Mapping[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {"step": int(r["step"]), "judged_rel_diff": float(r["judged_rel_diff"]),
                               "rel_diff": float(r["rel_diff"])}
        if directional:
            out["directional_rel_diff"] = None if r["directional_rel_diff"] is None else float(r["directional_rel_diff"])
        out["verdict"] = r["verdict"]
        return out

    return {name: [record(r) for r in records] for name, records in state.items()}


def _finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)


def _key_kind(kind: str, part: str) -> str:
    """Deduplication key of an alert kind: the training part's alerts are kept apart from the backward part's."""
    return kind if part == "backward" else f"{part}/{kind}"


class TrendTracker:
    """Per-tensor history of judged relative differences, baselines, drift and alert deduplication.

    A tensor's baseline is the median of its first ``baseline_checks`` finite judged values (tensors are checked on
    rotating subsets, so each has its own). Alerts:

    - ``threshold``: the verdict is SUSPICIOUS (warning) or WRONG (error).
    - ``drift``: once the baseline is complete, the median of the last ``drift_window`` judged values is at least
      ``baseline * 10**drift_decades`` and at least ``bands[0]`` (noise inside the EXCELLENT band never alerts; a zero
      baseline counts as 1e-12). Fires while the verdict is still ACCEPTABLE.
    - ``nonfinite``: the objective (tensor ``"*"``) or a tensor's samples are not finite.
    - ``nondeterministic``: the objective gave two values at the same point (``"*"``).
    - ``error``: the check raised (see :meth:`error`).
    - ``not_checked``: a unit or a part the check could not check (:meth:`not_checked`), once per run; and a part
      that gave no tensor a verdict at :data:`NEVER_GIVEN` checks in a row, once per run, with why in the user's
      terms (the training replay's call of the model unlike training's: which arguments differ) and what to do.

    One cause, one alert: where one diagnosis explains several failing tensors of a part at a check (a scale of the
    whole step, a cut, a count, a term, the same factor; or a module the check named, the tensors upstream of it
    included), they raise one ``threshold`` alert on the module or ``"*"``, its ``count`` and ``tensors`` saying which;
    a later check that finds the same cause updates it (its count and last step: :attr:`causes`, ``report.causes`` in
    the check record) instead of alerting again (:mod:`gradwatch.watch.causes`). Each tensor keeps its own history.

    Deduplication: a (tensor, kind) alert is not repeated while the condition persists. It is raised again when it
    gets worse (a higher verdict for ``threshold``; a value at least 10x the last alerted one for ``drift``; another
    exception type or message for ``error``) or once ``alert_cooldown`` further checks of that tensor have passed
    without it (``alert_cooldown=0`` repeats it on every check). When the condition clears, the state is forgotten,
    so a relapse alerts at once. Inconclusive tensors (no verdict) neither raise nor clear threshold/drift alerts.

    Args:
        bands: Upper bounds of EXCELLENT, ACCEPTABLE, SUSPICIOUS.
        baseline_checks: Checks of a tensor whose median forms its baseline; >= 1.
        drift_window: Checks in the rolling median compared with the baseline; >= 1.
        drift_decades: How many powers of ten above the baseline count as drift; > 0.
        alert_cooldown: Checks during which a persisting alert stays silent; >= 0.

    Example:
        >>> from gradwatch.check.judging.report import CheckReport, TensorCheck
        >>> def report(v):
        ...     t = TensorCheck(name="w", shape=(3,), rel_diff=v, max_rel_error=v,
        ...                     judged_rel_diff=v, verdict=Verdict.from_value(v))
        ...     return CheckReport(tensors={"w": t})
        >>> tracker = TrendTracker()
        >>> [tracker.update(s, report(1e-9)) for s in range(3)]
        [[], [], []]
        >>> [a.kind for a in tracker.update(3, report(5e-6))]
        []
        >>> [(a.kind, a.severity) for a in tracker.update(4, report(5e-6))]
        [('drift', 'warning')]
    """

    def __init__(
        self,
        bands: Sequence[float] = DEFAULT_BANDS,
        baseline_checks: int = 3,
        drift_window: int = 3,
        drift_decades: float = 2.0,
        alert_cooldown: int = 10,
    ) -> None:
        (self.bands, self.baseline_checks, self.drift_window, self.drift_decades,
         self.alert_cooldown) = trend_options(bands, baseline_checks, drift_window, drift_decades, alert_cooldown)
        self._history: Dict[str, List[Dict[str, Any]]] = {}
        self._baseline_samples: Dict[str, List[float]] = {}
        # The training part (live .grad against the objective's gradient): its own series per tensor.
        self._training_history: Dict[str, List[Dict[str, Any]]] = {}
        self._training_baseline_samples: Dict[str, List[float]] = {}
        # (tensor, kind) -> {"value": last alerted value, "rank": verdict rank, "at": check index}
        self._alerted: Dict[Tuple[str, str], Dict[str, Any]] = {}
        self._alert_counts: Dict[str, int] = {}
        self._checks = 0  # whole checks seen (update and error calls): the clock of "*" alerts
        self._causes = Causes()  # one cause of many failing tensors: said once, updated after
        self._gaps = Gaps()  # what the checks could not check: said once

    # ------------------------------------------------------------------ queries

    @property
    def history(self) -> Dict[str, List[Dict[str, Any]]]:
        """``{tensor: [{"step", "judged_rel_diff", "rel_diff", "directional_rel_diff", "verdict"}, ...]}``.

        ``verdict`` is the verdict's name (``"acceptable"``) or None for an
        inconclusive check; ``directional_rel_diff`` is None when no directions were used.
        """
        return {name: [dict(r) for r in records] for name, records in self._history.items()}

    @property
    def training_history(self) -> Dict[str, List[Dict[str, Any]]]:
        """``{tensor: [{"step", "judged_rel_diff", "rel_diff", "verdict"}, ...]}`` of the training part."""
        return {name: [dict(r) for r in records] for name, records in self._training_history.items()}

    def _series(self, part: str) -> Tuple[Dict[str, List[Dict[str, Any]]], Dict[str, List[float]]]:
        if part == "training":
            return self._training_history, self._training_baseline_samples
        return self._history, self._baseline_samples

    @property
    def causes(self) -> List[Dict[str, Any]]:
        """Each cause alerted as one for several tensors (:mod:`gradwatch.watch.causes`), as the run stands:
        ``{"part", "where", "words", "first_step", "last_step", "checks", "count", "tensors"}``.

        Example:
            >>> TrendTracker().causes
            []
        """
        return [{k: (list(v) if isinstance(v, list) else v) for k, v in e.items()} for e in self._causes.seen.values()]

    def baseline(self, tensor: str, part: str = "backward") -> Optional[float]:
        """Median of the tensor's first ``baseline_checks`` finite judged values; None until complete.

        Example:
            >>> TrendTracker().baseline("w") is None
            True
        """
        samples = self._series(part)[1].get(tensor, [])
        if len(samples) < self.baseline_checks:
            return None
        return float(statistics.median(samples))

    def summary(self) -> Dict[str, Dict[str, Any]]:
        """Per tensor: first/last/worst judged rel_diff, last verdict, alert count, checks, baseline.

        ``first``, ``last`` and ``worst`` are taken over the checks that gave a
        verdict (None if none did); ``verdict`` is the last check's (None when inconclusive).

        Example:
            >>> TrendTracker().summary()
            {}
        """
        out: Dict[str, Dict[str, Any]] = {}
        for name, records in self._history.items():
            judged = [r["judged_rel_diff"] for r in records if r["verdict"] is not None]
            out[name] = {
                "first": judged[0] if judged else None,
                "last": judged[-1] if judged else None,
                "worst": max(judged, key=lambda v: v if math.isfinite(v) else math.inf) if judged else None,
                "verdict": records[-1]["verdict"],
                "alerts": self._alert_counts.get(name, 0),
                "checks": len(records),
                "baseline": self.baseline(name),
            }
        return out

    # ------------------------------------------------------------------ updates

    def update(self, step: int, report: CheckReport) -> List[Alert]:
        """Record one check and return the alerts it raises (after deduplication).

        Args:
            step: Training step of the check.
            report: The check's :class:`~gradwatch.CheckReport`.

        Returns:
            New alerts, per tensor threshold then drift then nonfinite, then whole-check alerts.
        """
        step = int(step)
        self._checks += 1
        self._alerted.pop((WHOLE_CHECK, "error"), None)  # a check that completes clears the error state
        alerts: List[Alert] = []
        objective_nonfinite = report.nonfinite and not _finite(report.objective)
        tensor_nonfinite = False
        modules, explained = suspects(report)
        known = set(self._alerted.get((WHOLE_CHECK, "surrogate"), {}).get("seen", []))
        explained += [t.name for t in report.tensors.values() if t.failed and t.name in known and t.name not in explained]
        if explained:
            alerts.extend(self._straight_through(step, report, modules, explained))
        report.causes = []
        explained += self._causes_of(step, report, "backward", report.tensors, explained, alerts)
        trained = self._causes_of(step, report, "training", report.training, [], alerts)
        for t in report.tensors.values():
            self._record(step, t)
            if t.name not in explained:
                alerts.extend(self._threshold(step, t))
                alerts.extend(self._drift(step, t))
            bad = t.verdict is None and t.inconclusive_kind == InconclusiveKind.NONFINITE and not objective_nonfinite
            tensor_nonfinite |= bad
            alerts.extend(self._tensor_nonfinite(step, t, bad))
        for tc in report.training.values():
            self._record(step, tc, "training")
            if tc.name not in trained:
                alerts.extend(self._threshold(step, tc, "training"))
                alerts.extend(self._drift(step, tc, "training"))
        whole_nonfinite = report.nonfinite and (objective_nonfinite or not tensor_nonfinite)
        if whole_nonfinite:
            bad_terms = {k: v for k, v in report.terms.items() if not _finite(v)}
            msg = nonfinite_message(step, report.objective, bad_terms)
            alerts.extend(self._fire(WHOLE_CHECK, "nonfinite", step, report.objective, None, msg))
        else:
            self._alerted.pop((WHOLE_CHECK, "nonfinite"), None)
        if report.nondeterministic:
            msg = nondeterministic_message(step)
            alerts.extend(self._fire(WHOLE_CHECK, "nondeterministic", step, report.objective, None, msg))
        else:
            self._alerted.pop((WHOLE_CHECK, "nondeterministic"), None)
        alerts += self.not_checked(step, report.not_checked())
        return alerts + self._never_given(step, report)

    def _causes_of(self, step: int, report: CheckReport, part: str, checks: Mapping[str, Any], explained: List[str],
                   alerts: List[Alert]) -> List[str]:
        """One alert for each cause that explains several of ``part``'s failing tensors at this check, and an update
        (no alert) for a cause said before (:mod:`gradwatch.watch.causes`); each found goes in ``report.causes``.
        Returns the tensors the causes explain (they raise no threshold or drift alert of their own)."""
        failing = {n: t.diagnosis for n, t in checks.items() if n not in explained and t.verdict is not None
                   and t.verdict.rank >= Verdict.SUSPICIOUS.rank}
        if not failing:
            return []
        out: List[str] = []
        for group in self._causes.group(part, failing, named_modules(report) if part == "backward" else ()):
            new = self._causes.note(step, part, group)
            report.causes.append(self._causes.record(group, new))
            out += group.names
            if new:
                worst = max((checks[n] for n in group.names), key=lambda t: (t.verdict.rank, t.judged_rel_diff))
                self._alert_counts[group.where] = self._alert_counts.get(group.where, 0) + 1
                severity = "error" if worst.verdict.rank >= Verdict.WRONG.rank else "warning"
                msg = message(step, part, group, worst.verdict.value, float(worst.judged_rel_diff))
                alerts.append(Alert(step, group.where, "threshold", severity, float(worst.judged_rel_diff), None, msg,
                                    part, len(group.names), list(group.names)))
        return out

    def _never_given(self, step: int, report: CheckReport) -> List[Alert]:
        """One ``not_checked`` alert (a warning) for the run of a part, or some of its tensors, never given a verdict
        at :data:`NEVER_GIVEN` checks in a row (:meth:`~gradwatch.watch.causes.Gaps.never_given`)."""
        out: List[Alert] = []
        for part, msg in self._gaps.never_given(step, report):
            self._alert_counts[WHOLE_CHECK] = self._alert_counts.get(WHOLE_CHECK, 0) + 1
            out.append(Alert(step, WHOLE_CHECK, "not_checked", "warning", math.nan, None, msg, part))
        return out

    def not_checked(self, step: int, items: Sequence[NotChecked]) -> List[Alert]:
        """One ``not_checked`` alert (a warning) for each unit or part the check could not check, the first time in
        the run it is not checked for that reason (:attr:`NotChecked.key`): what, why, and how to check it instead.
        A piece over the room is said the second time: the room changes from check to check, and the next check takes
        such a piece first (a piece checked there was only delayed; the record's notes say each check's gaps either
        way). The units of one part said over the room at one check are one cause, the room: one alert names them all
        (:class:`~gradwatch.watch.causes.Gaps`).

        Example:
            >>> item = NotChecked("independence", "*", "loss_fn never calls the model itself", "check_independence")
            >>> tracker = TrendTracker()
            >>> [(a.kind, a.tensor, a.part) for a in tracker.not_checked(0, [item])], tracker.not_checked(1, [item])
            ([('not_checked', '*', 'independence')], [])
            >>> room = NotChecked("backward", "head", "needs about 9 MB, over the room memory_budget leaves (4 MB)", "...")
            >>> len(tracker.not_checked(2, [room])), len(tracker.not_checked(3, [room]))
            (0, 1)
        """
        return [self._not_checked_alert(step, *due) for due in self._gaps.due(items)]

    def _not_checked_alert(self, step: int, what: str, label: str, part: str, why: str, how: str) -> Alert:
        self._alert_counts[what] = self._alert_counts.get(what, 0) + 1
        msg = not_checked_message(step, label, part, why, how)
        return Alert(int(step), what, "not_checked", "warning", math.nan, None, msg, part)

    def error(self, step: int, exc: BaseException, where: Optional[str] = "loss_fn") -> Optional[Alert]:
        """Record a check that raised; return its alert, or None while it is deduplicated.

        Args:
            step: Training step of the check.
            exc: The exception the check raised.
            where: What raised it (``"loss_fn"``, ``"grad_fn"``, ``"regularizer 'l2'"``...); None when it was
                not the user's code (the exception's message then says what to change).

        Example:
            >>> alert = TrendTracker().error(7, ValueError("bad shape"))
            >>> alert.kind, alert.tensor, alert.severity
            ('error', '*', 'error')
            >>> "ValueError: bad shape" in alert.message
            True
        """
        self._checks += 1
        msg = error_message(step, exc, where)
        # another error than the last one fires at once: only the same error repeating is kept quiet
        fired = self._fire(WHOLE_CHECK, "error", int(step), math.nan, None, msg, sig=error_key(exc))
        return fired[0] if fired else None

    # ------------------------------------------------------------------ state

    def state_dict(self) -> Dict[str, Any]:
        """Plain JSON-able state (non-finite floats stored as strings).

        Example:
            >>> import json
            >>> t = TrendTracker()
            >>> t2 = TrendTracker()
            >>> t2.load_state_dict(json.loads(json.dumps(t.state_dict())))
            >>> t2.history
            {}
        """
        return {
            "version": _STATE_VERSION,
            "checks": self._checks,
            "history": _series_json(self._history),
            "baseline_samples": {name: list(v) for name, v in self._baseline_samples.items()},
            "training_history": _series_json(self._training_history),
            "training_baseline_samples": {name: list(v) for name, v in self._training_baseline_samples.items()},
            "alerted": [
                {"tensor": tensor, "kind": kind, "value": json_float(s["value"]), "rank": s["rank"], "at": s["at"],
                 **({"sig": s["sig"]} if "sig" in s else {}), **({"seen": list(s["seen"])} if "seen" in s else {})}
                for (tensor, kind), s in self._alerted.items()
            ],
            "alert_counts": dict(self._alert_counts),
            "not_checked": [list(k) for k in sorted(self._gaps.said)],
            "over_room_once": [list(k) for k in sorted(self._gaps.over_room_once)],
            "causes": self._causes.state_dict(),
            "idle": dict(self._gaps.idle),
            "missed": [[p, n, k] for (p, n), k in self._gaps.missed.items()],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (settings stay those given to the constructor).

        Raises:
            ConfigError: The state is not one this version wrote.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"TrendTracker state: got version {got!r}, expected {_STATE_VERSION}")
        self._checks = int(state["checks"])
        self._history = _series_from_json(state["history"], directional=True)
        self._baseline_samples = {name: [float(v) for v in vals] for name, vals in state["baseline_samples"].items()}
        # absent in states written before the training part existed
        self._training_history = _series_from_json(state.get("training_history", {}), directional=False)
        self._training_baseline_samples = {
            name: [float(v) for v in vals] for name, vals in state.get("training_baseline_samples", {}).items()
        }
        self._alerted = {
            (s["tensor"], s["kind"]): {"value": float(s["value"]), "rank": s["rank"], "at": int(s["at"]),
                                       **({"sig": str(s["sig"])} if "sig" in s else {}),
                                       **({"seen": [str(x) for x in s["seen"]]} if "seen" in s else {})}
            for s in state["alerted"]
        }
        self._alert_counts = {name: int(n) for name, n in state["alert_counts"].items()}
        self._gaps.said = {tuple(str(x) for x in k) for k in state.get("not_checked", [])}  # absent in older states
        self._gaps.over_room_once = {tuple(str(x) for x in k) for k in state.get("over_room_once", [])}  # likewise
        self._causes.load_state_dict(state.get("causes", []))  # likewise
        self._gaps.idle = {str(k): int(v) for k, v in state.get("idle", {}).items()}
        self._gaps.missed = {(str(p), str(n)): int(k) for p, n, k in state.get("missed", [])}

    # ------------------------------------------------------------------ internals

    def _record(self, step: int, t: Any, part: str = "backward") -> None:
        history, baselines = self._series(part)
        judged = float(t.judged_rel_diff)
        entry: Dict[str, Any] = {"step": step, "judged_rel_diff": judged, "rel_diff": float(t.rel_diff)}
        if part == "backward":
            entry["directional_rel_diff"] = None if t.directional_rel_diff is None else float(t.directional_rel_diff)
        entry["verdict"] = t.verdict.value if t.verdict is not None else None
        history.setdefault(t.name, []).append(entry)
        samples = baselines.setdefault(t.name, [])
        if t.verdict is not None and math.isfinite(judged) and len(samples) < self.baseline_checks:
            samples.append(judged)

    def _clock(self, tensor: str, part: str = "backward") -> int:
        return self._checks if tensor == WHOLE_CHECK else len(self._series(part)[0].get(tensor, ()))

    def _fire(
        self, tensor: str, kind: str, step: int, value: float, baseline: Optional[float], message: str,
        rank: int = 0, part: str = "backward", sig: Optional[str] = None,
    ) -> List[Alert]:
        """Apply deduplication; return ``[alert]`` or ``[]`` (``sig``: what tells one error from another)."""
        key = (tensor, _key_kind(kind, part))
        now = self._clock(tensor, part)
        last = self._alerted.get(key)
        if last is not None:
            worse = rank > last["rank"] or (
                kind == "drift" and _finite(value) and _finite(last["value"]) and value >= 10.0 * last["value"]
            ) or (sig is not None and sig != last.get("sig"))
            if not worse and now - last["at"] <= self.alert_cooldown:
                return []
        self._alerted[key] = {"value": float(value), "rank": rank, "at": now}
        if sig is not None:
            self._alerted[key]["sig"] = sig
        self._alert_counts[tensor] = self._alert_counts.get(tensor, 0) + 1
        severity = "error" if kind in ("nonfinite", "error") or (kind == "threshold" and rank >= Verdict.WRONG.rank) else "warning"
        return [Alert(step, tensor, kind, severity, float(value), baseline, message, part)]

    def _straight_through(self, step: int, report: CheckReport, modules: List[str], explained: List[str]) -> List[Alert]:
        """One alert for an undeclared straight-through (:func:`gradwatch.check.judging.report.suspects`), for the run.

        Its tensors are recorded as usual but raise no threshold alert of their own, now or at any later check
        where they fail (not after ``alert_cooldown``: the gradient is the same at every check); a new alert
        comes only for tensors no earlier one explained.
        """
        where = ", ".join(modules) if modules else "a module downstream of " + ", ".join(explained[:3])
        entry = self._alerted.setdefault((WHOLE_CHECK, "surrogate"), {"value": 0.0, "rank": 0, "at": self._checks, "seen": []})
        if set(explained) <= set(entry["seen"]):
            return []
        entry["seen"].extend(n for n in explained if n not in entry["seen"])
        checks = [report.tensors[n] for n in explained if n in report.tensors]
        worst = max(checks, key=lambda t: t.verdict.rank if t.verdict is not None else -1)
        msg = straight_through_message(step, where, modules, explained)
        self._alert_counts[where] = self._alert_counts.get(where, 0) + 1
        severity = "error" if worst.verdict is not None and worst.verdict.rank >= Verdict.WRONG.rank else "warning"
        return [Alert(step, where, "surrogate", severity, float(worst.judged_rel_diff), None, msg)]

    def _threshold(self, step: int, t: Any, part: str = "backward") -> List[Alert]:
        if t.verdict is None:
            return []
        if t.verdict.rank < Verdict.SUSPICIOUS.rank:
            self._alerted.pop((t.name, _key_kind("threshold", part)), None)
            return []
        baseline = self.baseline(t.name, part)
        band = self.bands[2] if t.verdict is Verdict.WRONG else self.bands[1]
        msg = threshold_message(step, t, part, band, baseline)
        return self._fire(t.name, "threshold", step, float(t.judged_rel_diff), baseline, msg, rank=t.verdict.rank, part=part)

    def _drift(self, step: int, t: Any, part: str = "backward") -> List[Alert]:
        baseline = self.baseline(t.name, part)
        if t.verdict is None or baseline is None:
            return []
        recent = [
            r["judged_rel_diff"]
            for r in self._series(part)[0][t.name]
            if r["verdict"] is not None and math.isfinite(r["judged_rel_diff"])
        ][-self.drift_window :]
        median = float(statistics.median(recent))
        limit = max(baseline, _ZERO_BASELINE) * 10.0 ** self.drift_decades
        if median < limit or median < self.bands[0]:
            self._alerted.pop((t.name, _key_kind("drift", part)), None)
            return []
        msg = drift_message(step, t, part, median, len(recent), baseline, baseline <= _ZERO_BASELINE)
        return self._fire(t.name, "drift", step, median, baseline, msg, part=part)

    def _tensor_nonfinite(self, step: int, t: TensorCheck, bad: bool) -> List[Alert]:
        if not bad:
            if t.verdict is not None:
                self._alerted.pop((t.name, "nonfinite"), None)
            return []
        msg = tensor_nonfinite_message(step, t.name, t.inconclusive)
        return self._fire(t.name, "nonfinite", step, float(t.judged_rel_diff), self.baseline(t.name), msg)


__all__ = ["ALERT_KINDS", "NEVER_GIVEN", "PARTS", "WHOLE_CHECK", "Alert", "TrendTracker"]
