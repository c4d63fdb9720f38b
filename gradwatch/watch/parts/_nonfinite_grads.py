"""A non-finite ``.grad``: an alert of its own kind, whatever the replay says.

The training verdict compares the ``.grad`` training applied with the step's objective's gradient replayed. A loss
with ``log(0)`` in one micro-batch gives an infinite ``.grad`` that a faithful replay reproduces bit for bit: the two
agree, and the verdict is EXCELLENT. The backward part checks the watched batch alone, often another micro-batch.
So the ``.grad`` itself is read here at every check: a tensor whose ``.grad`` holds NaN or inf is one ``nonfinite``
alert of the training part, naming the tensors, when the check before found none (it is said again after a finite
check). A float16 step (a ``GradScaler`` given, or training under float16 autocast, which a scaler runs: the
Trainer's is not handed to the watch) overflows by design and the scaler skips it: a note, no alert.

Example:
    >>> import torch
    >>> grads = NonfiniteGrads()
    >>> grads.look({"w": torch.tensor([1.0, float("inf")]), "b": torch.ones(2), "c": None})
    ['w']
    >>> [(a.kind, a.part, a.tensor, a.severity) for a in grads.alerts(3)]
    [('nonfinite', 'training', 'w', 'error')]
    >>> grads.look({"w": torch.tensor([1.0, float("inf")])}), grads.alerts(4)
    (['w'], [])
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

import torch

from gradwatch.watch.causes import names_text
from gradwatch.watch.trend import WHOLE_CHECK, Alert

#: Most characters of an alert's first line.
HEADLINE = 120


def is_finite(grad: torch.Tensor) -> bool:
    """Whether every entry of ``grad`` is finite: one sum (NaN and inf carry through it), confirmed entry by entry
    only where the sum is not finite (finite entries whose sum overflows).

    Example:
        >>> is_finite(torch.ones(3)), is_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
        >>> is_finite(torch.full((2,), 3e38))
        True
    """
    values = grad._values() if grad.is_sparse else grad
    values = values.detach()
    if values.is_complex():
        values = torch.view_as_real(values)
    if not values.is_floating_point() or not values.numel():
        return True
    if math.isfinite(float(values.sum())):
        return True
    return bool(torch.isfinite(values).all())


class NonfiniteGrads:
    """The watched tensors whose ``.grad`` is not finite at the latest check, and the alert that says so."""

    def __init__(self) -> None:
        #: The tensors found at the latest check.
        self.found: List[str] = []
        #: Whether a float16 ``GradScaler`` runs the step (an overflow it skips is no alert).
        self.scaled = False
        self._before = False  # the check before found some

    def look(self, grads: Mapping[str, Optional[torch.Tensor]], scaled: bool = False) -> List[str]:
        """Read each ``.grad`` (``None``: none); what is found is kept for :meth:`alerts` and :meth:`note`."""
        self.scaled = scaled
        self.found = [name for name, g in grads.items() if g is not None and not is_finite(g)]
        return self.found

    def note(self) -> Optional[str]:
        """The check record's note on what was found (None: every ``.grad`` finite)."""
        if not self.found:
            return None
        text = (f"training's .grad has NaN or inf entries in {len(self.found)} tensor"
                f"{'s' if len(self.found) != 1 else ''}: {names_text(self.found)}")
        if self.scaled:
            return text + " (a GradScaler step that overflowed: the scaler skips it and lowers its scale)"
        return text

    def alerts(self, step: int) -> List[Alert]:
        """One ``nonfinite`` alert of the training part where the latest check found some and the one before did not
        (none under a ``GradScaler``, whose overflows are skipped steps)."""
        found, before = self.found, self._before
        self._before = bool(found)
        if not found or before or self.scaled:
            return []
        n = len(found)
        where = found[0] if n == 1 else WHOLE_CHECK
        headline = f"step {step}: training's .grad is NaN or inf in {n} tensor{'s' if n != 1 else ''}: {found[0]}"
        headline += " and more" if n > 1 else ""
        message = (
            f"{headline if len(headline) <= HEADLINE else headline[:HEADLINE - 3] + '...'}\n"
            f"why: the step's loss or its backward left NaN or inf in {names_text(found)} (a log of 0, a division by 0 "
            "or an overflow in some micro-batch), whatever the replay says: the optimizer step puts it into the "
            "weights\n"
            "what to do: find the micro-batch whose loss is not finite (torch.isfinite(loss)) and guard the op "
            "(clamp the argument of log, add an epsilon to a division), or skip the step when a .grad is not finite"
        )
        return [Alert(step=int(step), tensor=where, kind="nonfinite", severity="error", value=math.nan, baseline=None,
                      message=message, part="training", count=n if n > 1 else 1,
                      tensors=list(found) if n > 1 else [])]

    def state_dict(self) -> Dict[str, Any]:
        """Whether the latest check found some (a resumed run does not say the same episode twice).

        Example:
            >>> NonfiniteGrads().state_dict()
            {'nonfinite_before': False}
        """
        return {"nonfinite_before": self._before}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._before = bool(state.get("nonfinite_before", False))


__all__ = ["NonfiniteGrads", "is_finite"]
