"""The optimizer's step in ``gradwatch report``: a run's ``"update"`` records read back, and the lines said of them.

After each check it was given the optimizer, the watch verifies the step that follows
(:mod:`gradwatch.watch.update_part`) and writes one ``"update"`` record
(:func:`gradwatch.io.records.update_record`). :class:`UpdateSummary` gathers a run's records: the algorithm
replayed, the steps verified, each step's clipping, each tensor's update verdict (a history of the shape
:mod:`gradwatch.io.runs` keeps for the other parts, so the report prints it in the same table), and, sharded, the
update against the optimizer's own class on the gathered tensor (``layout_rel_diff``). :meth:`UpdateSummary.lines`
says what the report prints above the tables. Pure functions of records: no file, no torch tensor.

Example:
    >>> s = UpdateSummary()
    >>> s.add({"type": "update", "step": 0, "algorithm": "SGD", "clipping": {"factor": 0.5, "threshold": 1.0},
    ...        "tensors": {"w": {"verdict": "excellent", "rel_diff": 1e-9, "judged_rel_diff": 0.0}}})
    >>> print("\\n".join(s.lines(checks=1)))
    optimizer step: verified after 1 of 1 check, SGD replayed in float64
    clipping: by the global norm at 1 of 1 verified step, factor 0.5, threshold 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from gradwatch.check.update.clipping import FACTOR_TOLERANCE, THRESHOLD_TOLERANCE
from gradwatch.check.update.optimizer_replay import REPLAYED

#: What each kind of clipping problem is, in a few words (:class:`gradwatch.check.update.clipping.Clipping`).
PROBLEMS = {
    "groups": "tensors scaled by different factors",
    "threshold": "a threshold other than asked or than before",
    "unasked": "clipped where none was asked",
    "not_scaling": ".grad changed, not by one factor",
}
#: What the update part's ``not_checked`` alert says where it stopped verifying the step for the run.
STOPPED = "the optimizer's step is not verified in this run"
#: What the report says of a run that has checks but no update record.
NOT_VERIFIED = "optimizer step: not verified (no update record: no optimizer= given, or none gradwatch can watch)"


def _number(value: Any) -> Optional[float]:
    """A record's finite number as a float; None for anything else (None, ``"nan"``, a bool)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _span(values: Sequence[float]) -> str:
    """``0.5`` for one value (within :data:`FACTOR_TOLERANCE`), else ``0.21 to 0.64``."""
    low, high = min(values), max(values)
    if abs(high - low) <= FACTOR_TOLERANCE * max(abs(high), 1e-30):
        return f"{high:.3g}"
    return f"{low:.3g} to {high:.3g}"


def distinct(values: Sequence[float], tolerance: float = THRESHOLD_TOLERANCE) -> List[float]:
    """The values that differ by more than ``tolerance`` (relative), each first as met: the thresholds a run clipped
    at (training's norm in float32 is off the watch's float64 one by up to 1e-4).

    Example:
        >>> distinct([1.0, 1.00002, 0.5, 1.0])
        [1.0, 0.5]
    """
    out: List[float] = []
    for v in values:
        if not any(abs(v - u) <= tolerance * max(abs(u), abs(v)) for u in out):
            out.append(v)
    return out


@dataclass
class UpdateSummary:
    """A run's optimizer steps verified, from its ``"update"`` records.

    Attributes:
        steps: The check's step of each record (one per step verified).
        algorithms: Records per algorithm replayed (``""``: the optimizer's is not one gradwatch replays).
        history: Per tensor, one ``{"step", "judged_rel_diff", "rel_diff", "verdict", "ratio"}`` per step whose
            update was replayed (the shape of :data:`gradwatch.io.runs.History`).
        factors: The one factor every tensor was scaled by at each step where there was one (1: not clipped).
        thresholds: The threshold of each step clipped by the global norm; ``bounds``: of each clipped by value.
        problems: ``(step, kind, words)`` of each step whose clipping is not what training asked for.
        layout: Sharded, an optimizer with no elementwise form: per tensor, ``(step, rel_diff)`` of its update against
            its optimizer's class stepped on the gathered tensor.
    """

    steps: List[int] = field(default_factory=list)
    algorithms: Dict[str, int] = field(default_factory=dict)
    history: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)
    factors: List[float] = field(default_factory=list)
    thresholds: List[float] = field(default_factory=list)
    bounds: List[float] = field(default_factory=list)
    problems: List[Tuple[int, str, str]] = field(default_factory=list)
    layout: Dict[str, List[Tuple[int, float]]] = field(default_factory=dict)

    def add(self, record: Mapping[str, Any]) -> None:
        """File one record (records of other types are left alone)."""
        if record.get("type") != "update":
            return
        step = int(record["step"])
        self.steps.append(step)
        name = str(record.get("algorithm") or "")
        self.algorithms[name] = self.algorithms.get(name, 0) + 1
        self._clipping(step, record.get("clipping") or {})
        for tensor, t in (record.get("tensors") or {}).items():
            layout = _number(t.get("layout_rel_diff"))
            if layout is not None:
                self.layout.setdefault(str(tensor), []).append((step, layout))
            if t.get("verdict") is not None or t.get("rel_diff") is not None:
                self.history.setdefault(str(tensor), []).append({
                    "step": step, "judged_rel_diff": _number(t.get("judged_rel_diff")),
                    "rel_diff": _number(t.get("rel_diff")), "verdict": t.get("verdict"), "ratio": _number(t.get("ratio"))})

    def _clipping(self, step: int, clipping: Mapping[str, Any]) -> None:
        factor, threshold = _number(clipping.get("factor")), _number(clipping.get("threshold"))
        if factor is not None:
            self.factors.append(factor)
            if threshold is not None:
                self.thresholds.append(threshold)
        elif threshold is not None:
            self.bounds.append(threshold)
        if clipping.get("problem"):
            kind = str(clipping.get("kind") or "")
            self.problems.append((step, kind, str(clipping["problem"])))

    @classmethod
    def merged(cls, parts: Sequence[UpdateSummary]) -> UpdateSummary:
        """One run read from several places (a run resumed in a new folder): in step order.

        Example:
            >>> a, b = UpdateSummary(), UpdateSummary()
            >>> a.add({"type": "update", "step": 4, "algorithm": "SGD"}); b.add({"type": "update", "step": 0})
            >>> m = UpdateSummary.merged([a, b])
            >>> m.steps, m.algorithms
            ([0, 4], {'SGD': 1, '': 1})
        """
        out = cls()
        for part in parts:
            out.steps.extend(part.steps)
            for name, n in part.algorithms.items():
                out.algorithms[name] = out.algorithms.get(name, 0) + n
            for tensor, entries in part.history.items():
                out.history.setdefault(tensor, []).extend(entries)
            for tensor, pairs in part.layout.items():
                out.layout.setdefault(tensor, []).extend(pairs)
            out.factors.extend(part.factors)
            out.thresholds.extend(part.thresholds)
            out.bounds.extend(part.bounds)
            out.problems.extend(part.problems)
        out.steps.sort()
        out.problems.sort()
        for entries in out.history.values():
            entries.sort(key=lambda e: e["step"])
        for pairs in out.layout.values():
            pairs.sort()
        return out

    # ------------------------------------------------------------------ words
    def replayed(self) -> List[str]:
        """The algorithms replayed, in the order first met (none: the optimizer's is not one gradwatch replays)."""
        return [name for name in self.algorithms if name]

    def heading(self) -> str:
        """The heading of the report's table of each tensor's update.

        Example:
            >>> s = UpdateSummary(algorithms={"AdamW": 3})
            >>> s.heading()
            "update (the step's update against AdamW's, replayed in float64 on sampled coordinates):"
        """
        names = " and ".join(f"{n}'s" for n in self.replayed()) or "the algorithm's"
        return f"update (the step's update against {names}, replayed in float64 on sampled coordinates):"

    def lines(self, checks: int, alerts: Sequence[Mapping[str, Any]] = (), source: str = "jsonl") -> List[str]:
        """What ``gradwatch report`` says of the optimizer's step above the tables: what was verified, the clipping,
        and sharded the update on the gathered tensor; or, once, that it was not verified.

        Args:
            checks: The run's checks (each arms the step that follows it).
            alerts: The run's alert records: the update part's ``not_checked`` says why the step went unverified.
            source: Where the run was read from: event files hold no update record (the line says so).

        Example:
            >>> UpdateSummary().lines(checks=3)
            ['optimizer step: not verified (no update record: no optimizer= given, or none gradwatch can watch)']
            >>> UpdateSummary().lines(3, [{"part": "update", "kind": "not_checked", "step": 0, "message": f"{STOPPED}: "
            ...                            "...", "headline": "optimizer step not verified: watching it raised KeyError (step 0)"}])
            ['optimizer step: not verified: watching it raised KeyError (step 0)']
        """
        stopped = [a for a in alerts if a.get("part") == "update" and a.get("kind") == "not_checked"
                   and STOPPED in str(a.get("message") or "")]  # (not a sharded tensor's layout left unverified)
        if not self.steps:
            if stopped:
                headline = str(stopped[0].get("headline") or "")
                why = headline.split(": ", 1)[1] if ": " in headline else f"from step {stopped[0].get('step')}"
                return [f"optimizer step: not verified: {why}"]
            if source == "events" or not checks:
                return [] if not checks else ["optimizer step: not read from event files (see checks.jsonl)"]
            return [NOT_VERIFIED]
        n = len(self.steps)
        names = self.replayed()
        what = f"{' and '.join(names)} replayed in float64" if names else (
            f"not replayed (not one of torch's {', '.join(REPLAYED)}: its clipping and that it moves the weights only)")
        first = f"optimizer step: verified after {n} of {_plural(max(checks, n), 'check')}, {what}"
        if names and self.algorithms.get(""):
            first += f" ({self.algorithms['']} not replayed)"
        if stopped:
            first += f"; then not verified from step {stopped[0].get('step')} (see the alerts)"
        return [first, self.clipping_line(), *self.layout_lines()]

    def clipping_line(self) -> str:
        """The run's clipping in one line: how often and how (factor range, thresholds), and any problem.

        Example:
            >>> s = UpdateSummary(steps=[0, 1, 2], factors=[0.4, 0.2, 1.0], thresholds=[0.05, 0.0500001])
            >>> s.clipping_line()
            'clipping: by the global norm at 2 of 3 verified steps, factor 0.2 to 0.4, threshold 0.05'
            >>> UpdateSummary(steps=[0, 1], factors=[1.0, 1.0]).clipping_line()
            'clipping: none (factor 1 at each of 2 verified steps)'
        """
        n = len(self.steps)
        clipped = [f for f in self.factors if f < 1.0 - FACTOR_TOLERANCE]
        parts = []
        if clipped:
            thresholds = distinct(self.thresholds)
            said = ", ".join(f"{t:.4g}" for t in thresholds)
            parts.append(f"by the global norm at {len(clipped)} of {_plural(n, 'verified step')}, factor {_span(clipped)}"
                         + (f", threshold{'s' if len(thresholds) > 1 else ''} {said}" if thresholds else ""))
        if self.bounds:
            parts.append(f"by value at {len(self.bounds)} of {_plural(n, 'verified step')}, bound {_span(self.bounds)}")
        if self.problems:
            kinds = list(dict.fromkeys(PROBLEMS.get(kind, kind or "a problem") for _, kind, _ in self.problems))
            parts.append(f"WRONG at {len(self.problems)} of {_plural(n, 'verified step')} from step {self.problems[0][0]}: "
                         f"{'; '.join(kinds)} (see the alerts)")
        if not parts:
            if len(self.factors) == n:
                return f"clipping: none (factor 1 at {'the' if n == 1 else 'each of'} {_plural(n, 'verified step')})"
            return f"clipping: none seen ({n - len(self.factors)} of {_plural(n, 'verified step')} with no factor read)"
        return "clipping: " + "; ".join(parts)

    def layout_lines(self) -> List[str]:
        """Sharded, an optimizer with no elementwise form: each tensor's update against its class's on the gathered
        tensor (one tensor a check, in turn), its worst relative difference.

        Example:
            >>> UpdateSummary(layout={"w": [(0, 2e-6), (2, 3e-6)]}).layout_lines()
            ['update on the gathered tensor (sharded: against the optimizer class in one process): w 3.0e-06 (2 checks)']
        """
        if not self.layout:
            return []
        worst = {name: max(v for _, v in pairs) for name, pairs in self.layout.items()}
        said = ", ".join(f"{name} {worst[name]:.1e} ({_plural(len(self.layout[name]), 'check')})"
                         for name in sorted(worst, key=lambda k: -worst[k]))
        return [f"update on the gathered tensor (sharded: against the optimizer class in one process): {said}"]

    def to_json(self, rows: Sequence[Mapping[str, Any]] = ()) -> Dict[str, Any]:
        """The ``update`` section of ``gradwatch report --format json``; ``rows``: each tensor's summary
        (:func:`gradwatch.io.runs.summarize` with ``part="update"``), its history joined.

        Example:
            >>> UpdateSummary(steps=[0], algorithms={"SGD": 1}, factors=[1.0]).to_json()["verified_steps"]
            [0]
        """
        return {
            "verified_steps": list(self.steps),
            "algorithms": dict(self.algorithms),
            "clipping": {"factors": list(self.factors), "thresholds": distinct(self.thresholds), "bounds": list(self.bounds),
                         "problems": [{"step": s, "kind": k, "problem": p} for s, k, p in self.problems]},
            "tensors": [{**r, "history": self.history.get(str(r["tensor"]), [])} for r in rows],
            "layout_rel_diff": {name: [{"step": s, "rel_diff": v} for s, v in pairs] for name, pairs in self.layout.items()},
        }


__all__ = ["NOT_VERIFIED", "PROBLEMS", "STOPPED", "UpdateSummary", "distinct"]
