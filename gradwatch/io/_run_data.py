"""A run read back: :class:`RunData`, what every reader of :mod:`gradwatch.io.runs` builds and its report reads.

Its :data:`History` shape, :func:`detail_key` (the key of its ``details``) and :func:`as_number` (a record's
number, non-finite strings included) are shared by the readers and the report's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from gradwatch.bands import DEFAULT_BANDS
from gradwatch.errors import GradWatchError
from gradwatch.io import not_judged
from gradwatch.io.not_judged import Unchecked
from gradwatch.io.update_summary import UpdateSummary

#: ``{tensor: [{"step", "judged_rel_diff", "rel_diff", "verdict"}, ...]}`` (the TrendTracker's history shape).
History = Dict[str, List[Dict[str, Any]]]


class RunNotFound(GradWatchError):
    """No gradwatch data where the user pointed (the CLI exits 2 with this message)."""


@dataclass
class RunData:
    """One run's checks and alerts, whatever they were read from.

    Attributes:
        history: Per tensor, one entry per check (see :data:`History`), in step order.
        alerts: Alert records (``step, tensor, kind, severity, value, baseline, message, headline, why, todo``).
        details: ``(step, tensor) -> {"verdict", "diagnosis"}`` of the check records, when known.
        source: ``"jsonl"``, ``"events"`` or ``"memory"``.
        path: The file or directory read.
        warnings: Problems met while reading (truncated lines, ...).
        bands: Verdict bands of the run (from its ``run`` record; defaults otherwise).
        check_steps: Steps at which a check completed.
        run_id: The run's id (from its records), when known.
        forms: Checks per form of the backward part (``"objective"``, ``"module"``); empty when not known.
        coverage: The last check's coverage: tensor -> ``{"backward": fraction, "training": fraction}`` of its
            rows probed in the run (empty when not known).
        cycle_length, steps_to_full: K, the checks within which every unit and parameter row is probed once, and K
            in training steps (None: not known).
        unchecked: What else the checks' notes say was not checked (by design: surrogates, padding rows), each once.
        independence: Structure -> ``[checks of it, checks that found a leak, the latest leak's module or None]``
            (checks with ``independence=``; empty when none ran or not known).
    """

    history: History
    alerts: List[Dict[str, Any]]
    details: Dict[Tuple[int, str], Dict[str, Any]] = field(default_factory=dict)
    source: str = "memory"
    path: Optional[str] = None
    warnings: List[str] = field(default_factory=list)
    bands: Tuple[float, float, float] = DEFAULT_BANDS
    check_steps: List[int] = field(default_factory=list)
    #: The training part's history (live ``.grad`` against the objective's gradient), same shape as ``history``.
    training: History = field(default_factory=dict)
    run_id: Optional[str] = None
    forms: Dict[str, int] = field(default_factory=dict)
    coverage: Dict[str, Dict[str, float]] = field(default_factory=dict)
    cycle_length: Optional[int] = None
    unchecked: List[str] = field(default_factory=list)
    independence: Dict[str, List[Any]] = field(default_factory=dict)
    #: What the checks did not judge, and why (:mod:`gradwatch.io.not_judged`): ``(part, tensor) -> [checks, reason]``.
    not_judged: not_judged.Tally = field(default_factory=dict)
    #: What the checks could not check, why, how to check it instead (:data:`gradwatch.io.not_judged.Unchecked`).
    not_checked: Unchecked = field(default_factory=dict)
    steps_to_full: Optional[int] = None
    #: The optimizer's step verified after each check (its ``update`` records, :mod:`gradwatch.io.update_summary`).
    update: UpdateSummary = field(default_factory=UpdateSummary)


def as_number(value: Any) -> Optional[float]:
    """A record's number (``"nan"``/``"inf"`` strings included) as a float; None stays None.

    Example:
        >>> as_number("inf"), as_number(None), as_number(True)
        (inf, None, None)
    """
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def detail_key(step: Any, tensor: Any, part: Optional[str] = "backward") -> Tuple[int, str]:
    """Key of :attr:`RunData.details` for a tensor's result at a step, in either part.

    Example:
        >>> detail_key(10, "w"), detail_key(10, "w", "training")
        ((10, 'w'), (10, 'training:w'))
    """
    name = str(tensor)
    return (int(step or 0), name if (part or "backward") == "backward" else f"{part}:{name}")
