"""The inner-derivatives part of a watch: the double backward an objective that differentiates relies on.

An objective that differentiates through the model (a gradient penalty) trains on the model's double
backward. At each check a few leaf modules (least-checked first, only those whose float64 copy fits
``memory_budget``, chosen by :meth:`~gradwatch.watch.check_plan.CheckPlanner.inner_modules`) get their
double backward checked (:mod:`gradwatch.check.higher_order.inner`), as report entries
``"<module>:double_backward"``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch import GradWatch
    >>> def penalty(m, x):  # the gradient's norm joins the loss: the objective differentiates
    ...     x = x.requires_grad_()
    ...     out = m(x).sum()
    ...     (g,) = torch.autograd.grad(out, x, create_graph=True)
    ...     return out + g.pow(2).sum()
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    >>> watch = GradWatch(model, penalty, every=1, training=False, log_dir=None)
    >>> report = watch.step(torch.randn(5, 3))
    >>> sorted(n for n in report.tensors if n.endswith(":double_backward"))
    ['0:double_backward', '1:double_backward', '2:double_backward']
"""

from __future__ import annotations

from typing import Any, Dict

from gradwatch.check.higher_order.inner import check_inner_derivatives
from gradwatch.watch.check_plan import CheckPlanner
from gradwatch.watch.context import CheckContext, TrendAlerting, WatchContext


class InnerPart(TrendAlerting):
    """Checks a few leaf modules' double backward per check when the objective differentiates.

    Args:
        watch: The watch's setting.
        planner: Chooses the modules under ``memory_budget``.

    Example:
        See the module's example.
    """

    name = "inner"
    #: Modules whose double backward a check of an objective that differentiates inside checks (least-checked first).
    PER_CHECK = 8

    def __init__(self, watch: WatchContext, planner: CheckPlanner) -> None:
        self.watch = watch
        self.planner = planner
        #: Modules whose double backward was checked, and how often.
        self.counts: Dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        """Whether the objective differentiates through the model (known after the first check)."""
        return bool(self.watch.objective.differentiates)

    def run(self, check: CheckContext) -> Dict[str, Any]:
        """The chosen modules' checks, added to ``check.report.tensors`` (and returned); notes say what was not."""
        report = check.report
        if report is None or not self.enabled:
            return {}
        if self.watch.by_shard:
            report.notes.append("double backward not checked: a model sharded with FSDP2 is checked shard by shard, "
                                "which does not check it yet (form='objective' checks it on a gathered replica)")
            return {}
        chosen, leaves = self.planner.inner_modules(check.target, report, self.counts, self.PER_CHECK)
        with self.watch.recorder_paused():
            checks = check_inner_derivatives(check.target, self.watch.objective.loss, check.batch,
                                             names=sorted(chosen, key=leaves.index), seed=check.opts.seed,
                                             fail_at=report.fail_at)
        for name in chosen:
            self.counts[name] = self.counts.get(name, 0) + 1
        report.tensors.update(checks)
        return dict(checks)


__all__ = ["InnerPart"]
