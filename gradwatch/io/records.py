"""JSON-able records of a run: the single source of truth for JSONL and TensorBoard.

Every sink writes from these dicts, so a value in ``checks.jsonl`` and the
TensorBoard scalar at the same step are the same number. Pure functions: no
I/O here (the current time is the only thing read from outside).

Non-finite floats are stored as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` so ``json.dumps`` never writes invalid JSON.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np

from gradwatch.check.judging.report import CheckReport, json_float
from gradwatch.io.headlines import with_lines
from gradwatch.io.not_judged import unjudged

#: Per-tensor fields copied into a check record, in this order.
TENSOR_FIELDS = (
    "rel_diff",
    "directional_rel_diff",
    "max_rel_error",
    "judged_rel_diff",
    "verdict",
    "kinks",
    "noise_floor",
    "diagnosis",
    "inconclusive",
    "inconclusive_kind",
    "ratio",
    "shape",
    "form",
)

#: Per-tensor metrics written to TensorBoard as ``gradwatch/<metric>/<param>``.
TENSOR_METRICS = ("rel_diff", "directional_rel_diff", "max_rel_error", "judged_rel_diff")
#: Per-tensor fields of the training part (``record["training"][name]``), in this order.
TRAINING_FIELDS = ("rel_diff", "max_rel_error", "judged_rel_diff", "verdict", "tolerance", "dtype", "ratio",
                   "param_coef", "diagnosis", "inconclusive", "live_grad")
#: Training metrics written to TensorBoard as ``gradwatch/training/<metric>/<param>``.
TRAINING_METRICS = ("rel_diff", "judged_rel_diff")

#: ``log10`` of a judged rel_diff of 0 ("agrees as well as finite differences can tell"), and the least one charted.
LOG10_FLOOR = -16.0
#: Per-tensor ``log10(judged_rel_diff)``: ``gradwatch/log10_judged_rel_diff/<param>`` (backward) and
#: ``gradwatch/training/log10_judged_rel_diff/<param>``; every band reads on one linear axis.
LOG10_METRIC = "log10_judged_rel_diff"
#: The bands' edges as log10, one scalar each at every check, drawn beside the log10 charts.
BAND_TAGS = ("gradwatch/bands/log10_excellent", "gradwatch/bands/log10_acceptable", "gradwatch/bands/log10_suspicious")

ALERT_FIELDS = ("step", "tensor", "kind", "severity", "value", "baseline", "message", "part")

ALERTS_COUNT_TAG = "gradwatch/alerts/count"
ALERTS_TEXT_TAG = "gradwatch/alerts"


def check_record(
    step: int,
    report: CheckReport,
    *,
    seconds: float,
    overhead_fraction: Optional[float],
    coverage: Optional[Mapping[str, Any]] = None,
    check_counts: Optional[Mapping[str, int]] = None,
    cycle_length: Optional[int] = None,
    wall_time: Optional[float] = None,
) -> Dict[str, Any]:
    """Build the ``"check"`` record of one gradient check.

    Args:
        step: Training step (TensorBoard ``global_step``) the check ran at.
        report: The check's :class:`~gradwatch.CheckReport`.
        seconds: Wall time the check cost the training loop.
        overhead_fraction: share of wall time spent in the monitor since the run's first step, this check included (None if unknown).
        coverage: Parameter name -> ``{"backward": fraction, "training": fraction}`` of its rows probed so far
            in the run (:attr:`GradWatch.coverage`).
        check_counts: Parameter name -> checks of the backward part it has been in.
        cycle_length: K, the checks within which every unit and parameter row is probed once.
        wall_time: Unix time of the record; now when None.

    Returns:
        ``{"type": "check", "step", "time", "seconds", "overhead_fraction", "evaluations",
        "objective", "terms", "dtype", "seed", "ok", "nondeterministic", "nonfinite", "kinks",
        "notes", "tensors": {name: {...TENSOR_FIELDS}} (the backward part), "training": {name:
        {...TRAINING_FIELDS}} (the training part), "training_note", "training_items" (the step's objective of a
        cut step: what is counted and each rank's micro-batch counts), "training_window" (a partial accumulation
        window: its micro-batches, the window each was divided by, the scale), "causes" (each cause that explained several
        failing tensors: its alert's, or an update of it, :mod:`gradwatch.watch.causes`), "summary": {"rel_diff_median",
        "rel_diff_p95", "rel_diff_max", "training_rel_diff_max"}, "coverage": {...}, "check_counts": {...},
        "cycle_length", "steps_to_full", "pieces"}`` (``pieces``: the module form's units and row slices checked).

    Example:
        >>> from gradwatch import CheckReport, TensorCheck
        >>> report = CheckReport(tensors={"w": TensorCheck("w", (3,), rel_diff=1e-9, max_rel_error=2e-9)})
        >>> rec = check_record(10, report, seconds=0.5, overhead_fraction=0.01, wall_time=0.0)
        >>> rec["tensors"]["w"]["rel_diff"], rec["summary"]["rel_diff_max"]
        (1e-09, 1e-09)
    """
    summary = rel_diff_summary(report)
    return {
        "type": "check",
        "step": int(step),
        "time": time.time() if wall_time is None else float(wall_time),
        "seconds": json_float(seconds),
        "overhead_fraction": json_float(overhead_fraction),
        "evaluations": int(report.evaluations),
        "objective": json_float(report.objective),
        "terms": {k: json_float(v) for k, v in report.terms.items()},
        "dtype": report.dtype,
        "form": report.form,
        "memory": to_jsonable(dict(report.memory)),
        "seed": report.seed,
        "ok": report.ok,
        "nondeterministic": report.nondeterministic,
        "nonfinite": report.nonfinite,
        "kinks": report.kinks,
        "notes": list(report.notes),
        "tensors": _tensor_entries(report),
        "training": _training_entries(report),
        "training_note": report.training_note,
        "training_items": to_jsonable(report.training_items),
        "training_window": to_jsonable(report.training_window),
        "causes": to_jsonable(report.causes),
        "summary": summary,
        "coverage": {str(k): to_jsonable(v) for k, v in (coverage or {}).items()},
        "check_counts": {str(k): int(v) for k, v in (check_counts or {}).items()},
        "cycle_length": cycle_length,
        "steps_to_full": report.steps_to_full,
        "pieces": list(report.pieces),
        "independence": None if report.independence is None else report.independence.to_dict(),
    }


def _tensor_entries(report: CheckReport) -> Dict[str, Dict[str, Any]]:
    """The backward part of a check record: :data:`TENSOR_FIELDS` of each tensor."""
    tensors: Dict[str, Dict[str, Any]] = {}
    for name, t in report.tensors.items():
        tensors[name] = {
            "rel_diff": json_float(t.rel_diff),
            "directional_rel_diff": json_float(t.directional_rel_diff),
            "max_rel_error": json_float(t.max_rel_error),
            "judged_rel_diff": json_float(t.judged_rel_diff) if t.verdict is not None else None,  # not judged: no 0
            "verdict": t.verdict.value if t.verdict is not None else None,
            "kinks": int(t.kinks),
            "noise_floor": json_float(t.noise_floor),
            "diagnosis": t.diagnosis,
            "inconclusive": t.inconclusive,
            "inconclusive_kind": t.inconclusive_kind.value if t.inconclusive_kind is not None else None,
            "ratio": json_float(t.ratio),
            "shape": [int(s) for s in t.shape],
            "form": report.form,
        }
    return tensors


def _training_entries(report: CheckReport) -> Dict[str, Dict[str, Any]]:
    """The training part of a check record: :data:`TRAINING_FIELDS` of each tensor."""
    training: Dict[str, Dict[str, Any]] = {}
    for name, tc in report.training.items():
        d = tc.to_dict()
        training[name] = {key: d[key] for key in TRAINING_FIELDS}
        if tc.verdict is None:
            training[name]["judged_rel_diff"] = None  # not judged: no value that reads as agreement
    return training


def rel_diff_summary(report: CheckReport) -> Dict[str, Optional[float]]:
    """The ``"summary"`` of a check record: median, p95 and max of the finite backward rel_diffs, and the
    training part's finite max (None where there is none).

    Example:
        >>> from gradwatch import CheckReport, TensorCheck
        >>> rel_diff_summary(CheckReport(tensors={"w": TensorCheck("w", (3,), rel_diff=1e-9, max_rel_error=2e-9)}))
        {'rel_diff_median': 1e-09, 'rel_diff_p95': 1e-09, 'rel_diff_max': 1e-09, 'training_rel_diff_max': None}
    """
    finite = [float(t.rel_diff) for t in report.tensors.values() if t.rel_diff is not None and math.isfinite(t.rel_diff)]
    if finite:
        values = np.asarray(finite, dtype=np.float64)
        summary: Dict[str, Optional[float]] = {
            "rel_diff_median": float(np.median(values)),
            "rel_diff_p95": float(np.percentile(values, 95)),
            "rel_diff_max": float(values.max()),
        }
    else:
        summary = {"rel_diff_median": None, "rel_diff_p95": None, "rel_diff_max": None}
    finite_training = [float(tc.rel_diff) for tc in report.training.values() if math.isfinite(tc.rel_diff)]
    summary["training_rel_diff_max"] = max(finite_training) if finite_training else None
    return summary


def alert_record(alert: Any, *, wall_time: Optional[float] = None) -> Dict[str, Any]:
    """Build the ``"alert"`` record of one alert.

    Args:
        alert: Any object with the attributes ``step, tensor, kind, severity, value,
            baseline, message`` (a :class:`gradwatch.Alert`), or a dict with those keys.
        wall_time: Unix time of the record; now when None.

    Returns:
        ``{"type": "alert", "time", "step", "tensor", "kind", "severity", "value",
        "baseline", "message", "part", "headline", "why", "todo"}`` (extra fields of ``alert.to_dict()`` are kept;
        ``headline``, ``why`` and ``todo`` derived from the others where the alert has none: :mod:`gradwatch.io.headlines`).

    Example:
        >>> from types import SimpleNamespace
        >>> a = SimpleNamespace(step=3, tensor="w", kind="band", severity="error",
        ...                     value=0.5, baseline=None, message="w: WRONG")
        >>> alert_record(a, wall_time=0.0)["kind"]
        'band'
    """
    if isinstance(alert, Mapping):
        fields = dict(alert)
    elif hasattr(alert, "to_dict"):
        fields = dict(alert.to_dict())
    elif dataclasses.is_dataclass(alert) and not isinstance(alert, type):
        fields = dataclasses.asdict(alert)
    else:
        fields = {}
    for key in ALERT_FIELDS:
        if key not in fields:
            fields[key] = getattr(alert, key, None)
    fields.pop("type", None)
    fields.pop("time", None)
    fields = with_lines(fields)
    record: Dict[str, Any] = {"type": "alert", "time": time.time() if wall_time is None else float(wall_time)}
    record.update(to_jsonable(fields))
    if record.get("step") is not None:
        record["step"] = int(record["step"])
    return record


_ALERT_TEXT = re.compile(r"^\*\*(?P<severity>[^*]*)\*\* `(?P<kind>[^`]*)` on `(?P<tensor>[^`]*)`: (?P<message>.*)$", re.S)
_NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
_VALUE_RES = {
    "threshold": re.compile(r"judged rel_diff " + _NUMBER + r" \("),
    "drift": re.compile(r"drifted to " + _NUMBER + r" \("),
}
_BASELINE_RE = re.compile(r"baseline " + _NUMBER)


def alert_text(record: Mapping[str, Any]) -> str:
    """An alert as TensorBoard's text plugin shows it (tag :data:`ALERTS_TEXT_TAG`); :func:`alert_from_text` reads it back.

    Example:
        >>> alert_text({"severity": "error", "kind": "threshold", "tensor": "w", "message": "w is wrong"})
        '**ERROR** `threshold` on `w`: w is wrong'
    """
    return (f"**{str(record.get('severity', '')).upper()}** `{record.get('kind')}` on "
            f"`{record.get('tensor')}`: {record.get('message')}")


def alert_from_text(step: int, text: str) -> Dict[str, Any]:
    """An alert record from its :func:`alert_text` (a threshold's value and a drift's baseline read from the message).

    Example:
        >>> text = alert_text({"severity": "error", "kind": "threshold", "tensor": "w",
        ...                    "message": "w: judged rel_diff 0.2 (wrong)"})
        >>> rec = alert_from_text(4, text)
        >>> rec["step"], rec["kind"], rec["severity"], rec["value"]
        (4, 'threshold', 'error', 0.2)
    """
    m = _ALERT_TEXT.match(text.strip())
    if m is None:
        return {"step": step, "tensor": "?", "kind": "?", "severity": "?", "value": None, "baseline": None, "message": text}
    message, kind = m["message"], m["kind"]
    value = baseline = None
    if kind in _VALUE_RES:
        found = _VALUE_RES[kind].search(message)
        value = float(found.group(1)) if found else None
        found = _BASELINE_RE.search(message)
        baseline = float(found.group(1)) if found else None
    return {"step": step, "tensor": m["tensor"], "kind": kind, "severity": m["severity"].lower(),
            "value": value, "baseline": baseline, "message": message}


def run_record(options: Mapping[str, Any], version: str, *, wall_time: Optional[float] = None) -> Dict[str, Any]:
    """Build the ``"run"`` record written once when a run starts.

    Args:
        options: The run's options (values are made JSON-able: dtypes and enums become strings).
        version: ``gradwatch.__version__``.
        wall_time: Unix time of the record; now when None.

    Example:
        >>> import torch
        >>> run_record({"every": 100, "dtype": torch.float64}, "0.1.0", wall_time=0.0)["options"]
        {'every': 100, 'dtype': 'float64'}
    """
    return {
        "type": "run",
        "time": time.time() if wall_time is None else float(wall_time),
        "version": str(version),
        "options": to_jsonable(dict(options)),
    }


def scalars_from_check(record: Mapping[str, Any]) -> List[Tuple[str, float]]:
    """TensorBoard scalars of one check record, as ``(tag, value)`` pairs.

    Tags: ``gradwatch/{rel_diff,directional_rel_diff,max_rel_error,judged_rel_diff}/<param>`` (the backward
    part), ``gradwatch/training/{rel_diff,judged_rel_diff}/<param>`` (the training part),
    ``gradwatch/summary/rel_diff_{median,p95,max}``, ``gradwatch/summary/training_rel_diff_max``,
    ``gradwatch/{,training/}log10_judged_rel_diff/<param>`` (:func:`log10_judged`),
    ``gradwatch/overhead/{seconds,fraction}``, ``gradwatch/coverage/{backward,training}`` (the mean share of
    the watched tensors' rows each part has probed in the run), ``gradwatch/coverage/cycle_length`` (K) and
    ``gradwatch/coverage/steps_to_full`` (K checks in training steps).
    None and non-finite values are skipped, and so is every metric of a tensor the check did not judge (its
    verdict is None: a 0 there would chart as agreement; :mod:`gradwatch.io.not_judged` says why, as text).
    ``gradwatch/alerts/count`` is not here: it depends on the alerts, which the sink is given separately.

    Example:
        >>> rec = {"tensors": {"w": {"rel_diff": 1e-9, "directional_rel_diff": None,
        ...        "max_rel_error": "nan", "judged_rel_diff": 1e-9}},
        ...        "summary": {"rel_diff_max": 1e-9}, "seconds": 0.5}
        >>> scalars_from_check(rec)
        [('gradwatch/rel_diff/w', 1e-09), ('gradwatch/judged_rel_diff/w', 1e-09), \
('gradwatch/log10_judged_rel_diff/w', -9.0), ('gradwatch/summary/rel_diff_max', 1e-09), ('gradwatch/overhead/seconds', 0.5)]
    """
    out: List[Tuple[str, float]] = []

    def add(tag: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((tag, float(value)))

    for prefix, key, metrics in (("gradwatch", "tensors", TENSOR_METRICS), ("gradwatch/training", "training", TRAINING_METRICS)):
        for name, t in (record.get(key) or {}).items():
            if not unjudged(t):
                for metric in metrics:
                    add(f"{prefix}/{metric}/{name}", t.get(metric))
                add(f"{prefix}/{LOG10_METRIC}/{name}", log10_judged(t.get("judged_rel_diff")))
    summary = record.get("summary") or {}
    for key in ("rel_diff_median", "rel_diff_p95", "rel_diff_max", "training_rel_diff_max"):
        add(f"gradwatch/summary/{key}", summary.get(key))
    add("gradwatch/overhead/seconds", record.get("seconds"))
    add("gradwatch/overhead/fraction", record.get("overhead_fraction"))
    for part, value in coverage_means(record.get("coverage")).items():
        add(f"gradwatch/coverage/{part}", value)
    add("gradwatch/coverage/cycle_length", record.get("cycle_length"))
    add("gradwatch/coverage/steps_to_full", record.get("steps_to_full"))
    return out


def update_record(last: Mapping[str, Any], *, wall_time: Optional[float] = None) -> Dict[str, Any]:
    """The JSONL record of the optimizer step after a check (:attr:`gradwatch.watch.update_part.UpdatePart.last`).

    ``{"type": "update", "time", "step", "algorithm", "clipping": {"factor", "threshold", "problem", "kind",
    "groups"}, "tensors": {name: {"verdict", "rel_diff", "judged_rel_diff", "ratio", "moved"}}}``: the clipping of
    the step, and each sampled tensor's update against its optimizer's algorithm replayed in float64 (none where the
    optimizer's algorithm is not one gradwatch replays).

    Example:
        >>> rec = update_record({"step": 3, "algorithm": "SGD", "clipping": {"factor": 1.0},
        ...                      "update": {"w": {"verdict": "excellent", "rel_diff": 1e-9, "judged_rel_diff": 0.0,
        ...                                       "ratio": None, "moved": True}}}, wall_time=0.0)
        >>> rec["type"], rec["tensors"]["w"]["verdict"]
        ('update', 'excellent')
    """
    tensors = {str(n): {k: json_float(v) if isinstance(v, float) else v for k, v in u.items()}
               for n, u in (last.get("update") or {}).items()}
    clipping = {k: json_float(v) if isinstance(v, float) else v for k, v in (last.get("clipping") or {}).items()}
    return {"type": "update", "time": time.time() if wall_time is None else float(wall_time), "step": int(last["step"]),
            "algorithm": last.get("algorithm"), "clipping": clipping, "tensors": tensors}


def scalars_from_update(record: Mapping[str, Any]) -> List[Tuple[str, float]]:
    """TensorBoard scalars of an update record: ``gradwatch/update/log10_judged_rel_diff/<param>`` (each tensor's
    update against the replayed algorithm's, :func:`log10_judged`) and ``gradwatch/update/clipping_factor``.

    Example:
        >>> scalars_from_update({"clipping": {"factor": 0.5}, "tensors": {"w": {"judged_rel_diff": 0.0}}})
        [('gradwatch/update/log10_judged_rel_diff/w', -16.0), ('gradwatch/update/clipping_factor', 0.5)]
    """
    out = [(f"gradwatch/update/log10_judged_rel_diff/{n}", v) for n, u in (record.get("tensors") or {}).items()
           if (v := log10_judged(u.get("judged_rel_diff"))) is not None]
    factor = (record.get("clipping") or {}).get("factor")
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor):
        out.append(("gradwatch/update/clipping_factor", float(factor)))
    return out


def log10_judged(value: Any) -> Optional[float]:
    """``log10`` of a judged rel_diff, :data:`LOG10_FLOOR` for 0 (and below it); None when it is not a number.

    Example:
        >>> log10_judged(1e-9), log10_judged(0.0), log10_judged(None), log10_judged("nan")
        (-9.0, -16.0, None, None)
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        return None
    return LOG10_FLOOR if value == 0 else max(round(math.log10(value), 12), LOG10_FLOOR)


def band_scalars(bands: Iterable[float]) -> List[Tuple[str, float]]:
    """The bands' edges as log10 scalars (:data:`BAND_TAGS`), the reference lines of the log10 charts.

    Example:
        >>> band_scalars((1e-7, 1e-4, 1e-2))[0]
        ('gradwatch/bands/log10_excellent', -7.0)
    """
    return [(tag, round(math.log10(float(b)), 12)) for tag, b in zip(BAND_TAGS, bands)]


def coverage_means(coverage: Any) -> Dict[str, float]:
    """The mean share of rows each part has probed, over the tensors of a record's ``coverage``
    (empty for records that counted checks per tensor instead).

    Example:
        >>> coverage_means({"w": {"backward": 0.5, "training": 1.0}, "b": {"backward": 1.0, "training": 1.0}})
        {'backward': 0.75, 'training': 1.0}
    """
    if not isinstance(coverage, Mapping) or not coverage:
        return {}
    values = [v for v in coverage.values() if isinstance(v, Mapping)]
    if not values:
        return {}
    return {part: sum(float(v.get(part) or 0.0) for v in values) / len(values) for part in ("backward", "training")}


def custom_scalars_layout(param_names: Iterable[str] = ()) -> Dict[str, Dict[str, list]]:
    """Layout for ``SummaryWriter.add_custom_scalars``: one ``"gradwatch"`` category.

    Charts are ``Multiline`` over tag regexes (``gradwatch/rel_diff/.*``, ...), so a
    tensor first checked late in the run (rotating subsets) still shows up;
    ``param_names`` is accepted for callers that know them but is not needed. The first two charts are
    ``log10(judged rel_diff)`` of each part with the bands' edges beside them: every band on one linear axis
    (a judged 0 at :data:`LOG10_FLOOR`).

    Example:
        >>> layout = custom_scalars_layout(["w"])
        >>> layout["gradwatch"]["rel_diff per tensor"]
        ['Multiline', ['gradwatch/rel_diff/.*']]
        >>> list(layout["gradwatch"])[0]
        'log10 judged rel_diff per tensor and the band edges (backward; 0 at -16)'
    """
    del param_names  # regexes cover every tensor, including ones not seen yet
    return {
        "gradwatch": {
            f"log10 judged rel_diff per tensor and the band edges (backward; 0 at {LOG10_FLOOR:g})":
                ["Multiline", [f"gradwatch/{LOG10_METRIC}/.*", "gradwatch/bands/.*"]],
            f"log10 judged rel_diff per tensor and the band edges (training; 0 at {LOG10_FLOOR:g})":
                ["Multiline", [f"gradwatch/training/{LOG10_METRIC}/.*", "gradwatch/bands/.*"]],
            "rel_diff per tensor": ["Multiline", ["gradwatch/rel_diff/.*"]],
            "directional rel_diff per tensor": ["Multiline", ["gradwatch/directional_rel_diff/.*"]],
            "max_rel_error per tensor": ["Multiline", ["gradwatch/max_rel_error/.*"]],
            "judged rel_diff per tensor": ["Multiline", ["gradwatch/judged_rel_diff/.*"]],
            "training rel_diff per tensor (live .grad vs objective)": ["Multiline", ["gradwatch/training/rel_diff/.*"]],
            "training judged rel_diff per tensor": ["Multiline", ["gradwatch/training/judged_rel_diff/.*"]],
            "rel_diff summary": ["Multiline", ["gradwatch/summary/.*"]],
            "overhead": ["Multiline", ["gradwatch/overhead/.*"]],
            "alerts": ["Multiline", [ALERTS_COUNT_TAG]],
        }
    }


def to_jsonable(value: Any) -> Any:
    """Make ``value`` safe for ``json.dumps(..., allow_nan=False)``.

    Non-finite floats become ``"nan"``/``"inf"``/``"-inf"``; numpy scalars become
    Python numbers; enums their value; tuples lists; anything else unknown ``str()``.

    Example:
        >>> to_jsonable({"a": float("inf"), "b": (1, 2)})
        {'a': 'inf', 'b': [1, 2]}
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return json_float(float(value))
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    text = str(value)
    return text[len("torch."):] if text.startswith("torch.") else text
