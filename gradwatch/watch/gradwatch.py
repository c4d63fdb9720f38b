"""GradWatch: the training-loop monitor, a façade over the parts that check.

Data flow of :meth:`GradWatch.step`: schedule says no -> return at once; schedule says yes -> the plan
(:mod:`gradwatch.watch.parts.planning`: tensors, form, room; under DDP rank 0's, agreed by
:mod:`gradwatch.parallel.coordinator`) -> the parts (:mod:`gradwatch.watch.parts.training`,
:mod:`gradwatch.watch.parts.backward`, :mod:`gradwatch.watch.parts.inner`, :mod:`gradwatch.watch.parts.independence`;
float64 shadow, deterministic, side-effect free) -> trend tracker (alerts) -> sinks (logging,
TensorBoard, JSONL) -> alert policy (:mod:`gradwatch.watch.alerts`: ``on_alert``, ``raise_on``).
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import torch
from torch import nn

from gradwatch._version import __version__
from gradwatch.check.judging.report import CheckReport
from gradwatch.check.model import GradFn, trainable_names
from gradwatch.check.numerics.sampling import coverage as coverage_of
from gradwatch.check.numerics.sampling import match_names
from gradwatch.check.objective.terms import Objective, coupled_weight_decay
from gradwatch.check.replay.reference import ForwardRecorder, Step
from gradwatch.config import GradWatchConfig, load_config
from gradwatch.errors import GradWatchError, blamed
from gradwatch.io.records import check_record, run_record
from gradwatch.io.sinks import SinkSet, build_sinks
from gradwatch.parallel.coordinator import DEFAULT_TIMEOUT, DistributedCoordinator
from gradwatch.parallel.shard_check import SHARD_NOTE
from gradwatch.parallel.sharded import refuse_unsupported
from gradwatch.parallel.step_objective import StepObjective
from gradwatch.parallel.wrappers import Wrapping
from gradwatch.plan.memory import MemoryMeter, model_device
from gradwatch.plan.planner import Planner
from gradwatch.watch.alerts import MAX_CONSECUTIVE_FAILURES, AlertPolicy
from gradwatch.watch.clock import OverheadClock
from gradwatch.watch.parts.backward import BackwardPart
from gradwatch.watch.parts.context import WatchContext, check_arguments
from gradwatch.watch.parts.independence import IndependencePart
from gradwatch.watch.parts.inner import InnerPart
from gradwatch.watch.parts.planning import CheckPlanner
from gradwatch.watch.parts.training import TrainingPart
from gradwatch.watch.parts.update import UpdatePart
from gradwatch.watch.runner import CheckRunner
from gradwatch.watch.schedule import Schedule
from gradwatch.watch.trend import Alert, TrendTracker

logger = logging.getLogger("gradwatch")

#: Option names that are Python objects, never YAML keys.
OBJECT_OPTIONS = ("optimizer", "grad_fn", "on_alert", "writer", "distributed", "distributed_timeout", "grad_scaler")

#: Version of :meth:`GradWatch.state_dict`'s layout (raise it when a key changes meaning; older ones still load).
STATE_VERSION = 1


def _forwarded(owner: str, attr: str, doc: str) -> Any:
    """A property of the façade that reads and sets ``self.<owner>.<attr>`` (where the state lives now)."""
    return property(lambda self: getattr(getattr(self, owner), attr),
                    lambda self, value: setattr(getattr(self, owner), attr, value), doc=doc)


class GradWatch:
    """Watches a training run for wrong gradients.

    Call :meth:`step` once per optimizer step, after ``loss.backward()`` and before gradient clipping and
    ``optimizer.step()``. At the first step and then on the schedule (``every=N`` or ``every="auto"`` within
    ``overhead_budget``) a check gives two verdicts per tensor:

    - **backward**: a rotating subset of parameter tensors against two-sided numerical gradients of the full
      objective (loss + regularizers + coupled weight decay), on a float64 shadow copy with dropout off: are the
      backward formulas right?
    - **training** (``training=True``, the default): every watched tensor's live ``.grad`` against the objective's
      gradient recomputed the way training computed it (live model and dtype, the same dropout masks and autocast
      state; see :mod:`gradwatch.check.replay.reference`): is the gradient training applies the objective's?

    Under gradient accumulation call :meth:`accumulate` after each micro-batch's backward. Training is left exactly
    as it would have been: parameters, ``.grad``, buffers and RNG streams are not touched.

    Args:
        model: The model being trained (DDP, ``torch.compile``, Fabric, DeepSpeed looked through: :mod:`gradwatch.parallel.wrappers`).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (the training loss).
        optimizer: Optional; its coupled ``weight_decay`` joins the objective, and the step after each check is
            verified (clipping, the update, ties: :mod:`gradwatch.watch.parts.update`).
        grad_fn: Optional hand-written backprop ``grad_fn(model, batch) -> {name: grad}``.
        on_alert: Optional callback ``on_alert(alert)``; if it raises, the error is logged and training goes on.
        writer: Optional existing ``SummaryWriter`` to log through (e.g. Lightning's).
        distributed: ``"auto"`` (default): coordinate the ranks when ``torch.distributed`` is initialized with 2+
            ranks (see :mod:`gradwatch.parallel.coordinator`); ``False``: act as a single process.
        distributed_timeout: Seconds gradwatch's own collectives wait for a missing rank.
        grad_scaler: Optional ``torch.amp.GradScaler`` of a float16 AMP loop. The training part then replays
            ``scaler.scale(loss).backward()`` and the unscaling as training ran them (the same bits), so call
            :meth:`step` after ``scaler.unscale_(optimizer)``.
        **options: Every option of :class:`~gradwatch.config.GradWatchConfig` (``every``, ``overhead_budget``,
            ``tensors_per_check``, ``raise_on``, ``log_dir``, ``coords``, ``directions``, ``regularizers``, ...).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loss_fn = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])
        >>> with GradWatch(model, loss_fn, every=5) as watch:
        ...     for _ in range(10):
        ...         batch = (torch.randn(16, 4), torch.randn(16, 1))
        ...         opt.zero_grad(); loss_fn(model, batch).backward()
        ...         report = watch.step(batch)
        ...         opt.step()
        >>> sorted(watch.check_counts.values()), watch.coverage["0.weight"], watch.cycle_length
        ([2, 2, 2, 2], {'backward': 1.0, 'training': 1.0}, 1)
        >>> watch.alerts
        []
    """

    grad_fn = _forwarded("context", "grad_fn", "Optional hand-written backprop ``grad_fn(model, batch) -> {name: grad}``.")
    on_alert = _forwarded("policy", "on_alert", "Optional callback ``on_alert(alert)``.")
    alerts = _forwarded("policy", "alerts", "Every alert of the run, in order.")
    grad_scaler = _forwarded("training", "grad_scaler", "Optional ``torch.amp.GradScaler`` the training part replays.")
    replay_context = _forwarded("training", "replay_context", "For integrations: ``() -> context manager`` that "
                                "training's loss runs in (e.g. Lightning's precision context with its autocast); the "
                                "training part's replay runs in it too.")
    _checks = _forwarded("context", "checks", "Checks completed (or failed) so far.")

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        optimizer: Optional[torch.optim.Optimizer] = None,
        grad_fn: Optional[GradFn] = None,
        on_alert: Optional[Callable[[Alert], Any]] = None,
        writer: Any = None,
        distributed: Any = "auto",
        distributed_timeout: float = DEFAULT_TIMEOUT,
        grad_scaler: Any = None,
        **options: Any,
    ) -> None:
        check_arguments(model, loss_fn, on_alert)
        self.config = options.pop("config", None) or GradWatchConfig()
        if options:
            self.config = self.config.replace(**options)
        model = (wrapping := Wrapping.of(model)).model  # the user's module; no collective (DDP) fires in a check
        refuse_unsupported(model)  # FSDP1; FSDP2 is checked on a gathered replica (see gradwatch.parallel.sharded)
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        check_arguments(model, loss_fn, grad_scaler=grad_scaler)
        self._check_options = self.config.check_options()
        names = trainable_names(model)
        if not names:
            raise ValueError(f"{type(model).__name__} has no trainable floating-point parameters to watch")
        match_names(names, self._check_options.tensors)  # fail now on a pattern matching nothing
        weight_decay, notes = coupled_weight_decay(model, wrapping.optimizer(optimizer))  # ZeRO's: its groups
        self.notes: List[str] = notes
        self.objective = Objective(loss_fn, self.config.regularizers, weight_decay)
        self.schedule = Schedule(self.config.every, self.config.overhead_budget, max_interval=self.config.max_interval)
        self.tracker = TrendTracker(**self.config.trend_kwargs())
        # Distributed (an initialized group of 2+ ranks): a coordinator, and file sinks on rank 0 only.
        self.dist = DistributedCoordinator.create(model, distributed, distributed_timeout)
        self.sinks: SinkSet = SinkSet([]) if self.dist is not None and not self.dist.is_main else build_sinks(
            self.config.log_dir, tensorboard=self.config.tensorboard, jsonl=self.config.jsonl, writer=writer
        )
        self._step = 0
        self._closed = False
        #: Training's own peak memory and the room a check has under ``memory_budget`` (:mod:`gradwatch.plan.memory`).
        self.memory = MemoryMeter(self.config.memory_budget, model_device(model))
        #: What each check covers (form, units, the cycle of K checks) and what the run has covered.
        self.planner = Planner(self.config.form, self.config.tensors_per_check, self._check_options.seed, self.config.memory_budget,
                               self.config.pace)
        # Training part: a forward pre-hook records what each training forward started from.
        self._recorder: Optional[ForwardRecorder] = ForwardRecorder(wrapping.root) if self.config.training else None
        #: What every part reads (:mod:`gradwatch.watch.parts.context`).
        self.context = WatchContext(model, self.objective, grad_fn, self._check_options, self.memory, self.dist,
                                    self._recorder, self.config.form, wrapping)
        if self.context.sharded:
            self.notes.append(self.context.sharding_note(SHARD_NOTE))
        #: The plan of each check: tensors, form, shadow, inner modules (:mod:`gradwatch.watch.parts.planning`).
        self.check_plan = CheckPlanner(self.context, self.planner, self.config)
        #: The step's objective of the training part: the weights of a step's micro-batches and ranks (``items=``,
        #: :mod:`gradwatch.parallel.step_objective`).
        self.step_objective = StepObjective(self.config.items)
        #: The parts (:class:`~gradwatch.watch.parts.context.Part`).
        self.backward = BackwardPart(self.context, self.check_plan)
        self.training = TrainingPart(self.context, self.step_objective, self.config.form, grad_scaler)
        self.inner = InnerPart(self.context, self.check_plan)
        #: Independence checks on the checked batch (``independence=``, :mod:`gradwatch.watch.parts.independence`).
        self.independence = IndependencePart(self.config.independence, self.config.alert_cooldown)
        #: What follows an alert: ``on_alert``, ``raise_on``, and the count of failed checks.
        self.policy = AlertPolicy(self.config.raise_on, self._check_options.bands, on_alert)
        #: Runs one check: the plan, the parts, the ranks' results merged (:mod:`gradwatch.watch.runner`).
        self.runner = CheckRunner(self.context, self.check_plan, self.backward, self.training, self.inner,
                                  self.independence, self.schedule, self.tracker, self.step_objective, self.notes)
        self.update = UpdatePart(model, optimizer, self._check_options.seed, emit=lambda s, a: self._emit(s, None, a, 0.0))
        self.update.write = self.sinks.write_update  # the step after each check, in the records
        #: The monitor's seconds against the run's wall time.
        self.clock = OverheadClock(timed=self.runner.say_steps_to_full)
        #: Why the checks are paused (None while they run); see :meth:`pause` and :meth:`resume`.
        self.paused: Optional[str] = None
        #: Names this run in every record; kept in the state, so a resumed run goes on under the same id.
        self.run_id = uuid.uuid4().hex[:12]
        self.sinks.run_id = self.run_id
        for sink in self.sinks:
            if getattr(sink, "appending", False):
                logger.warning("gradwatch: %s already holds records; this run's (run_id %s) are appended, and "
                               "`gradwatch report` keeps the runs apart (or joins a resumed run)", sink.path, self.run_id)
        self.sinks.write_run(run_record(self.config.to_dict(), __version__))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, path: Union[str, Path], *, model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                    **overrides: Any) -> "GradWatch":
        """Build from a YAML file; keyword ``overrides`` win over the file.

        Example:
            >>> import tempfile, os
            >>> path = os.path.join(tempfile.mkdtemp(), "gw.yaml")
            >>> _ = open(path, "w").write("every: 50\\ncoords: 4\\n")
            >>> GradWatch.from_config(path, model=nn.Linear(2, 1), loss_fn=lambda m, b: m(b).sum()).config.every
            50
        """
        config = load_config(path)
        objects = {k: overrides.pop(k) for k in OBJECT_OPTIONS if k in overrides}
        if overrides:
            config = config.replace(**overrides)
        return cls(model, loss_fn, config=config, **objects)

    # ------------------------------------------------------------------ public state
    @property
    def history(self) -> Dict[str, List[Dict[str, Any]]]:
        """Per-tensor history of checks (see :class:`~gradwatch.watch.trend.TrendTracker`)."""
        return self.tracker.history

    @property
    def coverage(self) -> Dict[str, Dict[str, float]]:
        """Per watched tensor, the share of its rows each part has probed in the run:
        ``{name: {"backward": fraction, "training": fraction}}`` (see :mod:`gradwatch.plan.coverage`;
        :attr:`modules_checked` lists the modules whose own code was inside a checked unit)."""
        return self.planner.coverage.fractions(self._watched_names())

    @property
    def check_counts(self) -> Dict[str, int]:
        """How many checks of the backward part each watched tensor has been in."""
        return coverage_of(self.backward.counts, self._watched_names())

    @property
    def modules_checked(self) -> Dict[str, int]:
        """Module form: module name -> checks in which its code (own code, or whole) was inside a checked unit."""
        return dict(self.planner.coverage.modules)

    @property
    def cycle_length(self) -> Optional[int]:
        """K: checks within which every unit and every parameter row is probed once (None before the first check)."""
        return self.check_plan.cycle_length

    @property
    def overhead_fraction(self) -> Optional[float]:
        """Share of wall time spent in the monitor since the first step, the baseline check at the first step
        included (with ``every="auto"`` it dominates short runs; see :attr:`overhead_fraction_after_baseline`)."""
        return self.clock.fraction()

    @property
    def overhead_fraction_after_baseline(self) -> Optional[float]:
        """:attr:`overhead_fraction` leaving out the baseline check at the first step (what ``overhead_budget`` governs)."""
        return self.clock.after_baseline()

    def _watched_names(self) -> List[str]:
        return self.context.watched_names()

    # ------------------------------------------------------------------ the loop
    def step(self, batch: Any = None, *, loss: Any = None, global_step: Optional[int] = None) -> Optional[CheckReport]:
        """Call once per optimizer step, after backward and before clipping and ``optimizer.step()``.

        Runs a check when the schedule says so.

        Args:
            batch: The current batch, passed untouched to ``loss_fn`` (under gradient
                accumulation: the last micro-batch, or None when every micro-batch was
                given to :meth:`accumulate`).
            loss: Optional: the value of ``loss_fn(model, batch)`` plus regularizers that training
                computed for this batch (a tensor or float; read only when a check runs). The
                training part then also says when training's loss differs from the objective's,
                and it verifies the replay where no forward of the model was seen.
            global_step: Step number to log under (default: an internal counter).

        Returns:
            The :class:`CheckReport` when a check ran, else None.

        Raises:
            GradientDriftError: After logging, when ``raise_on`` matches an alert.
        """
        if self.runner.running:  # called from inside a check (e.g. the objective stepped an optimizer): never re-enter
            return None
        now = self.clock.enter_step(self.schedule)
        step = self._step if global_step is None else int(global_step)
        self._step = step + 1
        try:
            if self.paused is not None or not self._due(step):
                return None
            pending = self.context.take(batch, loss)
            return self._run(step, pending.micro[-1].batch, pending=pending)
        finally:
            if self._recorder is not None:  # a new step starts: forget this one's forwards
                self._recorder.discard(full=self._due(step + 1))  # every generator's state only if it is checked
            self.clock.leave_step(now)

    def check(self, batch: Any, *, global_step: Optional[int] = None) -> Optional[CheckReport]:
        """Run a check now, whatever the schedule (returns None if ``loss_fn`` raised).

        An ``every=N`` schedule keeps its steps (0, N, 2N, ...); with ``every="auto"`` the
        next scheduled check is counted from this one, as its cost is paid.
        """
        step = self._step if global_step is None else int(global_step)
        start = time.perf_counter()
        try:
            pending = self.context.take(batch, None)
            return self._run(step, pending.micro[-1].batch, scheduled=False, pending=pending)
        finally:
            self.clock.add(time.perf_counter() - start)

    def accumulate(self, batch: Any, *, loss: Any = None) -> None:
        """Gradient accumulation: call after each micro-batch's backward, then :meth:`step` once.

        The training part then compares ``.grad`` with the gradient of the step's objective: the
        objective over every micro-batch of the step, each weighing its share of the step's items
        (``items=``; :mod:`gradwatch.parallel.step_objective`), as one batch would. Without these
        calls, a step whose ``.grad`` holds several micro-batches is recorded as
        "skipped: accumulating", never as wrong (one ``unjudged`` warning says so, once for the run).

        Args:
            batch: The micro-batch, as passed to ``loss_fn``.
            loss: Optional: training's value of ``loss_fn(model, batch)`` plus regularizers, before
                any division by the number of micro-batches.

        Example:
            >>> model = nn.Linear(3, 1)
            >>> loss_fn = lambda m, b: m(b).pow(2).mean()
            >>> watch = GradWatch(model, loss_fn, every=1, tensorboard=False, jsonl=False)
            >>> micro = [torch.randn(4, 3) for _ in range(2)]
            >>> for mb in micro:
            ...     (loss_fn(model, mb) / 2).backward()
            ...     watch.accumulate(mb)
            >>> report = watch.step()
            >>> report.training["weight"].verdict.value
            'excellent'
        """
        self.context.close_micro_batch(batch, loss)

    def start_batch(self) -> None:
        """For integrations: a micro-batch's ``loss_fn`` starts now, with no random draw before it (the replay
        starts every generator from here, :mod:`gradwatch.check.replay.reference`, even without a model forward)."""
        if self._recorder is not None:
            self._recorder.mark(exact=True, full=self.paused is None and self._due(self._step))

    def _due(self, step: int) -> bool:
        return self.schedule.due(step) if self.dist is None else self.dist.due(step, self.schedule)

    def _run(self, step: int, batch: Any, scheduled: bool = True, pending: Optional[Step] = None) -> Optional[CheckReport]:
        """One check (:class:`~gradwatch.watch.runner.CheckRunner`), then its records and alerts."""
        try:
            if self._closed:
                raise RuntimeError("GradWatch is closed; create a new one to keep monitoring")
            outcome = self.runner.run(step, batch, scheduled, pending)
        finally:
            self.context.release()  # a sharded model's gathered .grad lives for one check only
        if outcome is None:
            return None
        if outcome.error is not None:
            self._failed(step, outcome.error, outcome.seconds)
            return None
        if not outcome.merged:
            self.policy.succeeded()
            self.clock.checked(outcome.seconds)
        try:
            self._emit(step, outcome.report, outcome.alerts, outcome.seconds)
            self.update.arm(step)  # .grad as backprop left it: the step that follows is watched
        except GradWatchError:
            raise  # GradientDriftError: raise_on asked for it, after the records were written
        except Exception as exc:  # noqa: BLE001 - recording it failed (a gradwatch bug): an error alert, never training's
            self._failed(step, exc, outcome.seconds)
            return None
        return outcome.report

    def _failed(self, step: int, exc: Exception, seconds: float) -> None:
        """A check raised: log its cause once per kind of failure, count it, and pause after a few in a row."""
        key = self.policy.failed(step, exc)
        alert = self.tracker.error(step, exc, where=blamed(exc))
        self._emit(step, None, [alert] if alert is not None else [], seconds)
        if self.policy.should_pause() and self.paused is None:
            self.pause(f"{self.policy.failures} checks in a row failed (last: {key})", step=step)

    def pause(self, reason: str, *, step: Optional[int] = None) -> None:
        """Stop scheduled checks (``step`` returns None at once), with one ``paused`` alert (a warning).

        Called by the watch itself after :data:`MAX_CONSECUTIVE_FAILURES` failed checks in a row, and by
        integrations that find the check objective changing training. :meth:`resume` starts checking again.

        Example:
            >>> watch = GradWatch(nn.Linear(2, 1), lambda m, b: m(b).sum(), every=1)
            >>> watch.pause("testing")
            >>> watch.step(torch.zeros(3, 2)) is None, watch.paused
            (True, 'testing')
            >>> watch.resume(); watch.step(torch.zeros(3, 2)) is not None
            True
        """
        if self.paused is not None:
            return
        self.paused = str(reason)
        step = self._step if step is None else int(step)
        self._emit(step, None, [self.policy.paused_alert(step, reason)], 0.0)

    def resume(self) -> None:
        """Undo :meth:`pause`: scheduled checks run again."""
        self.paused = None
        self.policy.succeeded()

    def _emit(self, step: int, report: Optional[CheckReport], alerts: List[Alert], seconds: float) -> None:
        if report is not None:
            record = check_record(step, report, seconds=seconds, overhead_fraction=self.clock.fraction_with(seconds),
                                  coverage=self.coverage, check_counts=self.check_counts, cycle_length=self.cycle_length)
            record["overhead_fraction_after_baseline"] = self.clock.after_baseline_with(seconds, self.context.checks)
            self.sinks.write_check(record, alerts)
        elif alerts:
            self.sinks.write_alerts(alerts)
        self.policy.deliver(step, alerts)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume: schedule, trends, coverage, counters."""
        return {
            "version": STATE_VERSION,
            "run_id": self.run_id,
            "step": self._step,
            "checks": self.context.checks,
            **self.backward.state_dict(),  # "counts"
            "plan": self.planner.state_dict(),
            "schedule": self.schedule.state_dict(),
            "tracker": self.tracker.state_dict(),
            "independence": self.independence.state_dict(),
            **self.policy.state_dict(),  # "alerts"
            **self.clock.state_dict(),  # "monitor_seconds", "baseline_seconds", "wall_seconds"
            **self.training.state_dict(),  # "training": the accumulation window
            **self.update.state_dict(),  # "update": what it said, the clipping thresholds
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the schedule and trends continue as if uninterrupted."""
        if not isinstance(state, Mapping) or "tracker" not in state:
            raise ValueError("load_state_dict expects a dict produced by GradWatch.state_dict()")
        version = state.get("version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= STATE_VERSION:
            raise ValueError(f"load_state_dict: the state has version {version!r}, this gradwatch "
                             f"({__version__}) reads versions 1 to {STATE_VERSION}: a checkpoint written by a newer "
                             "gradwatch; upgrade gradwatch, or drop the 'gradwatch' entry to start the watch afresh")
        self._step = int(state["step"])
        self.context.checks = int(state["checks"])
        self.backward.load_state_dict({"counts": state["counts"]})
        self.planner.load_state_dict(state.get("plan", {}))
        self.schedule.load_state_dict(state["schedule"])
        self.tracker.load_state_dict(state["tracker"])
        self.independence.load_state_dict(state.get("independence", {}))
        for part in (self.policy, self.clock, self.training, self.update):  # each reads its own keys of the state
            part.load_state_dict(state)
        run_id = state.get("run_id")
        if run_id and str(run_id) != self.run_id:  # a resumed run: its records go on under its id
            self.run_id = self.sinks.run_id = str(run_id)
            self.sinks.write_run({**run_record(self.config.to_dict(), __version__), "resumed_at_step": self._step})

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Flush and close the sinks and remove the forward hook from the model (idempotent)."""
        if not self._closed:
            self._closed = True
            self.runner.close()
            self.update.close()
            if self._recorder is not None:
                self._recorder.close()
            self.sinks.close()
            if self.dist is not None:
                self.dist.close()

    def __enter__(self) -> "GradWatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GradWatch(every={self.config.every!r}, checks={self.context.checks}, alerts={len(self.alerts)})"


__all__ = ["MAX_CONSECUTIVE_FAILURES", "OBJECT_OPTIONS", "STATE_VERSION", "GradWatch"]
