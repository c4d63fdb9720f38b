"""Exceptions raised by gradwatch.

Every error carries the user's input that caused it, so a message can be
acted on without reading gradwatch's source.
"""

from __future__ import annotations


class GradWatchError(Exception):
    """Base class of every error gradwatch raises on purpose.

    Example:
        >>> try:
        ...     raise GradWatchError("something")
        ... except GradWatchError as err:
        ...     print(err)
        something
    """


class GradientCheckError(GradWatchError, AssertionError):
    """A gradient check found analytic and numerical gradients that disagree.

    Raised by :func:`gradwatch.check_backward` and
    :meth:`gradwatch.CheckReport.raise_for_failures`. It subclasses
    ``AssertionError`` so pytest shows it as a test failure. ``report`` holds
    the :class:`~gradwatch.CheckReport` when one exists.

    Example:
        >>> err = GradientCheckError("weight: analytic is 2.00x numeric")
        >>> isinstance(err, AssertionError)
        True
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class ConfigError(GradWatchError, ValueError):
    """An option or YAML configuration is invalid.

    The message names the file (when there is one), the key, the value given
    and what would be accepted.

    Example:
        >>> str(ConfigError("configs/x.yaml: every: got -1, expected an integer >= 1 or 'auto'"))
        "configs/x.yaml: every: got -1, expected an integer >= 1 or 'auto'"
    """


class GradientDriftError(GradWatchError):
    """Raised by :meth:`gradwatch.GradWatch.step` when ``raise_on`` asks for it.

    ``alerts`` holds the :class:`~gradwatch.Alert` objects that triggered it.

    Example:
        >>> GradientDriftError("fc1.weight: WRONG", alerts=[]).alerts
        []
    """

    def __init__(self, message: str, alerts: list | None = None) -> None:
        super().__init__(message)
        self.alerts = list(alerts or [])
