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


class ObjectiveError(GradWatchError, ValueError):
    """gradwatch's own default objective (the loss a Hugging Face model returns under the Trainer, the Trainer's
    ``compute_loss``, a ``LightningModule``'s ``training_step``) could not give the watched batch's loss.

    Its message says what happened, what of the model or the batch caused it, and what to do, each on its own line;
    the exception it caught, if any, is its ``__cause__``. It is marked as raised in ``"the default objective"``
    (:func:`blamed`): the user wrote no ``loss_fn`` to fix.

    Args:
        what: What happened (a headline).
        why: What of the model or the batch caused it.
        todo: What the user can do.

    Example:
        >>> err = ObjectiveError("Bert returned no loss", "the batch has no labels", "pass loss_fn=")
        >>> str(err).splitlines()
        ['Bert returned no loss', 'why: the batch has no labels', 'what to do: pass loss_fn=']
        >>> blamed(err)
        'the default objective'
    """

    def __init__(self, what: str, why: str, todo: str) -> None:
        super().__init__(f"{what}\nwhy: {why}\nwhat to do: {todo}")
        self.what, self.why, self.todo = what, why, todo
        setattr(self, WHERE_ATTR, DEFAULT_OBJECTIVE)


#: Where an :class:`ObjectiveError` was raised (:func:`blamed`).
DEFAULT_OBJECTIVE = "the default objective"


#: Attribute set on an exception raised inside gradwatch's own default objective: its words (:func:`say`).
SAID_ATTR = "gradwatch_said"


def say(exc: BaseException, words: ObjectiveError) -> BaseException:
    """Give ``exc``, raised inside gradwatch's own default objective, the words a person reads instead of its own
    (:func:`said`); it goes on as it is (a control-flow exception of the check passes through untouched).

    Example:
        >>> err = say(RuntimeError("no Double kernel"), ObjectiveError("M's forward failed", "float64", "dtype=None"))
        >>> said(err).what, blamed(err)
        ("M's forward failed", 'the default objective')
    """
    try:
        setattr(exc, SAID_ATTR, words)
    except (AttributeError, TypeError):  # an exception type that takes no attributes: said in its own words
        return exc
    return blame(exc, DEFAULT_OBJECTIVE)


def said(exc: BaseException) -> Optional[ObjectiveError]:
    """The words of an error of gradwatch's own default objective (an :class:`ObjectiveError`, or what :func:`say`
    gave an exception); None for any other.

    Example:
        >>> said(ValueError("x")) is None, said(ObjectiveError("a", "b", "c")).todo
        (True, 'c')
    """
    if isinstance(exc, ObjectiveError):
        return exc
    words = getattr(exc, SAID_ATTR, None)
    return words if isinstance(words, ObjectiveError) else None


def first_line(exc: BaseException, most: int = 200) -> str:
    """The first line of ``exc``'s message (at most ``most`` characters), without its class: the words a caught
    exception adds to a message written for the user.

    Example:
        >>> first_line(KeyError("labels")), first_line(RuntimeError("a\\nb"))
        ("'labels'", 'a')
    """
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else "no message"
    return text if len(text) <= most else text[:most - 3] + "..."


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
    words = said(exc)
    if words is not None:  # said in the user's words: no class
        return words.what[:500]
    return f"{type(exc).__name__}: {exc}"[:500]


def blamed(exc: BaseException) -> Optional[str]:
    """What :func:`blame` marked ``exc`` with (None: not raised by the user's code).

    Example:
        >>> blamed(ValueError("x")) is None
        True
    """
    return getattr(exc, WHERE_ATTR, None)
