"""The base of the sinks (:class:`Sink`) and the error a log directory raises (:class:`LogDirError`).

Shared by :mod:`gradwatch.io.sinks` and its TensorBoard sink; both names are imported from there.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Union

from gradwatch.errors import GradWatchError

PathLike = Union[str, "os.PathLike[str]"]


class LogDirError(GradWatchError, OSError):
    """A log directory or file cannot be created or written.

    Example:
        >>> isinstance(LogDirError("cannot write /x"), OSError)
        True
    """


class Sink:
    """Base of the sinks: every method is a no-op; subclasses override what they handle.

    Example:
        >>> Sink().write_check({"type": "check", "step": 0}, alert_count=0)
    """

    def write_run(self, record: Mapping[str, Any]) -> None:
        """Write the ``"run"`` record (once, when the run starts)."""

    def write_check(self, record: Mapping[str, Any], alert_count: int) -> None:
        """Write one ``"check"`` record; ``alert_count`` alerts were raised at this check."""

    def write_alert(self, record: Mapping[str, Any]) -> None:
        """Write one ``"alert"`` record."""

    def write_update(self, record: Mapping[str, Any]) -> None:
        """Write one ``"update"`` record (the optimizer step after a check, :func:`~gradwatch.io.records.update_record`)."""

    def close(self) -> None:
        """Release files and writers."""

    def __repr__(self) -> str:
        return type(self).__name__ + "()"
