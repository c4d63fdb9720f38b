"""When to check: the first step, then every N steps or within an overhead budget.

Pure bookkeeping: the hook feeds it step and check durations; it never reads a clock.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import fmean, median
from typing import Any, Deque, Dict, Optional, Union

from gradwatch.config import parse_max_interval

#: Longest gap between two checks in "auto" mode, in steps.
MAX_AUTO_INTERVAL = 100_000
#: An ``auto`` interval longer than this many steps is announced as a warning (shorter ones at INFO).
ANNOUNCE_AS_WARNING_ABOVE = 100



class Schedule:
    """Decides which optimizer steps run a check.

    ``every=N``: steps 0, N, 2N, ... (relative to the first step seen).
    ``every="auto"``: after the baseline check at the first step, the gap is
    chosen so that check time stays within ``overhead_budget`` of wall time:
    ``gap >= check_seconds * (1 - budget) / (budget * step_seconds)``, using
    the median of recent step durations (robust to the odd slow step: a
    validation loop, a checkpoint) and the mean of recent check durations
    (checks of a rotating tensor subset differ in cost; the budget is about
    their total). ``max_interval`` (steps, or a time converted to steps with
    the median step duration) caps the auto gap, so a long run is never
    unchecked for longer than the user allows.

    Example:
        >>> s = Schedule(every=10)
        >>> [step for step in range(25) if s.due(step) and s.record_check(step, 0.0) is None]
        [0, 10, 20]
        >>> a = Schedule(every="auto", overhead_budget=0.02)
        >>> a.due(0)
        True
        >>> a.record_check(0, 1.0); a.record_step_seconds(0.1)
        >>> a.interval()
        490
    """

    def __init__(self, every: Union[int, str] = "auto", overhead_budget: float = 0.02, window: int = 20,
                 max_interval: Any = None) -> None:
        if isinstance(every, str) and every.lower() == "auto":
            every = "auto"
        elif isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: got {every!r}, expected an integer >= 1 or 'auto'")
        if isinstance(overhead_budget, bool) or not isinstance(overhead_budget, (int, float)) or not 0 < overhead_budget <= 1:
            raise ValueError(f"overhead_budget: got {overhead_budget!r}, expected a number with 0 < x <= 1")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window: got {window!r}, expected an integer >= 1")
        self.every = every
        self.overhead_budget = float(overhead_budget)
        self.max_interval = max_interval
        self._max_steps, self._max_seconds = parse_max_interval(max_interval)
        self.last_check_step: Optional[int] = None
        self.first_step: Optional[int] = None
        self._step_seconds: Deque[float] = deque(maxlen=window)
        self._check_seconds: Deque[float] = deque(maxlen=max(3, window // 4))
        self._skip: Optional[tuple] = None

    def record_step_seconds(self, seconds: float) -> None:
        """Duration of one training step, excluding the monitor's own time."""
        if seconds > 0 and math.isfinite(seconds):
            self._step_seconds.append(float(seconds))

    def step_seconds(self) -> Optional[float]:
        """The median of the training steps' recorded seconds (None before one).

        Example:
            >>> s = Schedule(every=1); s.record_step_seconds(0.5); s.step_seconds()
            0.5
        """
        return median(self._step_seconds) if self._step_seconds else None

    def record_check(self, step: int, seconds: float, scheduled: bool = True) -> None:
        """A check ran at ``step`` and took ``seconds``.

        ``scheduled=False`` marks a check run on request (``GradWatch.check``): its cost
        counts toward the ``auto`` gap, but an ``every=N`` grid keeps its steps.

        Example:
            >>> s = Schedule(every=10)
            >>> s.record_check(0, 0.1); s.record_check(7, 0.1, scheduled=False)
            >>> s.due(10)
            True
        """
        if scheduled or self.every == "auto" or self.last_check_step is None:
            self.last_check_step = int(step)
        if self.first_step is None:
            self.first_step = int(step)
        if math.isfinite(seconds) and seconds >= 0:
            self._check_seconds.append(float(seconds))

    def interval(self) -> int:
        """Current gap between checks, in steps."""
        if self.every != "auto":
            return int(self.every)
        if not self._check_seconds or not self._step_seconds:
            return 1
        c, t, b = fmean(self._check_seconds), median(self._step_seconds), self.overhead_budget
        gap = c * (1.0 - b) / (b * max(t, 1e-9))
        gap = int(min(MAX_AUTO_INTERVAL, max(1, math.ceil(gap * (1 - 1e-12)))))  # float noise: a gap of 45.000000001 is 45
        return min(gap, self._cap(t))

    def steps_per_check(self) -> Optional[int]:
        """Steps between checks: ``every``, or ``auto``'s interval once a check and a step were timed (else None).

        Example:
            >>> Schedule(every=5).steps_per_check(), Schedule(every="auto").steps_per_check()
            (5, None)
        """
        if self.every == "auto" and not (self._check_seconds and self._step_seconds):
            return None
        return self.interval()

    def _cap(self, step_seconds: float) -> int:
        """The longest gap ``max_interval`` allows, in steps (``MAX_AUTO_INTERVAL`` without one)."""
        cap = MAX_AUTO_INTERVAL
        if self._max_steps is not None:
            cap = min(cap, self._max_steps)
        if self._max_seconds is not None:
            cap = min(cap, max(1, int(self._max_seconds / max(step_seconds, 1e-9))))
        return cap

    def explain(self) -> Optional[str]:
        """Why ``auto`` checks every :meth:`interval` steps (None before a check and a step were timed).

        Example:
            >>> a = Schedule(every="auto", overhead_budget=0.02, max_interval=200)
            >>> a.record_check(0, 1.0); a.record_step_seconds(0.1)
            >>> print(a.explain())  # doctest: +NORMALIZE_WHITESPACE
            every='auto' checks every 200 steps: a check takes 1 s and a training step 100 ms, so the 2%
            overhead_budget allows one check per 490 steps; max_interval=200 caps it at 200 steps
        """
        if self.every != "auto" or not self._check_seconds or not self._step_seconds:
            return None
        c, t = fmean(self._check_seconds), median(self._step_seconds)
        n = self.interval()
        free = Schedule("auto", self.overhead_budget)
        free._check_seconds, free._step_seconds = self._check_seconds, self._step_seconds
        budget_gap = free.interval()
        text = (f"every='auto' checks every {n} steps: a check takes {_duration(c)} and a training step {_duration(t)}, "
                f"so the {self.overhead_budget * 100:g}% overhead_budget allows one check per {budget_gap} steps")
        if n < budget_gap:
            text += f"; max_interval={self.max_interval} caps it at {n} steps"
        elif self.max_interval is None and n > ANNOUNCE_AS_WARNING_ABOVE:
            text += "; set max_interval (e.g. max_interval='30 min') or every=N to check more often"
        return text

    def due(self, step: int) -> bool:
        """True when a check should run at ``step``.

        A step before the last check (a run restarted from scratch or rewound to an
        earlier checkpoint with the same monitor) starts the schedule again there.
        """
        if self.last_check_step is None or int(step) < self.last_check_step:
            return True
        gap = int(step) - self.last_check_step
        skip = self._skip
        if skip is not None and skip[0] == self.last_check_step and gap < skip[1]:
            return False
        interval = self.interval()
        if gap >= interval:
            return True
        # Not due yet. interval() (a median and a mean) is not free next to a fast training step if it ran every
        # step: it is re-read after an eighth of the remaining gap instead.
        self._skip = (self.last_check_step, gap + max(1, (interval - gap) // 8))
        return False

    def state_dict(self) -> Dict[str, Any]:
        """JSON-able state for checkpoints."""
        return {
            "every": self.every,
            "overhead_budget": self.overhead_budget,
            "max_interval": self.max_interval,
            "last_check_step": self.last_check_step,
            "first_step": self.first_step,
            "step_seconds": list(self._step_seconds),
            "check_seconds": list(self._check_seconds),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (``every``/budget keep the current configuration)."""
        self.last_check_step = state.get("last_check_step")
        self.first_step = state.get("first_step")
        self._step_seconds.clear()
        self._step_seconds.extend(state.get("step_seconds", []))
        self._check_seconds.clear()
        self._check_seconds.extend(state.get("check_seconds", []))


def _duration(seconds: float) -> str:
    """A duration in seconds, milliseconds or microseconds, whichever suits it, to three significant digits.

    Example:
        >>> _duration(0.1), _duration(2.5), _duration(0.00025)
        ('100 ms', '2.5 s', '250 us')
    """
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
