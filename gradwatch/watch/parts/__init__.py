"""The parts of a check, one module each, independent of each other (an import-linter contract keeps it):

- :mod:`~gradwatch.watch.parts.backward`: the backward formulas against finite differences (the backward verdict);
- :mod:`~gradwatch.watch.parts.training`: the live ``.grad`` against the step objective's gradient (the training verdict);
- :mod:`~gradwatch.watch.parts.inner`: derivatives inside the objective (gradient penalties, inner losses);
- :mod:`~gradwatch.watch.parts.independence`: whether one sample's loss depends on another's inputs;
- :mod:`~gradwatch.watch.parts.update`: the optimizer's step between ``.grad`` and the weights.

What they share (the watch's setting, one check's context, the :class:`~gradwatch.watch.parts.context.Part`
protocol) is :mod:`~gradwatch.watch.parts.context`, below them; the replay that is also a capture's forward is
:mod:`~gradwatch.watch.parts.replay_capture`.
"""

from gradwatch.watch.parts.backward import BackwardPart
from gradwatch.watch.parts.context import CheckContext, Part, WatchContext
from gradwatch.watch.parts.independence import IndependencePart
from gradwatch.watch.parts.inner import InnerPart
from gradwatch.watch.parts.training import TrainingPart
from gradwatch.watch.parts.update import UpdatePart

__all__ = ["BackwardPart", "CheckContext", "IndependencePart", "InnerPart", "Part", "TrainingPart", "UpdatePart", "WatchContext"]
