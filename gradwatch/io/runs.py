"""Per-tensor trend tables and alert lines from a run: shared by ``gradwatch demo`` and ``gradwatch report``.

A run is read into a :class:`RunData` from one of three places:

- ``checks.jsonl`` records (:func:`from_records`, what :func:`gradwatch.io.sinks.read_jsonl` returns);
- TensorBoard event files (:func:`from_event_files`: the ``gradwatch/judged_rel_diff/<param>``
  and ``gradwatch/rel_diff/<param>`` scalars, alerts from the text plugin);
- a live :class:`~gradwatch.GradWatch` (:func:`from_watch`).

:func:`find_runs` and :func:`read_runs` turn one or more LOGDIRs into runs:
records are grouped by their ``run_id``, so one run resumed across folders
(Lightning's ``version_0``, ``version_1``) reads as one history, and runs
appended to one folder stay apart (each event file is one writer, so the
event-file view splits them the same way).

:func:`summarize` turns it into one row per tensor (first / last / worst
judged rel_diff, last verdict, alert count, a verdict strip), and the
``format_*`` helpers print rows and alerts the same way for every command (they are written in
:mod:`gradwatch.io._run_report`, :class:`RunData` in :mod:`gradwatch.io._run_data`, and imported here). The optimizer's
step verified after each check (the ``update`` records) is read by :mod:`gradwatch.io.update_summary`.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, cast

from gradwatch.bands import DEFAULT_BANDS, Verdict
from gradwatch.check.judging.report import not_checked_in
from gradwatch.io import not_judged
from gradwatch.io._run_data import History, RunData, RunNotFound, as_number, detail_key
from gradwatch.io._run_report import (
    VERDICT_NAMES,
    alert_key,
    coverage_line,
    fmt,
    format_alert,
    format_table,
    independence_line,
    legend,
    marks,
    short_diagnosis,
    strip,
    summarize,
    to_json,
    verdict_tables,
    verdict_text,
    wrap_message,
)
from gradwatch.io.headlines import with_lines
from gradwatch.io.records import ALERTS_TEXT_TAG, alert_from_text
from gradwatch.io.sinks import JSONL_NAME, RUN_TEXT_TAG, read_jsonl
from gradwatch.io.update_summary import UpdateSummary

_EVENT_PREFIX = "events.out.tfevents"


# --------------------------------------------------------------------- reading

def from_records(records: Iterable[Mapping[str, Any]], *, path: Optional[str] = None,
                 warnings: Sequence[str] = ()) -> RunData:
    """Build a :class:`RunData` from ``checks.jsonl`` records (``run``, ``check``, ``alert``, ``update``).

    Example:
        >>> recs = [{"type": "check", "step": 0, "tensors": {"w": {"judged_rel_diff": 1e-9,
        ...          "rel_diff": 1e-9, "verdict": "excellent"}}},
        ...         {"type": "alert", "step": 0, "tensor": "w", "kind": "drift", "severity": "warning",
        ...          "value": 1e-3, "baseline": 1e-9, "message": "w drifted"}]
        >>> data = from_records(recs)
        >>> data.history["w"][0]["verdict"], len(data.alerts)
        ('excellent', 1)
    """
    history: History = {}
    alerts: List[Dict[str, Any]] = []
    details: Dict[Tuple[int, str], Dict[str, Any]] = {}
    bands = DEFAULT_BANDS
    steps: List[int] = []
    notes = list(warnings)
    training: History = {}
    run_id = None
    forms: Dict[str, int] = {}
    coverage: Dict[str, Dict[str, float]] = {}
    cycle: Optional[int] = None
    full: Optional[int] = None
    unchecked: Dict[str, str] = {}
    independence: Dict[str, List[Any]] = {}
    unjudged: not_judged.Tally = {}
    never: not_judged.Unchecked = {}
    planned: Dict[str, int] = {}  # unit -> checks whose pieces held it (the module form)
    update = UpdateSummary()
    for number, rec in enumerate(records, start=1):
        run_id = run_id or rec.get("run_id")
        try:
            _add_record(rec, history, alerts, details, steps)
            update.add(rec)
            if rec.get("type") == "check":
                _add_training(rec, training, details)
                form = str(rec.get("form") or "objective")
                forms[form] = forms.get(form, 0) + 1
                got = rec.get("coverage") or {}
                if got and all(isinstance(v, Mapping) for v in got.values()):
                    coverage = {str(k): {part: float(v.get(part) or 0.0) for part in ("backward", "training")}
                                for k, v in got.items()}
                cycle = int(rec["cycle_length"]) if rec.get("cycle_length") is not None else cycle
                full = int(rec["steps_to_full"]) if rec.get("steps_to_full") is not None else full
                _add_independence(rec.get("independence"), independence)
                not_judged.add(unjudged, not_judged.of_check(rec))
                not_judged.add_unchecked(never, not_judged.unchecked_of(rec), int(rec["step"]))
                for unit in not_judged.planned_units(rec):
                    planned[unit] = planned.get(unit, 0) + 1
                for note in rec.get("notes") or ():
                    if "not checked" in str(note) and not not_checked_in([str(note)]):
                        unchecked[re.sub(r"[\d.]+ ?MB|\d+", "#", str(note))] = str(note)
        except (TypeError, ValueError, AttributeError, KeyError) as err:
            notes.append(f"{path or 'the log'}: record {number} ({str(rec.get('type'))!r}) is malformed "
                         f"({type(err).__name__}: {err}); skipped")
            continue
        if rec.get("type") == "run":
            opt_bands = (rec.get("options") or {}).get("bands")
            if isinstance(opt_bands, (list, tuple)) and len(opt_bands) == 3 and all(as_number(b) for b in opt_bands):
                bands = tuple(float(b) for b in opt_bands)  # type: ignore[assignment]
    not_judged.plan_counts(never, planned, alerts)
    return RunData(history, alerts, details, "jsonl", path, notes, bands, steps, training, run_id, forms, coverage, cycle,
                   list(unchecked.values()), independence, unjudged, never, steps_to_full=full, update=update)


def _add_independence(found: Any, independence: Dict[str, List[Any]]) -> None:
    """Count a check record's independence results per structure (checks, leaks, the latest leak's module)."""
    for name, r in ((found or {}).get("structures") or {}).items():
        entry = independence.setdefault(str(name), [0, 0, None])
        entry[0] += 1
        if not r.get("ok", True):
            entry[1] += 1
            entry[2] = (r.get("violation") or {}).get("module")


def _add_training(rec: Mapping[str, Any], training: History, details: Dict[Tuple[int, str], Dict[str, Any]]) -> None:
    """File the training part of a ``check`` record (absent in logs written before it existed)."""
    step = int(rec["step"])
    for name, t in (rec.get("training") or {}).items():
        training.setdefault(str(name), []).append(
            {"step": step, "judged_rel_diff": as_number(t.get("judged_rel_diff")), "rel_diff": as_number(t.get("rel_diff")),
             "verdict": t.get("verdict")})
        details[detail_key(step, name, "training")] = {"verdict": t.get("verdict"), "diagnosis": t.get("diagnosis")}


def _add_record(rec: Mapping[str, Any], history: History, alerts: List[Dict[str, Any]],
                details: Dict[Tuple[int, str], Dict[str, Any]], steps: List[int]) -> int:
    """File one JSONL record; returns 1 for a ``run`` record, else 0."""
    kind = rec.get("type")
    if kind == "run":
        return 1
    if kind == "check":
        step = int(rec["step"])
        entries = [
            (str(name), {"step": step, "judged_rel_diff": as_number(t.get("judged_rel_diff")),
                         "rel_diff": as_number(t.get("rel_diff")), "verdict": t.get("verdict")},
             {"verdict": t.get("verdict"), "diagnosis": t.get("diagnosis")})
            for name, t in (rec.get("tensors") or {}).items()
        ]
        steps.append(step)
        for name, entry, detail in entries:
            history.setdefault(name, []).append(entry)
            details[(step, name)] = detail
    elif kind == "alert":
        alert = with_lines(rec)  # a record written before alerts had a headline, why and todo: derived
        alert["step"] = None if alert.get("step") is None else int(alert["step"])
        alerts.append(alert)
    return 0


def from_watch(watch: Any, details: Optional[Dict[Tuple[int, str], Dict[str, Any]]] = None) -> RunData:
    """Build a :class:`RunData` from a live :class:`~gradwatch.GradWatch` (its tracker history and alerts)."""
    alerts = [a.to_dict() for a in watch.alerts]
    history = watch.history
    steps = sorted({r["step"] for records in history.values() for r in records})
    return RunData(history, alerts, dict(details or {}), "memory", None, [], tuple(watch.config.bands), steps,
                   watch.tracker.training_history, not_checked=not_judged.unchecked_from_alerts(alerts))


def event_files(directory: Path) -> List[Path]:
    """TensorBoard event files directly in ``directory``, in the order they were written.

    Their names end ``<seconds>.<host>.<pid>.<writer count>``: two writers of one process within a second differ by
    the count alone, which sorts as a number (``.9`` before ``.10``), not as text.
    """
    try:
        return sorted((p for p in directory.iterdir() if p.is_file() and p.name.startswith(_EVENT_PREFIX)), key=_natural)
    except OSError:
        return []


def from_event_files(path: os.PathLike, bands: Tuple[float, float, float] = DEFAULT_BANDS) -> RunData:
    """Build a :class:`RunData` from TensorBoard event files (a run directory or one event file).

    Scalars ``gradwatch/judged_rel_diff/<param>`` and ``gradwatch/rel_diff/<param>``
    give the history (values as stored: float32); verdicts are re-derived
    from the judged value with ``bands``. Alerts come from the text plugin
    (tag ``gradwatch/alerts``); their ``value`` is unknown (None).
    """
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(os.fspath(path), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    scalar_tags = set(tags.get(ea.SCALARS, []))
    judged_prefix, rel_prefix = "gradwatch/judged_rel_diff/", "gradwatch/rel_diff/"
    names = [t[len(judged_prefix):] for t in sorted(scalar_tags) if t.startswith(judged_prefix)]
    history: History = {}
    all_steps = set()
    for name in names:
        rel = {e.step: e.value for e in acc.Scalars(rel_prefix + name)} if rel_prefix + name in scalar_tags else {}
        entries = []
        for e in acc.Scalars(judged_prefix + name):
            value = float(e.value)
            verdict = Verdict.from_value(value, bands).value if math.isfinite(value) else None
            entries.append({"step": int(e.step), "judged_rel_diff": value,
                            "rel_diff": float(rel[e.step]) if e.step in rel else None, "verdict": verdict})
            all_steps.add(int(e.step))
        history[name] = entries
    alerts: List[Dict[str, Any]] = []
    run_id = None
    unjudged: not_judged.Tally = {}
    for tag in tags.get(ea.TENSORS, []):
        if tag == not_judged.TEXT_TAG or tag.startswith(not_judged.TEXT_TAG + "/"):
            for e in acc.Tensors(tag):  # tensors the check did not judge: no verdict at that step, and why
                items = [it for raw in e.tensor_proto.string_val for it in not_judged.from_text(raw.decode("utf-8", "replace"))]
                not_judged.add(unjudged, items)
                for _, name, _ in (it for it in items if it[0] == "backward"):
                    history.setdefault(name, []).append({"step": int(e.step), "judged_rel_diff": None, "rel_diff": None,
                                                         "verdict": None})
                all_steps.add(int(e.step))
            continue
        if tag == RUN_TEXT_TAG or tag.startswith(RUN_TEXT_TAG + "/"):
            texts = [raw.decode("utf-8", "replace") for e in acc.Tensors(tag) for raw in e.tensor_proto.string_val]
            ids = [t.split(" ", 1)[1].strip() for t in texts if t.startswith("run_id ")]
            run_id = ids[-1] if ids else run_id  # a resumed run writes its restored id last
            continue
        if tag != ALERTS_TEXT_TAG and not tag.startswith(ALERTS_TEXT_TAG + "/"):
            continue
        for e in acc.Tensors(tag):
            for raw in e.tensor_proto.string_val:
                alerts.append(with_lines(alert_from_text(int(e.step), raw.decode("utf-8", "replace"))))
    alerts.sort(key=lambda a: a["step"])
    for entries in history.values():
        entries.sort(key=lambda e: int(cast(float, e["step"])))
    return RunData(history, alerts, {}, "events", os.fspath(path), [], bands, sorted(all_steps), run_id=run_id,
                   not_judged=unjudged, not_checked=not_judged.unchecked_from_alerts(alerts))


def _natural(path: Path) -> List[Any]:
    """Sort key: ``version_2`` before ``version_10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def find_runs(logdirs: Sequence[os.PathLike], source: str = "auto") -> List[Tuple[str, Path]]:
    """Where the runs' data is: ``("jsonl", file)`` or ``("events", directory or file)`` per place, in order.

    Each LOGDIR is a ``checks.jsonl`` or event file, a run directory, or a parent
    directory whose subdirectories hold runs (Lightning's ``version_N``, in
    numeric order); a directory with data of its own is not searched further.

    Raises:
        RunNotFound: A LOGDIR does not exist or holds no gradwatch data here or below.
    """
    found: List[Tuple[str, Path]] = []
    what = {"auto": f"{JSONL_NAME} or TensorBoard event files", "jsonl": JSONL_NAME, "events": "TensorBoard event files"}[source]
    for logdir in logdirs:
        p = Path(logdir)
        if not p.exists():
            raise RunNotFound(f"{p}: no such file or directory")
        if p.is_file():
            if p.name.startswith(_EVENT_PREFIX) and source in ("auto", "events"):
                found.append(("events", p))
            elif source in ("auto", "jsonl") and not p.name.startswith(_EVENT_PREFIX):
                found.append(("jsonl", p))
            else:
                raise RunNotFound(f"{p}: not a {source} source")
            continue
        own = _run_in(p, source)
        if own is not None:
            found.append(own)
            continue
        below = [r for r in (_run_in(d, source) for d in sorted((q for q in p.rglob("*") if q.is_dir()), key=_natural))
                 if r is not None]
        if not below:
            raise RunNotFound(f"{p}: no {what} here or below (is this the --log-dir of a gradwatch run?)")
        found.extend(below)
    return found


_KNOWN_TYPES = ("run", "check", "alert", "update")


def split_runs(records: Sequence[Mapping[str, Any]], path: str) -> List[Tuple[str, List[Mapping[str, Any]]]]:
    """Group a log's records by ``run_id`` (records of older logs, without one: by ``run`` record), in order.

    Example:
        >>> recs = [{"type": "run", "run_id": "a"}, {"type": "check", "run_id": "a", "step": 0},
        ...         {"type": "run", "run_id": "b"}, {"type": "check", "run_id": "b", "step": 0}]
        >>> [(key, len(group)) for key, group in split_runs(recs, "x")]
        [('a', 2), ('b', 2)]
    """
    groups: Dict[str, List[Mapping[str, Any]]] = {}
    legacy, current = 0, None
    for rec in records:
        if rec.get("type") not in _KNOWN_TYPES:
            continue
        key = rec.get("run_id")
        if key is None:
            if rec.get("type") == "run" or current is None:
                legacy += 1
                current = f"{path}#{legacy}"
            key = current
        groups.setdefault(str(key), []).append(rec)
    return list(groups.items())


def merge_runs(parts: Sequence[RunData]) -> RunData:
    """One run read from several places (a run resumed in a new folder): histories joined in step order.

    Example:
        >>> a = RunData({"w": [{"step": 0, "judged_rel_diff": 0.0, "rel_diff": 0.0, "verdict": "excellent"}]}, [],
        ...             check_steps=[0], path="v0")
        >>> b = RunData({"w": [{"step": 4, "judged_rel_diff": 0.0, "rel_diff": 0.0, "verdict": "excellent"}]}, [],
        ...             check_steps=[4], path="v1")
        >>> m = merge_runs([a, b])
        >>> m.check_steps, len(m.history["w"]), m.path
        ([0, 4], 2, 'v0, v1')
    """
    if len(parts) == 1:
        return parts[0]
    history: History = {}
    training: History = {}
    alerts: List[Dict[str, Any]] = []
    details: Dict[Tuple[int, str], Dict[str, Any]] = {}
    steps: List[int] = []
    warnings: List[str] = []
    forms: Dict[str, int] = {}
    unjudged: not_judged.Tally = {}
    never: not_judged.Unchecked = {}
    for part in parts:
        for form, n in part.forms.items():
            forms[form] = forms.get(form, 0) + n
        not_judged.merge(unjudged, part.not_judged)
        not_judged.merge_unchecked(never, part.not_checked)
        for name, entries in part.history.items():
            history.setdefault(name, []).extend(entries)
        for name, entries in part.training.items():
            training.setdefault(name, []).extend(entries)
        alerts.extend(part.alerts)
        details.update(part.details)
        steps.extend(part.check_steps)
        warnings.extend(part.warnings)
    for entries in [*history.values(), *training.values()]:
        entries.sort(key=lambda e: e["step"])
    alerts.sort(key=lambda a: -1 if a.get("step") is None else a["step"])
    sources = {p.source for p in parts}
    paths = list(dict.fromkeys(str(p.path) for p in parts))
    return RunData(history, alerts, details, sources.pop() if len(sources) == 1 else "mixed", ", ".join(paths),
                   warnings, parts[0].bands, sorted(steps), training, parts[0].run_id, forms,
                   parts[-1].coverage, parts[-1].cycle_length, list(dict.fromkeys(n for p in parts for n in p.unchecked)),
                   not_judged=unjudged, not_checked=never, steps_to_full=parts[-1].steps_to_full,
                   update=UpdateSummary.merged([p.update for p in parts]))


def read_runs(found: Sequence[Tuple[str, Path]]) -> Tuple[List[RunData], List[str]]:
    """Read the places :func:`find_runs` returned into runs, one :class:`RunData` per ``run_id``.

    A run resumed across folders is joined into one; runs appended to one folder stay apart;
    each event file is read on its own (one writer, one run). A run that recorded nothing
    (it was resumed at once under its old id) is left out when another run has data.

    Returns:
        ``(runs, warnings)``; no runs when nothing readable was found.

    Raises:
        OSError: A ``checks.jsonl`` cannot be read. Corrupt event files raise what TensorBoard raises.
    """
    parts: List[Tuple[str, RunData]] = []
    warnings: List[str] = []
    for kind, path in found:
        if kind == "jsonl":
            records, warns = read_jsonl(path)
            warnings.extend(warns)
            groups = split_runs(records, str(path))
            if len(groups) > 1:
                warnings.append(f"{path} holds {len(groups)} runs (appended to one log); each is reported on its own")
            for key, recs in groups:
                parts.append((key, from_records(recs, path=str(path))))
        else:
            files = event_files(path) if path.is_dir() else [path]
            for file in files:
                data = from_event_files(file)
                if data.history or data.alerts or data.run_id:
                    parts.append((data.run_id or str(file), data))
    for _, data in parts:
        warnings.extend(data.warnings)
        data.warnings = []
    grouped: Dict[str, List[RunData]] = {}
    for key, data in parts:
        grouped.setdefault(key, []).append(data)
    runs = [merge_runs(group) for group in grouped.values()]
    with_data = [r for r in runs if r.check_steps or r.alerts]
    return (with_data or runs[:1]), warnings


def _run_in(d: Path, source: str) -> Optional[Tuple[str, Path]]:
    jsonl = d / JSONL_NAME
    if source in ("auto", "jsonl") and jsonl.is_file():
        return "jsonl", jsonl
    if source in ("auto", "events") and event_files(d):
        return "events", d
    return None


__all__ = [
    "VERDICT_NAMES", "History", "RunData", "RunNotFound", "alert_key", "as_number", "coverage_line", "detail_key",
    "event_files", "find_runs", "fmt", "format_alert", "format_table", "from_event_files", "from_records", "from_watch",
    "independence_line", "legend", "marks", "merge_runs", "read_runs", "short_diagnosis", "split_runs", "strip",
    "summarize", "to_json", "verdict_tables", "verdict_text", "wrap_message",
]
