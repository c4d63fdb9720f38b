"""One check, from its plan to its report and alerts: the parts called in order, and the ranks' results merged.

:class:`CheckRunner` runs a check for the façade (:class:`~gradwatch.GradWatch`): the plan
(:class:`~gradwatch.watch.parts.planning.CheckPlanner`; under DDP rank 0's, taken by every rank), then the
training part's replay, the backward part, and on the reporting rank the inner-derivatives and
independence parts; distributed, every rank's result is gathered and merged alike
(:mod:`gradwatch.parallel.coordinator`). It writes nothing and raises nothing of the user's code: the
façade gets an :class:`Outcome` to record and to alert on.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch import GradWatch
    >>> watch = GradWatch(nn.Linear(3, 1), lambda m, b: m(b).pow(2).mean(), every=1, training=False, log_dir=None)
    >>> outcome = watch.runner.run(0, torch.randn(4, 3), scheduled=False)
    >>> sorted(outcome.report.tensors), outcome.alerts, outcome.error
    (['bias', 'weight'], [], None)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from gradwatch.check.judging.report import CheckReport
from gradwatch.check.objective.rng import preserved_rng
from gradwatch.errors import GradWatchError, blamed
from gradwatch.io.headlines import line
from gradwatch.io.records import check_record
from gradwatch.parallel.coordinator import RankResult, merge_results
from gradwatch.parallel.lockstep import Lockstep
from gradwatch.parallel.sharded import live_forward_forbidden
from gradwatch.parallel.step_objective import StepObjective
from gradwatch.plan.memory import MemoryMeter, model_device, release_freed
from gradwatch.watch.alerts import AlertPolicy
from gradwatch.watch.check_thread import CheckThread
from gradwatch.watch.clock import OverheadClock
from gradwatch.watch.parts.backward import BackwardPart
from gradwatch.watch.parts.context import CheckContext, WatchContext
from gradwatch.watch.parts.independence import IndependencePart
from gradwatch.watch.parts.inner import InnerPart
from gradwatch.watch.parts.planning import CheckPlanner
from gradwatch.watch.parts.replay_capture import Hooks, ReplayCapture, fusable, held_budget
from gradwatch.watch.parts.training import TrainingPart
from gradwatch.watch.parts.update import Replicas, UpdatePart, replica_hashes
from gradwatch.watch.schedule import Schedule
from gradwatch.watch.trend import WHOLE_CHECK, Alert, TrendTracker

logger = logging.getLogger("gradwatch")


@dataclasses.dataclass
class Outcome:
    """What a check gives the façade to record and alert on.

    Attributes:
        report: The check's report (merged over the ranks, distributed); None when it has none.
        alerts: The alerts it raised (its trends', the independence part's, a distributed error's).
        seconds: The seconds it took (distributed: the slowest rank's).
        error: In one process, what the check raised (the façade counts it, and may pause the checks).
        merged: Whether the ranks' results were merged (distributed).

    Example:
        >>> Outcome(None, [], 0.5).merged
        False
    """

    report: Optional[CheckReport]
    alerts: List[Alert]
    seconds: float
    error: Optional[Exception] = None
    merged: bool = False


#: Version of :meth:`GradWatch.state_dict`'s layout (raise it when a key changes meaning; older ones still load).
STATE_VERSION = 1


def check_state(state: Any, version_text: str) -> None:
    """Refuse a checkpoint state that :meth:`GradWatch.state_dict` did not write, or a newer layout's.

    Example:
        >>> check_state({"tracker": {}, "version": 9}, "0.1.0")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: load_state_dict: the state has version 9, this gradwatch (0.1.0) reads versions 1 to 1: ...
    """
    if not isinstance(state, Mapping) or "tracker" not in state:
        raise ValueError("load_state_dict expects a dict produced by GradWatch.state_dict()")
    version = state.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= STATE_VERSION:
        raise ValueError(f"load_state_dict: the state has version {version!r}, this gradwatch "
                         f"({version_text}) reads versions 1 to {STATE_VERSION}: a checkpoint written by a newer "
                         "gradwatch; upgrade gradwatch, or drop the 'gradwatch' entry to start the watch afresh")


@dataclasses.dataclass
class Delivery:
    """Where a check's outcome goes once the runner has it.

    Attributes:
        sinks: The records (logging, TensorBoard, JSONL).
        policy: The alert policy (``on_alert``, ``raise_on``, failed checks counted).
        clock: The overhead clock (a check's seconds).
        update: The update part, armed after each check (the optimizer step that follows is watched).
        so_far: ``() -> {"coverage", "check_counts", "cycle_length"}``: what a check record says of the run so far.
        pause: ``pause(reason, step)``: the façade's pause, after failed checks in a row.

    Example:
        See :class:`CheckRunner`'s module.
    """

    sinks: Any
    policy: AlertPolicy
    clock: OverheadClock
    update: UpdatePart
    so_far: Callable[[], Dict[str, Any]]
    pause: Callable[[str, int], None]


class CheckRunner:
    """Runs one check: the plan, the parts, then (distributed) the ranks' results gathered and merged.

    Args:
        watch: The watch's setting.
        check_plan: The planner of the checks.
        backward, training, inner, independence: The parts.
        schedule: The schedule (a check's seconds are recorded in it; distributed, its interval travels).
        tracker: The trends, which turn a report into alerts.
        step_objective: The step's objective (its sketches of the micro-batches travel with the result).
        notes: Notes every report starts with (the optimizer's weight decay, the sharding...).

    Example:
        See the module's example.
    """

    def __init__(self, watch: WatchContext, check_plan: CheckPlanner, backward: BackwardPart, training: TrainingPart,
                 inner: InnerPart, independence: IndependencePart, schedule: Schedule, tracker: TrendTracker,
                 step_objective: StepObjective, notes: List[str]) -> None:
        self.watch = watch
        self.thread = CheckThread()  # one process on the CPU: a check allocates from an arena of its own
        self.check_plan = check_plan
        self.backward, self.training, self.inner, self.independence = backward, training, inner, independence
        self.schedule = schedule
        self._said_steps: Optional[int] = None
        self.tracker = tracker
        self.step_objective = step_objective
        self.notes = notes
        #: A check is running (a step() from inside it, the objective stepping an optimizer, is ignored).
        self.running = False
        #: The replay is tried as the capture's forward (until a replay's forward was not faithful).
        self._fuse = True
        #: Replicas (DDP's, DTensors' replicated shards) compared across ranks at each check
        #: (:class:`~gradwatch.watch.parts.update.Replicas`).
        self.replicas = Replicas()

    @property
    def memory(self) -> MemoryMeter:
        return self.watch.memory

    def run(self, step: int, batch: Any, scheduled: bool = True, pending: Any = None) -> Optional[Outcome]:
        """One check of ``batch`` at ``step`` (None when the ranks' coordinator is broken: no more checks); in one
        process with the model on the CPU, in the check's own thread (:mod:`gradwatch.watch.check_thread`)."""
        ctx = self.watch
        if ctx.one_process and model_device(ctx.model).type == "cpu":
            return self.thread.run(lambda: self._run(step, batch, scheduled, pending))
        return self._run(step, batch, scheduled, pending)

    def close(self) -> None:
        """Stop the check's thread (idempotent)."""
        self.thread.close()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The parts' state, the plan's coverage, the schedule and the trends, for a checkpoint."""
        return {
            **self.backward.state_dict(),  # "counts"
            "plan": self.check_plan.planner.state_dict(),
            "schedule": self.schedule.state_dict(),
            "tracker": self.tracker.state_dict(),
            "independence": self.independence.state_dict(),
            **self.training.state_dict(),  # "training": the accumulation window
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume what :meth:`state_dict` kept (a state of any version :func:`check_state` accepts)."""
        self.watch.checks = int(state["checks"])
        self.backward.load_state_dict({"counts": state["counts"]})
        self.check_plan.planner.load_state_dict(state.get("plan", {}))
        self.schedule.load_state_dict(state["schedule"])
        self.tracker.load_state_dict(state["tracker"])
        self.independence.load_state_dict(state.get("independence", {}))
        self.training.load_state_dict(state)  # reads its own keys of the state

    # ------------------------------------------------------------------ a check's outcome delivered
    def check(self, step: int, batch: Any, delivery: Delivery, scheduled: bool = True, pending: Any = None
              ) -> Optional[CheckReport]:
        """One check (:meth:`run`), then its records and alerts (:meth:`emit`); a check that raised, or whose
        records could not be written, is counted and alerted as an error (:meth:`failed`), never training's."""
        try:
            outcome = self.run(step, batch, scheduled, pending)
        finally:
            self.watch.release()  # a sharded model's gathered .grad lives for one check only
        if outcome is None:
            return None
        if outcome.error is not None:
            self.failed(step, outcome.error, outcome.seconds, delivery)
            return None
        if not outcome.merged:
            delivery.policy.succeeded()
            delivery.clock.checked(outcome.seconds)
        try:
            self.emit(step, outcome.report, outcome.alerts, outcome.seconds, delivery)
            delivery.update.arm(step)  # .grad as backprop left it: the step that follows is watched
        except GradWatchError:
            raise  # GradientDriftError: raise_on asked for it, after the records were written
        except Exception as exc:  # noqa: BLE001 - recording it failed (a gradwatch bug): an error alert, never training's
            self.failed(step, exc, outcome.seconds, delivery)
            return None
        return outcome.report

    def failed(self, step: int, exc: Exception, seconds: float, delivery: Delivery) -> None:
        """A check raised: log its cause once per kind of failure, count it, and pause after a few in a row."""
        key = delivery.policy.failed(step, exc)
        alert = self.tracker.error(step, exc, where=blamed(exc))
        self.emit(step, None, [alert] if alert is not None else [], seconds, delivery)
        if delivery.policy.should_pause():
            delivery.pause(f"{delivery.policy.failures} checks in a row failed (last: {key})", step)

    def emit(self, step: int, report: Optional[CheckReport], alerts: List[Alert], seconds: float,
             delivery: Delivery) -> None:
        """A check's record (with its alerts) to the sinks, or the alerts alone; then the alert policy."""
        if report is not None:
            clock = delivery.clock
            record = check_record(step, report, seconds=seconds, overhead_fraction=clock.fraction_with(seconds),
                                  **delivery.so_far())
            record["overhead_fraction_after_baseline"] = clock.after_baseline_with(seconds, self.watch.checks)
            delivery.sinks.write_check(record, alerts)
        elif alerts:
            delivery.sinks.write_alerts(alerts)
        delivery.policy.deliver(step, alerts)

    def _run(self, step: int, batch: Any, scheduled: bool, pending: Any) -> Optional[Outcome]:
        ctx, coord = self.watch, self.watch.dist
        if coord is not None and coord.broken is not None:
            return None
        opts = dataclasses.replace(ctx.options, seed=ctx.options.seed + ctx.checks)
        check = CheckContext(ctx, step, ctx.model, batch, opts, pending)
        start = time.perf_counter()
        self.running = True
        error: Optional[Exception] = None
        try:
            self._plan_and_run(check)
            if coord is None:
                if check.report is None:
                    raise ValueError(f"no tensor was chosen for the check at step {step} (tensors_per_check="
                                     f"{self.check_plan.config.tensors_per_check!r})")
                self.memory.checked()
        except Exception as exc:  # noqa: BLE001 - the user's code raised: log it, keep training
            error = exc
        finally:
            self.running = False
            waited = ctx.lockstep.waited if ctx.lockstep is not None else 0.0
            ctx.lockstep = None
        seconds = time.perf_counter() - start
        self.schedule.record_check(step, seconds, scheduled)
        if coord is not None:
            try:
                return self._across_ranks(check, error, seconds, waited)
            except Exception as exc:  # noqa: BLE001 - its bookkeeping after the last collective: a failed check
                return Outcome(None, [], seconds, exc)
            finally:
                if not ctx.sharded or ctx.by_shard:
                    self.memory.checked()  # after the replays' averaging: its peak is the check's, not training's
        if error is not None:
            return Outcome(None, [], seconds, error)
        assert check.report is not None
        self.check_plan.planner.timed(check.report.form, seconds)
        try:
            return Outcome(check.report, self.completed(step, check.report), seconds)
        except Exception as exc:  # noqa: BLE001 - gradwatch's own bookkeeping raised: a failed check, never training's
            return Outcome(None, [], seconds, exc)

    def _plan_and_run(self, check: CheckContext) -> None:
        """The check's plan (room, form, tensors; under DDP rank 0's, taken by every rank), then the parts.

        Distributed, the coordinator is called at fixed points, the same on every rank: the layout of a sharded
        model agreed and gathered first (before anything that may raise), then this rank's share of the tensors.
        """
        ctx, coord = self.watch, self.watch.dist
        # The memory budget holds in one process and under DDP (rank 0 decides for all, every rank holding
        # the whole model); under FSDP2 every rank checks the whole objective on its gathered replica.
        if coord is None or not ctx.sharded or ctx.by_shard:
            self.memory.observe()
            check.room = self.memory.room()
        if coord is not None and ctx.by_shard:
            # Every rank plans from the same state (a check that failed on some rank is undone on every rank,
            # in _across_ranks) and with the smallest room (measured after the replay, _run_parts).
            self.check_plan.mark()
        if coord is not None and not ctx.sharded:
            fitting = self.training.fitting if self.training.enabled else None
            check.room, check.plan = coord.plan_from_main(check.room, lambda: self.check_plan.for_ranks(check.room, fitting))
            self.training.count(check.plan.training or ())
        with preserved_rng():  # one guard for every part: every generator as training left it afterwards
            check.target = ctx.target()  # the model, or the replica gathered from a sharded one
            check.chosen = self.check_plan.tensors(self.backward.counts)
            check.names = self.check_plan.mine(check.chosen, check.plan)
            check.judge = coord is None or ctx.by_shard
            if ctx.by_shard and coord is not None:
                ctx.lockstep = Lockstep(coord, ctx.model)
            try:
                with live_forward_forbidden(ctx.model) if ctx.sharded and not ctx.by_shard \
                        else ctx.lockstep or contextlib.nullcontext():
                    self._run_parts(check)
            except BaseException:
                check.report = check.replay = None  # nothing of a check that raised goes to the other ranks
                raise
            finally:
                if check.room is not None:
                    release_freed(mkl=True)  # what the check freed, before training's next forward allocates
            # every rank: each part says what it does there (every rank's batch); where another rank's check raised
            # (seen at the region's last agreement point) none does, as on the rank that raised
            if check.report is not None and not (ctx.lockstep is not None and ctx.lockstep.failed):
                self.inner.run(check)
                k = self.check_plan.cycle_length
                later = None if coord is not None else self.independence.due(ctx.checks, k)
                if later is None:
                    self.independence.run(check)
                elif self.independence.enabled:
                    check.report.notes.append(f"independence: checked at the first check of each pass of K = {k} checks "
                                              f"(the next: check {later + 1})")

    def _run_parts(self, check: CheckContext) -> None:
        """The training part's replay (judged first in one process, its replayed gradients freed before the
        backward part allocates; else kept in ``check.replay`` for the ranks to average), then the backward part.
        In one process, and shard by shard through DTensors, where the replay's forward computes the capture's, the
        replay is the backward part's capture forward (:mod:`gradwatch.watch.parts.replay_capture`; agreed by every rank)."""
        ctx = self.watch
        judged: Optional[CheckReport] = None
        objective: Optional[float] = None
        check.held = held_budget(ctx, check.room)  # what the captures may hold through a replay that is their forward
        if check.room is not None and check.judge and ctx.one_process and ctx.recorder is not None:
            check.saved = self.check_plan.activations(check.target, check.batch)  # (counted once a batch shape)
        replayed: Optional[float] = None  # the replay's seconds: the step's forwards and backwards again, about a step

        def replay(hooks: Optional[Hooks] = None) -> Tuple[Optional[float], Optional[bool]]:
            nonlocal judged, objective, replayed
            check.hooks, check.faithful = hooks, None
            ran = self.training.run(check)  # its replay is in check.replay only: dropped below,
            check.hooks = None  # the capture's hooks and what they hold: for this replay's forward only
            if ran is not None and ran.seconds:  # freed
                replayed = ran.seconds
            if hooks is not None and ctx.recorder is not None:
                ctx.recorder.paused = True  # the backward part's evaluations go on: not training forwards
            if check.judge:
                judged = CheckReport(tensors={})
                self.training.judge(judged, check.replay)
                objective = getattr(check.replay, "objective", None)
                check.replay = None
                if check.room is not None or ctx.by_shard:
                    # the replay's activations and gradients, before the backward part allocates and measures (the
                    # whole objective's batches are sized to training's activations: what the process holds now is
                    # taken off)
                    release_freed()
            return objective, check.faithful  # (None: its forward ran without the hooks)

        fused: Optional[ReplayCapture] = None
        if ctx.lockstep is not None and ctx.by_shard and not ctx.zero:  # a point on every rank, whatever each says
            lockstep = ctx.lockstep
            if lockstep.point(1 if self._fuse and fusable(ctx, check) else 0) == 1:  # every rank's check can
                fused = ReplayCapture(replay, lockstep.point)
        elif ctx.one_process and self._fuse and fusable(ctx, check):
            fused = ReplayCapture(replay, lambda value: value)  # one process: no other rank to agree with
        if fused is None:
            replay()
        check.step_seconds = self.schedule.step_seconds() or replayed
        if ctx.by_shard and check.room is not None:
            # What the replay left held counts against the room (measured again now); every rank plans the same
            # pieces with the smallest room (an agreement point: a rank that raised above stops the others here).
            check.room = self.memory.room()
            if ctx.lockstep is not None:
                check.room = ctx.lockstep.point(check.room)
        check.fused = fused
        report = check.report = self.backward.run(check)
        check.fused = None  # (the capture's forward, for the backward part's run only)
        if fused is not None and not fused.ran:  # (one process: no piece captured, or the whole objective's form)
            replay()
        if fused is not None and fused.ran and not fused.usable and not fused.declined:
            self._fuse = False  # its forward drew random numbers or ran autocast (alike on every rank): not again
        if report is not None and report.objective != report.objective and objective is not None:
            # the module form's capture stopped before the loss (one process): the replay's is the step's objective
            report.objective, report.terms = objective, {"loss": objective}
            report.nonfinite = report.nonfinite or not math.isfinite(objective)
        if report is not None and judged is not None:
            report.training, report.training_note = judged.training, judged.training_note
            report.training_rows, report.training_items = judged.training_rows, judged.training_items
            report.training_window = judged.training_window

    def completed(self, step: int, report: CheckReport) -> List[Alert]:
        """A check that has a report: notes, counters and coverage, then its trends' alerts and the parts' own."""
        report.notes[:0] = self.notes
        self.watch.checks += 1
        self.backward.record(report)
        self.check_plan.record(step, report)
        report.steps_to_full = self.say_steps_to_full()
        return (self.tracker.update(step, report) + self.training.alerts(step, report)
                + self.independence.alerts(step, report.independence))

    def say_steps_to_full(self) -> Optional[int]:
        """K checks in steps (None before K and the interval are known), said once each time it changes: at each
        check, and under ``every="auto"`` as soon as the first step after the first check is timed."""
        k, per = self.check_plan.cycle_length, self.schedule.steps_per_check()
        full = None if k is None or per is None else k * per
        if full is not None and full != self._said_steps:
            self._said_steps = full
            budget = f" at the {self.schedule.overhead_budget * 100:g}% overhead_budget" \
                if self.schedule.every == "auto" else ""
            logger.info("gradwatch: every op and parameter row checked within about %d steps%s (K = %d checks, one "
                        "every %d steps)", full, budget, k, per)
        return full

    def _across_ranks(self, check: CheckContext, error: Optional[Exception], seconds: float,
                      waited: float = 0.0) -> Outcome:
        """This rank's share gathered with the others' and merged alike on every rank; its trends' alerts."""
        coord, step, replay = self.watch.dist, check.step, check.replay
        assert coord is not None
        replayed = replay is not None and replay.grads is not None
        result = RankResult(rank=coord.rank, report=check.report, seconds=seconds, waited=waited,
                            interval=self.schedule.interval(),
                            training=None if replay is None else (replay.grads is not None, replay.reason),
                            cut=list(self.step_objective.rows) if replayed else None,
                            replicas=replica_hashes(self.watch.model)
                            if self.watch.wrapping.replicated or self.watch.sharded else None)
        results = coord.gather_check(step, result, error)
        if results is None:  # once: the coordinator is broken and checks no more
            gave_up = Alert(step=int(step), tensor=WHOLE_CHECK, kind="error", severity="error", value=math.nan,
                            baseline=None, message=f"step {step}: {coord.broken}; training continues",
                            headline=line("distributed checks stopped", "", "the ranks no longer meet", step))
            return Outcome(None, [gave_up], seconds, merged=True)
        merged = merge_results(results, check.chosen, check.opts)
        if merged.error is not None:
            self.check_plan.rewind()  # shard by shard: the same plan on every rank again
        alerts: List[Alert] = []
        if merged.report is not None:
            self.training.judge_across_ranks(merged.report, replay, merged.training, [r.cut for r in results])
            alerts = self.completed(step, merged.report)
        else:
            self.watch.checks += 1
        if merged.error is not None:
            alert = self.tracker.error(step, merged.error, where=merged.where)
            alerts.extend([alert] if alert is not None else [])
        alerts.extend(self.replicas.alerts(step, [r.replicas for r in results]))
        return Outcome(merged.report, alerts, merged.seconds, merged=True)


__all__ = ["STATE_VERSION", "CheckRunner", "Delivery", "Outcome", "check_state"]
