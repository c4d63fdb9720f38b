"""The run's gradient accumulation as the training part sees it: its window, a partial window, unseen micro-batches.

Three things the training verdict must say once, as what they are, rather than tensor by tensor:

- **The run's window** ``K``: the most micro-batches a checked step held (handed over with
  :meth:`gradwatch.GradWatch.accumulate`), or told by training's forwards where they were not handed over.
- **A partial window**: a checked step of ``n < K`` micro-batches whose ``.grad`` is its objective's
  gradient times ``n / K`` (accumulation that divides every loss by the full window, as accelerate's
  ``accumulate()`` does at the end of an epoch; :mod:`gradwatch.check.replay.window`). The failing tensors
  are judged again against the objective's gradient times ``n / K``; where that explains most of them, their
  new verdicts stand (a tensor wrong beyond the window still fails, with its own diagnosis), the report
  keeps the window (``training_window``), and one ``partial_window`` alert (a warning) names it, for each
  step it happens at.
- **Micro-batches the watch never sees**: ``watch.step`` given the last micro-batch of a window with no
  ``watch.accumulate`` before it. No step's ``.grad`` can be judged (each check's ``training_note`` says
  "skipped: accumulating"); one ``unjudged`` alert (a warning) says so for the run, with the calls to make.

Example:
    >>> from gradwatch.check.judging.report import CheckReport
    >>> from gradwatch.check.judging.training_judge import judge_training
    >>> window = AccumulationWindow()
    >>> window.observe(4)  # a whole window of 4 micro-batches checked
    >>> ref, p = {"w": torch.tensor([1.0, -2.0])}, torch.zeros(2)
    >>> live = {"w": ref["w"] / 4}  # then a step of one micro-batch, divided by 4
    >>> report = CheckReport(tensors={}, training={"w": judge_training("w", live["w"], ref["w"], p, torch.float32)})
    >>> report.training["w"].verdict.value
    'wrong'
    >>> again = lambda n, factor: judge_training(n, live[n], ref[n] * factor, p, torch.float32)
    >>> found = window.judge(report.training, live, ref, 1, again)
    >>> report.training["w"].verdict.value, found.window
    ('excellent', 4)
    >>> report.training_window = found.record()
    >>> [(a.kind, a.severity) for a in window.alerts(7, report)]
    [('partial_window', 'warning')]
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from gradwatch.check.judging.report import CheckReport, TrainingCheck
from gradwatch.check.judging.training_judge import fitted_scale
from gradwatch.check.replay.window import PartialWindow, window_of
from gradwatch.watch.trend import WHOLE_CHECK, Alert

#: The recipe under accelerate's ``accumulate()``, said where the watch is not handed the micro-batches.
ACCELERATE_CALLS = "if accelerator.sync_gradients: watch.step(batch) else: watch.accumulate(batch)"


class AccumulationWindow:
    """The training part's view of the run's accumulation (module docstring): learned, judged, said once.

    Example:
        See the module's example.
    """

    def __init__(self) -> None:
        #: The run's window: the most micro-batches a checked step held (None until a step held two or more).
        self.window: Optional[int] = None
        #: Whether the ``unjudged`` warning was given (once for the run).
        self.warned = False
        self._unseen: Optional[Tuple[int, int]] = None  # this check: (training's forwards, one replay's), when skipped

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs: the window learned and whether the warning was given."""
        return {"window": self.window, "warned": self.warned}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from :meth:`state_dict` (an empty mapping, from a state written before it was kept: a fresh start)."""
        window = state.get("window")
        self.window = int(window) if window is not None else None
        self.warned = bool(state.get("warned", False))

    def observe(self, micro_batches: int) -> None:
        """A checked step held ``micro_batches`` (called once per check, before its replay)."""
        self._unseen = None
        if micro_batches > (self.window or 1):
            self.window = int(micro_batches)

    def replayed(self, accumulating: int, forwards: Tuple[int, int]) -> None:
        """After the replay: a step skipped because training ran ``accumulating`` micro-batches the watch was not
        handed (told by its ``forwards``: training's, one replay's) teaches the window, and is said once."""
        if accumulating > 1:
            self._unseen = forwards
            if accumulating > (self.window or 1):
                self.window = int(accumulating)

    def judge(self, training: Dict[str, TrainingCheck], lives: Mapping[str, Optional[torch.Tensor]],
              refs: Mapping[str, torch.Tensor], micro_batches: Optional[int],
              again: Callable[[str, float], TrainingCheck]) -> Optional[PartialWindow]:
        """Where tensors failed: the partial window that explains most of them, each then judged again against the
        step's objective times ``n / K`` (in ``training``); None, and ``training`` untouched, where there is none.

        Args:
            training: The training verdicts (``{name: TrainingCheck}``); the failing ones may be replaced.
            lives: ``{name: training's gradient}``.
            refs: ``{name: the step objective's gradient}``.
            micro_batches: The micro-batches of the step on each rank (None: they differ between ranks).
            again: ``again(name, factor)``: the tensor judged against its objective's gradient times ``factor``.
        """
        failing = [n for n, tc in training.items() if tc.failed]
        ratios = [tc.ratio for tc in map(training.__getitem__, failing) if tc.ratio is not None and not tc.param_coef]
        if micro_batches is None or 2 * len(ratios) <= len(failing):
            return None  # most failing tensors show no constant ratio: no window to read
        k = window_of(ratios, micro_batches, self.window)
        if k is None:
            return None
        judged = {n: again(n, micro_batches / k) for n in failing}
        explained = [n for n, tc in judged.items() if not tc.failed]
        if 2 * len(explained) <= len(failing):
            return None  # the window explains too few: the tensors are wrong each in its own way
        training.update(judged)
        return PartialWindow(micro_batches, k, fitted_scale({n: lives[n] for n in explained}, {n: refs[n] for n in explained}))

    def alerts(self, step: int, report: CheckReport) -> List[Alert]:
        """This check's alerts: the partial window its report keeps (each time one is found), micro-batches the
        watch was not handed (once for the run)."""
        out: List[Alert] = []
        kept = report.training_window
        if kept is not None:
            found = PartialWindow(int(kept["micro_batches"]), int(kept["window"]), float(kept["scale"]))
            message = (f"step {step} (training): a partial accumulation window: {found.text()}. The step's tensors "
                       f"are judged against its objective's gradient times {found.micro_batches}/{found.window} — to "
                       f"fix it, {found.fix()}")
            out.append(Alert(int(step), WHOLE_CHECK, "partial_window", "warning", found.scale, None, message,
                             "training"))
        if self._unseen is not None and not self.warned and not report.training:
            self.warned = True
            trained, per = self._unseen
            message = (
                f"step {step} (training): the training verdict is off: training ran {trained} forwards of the model "
                f"since the last watch.step where one replay of the step's batch makes {per}, so its .grad holds "
                f"{trained // max(per, 1)} micro-batches and the watch was handed one — call "
                "watch.accumulate(micro_batch) after each micro-batch's backward and watch.step once per optimizer "
                f"step (under accelerate's accumulate(): {ACCELERATE_CALLS}). The backward verdict goes on; each "
                "check's training_note says why the training part was skipped; said once for the run")
            out.append(Alert(int(step), WHOLE_CHECK, "unjudged", "warning", math.nan, None, message, "training"))
        self._unseen = None
        return out


__all__ = ["ACCELERATE_CALLS", "AccumulationWindow"]
