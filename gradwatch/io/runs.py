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
``format_*`` helpers print rows and alerts the same way for every command. The optimizer's step verified after
each check (the ``update`` records) is read by :mod:`gradwatch.io.update_summary`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, cast

from gradwatch.bands import DEFAULT_BANDS, Verdict
from gradwatch.check.judging.report import not_checked_in
from gradwatch.errors import GradWatchError
from gradwatch.io import not_judged
from gradwatch.io.headlines import with_lines, wrapped
from gradwatch.io.not_judged import Unchecked
from gradwatch.io.records import ALERTS_TEXT_TAG, alert_from_text, to_jsonable
from gradwatch.io.sinks import JSONL_NAME, RUN_TEXT_TAG, read_jsonl
from gradwatch.io.update_summary import UpdateSummary

#: ``{tensor: [{"step", "judged_rel_diff", "rel_diff", "verdict"}, ...]}`` (the TrendTracker's history shape).
History = Dict[str, List[Dict[str, Any]]]

VERDICT_NAMES = tuple(v.value for v in Verdict)
_RANK = {v.value: v.rank for v in Verdict}
_MARKS_UNICODE = {"excellent": "\u2581", "acceptable": "\u2583", "suspicious": "\u2585", "wrong": "\u2588", None: "?"}
_MARKS_ASCII = {"excellent": ".", "acceptable": ":", "suspicious": "+", "wrong": "#", None: "?"}
_EVENT_PREFIX = "events.out.tfevents"


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


# --------------------------------------------------------------------- reading

def _num(value: Any) -> Optional[float]:
    """A record's number (``"nan"``/``"inf"`` strings included) as a float; None stays None."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


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
            if isinstance(opt_bands, (list, tuple)) and len(opt_bands) == 3 and all(_num(b) for b in opt_bands):
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


def _add_training(rec: Mapping[str, Any], training: History, details: Dict[Tuple[int, str], Dict[str, Any]]) -> None:
    """File the training part of a ``check`` record (absent in logs written before it existed)."""
    step = int(rec["step"])
    for name, t in (rec.get("training") or {}).items():
        training.setdefault(str(name), []).append(
            {"step": step, "judged_rel_diff": _num(t.get("judged_rel_diff")), "rel_diff": _num(t.get("rel_diff")),
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
            (str(name), {"step": step, "judged_rel_diff": _num(t.get("judged_rel_diff")),
                         "rel_diff": _num(t.get("rel_diff")), "verdict": t.get("verdict")},
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


def detail_key(step: Any, tensor: Any, part: Optional[str] = "backward") -> Tuple[int, str]:
    """Key of :attr:`RunData.details` for a tensor's result at a step, in either part.

    Example:
        >>> detail_key(10, "w"), detail_key(10, "w", "training")
        ((10, 'w'), (10, 'training:w'))
    """
    name = str(tensor)
    return (int(step or 0), name if (part or "backward") == "backward" else f"{part}:{name}")


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
    value = _num(alert.get("value"))
    baseline = _num(alert.get("baseline"))
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
