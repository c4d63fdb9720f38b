"""The overhead clock of a watch: the wall time spent in the monitor against the run's wall time.

:class:`OverheadClock` times the steps for the schedule, adds up the seconds of every
:meth:`GradWatch.step` and :meth:`GradWatch.check` call, keeps the first check's time apart (the
baseline check at the first step, which dominates short runs with ``every="auto"``), and survives a
checkpoint (the wall time before a resume is kept).

Example:
    >>> clock = OverheadClock()
    >>> clock.fraction() is None  # before the first step
    True
    >>> clock.start(); clock.add(0.0)
    >>> 0.0 <= clock.fraction() <= 1.0
    True
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Mapping, Optional

from gradwatch.watch.schedule import ANNOUNCE_AS_WARNING_ABOVE, Schedule

logger = logging.getLogger("gradwatch")


class OverheadClock:
    """Seconds in the monitor, the run's wall time, and the baseline check's seconds.

    Example:
        See the module's example.
    """

    def __init__(self, timed: Optional[Callable[[], Any]] = None) -> None:
        #: Called once the schedule has a check and a step timed (the watch says its steps to full coverage).
        self.timed = timed
        #: When the first step was seen (None before it, and after a resume until the next step).
        self.started: Optional[float] = None
        #: When the last :meth:`GradWatch.step` returned.
        self.last_call: Optional[float] = None
        #: Seconds spent in the monitor.
        self.monitor_seconds = 0.0
        #: Wall seconds before a resume.
        self.wall_before = 0.0
        #: The first check's seconds (the baseline check, at the first step).
        self.baseline_seconds: Optional[float] = None
        self._explained = False  # every="auto": its interval announced once both a check and a step were timed

    def enter_step(self, schedule: Schedule) -> float:
        """A :meth:`GradWatch.step` starts: the run's wall time starts at the first one; each later one times the
        step since the last for ``schedule`` (whose ``every="auto"`` interval is said once). Returns now."""
        now = time.perf_counter()
        if self.started is None:
            self.started = now
        elif self.last_call is not None:
            schedule.record_step_seconds(now - self.last_call)
            if not self._explained:
                self._announce(schedule)
        return now

    def leave_step(self, entered: float) -> None:
        """The :meth:`GradWatch.step` that :meth:`enter_step` started returns: its seconds are the monitor's."""
        end = time.perf_counter()
        self.monitor_seconds += end - entered
        self.last_call = end

    def _announce(self, schedule: Schedule) -> None:
        """Say once which interval ``every="auto"`` chose and why (a warning when checks are far apart)."""
        text = schedule.explain()
        if text is None:
            return
        self._explained = True
        far = schedule.interval() > ANNOUNCE_AS_WARNING_ABOVE
        logger.log(logging.WARNING if far else logging.INFO, "gradwatch: %s", text)
        if self.timed is not None:
            self.timed()

    def start(self, now: Optional[float] = None) -> None:
        """The run's wall time starts now (at the first step)."""
        self.started = time.perf_counter() if now is None else now

    def add(self, seconds: float) -> None:
        """``seconds`` more spent in the monitor."""
        self.monitor_seconds += seconds

    def checked(self, seconds: float) -> None:
        """A check completed in ``seconds``: the first one is the baseline."""
        if self.baseline_seconds is None:
            self.baseline_seconds = seconds

    def _wall(self) -> float:
        assert self.started is not None
        return self.wall_before + (time.perf_counter() - self.started)

    def fraction(self) -> Optional[float]:
        """Share of wall time spent in the monitor since the first step (None before it)."""
        if self.started is None:
            return None
        wall = self._wall()
        return self.monitor_seconds / wall if wall > 0 else None

    def fraction_with(self, seconds: float) -> Optional[float]:
        """:meth:`fraction` counting a check still in progress (its ``seconds`` are not yet added)."""
        if self.started is None:
            return None
        wall = self._wall()
        return min(1.0, (self.monitor_seconds + seconds) / wall) if wall > 0 else None

    def after_baseline(self) -> Optional[float]:
        """:meth:`fraction` leaving out the baseline check (what ``overhead_budget`` governs)."""
        if self.started is None or self.baseline_seconds is None:
            return None
        wall = self._wall() - self.baseline_seconds
        return max(0.0, self.monitor_seconds - self.baseline_seconds) / wall if wall > 0 else None

    def after_baseline_with(self, seconds: float, checks: int) -> Optional[float]:
        """:meth:`after_baseline` counting a check in progress (None at the baseline check: ``checks`` <= 1)."""
        if self.started is None or self.baseline_seconds is None or checks <= 1:
            return None
        wall = self._wall() - self.baseline_seconds
        return min(1.0, max(0.0, self.monitor_seconds + seconds - self.baseline_seconds) / wall) if wall > 0 else None

    def state_dict(self) -> Dict[str, Any]:
        return {
            "monitor_seconds": self.monitor_seconds,
            "baseline_seconds": self.baseline_seconds,
            "wall_seconds": self.wall_before + ((time.perf_counter() - self.started) if self.started else 0.0),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a checkpoint: the wall time so far is kept; the clock restarts at the next step."""
        self.monitor_seconds = float(state.get("monitor_seconds", 0.0))
        self.wall_before = float(state.get("wall_seconds", 0.0))
        baseline = state.get("baseline_seconds")
        self.baseline_seconds = None if baseline is None else float(baseline)
        self.started = None
        self.last_call = None


__all__ = ["OverheadClock"]
