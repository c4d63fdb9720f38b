"""Where check records go: JSONL, TensorBoard and logging.

Every sink is written from the records of :mod:`gradwatch.io.records`, so the
JSONL file and the TensorBoard scalars hold the same numbers. A
:class:`SinkSet` fans records out and keeps training alive when one sink
fails (disk full, closed writer): it logs one warning and carries on. The TensorBoard sink is written in
:mod:`gradwatch.io._tensorboard` and the sinks' base in :mod:`gradwatch.io._sink_base`; both are imported here.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from gradwatch.io._sink_base import LogDirError, PathLike, Sink
from gradwatch.io._tensorboard import MAP_IMAGE_TAG, RUN_TEXT_TAG, TensorBoardSink, write_png, writer_dir
from gradwatch.io.records import alert_record, to_jsonable, update_record

JSONL_NAME = "checks.jsonl"

_log = logging.getLogger("gradwatch")


class JsonlSink(Sink):
    """Appends one JSON object per line, flushed and fsynced at once (a SIGKILL loses nothing written).

    Args:
        path: The ``.jsonl`` file, or a directory (then ``<path>/checks.jsonl``).
            Missing parent directories are created.

    Raises:
        LogDirError: The file cannot be opened for appending (message names the path).

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> sink = JsonlSink(os.path.join(d, "checks.jsonl"))
        >>> sink.write({"type": "run", "time": 0.0, "version": "0.1.0", "options": {}})
        >>> sink.close()
        >>> read_jsonl(d)[0][0]["type"]
        'run'
    """

    def __init__(self, path: PathLike) -> None:
        p = Path(path)
        if p.is_dir():
            p = p / JSONL_NAME
        self.path = p
        #: The file already held records (of another run, or of the run this one resumes).
        self.appending = p.is_file() and p.stat().st_size > 0
        self._file = self._open()
        self._lock = threading.Lock()
        self._run_line: Optional[str] = None

    def _open(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return open(self.path, "a", encoding="utf-8")
        except OSError as err:
            raise LogDirError(
                f"gradwatch cannot write its log file {str(self.path)!r}: {err.strerror or err} "
                f"(pass a writable log_dir, or log_dir=None to log to `logging` only)"
            ) from err

    def _moved(self) -> bool:
        """True when the open file is no longer at :attr:`path` (deleted, or its directory removed or renamed)."""
        try:
            here, ours = os.stat(self.path), os.fstat(self._file.fileno())
        except (OSError, ValueError):  # ValueError: the file was closed after a failed reopen
            return True
        return (here.st_dev, here.st_ino) != (ours.st_dev, ours.st_ino)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line, then flush and fsync.

        If the file was deleted since it was opened (a log directory removed mid-run), a WARNING
        says so and the file is created again, starting with the ``"run"`` record, so later
        records are kept; the records written before are lost with the deleted file.
        """
        line = json.dumps(to_jsonable(record), allow_nan=False, separators=(",", ":"))
        with self._lock:
            if self._moved():
                self._reopen()
            self._file.write(line + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def _reopen(self) -> None:
        _log.warning(
            "gradwatch: %s was deleted or moved during the run (its directory removed?); the records written to it "
            "so far are lost with it; creating it again and writing the next records there", self.path,
        )
        self._file.close()
        self._file = self._open()
        if self._run_line is not None:
            self._file.write(self._run_line + "\n")

    def write_run(self, record: Mapping[str, Any]) -> None:
        self._run_line = json.dumps(to_jsonable(record), allow_nan=False, separators=(",", ":"))
        self.write(record)

    def write_check(self, record: Mapping[str, Any], alert_count: int) -> None:
        self.write(record)

    def write_alert(self, record: Mapping[str, Any]) -> None:
        self.write(record)

    def write_update(self, record: Mapping[str, Any]) -> None:
        self.write(record)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"


class LoggingSink(Sink):
    """Sends alerts to :mod:`logging` (WARNING, or ERROR for severe ones) and one line per check.

    Args:
        logger_name: Logger to write to.
        check_level: Level of the one-line check summary.

    Example:
        >>> sink = LoggingSink()
        >>> sink.write_alert({"severity": "warning", "message": "fc.weight drifted"})
    """

    ERROR_SEVERITIES = frozenset({"error", "critical", "fatal", "wrong"})

    def __init__(self, logger_name: str = "gradwatch", check_level: int = logging.INFO) -> None:
        self.logger = logging.getLogger(logger_name)
        self.check_level = check_level

    def write_check(self, record: Mapping[str, Any], alert_count: int) -> None:
        if not self.logger.isEnabledFor(self.check_level):
            return
        self.logger.log(self.check_level, "%s", format_check_line(record, alert_count))

    def write_alert(self, record: Mapping[str, Any]) -> None:
        severity = str(record.get("severity", "")).lower()
        level = logging.ERROR if severity in self.ERROR_SEVERITIES else logging.WARNING
        self.logger.log(level, "%s", record.get("message"))

    def __repr__(self) -> str:
        return f"LoggingSink({self.logger.name!r})"


def format_check_line(record: Mapping[str, Any], alert_count: int = 0) -> str:
    """One line describing a check record.

    Example:
        >>> format_check_line({"step": 5, "ok": True, "tensors": {"w": {"judged_rel_diff": 1e-9}},
        ...                    "seconds": 0.25, "overhead_fraction": 0.02})
        'gradwatch step 5: ok, 1 tensors, worst w judged_rel_diff 1.00e-09, 0.250s (2.0% overhead), 0 alerts'
    """
    tensors = record.get("tensors") or {}
    judged = [
        (v.get("judged_rel_diff"), name)
        for name, v in tensors.items()
        if isinstance(v.get("judged_rel_diff"), (int, float))
    ]
    parts = [f"gradwatch step {record.get('step')}: {'ok' if record.get('ok') else 'FAILED'}", f"{len(tensors)} tensors"]
    if judged:
        value, name = max(judged)
        parts.append(f"worst {name} judged_rel_diff {value:.2e}")
    timing = f"{record.get('seconds', 0.0):.3f}s" if isinstance(record.get("seconds"), (int, float)) else "?s"
    frac = record.get("overhead_fraction")
    if isinstance(frac, (int, float)):
        timing += f" ({100 * frac:.1f}% overhead)"
    parts.append(timing)
    parts.append(f"{alert_count} alerts")
    return ", ".join(parts)


class SinkSet:
    """Fans records out to several sinks; a failing sink never stops training.

    The first failure of each sink is logged as one WARNING on logger ``"gradwatch"``
    naming the sink and the error; the sink is still tried on later records
    (a full disk may free up) and the other sinks keep working.

    Args:
        sinks: The sinks, in writing order.

    Example:
        >>> sinks = SinkSet([LoggingSink()])
        >>> sinks.write_run({"type": "run", "time": 0.0, "version": "0.1.0", "options": {}})
        >>> sinks.close()
    """

    def __init__(self, sinks: Sequence[Sink] = ()) -> None:
        self.sinks: List[Sink] = list(sinks)
        self.errors: Dict[int, int] = {}
        #: Written as ``"run_id"`` in every record when set (the hook sets it).
        self.run_id: Optional[str] = None

    def _stamp(self, record: Mapping[str, Any]) -> Mapping[str, Any]:
        return record if self.run_id is None or "run_id" in record else {**record, "run_id": self.run_id}

    def add(self, sink: Sink) -> None:
        """Add a sink after construction (an integration's own, e.g. a Lightning logger)."""
        self.sinks.append(sink)

    def write_run(self, record: Mapping[str, Any]) -> None:
        """Write the ``"run"`` record to every sink."""
        record = self._stamp(record)
        for sink in self.sinks:
            self._call(sink, "write_run", record)

    def write_check(self, record: Mapping[str, Any], alerts: Sequence[Any] = ()) -> List[Dict[str, Any]]:
        """Write one check record and the alerts raised at it; returns the alert records.

        Each sink gets the check (with the alert count) and then one alert record per alert.
        ``alerts`` are :class:`gradwatch.Alert` objects (or alert records).
        """
        alert_records = [dict(self._stamp(alert_record(a, wall_time=record.get("time")))) for a in alerts]
        record = self._stamp(record)
        for sink in self.sinks:
            self._call(sink, "write_check", record, len(alert_records))
            for a in alert_records:
                self._call(sink, "write_alert", a)
        return alert_records

    def write_update(self, last: Mapping[str, Any]) -> Dict[str, Any]:
        """Write the record of the optimizer step after a check (``UpdatePart.last``); returns it."""
        record = dict(self._stamp(update_record(last)))
        for sink in self.sinks:
            self._call(sink, "write_update", record)
        return record

    def write_alerts(self, alerts: Sequence[Any], wall_time: Optional[float] = None) -> List[Dict[str, Any]]:
        """Write alerts raised outside a completed check (e.g. ``loss_fn`` raised)."""
        alert_records = [dict(self._stamp(alert_record(a, wall_time=wall_time))) for a in alerts]
        for sink in self.sinks:
            for a in alert_records:
                self._call(sink, "write_alert", a)
        return alert_records

    def flush(self) -> None:
        """Flush every sink that buffers (errors are logged, never raised)."""
        for sink in self.sinks:
            if hasattr(sink, "flush"):
                self._call(sink, "flush")

    def close(self) -> None:
        """Close every sink (errors are logged, never raised)."""
        for sink in self.sinks:
            self._call(sink, "close")

    def _call(self, sink: Sink, method: str, *args: Any) -> bool:
        try:
            getattr(sink, method)(*args)
            return True
        except Exception as err:  # a sink must never kill training
            count = self.errors.get(id(sink), 0)
            self.errors[id(sink)] = count + 1
            if count == 0:
                _log.warning(
                    "gradwatch: %r failed in %s (%s: %s); continuing with the other sinks "
                    "(further errors of this sink are not logged)",
                    sink, method, type(err).__name__, err,
                )
            return False

    def __iter__(self):
        return iter(self.sinks)

    def __len__(self) -> int:
        return len(self.sinks)

    def __repr__(self) -> str:
        return f"SinkSet({self.sinks!r})"


def build_sinks(
    log_dir: Optional[PathLike],
    *,
    tensorboard: bool = True,
    jsonl: bool = True,
    writer: Any = None,
    logging_sink: bool = True,
) -> SinkSet:
    """The usual sinks for a run.

    - ``log_dir=None`` and no ``writer``: logging only.
    - ``log_dir``: ``<log_dir>/checks.jsonl`` and a TensorBoard writer in ``log_dir``.
    - ``writer`` (e.g. Lightning's ``logger.experiment``): TensorBoard goes through it;
      JSONL goes to ``log_dir``, or to ``writer.log_dir`` when ``log_dir`` is None.

    Args:
        log_dir: Run directory (created if missing).
        tensorboard: Write TensorBoard events.
        jsonl: Write ``checks.jsonl``.
        writer: Existing ``SummaryWriter`` to write through (never closed by gradwatch).
        logging_sink: Also send alerts and check lines to logger ``"gradwatch"``.

    Raises:
        LogDirError: ``log_dir`` cannot be written (raised here, not at the first check).

    Example:
        >>> build_sinks(None)
        SinkSet([LoggingSink('gradwatch')])
    """
    sinks: List[Sink] = []
    jsonl_dir = log_dir if log_dir is not None else (writer_dir(writer) if writer is not None else None)
    try:
        if jsonl and jsonl_dir is not None:
            sinks.append(JsonlSink(Path(jsonl_dir) / JSONL_NAME))
        if tensorboard and (writer is not None or log_dir is not None):
            sinks.append(TensorBoardSink(log_dir=None if writer is not None else log_dir, writer=writer))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    if logging_sink:
        sinks.append(LoggingSink())
    return SinkSet(sinks)


def read_jsonl(path: PathLike) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Read a ``checks.jsonl``, skipping a truncated last line and garbage lines with a warning each.

    Args:
        path: The file, or a run directory holding ``checks.jsonl``.

    Returns:
        ``(records, warnings)``; each warning names the file and line number.

    Raises:
        FileNotFoundError: No such file.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> with open(os.path.join(d, "checks.jsonl"), "w") as f:
        ...     _ = f.write('{"type": "run"}\\n{"type": "che')
        >>> records, warnings = read_jsonl(d)
        >>> len(records), warnings[0].split(": ", 1)[1][:24]
        (1, 'line 2: truncated last l')
    """
    p = Path(path)
    if p.is_dir():
        p = p / JSONL_NAME
    with open(p, encoding="utf-8", errors="replace") as f:
        text = f.read()
    complete = text.endswith("\n")
    lines = text.split("\n")
    if complete:
        lines.pop()  # the empty string after the final newline
    records: List[Dict[str, Any]] = []
    warnings: List[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last = number == len(lines) and not complete
        try:
            value = json.loads(line)
        except ValueError as err:
            if last:
                warnings.append(f"{p}: line {number}: truncated last line (the run was probably killed while writing); skipped")
            else:
                warnings.append(f"{p}: line {number}: not valid JSON ({err}); skipped")
            continue
        if not isinstance(value, dict):
            warnings.append(f"{p}: line {number}: expected a JSON object, got {type(value).__name__}; skipped")
            continue
        records.append(value)
    return records, warnings


__all__ = [
    "JSONL_NAME", "MAP_IMAGE_TAG", "RUN_TEXT_TAG", "JsonlSink", "LogDirError", "LoggingSink", "PathLike", "Sink", "SinkSet",
    "TensorBoardSink", "build_sinks", "format_check_line", "read_jsonl", "write_png",
]
