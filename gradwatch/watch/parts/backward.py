"""The backward part of a watch: are the backward formulas right?

Each check compares a few parameter tensors' gradients with two-sided numerical gradients of the
objective, in the form the :class:`~gradwatch.watch.parts.planning.CheckPlanner` chose:

- ``"objective"``: the whole objective on a float64 shadow copy (:func:`gradwatch.check.model.run_model_check`);
- ``"module"``: unit by unit, the cycle's pieces (:func:`gradwatch.check.modules.module_form.run_module_check`),
  shard by shard for an FSDP2 model (:mod:`gradwatch.parallel.shard_check`), split between DDP ranks.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch import GradWatch
    >>> watch = GradWatch(nn.Linear(3, 1), lambda m, b: m(b).pow(2).mean(), every=1, training=False, log_dir=None)
    >>> _ = watch.step(torch.randn(4, 3))
    >>> watch.backward.counts
    {'weight': 1, 'bias': 1}
"""

from __future__ import annotations

import time
from typing import Any, Dict, Mapping, Optional, Tuple, cast

from gradwatch.check import model as model_check
from gradwatch.check.judging.report import CheckReport
from gradwatch.check.modules import module_form
from gradwatch.check.modules.activations import Saved
from gradwatch.check.modules.batch_cut import batch_dims, forward_transient, positions, sub_batch
from gradwatch.check.modules.capture import Forward, capture
from gradwatch.check.modules.localize import name_shared_module, name_straight_through
from gradwatch.parallel.shard_check import ShardView, plan_shards, reshard
from gradwatch.parallel.sharded import is_fsdp
from gradwatch.plan.memory import SAFETY, gradient_bytes, mb, objective_activations, objective_bytes, objective_samples, release_freed
from gradwatch.watch.parts.context import CheckContext, TrendAlerting, WatchContext
from gradwatch.watch.parts.planning import CheckPlanner


class BackwardPart(TrendAlerting):
    """Runs the backward part of a check in the planned form and counts the checks of each tensor.

    Args:
        watch: The watch's setting.
        planner: Decides the form and the pieces, and holds the shadow copy.

    Example:
        See the module's example.
    """

    name = "backward"

    def __init__(self, watch: WatchContext, planner: CheckPlanner) -> None:
        self.watch = watch
        self.planner = planner
        #: Checks each report entry has been in (tensors, and ``"<module>:double_backward"`` entries).
        self.counts: Dict[str, int] = {}
        self._straight_through_named = False  # an undeclared straight-through's module is looked for once
        self._module_named = False  # likewise the module several failing tensors share (one alert names it)
        #: What each unit's pieces took at its last check (:attr:`CheckReport.piece_seconds`): shard by shard, the
        #: ranks share the whole pieces out by it (from the merged report: the same on every rank).
        self.piece_seconds: Dict[str, Tuple[float, int]] = {}
        #: Bytes of the model's output per sample and position, as the last forward to its end saw them: shard by
        #: shard, what a forward of the next check holds beyond its captures is sized from it (its batch cut to fit).
        self.output_per_position = 0.0

    @property
    def enabled(self) -> bool:
        return True

    def run(self, check: CheckContext) -> Optional[CheckReport]:
        """The check's report on ``check.names`` (None when this rank has none); the training part's verdicts
        are added to it by the caller. Its memory summary is set where this process decided the plan. With
        ``check.fused`` (:mod:`gradwatch.watch.parts.replay_capture`), the training part's replay is the module form's
        first capture's forward, its captures holding at most ``check.held`` bytes through it."""
        if not check.names:
            return None
        estimate: Optional[int] = None
        began = time.perf_counter()  # the module form's pace holds the planning too
        with self.watch.recorder_paused():
            form, estimate, why = self.planner.form_for(check)
            if form == "objective":
                report = self._objective(check)
            else:
                report = self._modules(check, check.fused, check.held, began)
                estimate = report.memory.get("estimate_bytes")
            if why:
                report.notes.append(why)
        if check.judge or check.plan is not None:
            report.memory = self.watch.memory.summary(check.room, estimate)
        return report

    def _objective(self, check: CheckContext) -> CheckReport:
        """The whole objective on the shadow copy (one process: what it cannot resolve, judged on modules), on as many
        of the batch's samples as its counted activations leave room for (:meth:`_fitting`)."""
        ctx, target, batch, opts = self.watch, check.target, check.batch, check.opts
        saved = self.planner.activations(target, batch) if check.room is not None else None
        batch, cut = self._fitting(check, saved)
        if batch is None:
            return CheckReport(tensors={}, seed=opts.seed, notes=[cast(str, cut)])
        shadow = self.planner.shadow_for(target, opts)
        # through the module: a spy on gradwatch.check.model.run_model_check sees every check
        alone = ctx.grad_fn is None  # distributed too: each rank judges its share on modules (no collective)
        # Under memory_budget the room was sized without the outputs a probe replays: every evaluation runs it all.
        # The batched evaluations hold one forward's activations per perturbation: as counted, in the check's dtype.
        size = opts.torch_dtype.itemsize if opts.torch_dtype is not None else None
        activations = 2 * ctx.memory.transient(ctx.model) if saved is None else saved.scaled(size, batch_dims(batch)[0])
        report = model_check.run_model_check(target, ctx.objective, batch, opts, grad_fn=ctx.grad_fn, names=check.names,
                                             shadow=shadow, mark_unseen=alone,
                                             prefix_bytes=model_check.KEEP_BYTES if check.room is None else None,
                                             activations=activations)
        if cut is not None:
            report.notes.append(cut)
        if alone:
            model_check.judge_unseen_on_modules(report, target, ctx.objective, batch, opts, screen=True)
        if not self._straight_through_named:
            self._straight_through_named = name_straight_through(report, target, ctx.objective.loss, batch, opts)
        if not self._module_named and alone and ctx.one_process:
            self._module_named = name_shared_module(report, target, ctx.objective.loss, batch, opts)
        return report

    def _fitting(self, check: CheckContext, saved: Optional[Saved]) -> Tuple[Any, Optional[str]]:
        """``(batch, note)``: the check's batch, or its first samples where the whole batch's activations (``saved``, as
        counted) would not fit the room beside the float64 copy (an explicit ``form="objective"`` obeys the budget
        too), with a note saying so; ``(None, note)`` where not even one sample fits."""
        ctx, opts, room = self.watch, check.opts, check.room
        if saved is None or room is None:
            return check.batch, None
        dtype = opts.torch_dtype
        shadow = self.planner.shadow
        held = dtype is not None and shadow is not None and shadow.matches(check.target)
        fixed = objective_bytes(check.target, check.names, dtype) - (objective_bytes(check.target, [], dtype) if held else 0)
        per, size = saved.scaled(dtype.itemsize if dtype is not None else None, 1), saved.samples
        keep = objective_samples(fixed, per, size, room)
        if keep >= size:
            return check.batch, None
        need = mb(fixed + objective_activations(per, size))
        if keep == 0:
            return None, (f"the whole objective not checked: {'its float64 copy and ' if dtype is not None else ''}"
                          f"one sample's activations need about {mb(fixed + objective_activations(per))}, over the "
                          f"room memory_budget={ctx.memory.budget} leaves ({mb(room)}) (on the whole batch {need})")
        return sub_batch(check.batch, keep)[0], (
            f"form: objective: checked on {keep} of the batch's {size} samples (on the whole batch it needs about "
            f"{need}, over the room memory_budget={ctx.memory.budget} leaves, {mb(room)}); the training verdict "
            "judges the whole batch")

    def _modules(self, check: CheckContext, fused: Optional[Forward] = None, captures: Optional[int] = None,
                 began: Optional[float] = None) -> CheckReport:
        """Unit by unit: this check's pieces (this rank's share under DDP; shard by shard under FSDP2); their pace
        counts what the check's planning took since ``began``."""
        ctx, target, batch, opts, room = self.watch, check.target, check.batch, check.opts, check.room
        self.planner.drop_shadow()
        replay = check.replay
        held = 0 if replay is None or replay.grads is None else gradient_bytes(replay.grads.values())
        piece_room = None if room is None else int(SAFETY * max(0, room - held))  # DDP holds the replay
        if ctx.objective.differentiates is None:  # once: does loss_fn differentiate inside (a penalty)?
            got = capture(target, ctx.objective.loss, batch, [], opts.seed)  # no unit: the forward, its output's size
            self.output_per_position = got.model_bytes / positions(batch)
            ctx.dropout_only = got.dropout_only
        units, pieces = self.planner.module_pieces(check, piece_room)
        saved = self.planner.activations(target, batch) if room is not None else None
        for unit in units:  # what each unit's own ops save for backward, as counted on this batch
            unit.saved_ratio = saved.ratios.get(unit.name, 0.0) if saved is not None and unit.kind != "loss_fn" else 0.0
        view = None
        everyone = None
        early = ctx.dist is None
        if ctx.by_shard:  # FSDP2: rows on the rank that holds them, the rest gathered piece by piece
            if ctx.lockstep is not None:
                ctx.lockstep.point()  # the gathers are collectives: every rank's capture went well
            reshard(target)  # a forward that found the units left the root's parameters gathered
            everyone = [p.unit for p in pieces]  # the whole check's plan, the same on every rank
            # Tensor and sequence parallel: the capture's forward stops where every rank has captured what it checks
            # (FSDP2's and ZeRO-3's forward hooks keep per-forward state: their forwards run whole).
            early = not ctx.zero3 and not any(is_fsdp(m) for m in target.modules())
            # (DTensors: the whole pieces' parameters gathered after the capture, not held through it; ZeRO-3's
            # gathers run through its hooks, which keep per-forward state: before the capture's forward)
            pieces, gathered, offsets = plan_shards(target, units, pieces, self.piece_seconds, later=not ctx.zero)
            view = ShardView(target, gathered, offsets, ctx.lockstep.point if ctx.lockstep is not None else None)
        elif ctx.dist is not None:
            pieces = ctx.dist.share(pieces)  # DDP: the ranks split the plan
        spent = 0.0 if began is None else time.perf_counter() - began
        try:
            # through the module: a spy on module_form.run_module_check sees every check
            report = module_form.run_module_check(
                target, ctx.objective, batch, opts, units=units, pieces=pieces, room=piece_room, screen=True,
                early=early, replay=fused, replay_budget=captures if fused is not None else None,
                seconds=self.planner.pace_seconds(check, spent),
                sharded=None if view is None else module_form.Sharded(
                    view, everyone, forward_transient(self.output_per_position, batch)))
        except BaseException:
            # (a replay run as the capture may have raised inside the model's backward: FSDP2's state is reset where
            # the check's region ends, as after a replay run on its own, not resharded here midway)
            if view is not None:
                release_freed()
            raise
        if view is not None:
            reshard(target)
            release_freed()  # the pieces' copies, before training's next forward
        # for the next check's forwards, not for the records
        self.output_per_position = report.memory.pop("output_per_position", 0.0) or self.output_per_position
        return report

    def record(self, report: CheckReport) -> None:
        """Count the check of every entry of a completed report; keep its pieces' times, but the first check's (they
        include the first call of each code path, several times a later check's on a tensor parallel model, which made
        the ranks' shares of later checks uneven: docs/costs.md)."""
        for n in report.tensors:
            self.counts[n] = self.counts.get(n, 0) + 1
        if self.watch.checks > 1:
            self.piece_seconds.update(report.piece_seconds)

    def state_dict(self) -> Dict[str, Any]:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.counts = dict(state.get("counts", {}))


__all__ = ["BackwardPart"]
