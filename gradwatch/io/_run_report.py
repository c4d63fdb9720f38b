"""What ``gradwatch report`` and ``gradwatch demo`` say of a run: per-tensor rows and tables, alert lines,
the coverage and independence lines, and the ``--format json`` document (all read from a :class:`RunData`).
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from gradwatch.bands import DEFAULT_BANDS, Verdict
from gradwatch.io import not_judged
from gradwatch.io._run_data import RunData, as_number
from gradwatch.io.headlines import wrapped
from gradwatch.io.records import to_jsonable

VERDICT_NAMES = tuple(v.value for v in Verdict)
_RANK = {v.value: v.rank for v in Verdict}
_MARKS_UNICODE = {"excellent": "\u2581", "acceptable": "\u2583", "suspicious": "\u2585", "wrong": "\u2588", None: "?"}
_MARKS_ASCII = {"excellent": ".", "acceptable": ":", "suspicious": "+", "wrong": "#", None: "?"}


# --------------------------------------------------------------------- summarizing

def _finite(v: Optional[float]) -> bool:
    return v is not None and math.isfinite(v)


def _worst(values: List[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return max(vals, key=lambda v: v if math.isfinite(v) else math.inf)


def summarize(data: RunData, part: str = "backward") -> List[Dict[str, Any]]:
    """One row per tensor: ``tensor, checks, first, last, worst`` (judged rel_diff over checks with
    a verdict), ``first_rel_diff, last_rel_diff, worst_rel_diff``, ``verdict`` (last check's),
    ``worst_verdict``, ``alerts``, ``verdicts`` (one per check), plus a ``"*"`` row when
    whole-check alerts exist.

    ``part="backward"`` (the default) summarizes ``data.history`` and the backward part's alerts;
    ``part="training"`` summarizes ``data.training`` and the training part's alerts; ``part="update"``
    each tensor's update against the optimizer's algorithm replayed (``data.update.history``) and the update's alerts.

    Example:
        >>> data = RunData({"w": [{"step": 0, "judged_rel_diff": 1e-9, "rel_diff": 1e-9, "verdict": "excellent"},
        ...                       {"step": 10, "judged_rel_diff": 0.1, "rel_diff": 0.1, "verdict": "wrong"}]}, [])
        >>> row = summarize(data)[0]
        >>> row["first"], row["worst"], row["verdict"], row["worst_verdict"]
        (1e-09, 0.1, 'wrong', 'wrong')
    """
    counts: Dict[str, int] = {}
    for a in (a for a in data.alerts if a.get("part", "backward") == part):  # one cause's alert: each tensor's too
        for name in dict.fromkeys([str(a.get("tensor")), *map(str, a.get("tensors") or ())]):
            counts[name] = counts.get(name, 0) + 1
    rows = []
    for name, entries in {"training": data.training, "update": data.update.history}.get(part, data.history).items():
        judged = [e for e in entries if e.get("verdict") is not None]
        jv = [e["judged_rel_diff"] for e in judged]
        rv = [e["rel_diff"] for e in judged]
        verdicts = [e.get("verdict") for e in entries]
        ranked = [v for v in verdicts if v in _RANK]
        rows.append({
            "tensor": name,
            "checks": len(entries),
            "first": jv[0] if jv else None,
            "last": jv[-1] if jv else None,
            "worst": _worst(jv),
            "first_rel_diff": rv[0] if rv else None,
            "last_rel_diff": rv[-1] if rv else None,
            "worst_rel_diff": _worst(rv),
            "verdict": verdicts[-1] if verdicts else None,
            "worst_verdict": max(ranked, key=_RANK.__getitem__) if ranked else None,
            "alerts": counts.pop(name, 0),
            "verdicts": verdicts,
        })
    for name, n in counts.items():  # alerts on the whole check ("*") or on tensors never recorded
        rows.append({"tensor": name, "checks": 0, "first": None, "last": None, "worst": None,
                     "first_rel_diff": None, "last_rel_diff": None, "worst_rel_diff": None,
                     "verdict": None, "worst_verdict": None, "alerts": n, "verdicts": []})
    return rows


# --------------------------------------------------------------------- formatting

def fmt(value: Optional[float]) -> str:
    """``2.8e-02``; ``-`` for None; ``nan``/``inf`` as such.

    Example:
        >>> fmt(0.028), fmt(None), fmt(0.0)
        ('2.8e-02', '-', '0')
    """
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.1e}"


def verdict_text(verdict: Optional[str]) -> str:
    """``excellent``/``acceptable`` in lower case, failing verdicts in upper case, ``-`` when inconclusive."""
    if verdict is None:
        return "-"
    return verdict.upper() if _RANK.get(verdict, 0) >= Verdict.SUSPICIOUS.rank else verdict


def marks(unicode: bool = True) -> Dict[Optional[str], str]:
    """Verdict -> one-character mark of the history strip."""
    return dict(_MARKS_UNICODE if unicode else _MARKS_ASCII)


def strip(verdicts: Sequence[Optional[str]], width: int = 30, unicode: bool = True) -> str:
    """One mark per check (the worst per bucket when there are more than ``width`` checks).

    Example:
        >>> strip(["excellent", "excellent", "wrong"], unicode=False)
        '..#'
    """
    m = marks(unicode)
    if not verdicts:
        return ""
    n = len(verdicts)
    buckets = min(n, width)
    out = []
    for b in range(buckets):
        chunk = verdicts[b * n // buckets:(b + 1) * n // buckets]
        ranked = [v for v in chunk if v in _RANK]
        out.append(m[max(ranked, key=_RANK.__getitem__)] if ranked else m[None])
    return "".join(out)


def legend(bands: Sequence[float], unicode: bool = True) -> List[str]:
    """Three lines explaining the table's numbers and its history marks."""
    m = marks(unicode)
    b = [f"{x:.0e}" for x in bands]
    return [
        "values: judged rel_diff (decides verdicts and alerts; 0 = agreement within the finite-difference noise)",
        f"bands: excellent < {b[0]} <= acceptable < {b[1]} <= suspicious < {b[2]} <= wrong",
        "history: one mark per check, oldest first: "
        + "  ".join(f"{m[v]} {v}" for v in VERDICT_NAMES) + f"  {m[None]} no verdict",
    ]


def verdict_tables(data: RunData, bands: Sequence[float], unicode: bool = True, heading_indent: str = "",
                   rows: Optional[List[Dict[str, Any]]] = None) -> List[str]:
    """A run's per-tensor tables as lines: backward, then training and the update (when judged), then the :func:`legend`.

    What ``gradwatch report`` and the demo's summary print. ``rows``: :func:`summarize` of the
    backward part when the caller has it already.

    Example:
        >>> data = RunData({"w": [{"step": 0, "judged_rel_diff": 1e-9, "rel_diff": 1e-9, "verdict": "excellent"}]}, [])
        >>> verdict_tables(data, (1e-7, 1e-4, 1e-2), unicode=False)[0]
        'backward (backprop against finite differences of the objective):'
    """
    out = [heading_indent + "backward (backprop against finite differences of the objective):"]
    out += ["  " + line for line in format_table(summarize(data) if rows is None else rows, unicode=unicode)]
    training = summarize(data, "training")
    if training:
        out.append(heading_indent + "training (the live .grad against the objective's gradient):")
        out += ["  " + line for line in format_table(training, unicode=unicode)]
    if data.update.history:
        out.append(heading_indent + data.update.heading())
        out += ["  " + line for line in format_table(summarize(data, "update"), unicode=unicode)]
    out += ["  " + line for line in legend(bands, unicode=unicode)]
    return out


def format_table(rows: Sequence[Mapping[str, Any]], unicode: bool = True, strip_width: int = 30) -> List[str]:
    """The per-tensor table as aligned lines (header first).

    Example:
        >>> rows = summarize(RunData({"w": [{"step": 0, "judged_rel_diff": 1e-9, "rel_diff": 1e-9,
        ...                                  "verdict": "excellent"}]}, []))
        >>> print("\\n".join(format_table(rows, unicode=False)))
        tensor  checks  first    last     worst    verdict     alerts  history
        w            1  1.0e-09  1.0e-09  1.0e-09  excellent        0  .
    """
    header = ("tensor", "checks", "first", "last", "worst", "verdict", "alerts", "history")
    body = [
        (str(r["tensor"]), str(r["checks"]), fmt(r["first"]), fmt(r["last"]), fmt(r["worst"]),
         verdict_text(r["verdict"]), str(r["alerts"]), strip(r["verdicts"], strip_width, unicode))
        for r in rows
    ]
    table = [header, *body]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    widths[5] = max(widths[5], len("acceptable"))
    right = {1, 6}
    lines = []
    for row in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def short_diagnosis(text: Optional[str]) -> Optional[str]:
    """The diagnosis without the sampled values and the advice, for one-line alerts.

    Example:
        >>> short_diagnosis("analytic is 1.50x numeric (constant ratio): a factor in backward is wrong")
        'analytic is 1.50x numeric (constant ratio)'
    """
    if not text:
        return None
    text = re.sub(r"\s*\(worst: [^)]*\)", "", text)
    cut = text.find("(constant ratio)")
    if cut >= 0:
        text = text[: cut + len("(constant ratio)")]
    return text.strip()


def alert_key(alert: Mapping[str, Any]) -> Tuple[str, str, int]:
    """``(tensor, kind, step)``: what identifies an alert across the demo, JSONL and TensorBoard."""
    return (str(alert.get("tensor")), str(alert.get("kind")), int(alert.get("step") or 0))


def format_alert(alert: Mapping[str, Any], *, bands: Sequence[float] = DEFAULT_BANDS,
                 detail: Optional[Mapping[str, Any]] = None, name_width: int = 0) -> str:
    """One line per alert: ``step  tensor  kind  judged rel_diff (verdict, or drift vs baseline); diagnosis``.

    Example:
        >>> format_alert({"step": 150, "tensor": "fc1.weight", "kind": "threshold", "severity": "error",
        ...               "value": 0.028, "baseline": 0.0},
        ...              detail={"diagnosis": "analytic is 1.50x numeric (constant ratio): a factor is wrong"})
        'step   150  fc1.weight  threshold  2.8e-02 WRONG; analytic is 1.50x numeric (constant ratio)'
    """
    kind = str(alert.get("kind"))
    value = as_number(alert.get("value"))
    baseline = as_number(alert.get("baseline"))
    if kind == "threshold" and value is not None and _finite(value):
        what = f"{fmt(value)} {verdict_text(Verdict.from_value(value, bands).value)}"
    elif kind == "drift" and _finite(value):
        what = f"{fmt(value)} (recent median) vs baseline {fmt(baseline)}"
    elif kind in ("threshold", "drift"):
        verdict = (detail or {}).get("verdict")
        what = f"verdict {verdict_text(verdict)}" if verdict else str(alert.get("severity"))
    else:
        what = _first_clause(str(alert.get("headline") or alert.get("message") or kind))
    diag = short_diagnosis((detail or {}).get("diagnosis")) or (  # one cause's alert: how many, and the first
        f"{alert.get('count')} tensors, one cause: {', '.join(map(str, alert['tensors'][:3]))}" if alert.get("tensors") else None)
    if diag and kind in ("threshold", "drift"):
        what += f"; {diag}"
    step = alert.get("step")
    step_text = "?" if step is None else str(int(step))
    label = kind if alert.get("part", "backward") == "backward" else f"{alert.get('part')}/{kind}"
    return f"step {step_text:>5}  {str(alert.get('tensor')).ljust(name_width)}  {label:<9}  {what}"


def _first_clause(message: str) -> str:
    message = re.sub(r"^step \d+: | \(step \d+\)$", "", message.split("\n")[0])
    return message.split(" — ")[0].split("; ")[0]


def wrap_message(alert: Any, indent: str = "    ", width: int = 100) -> List[str]:
    """An alert (a record, or its message) for a terminal: its headline, then why and what to do indented below it."""
    return wrapped(alert if isinstance(alert, Mapping) else {"message": str(alert)}, indent, width)


def coverage_line(coverage: Mapping[str, Mapping[str, float]], cycle_length: Optional[int], checks: int,
                  steps_to_full: Optional[int] = None) -> str:
    """What ``gradwatch report`` says of coverage: the share of rows each part probed, and what no check reached.

    Example:
        >>> coverage_line({"w": {"backward": 1.0, "training": 1.0}, "emb": {"backward": 0.25, "training": 0.0}}, 4, 2)
        'coverage after 2 checks (K = 4): backward 62% of rows (1 of 2 tensors whole), training 50%; never checked: training: emb'
    """
    parts = []
    never = []
    for part in ("backward", "training"):
        values = [float(v.get(part) or 0.0) for v in coverage.values()]
        mean = sum(values) / len(values) if values else 0.0
        whole = sum(1 for v in values if v >= 1.0)
        text = f"{part} {mean:.0%}" + (" of rows" if part == "backward" else "")
        if part == "backward":
            text += f" ({whole} of {len(values)} tensors whole)"
        parts.append(text)
        missing = [n for n, v in coverage.items() if not float(v.get(part) or 0.0)]
        if missing:
            never.append(f"{part}: {', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}")
    about = f", about {steps_to_full} step{'s' if steps_to_full != 1 else ''}" if steps_to_full else ""
    k = f" (K = {cycle_length}{about})" if cycle_length else ""
    tail = f"; never checked: {'; '.join(never)}" if never else ""
    return f"coverage after {checks} check{'s' if checks != 1 else ''}{k}: {', '.join(parts)}{tail}"


def to_json(data: RunData, rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """The ``gradwatch report --format json`` document (non-finite numbers as ``"nan"``/``"inf"``)."""
    return to_jsonable({
        "source": data.source,
        "path": data.path,
        "checks": len(data.check_steps),
        "first_step": data.check_steps[0] if data.check_steps else None,
        "last_step": data.check_steps[-1] if data.check_steps else None,
        "bands": list(data.bands),
        "forms": dict(data.forms),
        "cycle_length": data.cycle_length,
        "steps_to_full": data.steps_to_full,
        "coverage": dict(data.coverage),
        "unchecked": list(data.unchecked),
        "not_judged": not_judged.to_json(data.not_judged),
        "not_checked": [dict(entry) for entry in data.not_checked.values()],
        "tensors": [{**{k: v for k, v in r.items()}, "history": data.history.get(str(r["tensor"]), [])} for r in rows],
        "training": [{**r, "history": data.training.get(str(r["tensor"]), [])} for r in summarize(data, "training")],
        "update": data.update.to_json(summarize(data, "update")),
        "alerts": data.alerts,
        "warnings": data.warnings,
    })


def independence_line(independence: Mapping[str, Sequence[Any]]) -> str:
    """What ``gradwatch report`` says of the independence checks.

    Example:
        >>> independence_line({"causal": [3, 3, "blocks.1.attn"], "padding": [3, 0, None]})
        'independence: causal LEAK in 3 of 3 checks (blocks.1.attn); padding ok in 3 checks'
    """
    parts = []
    for name, (checks, leaks, module) in independence.items():
        if leaks:
            where = f" ({module})" if module else ""
            parts.append(f"{name} LEAK in {leaks} of {checks} check{'s' if checks != 1 else ''}{where}")
        else:
            parts.append(f"{name} ok in {checks} check{'s' if checks != 1 else ''}")
    return "independence: " + "; ".join(parts)
