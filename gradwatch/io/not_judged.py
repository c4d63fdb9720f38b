"""What a check could not judge, and why: read from a check record, written to TensorBoard as text, tallied
for ``gradwatch report``.

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

from typing import Any, Dict, List, Mapping, Sequence, Tuple

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
