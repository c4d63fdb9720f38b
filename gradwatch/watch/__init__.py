"""Watching a training run: the :class:`~gradwatch.GradWatch` façade, the runner (plan -> parts -> merge), the check's
planning, the schedule and clock, trends (where alerts are decided), causes and the alert policy.

The parts of a check live in :mod:`gradwatch.watch.parts`; ranks and shards in :mod:`gradwatch.parallel`.
"""

from gradwatch.watch.gradwatch import GradWatch
from gradwatch.watch.trend import Alert, TrendTracker

__all__ = ["Alert", "GradWatch", "TrendTracker"]
