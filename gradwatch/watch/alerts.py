"""What a watch does with its alerts: keep them, call ``on_alert``, raise on ``raise_on``, count failed checks.

The trends decide *which* alerts a check raises (:class:`~gradwatch.watch.trend.TrendTracker`, with its
cooldown, and the independence part's own); :class:`AlertPolicy` decides what follows: every alert is
kept (``watch.alerts``) and handed to ``on_alert`` (a callback that raises is logged, training goes
on), then a :class:`~gradwatch.errors.GradientDriftError` is raised when ``raise_on`` matches. A check
that raised is logged once per kind of failure and counted; :data:`MAX_CONSECUTIVE_FAILURES` in a row
pause the checks.

Example:
    >>> import math
    >>> policy = AlertPolicy(raise_on="wrong")
    >>> alert = Alert(step=3, tensor="w", kind="drift", severity="warning", value=1e-3, baseline=1e-9, message="m")
    >>> policy.should_raise(alert)
    False
    >>> policy.should_raise(Alert(3, "fc", "not_checked", "warning", math.nan, None, "m"))
    False
    >>> policy.deliver(3, [alert]); len(policy.alerts)
    1
    >>> alert_from_dict(alert.to_dict()) == alert
    True
"""

from __future__ import annotations

import logging
import math
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from gradwatch.bands import DEFAULT_BANDS, Verdict
from gradwatch.errors import GradientDriftError, blamed, error_key, said
from gradwatch.watch.trend import Alert

logger = logging.getLogger("gradwatch")

#: Consecutive failed checks after which the watch pauses its checks (see :meth:`GradWatch.pause`).
MAX_CONSECUTIVE_FAILURES = 3


def alert_from_dict(d: Mapping[str, Any]) -> Alert:
    """Inverse of :meth:`Alert.to_dict` (``"nan"``/``"inf"`` strings back to floats).

    Example:
        >>> alert_from_dict({"step": 1, "tensor": "*", "kind": "paused", "severity": "warning", "value": "nan",
        ...                  "baseline": None, "message": "m"}).value
        nan
    """
    fields = {k: v for k, v in d.items() if k in Alert.__dataclass_fields__}
    fields["value"] = float(fields["value"]) if fields.get("value") is not None else math.nan
    if fields.get("baseline") is not None:
        fields["baseline"] = float(fields["baseline"])
    return Alert(**fields)


class AlertPolicy:
    """Keeps a watch's alerts, calls ``on_alert``, raises on ``raise_on``, and counts failed checks.

    Args:
        raise_on: The ``raise_on`` option (a verdict name, or None: never raise).
        bands: The verdict bands (a ``threshold`` alert raises when its value's verdict fails ``raise_on``).
        on_alert: Optional callback ``on_alert(alert)``.

    Example:
        See the module's example.
    """

    def __init__(self, raise_on: Optional[str] = None, bands: Any = DEFAULT_BANDS,
                 on_alert: Optional[Callable[[Alert], Any]] = None) -> None:
        self.raise_on = raise_on
        self.bands = bands
        self.on_alert = on_alert
        #: Every alert of the run, in order.
        self.alerts: List[Alert] = []
        #: Consecutive failed checks.
        self.failures = 0
        #: ``"Type: message"`` -> how many checks failed with it.
        self.failure_counts: Dict[str, int] = {}

    def deliver(self, step: int, alerts: Sequence[Alert]) -> None:
        """Keep ``alerts``, hand each to ``on_alert``, then raise if ``raise_on`` matches any.

        Raises:
            GradientDriftError: ``raise_on`` matched (after every alert was kept and handed on).
        """
        self.alerts.extend(alerts)
        for alert in alerts:
            if self.on_alert is not None:
                try:
                    self.on_alert(alert)
                except Exception:  # noqa: BLE001 - a user callback must not kill training
                    logger.error("gradwatch: on_alert callback raised for %s alert on %s; training goes on:\n%s",
                                 alert.kind, alert.tensor, traceback.format_exc())
        raising = [a for a in alerts if self.should_raise(a)]
        if raising:
            raise GradientDriftError(
                f"gradwatch: raise_on={self.raise_on!r} matched at step {step}:\n"
                + "\n".join("  - " + a.message.replace("\n", "\n    ") for a in raising),  # why, what to do below
                alerts=raising,
            )

    def should_raise(self, alert: Alert) -> bool:
        """Whether ``alert`` raises under ``raise_on`` (a confirmed independence leak raises at any level; a drift and
        a partial accumulation window, warnings, at ``"suspicious"``; a ``not_checked`` alert never: nothing was
        judged, see :meth:`~gradwatch.watch.trend.TrendTracker.not_checked`; a ``term_weight`` alert as the threshold
        alerts of the tensors it explains would, by its value)."""
        level = self.raise_on
        if level is None or alert.kind == "not_checked":
            return False
        if alert.kind == "independence":  # a confirmed leak is wrong at any level
            return True
        if alert.kind in ("threshold", "term_weight"):  # a term weighted wrong: as its tensors' verdicts would
            return Verdict.from_value(alert.value, self.bands).is_failure(Verdict.parse(level))
        return alert.kind in ("drift", "partial_window") and Verdict.parse(level) == Verdict.SUSPICIOUS

    def failed(self, step: int, exc: BaseException) -> str:
        """A check raised: count it, log its cause once per kind of failure; returns the kind (``"Type: message"``)."""
        self.failures += 1
        key = error_key(exc)
        seen = self.failure_counts.get(key, 0)
        self.failure_counts[key] = seen + 1
        if seen == 0:  # the cause and the fix; the alert says it in one line
            fix = ("make loss_fn(model, batch) compute the training loss of the batch without side effects (no backward, "
                   "no optimizer step)" if blamed(exc) else "none on your side if loss_fn runs alone: this may be a "
                   "gradwatch bug; please report it with the traceback below")
            words = said(exc)
            if words is not None:  # gradwatch's own default objective: the fix is in its words
                fix = words.todo
            logger.error(
                "gradwatch: the check at step %d raised %s (in %s); the check is skipped and training goes on. "
                "Fix: %s. Later failures like this one are counted, not printed.\n%s",
                step, key, blamed(exc) or "gradwatch", fix,
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
        else:
            logger.debug("gradwatch: the check at step %d failed again (%d times): %s", step, seen + 1, key)
        return key

    @staticmethod
    def paused_alert(step: int, reason: str) -> Alert:
        """The one ``paused`` alert (a warning) of :meth:`GradWatch.pause`."""
        message = (f"step {step}: {reason}. Training goes on unchecked — "
                   "fix the cause and call watch.resume() (or restart the run) to check again")
        return Alert(step=step, tensor="*", kind="paused", severity="warning", value=math.nan, baseline=None,
                     message=message)

    def should_pause(self) -> bool:
        """Whether the failures in a row reached :data:`MAX_CONSECUTIVE_FAILURES`."""
        return self.failures >= MAX_CONSECUTIVE_FAILURES

    def succeeded(self) -> None:
        """A check completed: the failures in a row start again from zero."""
        self.failures = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"alerts": [a.to_dict() for a in self.alerts]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.alerts = [alert_from_dict(a) for a in state.get("alerts", [])]


__all__ = ["MAX_CONSECUTIVE_FAILURES", "AlertPolicy", "alert_from_dict"]
