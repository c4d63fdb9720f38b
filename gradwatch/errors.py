"""Exceptions raised by gradwatch.

Every error carries the user's input that caused it, so a message can be
acted on without reading gradwatch's source.
"""

from __future__ import annotations

from typing import Optional

#: Attribute set on an exception raised by the user's code during a check: which function raised it.
WHERE_ATTR = "gradwatch_where"


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


def blame(exc: BaseException, where: str) -> BaseException:
    """Mark ``exc`` as raised in the user's ``where`` (``"loss_fn"``, ``"regularizer 'l2'"``); the first mark wins.

    Example:
        >>> blamed(blame(KeyError("x"), "grad_fn"))
        'grad_fn'
    """
    if getattr(exc, WHERE_ATTR, None) is None:
        try:
            setattr(exc, WHERE_ATTR, where)
        except (AttributeError, TypeError):  # an exception type that takes no attributes: left unmarked
            pass
    return exc


def error_key(exc: BaseException) -> str:
    """What tells one error from another: its type and message (at most 500 characters).

    Example:
        >>> error_key(KeyError("w"))
        "KeyError: 'w'"
    """
    return f"{type(exc).__name__}: {exc}"[:500]


def blamed(exc: BaseException) -> Optional[str]:
    """What :func:`blame` marked ``exc`` with (None: not raised by the user's code).

    Example:
        >>> blamed(ValueError("x")) is None
        True
    """
    return getattr(exc, WHERE_ATTR, None)
