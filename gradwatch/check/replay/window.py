"""A partial accumulation window: training's gradient is the step's objective's times ``n / K``, on every tensor.

Gradient accumulation over a window of ``K`` micro-batches divides each micro-batch's loss by ``K``
(accelerate's ``Accelerator.backward`` inside ``accumulate()``, Lightning's ``accumulate_grad_batches``,
a plain loop's ``loss / K``). A step that holds fewer, ``n < K`` (the last window of an epoch whose
micro-batches do not fill it), applies the gradient of its objective times ``n / K``: the right
direction on every tensor, one wrong size for the step. :func:`window_of` reads the window off the
constant ratios of the failing tensors (the run's window when it is known, else ``n / ratio`` when
that is a whole number); judging the tensors again against the objective's gradient times ``n / K``
then tells a partial window (most of them agree) from tensors that are wrong each in its own way
(:mod:`gradwatch.watch.accumulation`). Pure math and words: no model, no state.

Example:
    >>> window_of([0.5, 0.5, 0.5002], micro_batches=2)  # 2 micro-batches, each divided by 4
    4
    >>> window_of([0.25], micro_batches=1, window=4), window_of([0.25], micro_batches=1)  # one: only a known window
    (4, None)
    >>> found = PartialWindow(2, 4, 0.5)
    >>> found.record()
    {'micro_batches': 2, 'window': 4, 'scale': 0.5}
    >>> found.text().split(": ")[1]
    "training's gradient is 0.500x the step's, so this step's update is 1/2 the size its objective asks for"
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Dict, Optional, Sequence

from gradwatch.check.replay.cut import EXPLAINED, MAX_WINDOW


@dataclass
class PartialWindow:
    """A step whose ``.grad`` is its objective's gradient times ``micro_batches / window``.

    Attributes:
        micro_batches: The micro-batches the step held (``n``).
        window: The full window each of them was divided by (``K > n``).
        scale: Training's gradient over the step objective's, fitted over the tensors it explains.
    """

    micro_batches: int
    window: int
    scale: float

    @property
    def factor(self) -> float:
        """``n / K``: what training multiplied the step's objective by."""
        return self.micro_batches / self.window

    def text(self) -> str:
        """The window in words (the diagnosis of the step)."""
        n, k = self.micro_batches, self.window
        each = f"each of the step's {n} micro-batches is" if n > 1 else "the step's one micro-batch is"
        return (f"{each} divided by {k}, the full accumulation window, where the step has {n} (a partial window, as at "
                f"the end of an epoch): training's gradient is {self.scale:.3f}x the step's, so this step's update is "
                f"{Fraction(n, k)} the size its objective asks for")

    def fix(self) -> str:
        """What makes every window whole again, or the last one right."""
        return (f"make every window whole (batches per epoch a multiple of {self.window}; in accelerate, "
                f"GradientAccumulationPlugin(num_steps={self.window}, sync_with_dataloader=False) lets a window run on "
                "into the next epoch), or divide each micro-batch's loss by the micro-batches its step has, or by the "
                "step's item count")

    def record(self) -> Dict[str, Any]:
        """The window as a check record keeps it."""
        return {"micro_batches": self.micro_batches, "window": self.window, "scale": round(self.scale, 6)}


def window_of(ratios: Sequence[float], micro_batches: int, window: Optional[int] = None) -> Optional[int]:
    """The full window ``K`` that the constant ratios of training's gradient to the objective's name, or None.

    Args:
        ratios: Training's gradient over the objective's, for each tensor a constant ratio explains.
        micro_batches: The micro-batches the step held (on each rank).
        window: The run's full window, when known (the most micro-batches a step of the run held); a step with
            fewer is read against it. None, or no more than ``micro_batches``: the window is read off the ratios
            (``micro_batches / ratio`` a whole number), for a step of two micro-batches or more.

    Returns:
        ``K`` when the median ratio is ``micro_batches / K`` (to 1%) for a ``K`` above ``micro_batches``; else None.
    """
    if micro_batches < 1 or not ratios:
        return None
    ratio = float(statistics.median(ratios))
    if not 0.0 < ratio < 1.0:
        return None
    if window is not None and window > micro_batches:
        k = int(window)
    elif micro_batches >= 2:
        k = round(micro_batches / ratio)
        if not micro_batches < k <= MAX_WINDOW:
            return None
    else:
        return None
    return k if abs(ratio * k / micro_batches - 1.0) <= EXPLAINED else None


__all__ = ["PartialWindow", "window_of"]
