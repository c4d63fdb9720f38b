"""What a check could not judge, and why: read from a check record, written to TensorBoard as text, tallied
for ``gradwatch report``; and what it could not check at all (a unit, a part), tallied the same way.

A tensor with no verdict (an inconclusive backward result, a training result with none) and a training part
that judged nothing (skipped, with the reason in ``training_note``) are written as what they are: no scalar
that a chart or a re-derived verdict could read as agreement, and a line that says why.

Example:
    >>> rec = {"tensors": {"w": {"verdict": None, "inconclusive": "analytic gradient has non-finite values"},
    ...                    "b": {"verdict": "excellent"}},
    ...        "training": {}, "training_note": "not judged: no watched parameter has a .grad yet"}
    >>> items = of_check(rec)
    >>> items
    [('backward', 'w', 'analytic gradient has non-finite values'), ('training', '*', 'no watched parameter has a .grad yet')]
    >>> from_text(to_text(items)) == items
    True
    >>> tally: Tally = {}
    >>> add(tally, items)
    >>> report_lines(tally)[1]
    'not judged: the training part, at 1 check: no watched parameter has a .grad yet'
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from gradwatch.check.judging.report import NotChecked, not_checked_in

#: TensorBoard text tag of the lines (one text per check, one line per item).
TEXT_TAG = "gradwatch/not_judged"
#: The tensor of an item about a whole part (a training part that judged nothing).
WHOLE = "*"

#: ``(part, tensor, reason)``: ``part`` is ``"backward"`` or ``"training"``.
Item = Tuple[str, str, str]
#: ``(part, tensor) -> [checks not judged, the latest reason]``.
Tally = Dict[Tuple[str, str], List[Any]]


def _reason(text: Any) -> str:
    words = str(text or "no verdict").strip()
    return words[len("not judged: "):] if words.startswith("not judged: ") else words


def unjudged(entry: Any) -> bool:
    """True for a tensor's entry of a check record that says it got no verdict (``"verdict": None``; an entry
    without the key, from an older record, counts as judged)."""
    return isinstance(entry, Mapping) and "verdict" in entry and entry["verdict"] is None


def of_check(record: Mapping[str, Any]) -> List[Item]:
    """The items of one ``check`` record: each tensor whose verdict is None, and the training part when it judged
    nothing although it ran (its ``training_note`` says why)."""
    out: List[Item] = []
    for part, key in (("backward", "tensors"), ("training", "training")):
        for name, t in (record.get(key) or {}).items():
            if unjudged(t):
                out.append((part, str(name), _reason(t.get("inconclusive"))))
    if not record.get("training") and record.get("training_note"):
        out.append(("training", WHOLE, _reason(record["training_note"])))
    return out


def to_text(items: Sequence[Item]) -> str:
    """One line per item, tab-separated (tensor names may hold ``:``), for TensorBoard's text plugin."""
    return "\n".join("\t".join((part, tensor, reason.replace("\n", " "))) for part, tensor, reason in items)


def from_text(text: str) -> List[Item]:
    """The items :func:`to_text` wrote (lines of another shape are skipped)."""
    out: List[Item] = []
    for line in text.splitlines():
        fields = line.split("\t", 2)
        if len(fields) == 3 and fields[0] in ("backward", "training"):
            out.append((fields[0], fields[1], fields[2]))
    return out


def add(tally: Tally, items: Sequence[Item]) -> None:
    """Count each item's check and keep its latest reason."""
    for part, tensor, reason in items:
        entry = tally.setdefault((part, tensor), [0, reason])
        entry[0] += 1
        entry[1] = reason


def merge(tally: Tally, other: Tally) -> None:
    """Add ``other``'s counts to ``tally`` (the runs of one job read from several places); its reasons are later."""
    for key, (checks, reason) in other.items():
        entry = tally.setdefault(key, [0, reason])
        entry[0] += checks
        entry[1] = reason


def report_lines(tally: Tally) -> List[str]:
    """``not judged: ...`` lines for ``gradwatch report``: backward tensors first, then the training part."""
    lines = []
    for (part, tensor), (checks, reason) in sorted(tally.items(), key=lambda kv: (kv[0][0] != "backward", kv[0][1])):
        what = f"the {part} part" if tensor == WHOLE else f"{part} `{tensor}`"
        lines.append(f"not judged: {what}, at {checks} check{'s' if checks != 1 else ''}: {reason}")
    return lines


def to_json(tally: Tally) -> List[Dict[str, Any]]:
    """The tally as JSON-able rows (``gradwatch report --format json``)."""
    return [{"part": part, "tensor": tensor, "checks": checks, "reason": reason}
            for (part, tensor), (checks, reason) in sorted(tally.items())]


# --------------------------------------------------------------------- not checked

#: :attr:`NotChecked.key` -> ``{"part", "what", "why", "how", "label", "checks", "step", "planned"}``: checks at which it
#: was not checked (None: not known, read from alerts), the first step, its latest wording, and for a unit of the module
#: form the checks that planned it (it is one piece of a cycle of K checks; None: not known).
Unchecked = Dict[Tuple[str, str, str], Dict[str, Any]]

#: A ``not_checked`` alert's message (:meth:`gradwatch.watch.trend.TrendTracker.not_checked`), read back.
_ALERT = re.compile(r"^step (?P<step>\d+): (?P<label>.*?) not checked \((?P<part>\w+) part\): (?P<why>.*) — check it "
                    r"instead: (?P<how>.*?)\. Said once for the run", re.S)


def unchecked_of(record: Mapping[str, Any]) -> List[NotChecked]:
    """What a ``check`` record's notes say it could not check (:func:`~gradwatch.check.judging.report.not_checked_in`)."""
    return not_checked_in([str(n) for n in record.get("notes") or ()], record.get("training_note"),
                          bool(record.get("training")))


def add_unchecked(tally: Unchecked, items: Sequence[NotChecked], step: Any) -> None:
    """Count each item's check (the first step kept, the latest wording)."""
    for item in items:
        entry = tally.setdefault(item.key, {"checks": 0, "step": step, "planned": None})
        entry.update(item.to_dict(), checks=(entry["checks"] or 0) + 1)


def unchecked_from_alerts(alerts: Sequence[Mapping[str, Any]]) -> Unchecked:
    """The tally from the ``not_checked`` alerts alone (event files keep no notes): once each, checks not known.

    Example:
        >>> msg = ("step 2: `fc` (Linear) not checked (backward part): it raised — check it instead: "
        ...        "form='objective'. Said once for the run (...)")
        >>> tally = unchecked_from_alerts([{"kind": "not_checked", "tensor": "fc", "message": msg}])
        >>> unchecked_lines(tally, 4)
        ["not checked: `fc` (Linear) in the backward part, from step 2: it raised — check it instead: form='objective'"]
    """
    tally: Unchecked = {}
    for a in alerts:
        text = f"step {a.get('step')}: {a['why']} — {a.get('todo')}" if a.get("why") else str(a.get("message") or "")
        found = _ALERT.match(text) if a.get("kind") == "not_checked" else None  # three lines (issue 73), or one
        if found is not None:
            item = NotChecked(found["part"], str(a.get("tensor")), found["why"], found["how"], found["label"])
            tally.setdefault(item.key, {**item.to_dict(), "checks": None, "step": int(found["step"]), "planned": None})
    return tally


def plan_counts(tally: Unchecked, planned: Mapping[str, int], alerts: Sequence[Mapping[str, Any]] = ()) -> None:
    """Give each unit of the module form the checks that planned it (``planned``: unit -> checks whose ``pieces``
    held it; the root model's unit is ``""``), at least those that said it was not checked; and add what only a
    ``not_checked`` alert of ``alerts`` says (a part that gave no verdict at several checks in a row: each check's
    record says why, not that it was not checked).

    Example:
        >>> msg = ("step 2: the training verdict not checked (training part): never given at 3 checks in a row: "
        ...        "why — check it instead: how. Said once for the run")
        >>> tally: Unchecked = {}
        >>> plan_counts(tally, {}, [{"kind": "not_checked", "tensor": "*", "message": msg}])
        >>> unchecked_lines(tally, 3)
        ['not checked: the training verdict, from step 2: never given at 3 checks in a row: why — check it instead: how']
    """
    units = {entry["what"] for entry in tally.values() if entry["part"] == "backward"}
    for key, entry in unchecked_from_alerts(alerts).items():
        if entry["part"] == "backward" and entry["what"] in units:
            continue  # the records' notes said it, unit by unit (one alert of one cause names several)
        tally.setdefault(key, entry)
    for entry in tally.values():
        if entry["part"] == "backward" and entry.get("checks") is not None:
            unit = "" if entry["what"] == "<model>" else entry["what"]
            entry["planned"] = max(int(planned.get(unit, 0)), entry["checks"])


def planned_units(record: Mapping[str, Any]) -> List[str]:
    """The units of a ``check`` record's ``pieces`` (``"lm_head[0:256]"`` is a piece of ``lm_head``), each once."""
    return list(dict.fromkeys(str(p).split("[", 1)[0] for p in record.get("pieces") or ()))


def merge_unchecked(tally: Unchecked, other: Unchecked) -> None:
    """Add ``other``'s counts to ``tally`` (a run read from several places; ``other`` is later)."""
    for key, entry in other.items():
        if key not in tally:
            tally[key] = dict(entry)
        else:
            mine = tally[key]
            counts = {k: None if mine.get(k) is None or entry.get(k) is None else mine[k] + entry[k]
                      for k in ("checks", "planned")}
            mine.update({**entry, **counts, "step": mine["step"]})


def unchecked_lines(tally: Unchecked, checks: int) -> List[str]:
    """``not checked: ...`` lines for ``gradwatch report``: what, where, at how many of the run's ``checks``, why, and
    how to check it instead."""
    lines = []
    for entry in tally.values():
        where = " in the backward part" if entry["part"] == "backward" else ""
        n, planned = entry.get("checks"), entry.get("planned")
        of = checks if planned is None else planned
        if n is None:
            when = f"from step {entry['step']}"
        elif n >= of:
            when = f"never checked in the run ({n} check{'s' if n != 1 else ''}" + (" planned it)" if planned else ")")
        else:
            when = f"at {n} of the {of} checks{' that planned it' if planned else ''}, from step {entry['step']}"
        lines.append(f"not checked: {entry['label']}{where}, {when}: {entry['why']} — check it instead: {entry['how']}")
    return lines
