"""The TensorBoard sink: scalars, alert texts, the custom-scalars layout and the verdict maps through one
``SummaryWriter`` per run directory (shared by the sinks of one process). Imported from :mod:`gradwatch.io.sinks`.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Mapping, Optional, Tuple

from gradwatch.bands import DEFAULT_BANDS
from gradwatch.io import not_judged
from gradwatch.io._sink_base import LogDirError, PathLike, Sink
from gradwatch.io.records import (
    ALERTS_COUNT_TAG,
    ALERTS_TEXT_TAG,
    alert_text,
    band_scalars,
    custom_scalars_layout,
    scalars_from_check,
    scalars_from_update,
)
from gradwatch.io.verdict_map import PARTS, MapHistory, map_png

#: TensorBoard text tag holding ``run_id <id>`` (written when a run starts or resumes).
RUN_TEXT_TAG = "gradwatch/run"
#: TensorBoard image tag of each part's verdict map (:mod:`gradwatch.io.verdict_map`): ``gradwatch/verdict_map/backward``.
MAP_IMAGE_TAG = "gradwatch/verdict_map"

# One owned SummaryWriter per run directory in this process: log_dir realpath -> [writer, users].
_WRITERS: Dict[str, list] = {}
_WRITERS_LOCK = threading.Lock()


def _acquire_writer(log_dir: PathLike) -> Tuple[Any, str]:
    from torch.utils.tensorboard import SummaryWriter

    key = os.path.realpath(os.fspath(log_dir))
    with _WRITERS_LOCK:
        entry = _WRITERS.get(key)
        if entry is None:
            try:
                os.makedirs(key, exist_ok=True)
                entry = _WRITERS[key] = [SummaryWriter(log_dir=key), 0]
            except OSError as err:
                raise LogDirError(
                    f"gradwatch cannot write TensorBoard events to {os.fspath(log_dir)!r}: {err.strerror or err}"
                ) from err
        entry[1] += 1
        return entry[0], key


def _release_writer(key: str) -> None:
    with _WRITERS_LOCK:
        entry = _WRITERS.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _WRITERS[key]
            entry[0].close()


class TensorBoardSink(Sink):
    """Writes check scalars, alert texts, one custom-scalars layout and the verdict maps through one SummaryWriter.

    At each check, one image per part that judged anything so far (``gradwatch/verdict_map/<part>``): the run's
    tensors by its checks, drawn from the history this sink keeps, after the check's alerts have come (the
    alert count says how many) so that they are marked.

    Args:
        log_dir: Run directory; a ``SummaryWriter`` is created there and owned (closed by
            :meth:`close`). Sinks in one process with the same ``log_dir`` share one writer,
            so a directory never gets two event files from gradwatch.
        writer: An existing ``SummaryWriter`` (e.g. Lightning ``TensorBoardLogger.experiment``)
            to write through; it is flushed but never closed.

    Example:
        >>> import tempfile
        >>> sink = TensorBoardSink(tempfile.mkdtemp())
        >>> sink.write_check({"type": "check", "step": 0, "time": 0.0, "seconds": 0.1,
        ...                   "tensors": {}, "summary": {}}, alert_count=0)
        >>> sink.close()
    """

    def __init__(self, log_dir: Optional[PathLike] = None, writer: Any = None) -> None:
        if writer is None and log_dir is None:
            raise ValueError("TensorBoardSink needs a log_dir or a writer")
        self._key: Optional[str] = None
        if writer is not None:
            self.writer = writer
            self.owns_writer = False
        else:
            self.writer, self._key = _acquire_writer(log_dir)  # type: ignore[arg-type]
            self.owns_writer = True
        self._layout_written = False
        self._closed = False
        self._maps = MapHistory()
        self._bands: Tuple[float, ...] = DEFAULT_BANDS
        self._pending: Optional[List[Any]] = None  # [step, walltime, alerts still to come] of the check not drawn

    def write_run(self, record: Mapping[str, Any]) -> None:
        bands = (record.get("options") or {}).get("bands")
        if isinstance(bands, (list, tuple)) and len(bands) == 3:
            self._bands = tuple(float(b) for b in bands)
        if record.get("run_id"):  # lets `gradwatch report` tell runs apart in event files too
            step = record.get("resumed_at_step")
            self.writer.add_text(RUN_TEXT_TAG, f"run_id {record['run_id']}", global_step=int(step or 0),
                                 walltime=record.get("time"))

    @property
    def log_dir(self) -> Optional[str]:
        """Directory the writer writes to (None if the writer does not say)."""
        return writer_dir(self.writer)

    def write_check(self, record: Mapping[str, Any], alert_count: int) -> None:
        step = int(record["step"])
        walltime = record.get("time")
        if not self._layout_written:
            self.writer.add_custom_scalars(custom_scalars_layout(record.get("tensors") or {}))
            self._layout_written = True
        for tag, value in scalars_from_check(record) + band_scalars(self._bands):
            self.writer.add_scalar(tag, value, global_step=step, walltime=walltime)
        self.writer.add_scalar(ALERTS_COUNT_TAG, float(alert_count), global_step=step, walltime=walltime)
        items = not_judged.of_check(record)
        if items:  # what the check did not judge, and why (its metrics were left out above)
            self.writer.add_text(not_judged.TEXT_TAG, not_judged.to_text(items), global_step=step, walltime=walltime)
        self._draw_maps()  # a check whose alerts never came is drawn as it was
        self._maps.add_check(record)
        self._pending = [step, walltime, int(alert_count)]
        if alert_count <= 0:
            self._draw_maps()
        self.writer.flush()

    def write_update(self, record: Mapping[str, Any]) -> None:
        step, walltime = int(record["step"]), record.get("time")
        for tag, value in scalars_from_update(record):
            self.writer.add_scalar(tag, value, global_step=step, walltime=walltime)
        self.writer.flush()

    def _draw_maps(self) -> None:
        """Write the pending check's verdict maps, one image per part that has tensors."""
        if self._pending is None:
            return
        step, walltime, _ = self._pending
        self._pending = None
        for part in PARTS:
            grid = self._maps.grid(part)
            if grid.names:
                png, height, width = map_png(grid, self._bands)
                write_png(self.writer, f"{MAP_IMAGE_TAG}/{part}", png, height, width, step, walltime)

    def write_alert(self, record: Mapping[str, Any]) -> None:
        step = record.get("step")
        self.writer.add_text(
            ALERTS_TEXT_TAG, alert_text(record), global_step=None if step is None else int(step), walltime=record.get("time")
        )
        self._maps.add_alert(record)
        if self._pending is not None:
            self._pending[2] -= 1
            if self._pending[2] <= 0:
                self._draw_maps()
        self.writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._draw_maps()
        if self.owns_writer and self._key is not None:
            _release_writer(self._key)
        else:
            self.writer.flush()

    def __repr__(self) -> str:
        return f"TensorBoardSink({self.log_dir!r})"


def write_png(writer: Any, tag: str, png: bytes, height: int, width: int, step: int, walltime: Optional[float]) -> None:
    """Write an encoded PNG as a TensorBoard image summary (no imaging library needed); a writer without torch's
    ``_get_file_writer`` gets the pixels through its ``add_image`` instead.

    Example:
        >>> import tempfile
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> from gradwatch.io.verdict_map import grid_from_history, map_png
        >>> png, h, w = map_png(grid_from_history({"w": [{"step": 0, "verdict": "excellent"}]}, [0], []))
        >>> writer = SummaryWriter(tempfile.mkdtemp())
        >>> write_png(writer, "gradwatch/verdict_map/backward", png, h, w, 0, None)
        >>> writer.close()
    """
    if not hasattr(writer, "_get_file_writer"):
        import io

        import numpy as np
        from PIL import Image  # what tensorboardX and torch's add_image need anyway

        writer.add_image(tag, np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), global_step=step,
                         walltime=walltime, dataformats="HWC")
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step, walltime)


def writer_dir(writer: Any) -> Optional[str]:
    """The directory a ``SummaryWriter`` (torch's or tensorboardX's) writes to; None if it does not say."""
    log_dir = getattr(writer, "log_dir", None)
    if log_dir is None and hasattr(writer, "get_logdir"):
        log_dir = writer.get_logdir()
    return None if log_dir is None else os.fspath(log_dir)
