"""GradWatch: the training-loop monitor, a façade that wires the parts that check (:mod:`gradwatch.watch.parts`).

:meth:`GradWatch.step`: the schedule says no -> return at once; yes -> the runner (:mod:`gradwatch.watch.runner`:
the plan, the parts, the ranks' results merged) -> trends (alerts) -> sinks -> the alert policy.
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
from gradwatch.config import resolve_config
from gradwatch.io.records import run_record
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
from gradwatch.watch.runner import STATE_VERSION, CheckRunner, Delivery, check_state
from gradwatch.watch.schedule import Schedule
from gradwatch.watch.trend import Alert, TrendTracker

logger = logging.getLogger("gradwatch")


def _forwarded(owner: str, attr: str, doc: str) -> Any:
    """A property of the façade that reads and sets ``self.<owner>.<attr>`` (where the state lives now)."""
    return property(lambda self: getattr(getattr(self, owner), attr),
                    lambda self, value: setattr(getattr(self, owner), attr, value), doc=doc)


class GradWatch:
    """Watches a training run for wrong gradients.

    Call :meth:`step` once per optimizer step, after ``loss.backward()`` and before clipping and ``optimizer.step()``
    (under accumulation, :meth:`accumulate` after each micro-batch's backward). At the first step and then on the
    schedule (``every=N``, or ``every="auto"`` within ``overhead_budget``) a check gives each tensor two verdicts:
    **backward** (the backward formulas against two-sided numerical gradients of the whole objective, on a float64
    shadow with dropout off) and **training** (the live ``.grad`` against the objective's gradient recomputed as
    training computed it: :mod:`gradwatch.check.replay.reference`). Training is left exactly as it would have been.

    Args:
        model: The model being trained (DDP, ``torch.compile``, Fabric, DeepSpeed looked through: :mod:`gradwatch.parallel.wrappers`).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (the training loss).
        optimizer: Optional; its coupled ``weight_decay`` joins the objective, and the step after each check is
            verified (clipping, the update, ties: :mod:`gradwatch.watch.parts.update`).
        grad_fn: Optional hand-written backprop ``grad_fn(model, batch) -> {name: grad}``.
        on_alert: Optional callback ``on_alert(alert)``; if it raises, the error is logged and training goes on.
        writer: Optional existing ``SummaryWriter`` to log through (e.g. Lightning's).
        distributed: ``"auto"`` (default): coordinate the ranks when ``torch.distributed`` is initialized with 2+
            ranks (:mod:`gradwatch.parallel.coordinator`); ``"on"``: require them; ``"off"``: act as one process.
        distributed_timeout: Seconds gradwatch's own collectives wait for a missing rank.
        grad_scaler: Optional ``torch.amp.GradScaler`` of a float16 AMP loop. The training part then replays
            ``scaler.scale(loss).backward()`` and the unscaling as training ran them (the same bits), so call
            :meth:`step` after ``scaler.unscale_(optimizer)``.
        **options: Every option of :class:`~gradwatch.config.GradWatchConfig`, flat (``every=50``) or by group
            (``schedule={"every": 50}``); ``config=``: a ``GradWatchConfig`` or a YAML path, the keywords winning.

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
        self.config = resolve_config(options.pop("config", None), options)
        model = (wrapping := Wrapping.of(model)).model  # the user's module; no collective (DDP) fires in a check
        refuse_unsupported(model)  # FSDP1; FSDP2 is checked on a gathered replica (see gradwatch.parallel.sharded)
        check_arguments(model, loss_fn, grad_scaler=grad_scaler)
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self._check_options = self.config.check_options()
        names = trainable_names(model)
        if not names:
            raise ValueError(f"{type(model).__name__} has no trainable floating-point parameters to watch")
        match_names(names, self._check_options.tensors)  # fail now on a pattern matching nothing
        weight_decay, notes = coupled_weight_decay(model, wrapping.optimizer(optimizer))  # ZeRO's: its groups
        self.notes: List[str] = notes
        self.objective = Objective(loss_fn, self.config.regularizers, weight_decay)
        # Distributed (an initialized group of 2+ ranks): a coordinator, and file sinks on rank 0 only.
        self.dist = DistributedCoordinator.create(model, distributed, distributed_timeout)
        self.sinks: SinkSet = SinkSet([]) if self.dist is not None and not self.dist.is_main else build_sinks(
            self.config.log_dir, tensorboard=self.config.tensorboard, jsonl=self.config.jsonl, writer=writer
        )
        self._step = 0
        self._closed = False
        self._wire_parts(wrapping, grad_fn, grad_scaler)
        #: What follows an alert: ``on_alert``, ``raise_on``, and the count of failed checks.
        self.policy = AlertPolicy(self.config.raise_on, self._check_options.bands, on_alert)
        self.update = UpdatePart(model, optimizer, self._check_options.seed,
                                 emit=lambda s, a: self.runner.emit(s, None, a, 0.0, self.delivery))
        self.update.write = self.sinks.write_update  # the step after each check, in the records
        #: The monitor's seconds against the run's wall time.
        self.clock = OverheadClock(timed=self.runner.say_steps_to_full)
        #: Where each check's outcome goes (:class:`~gradwatch.watch.runner.Delivery`).
        self.delivery = Delivery(self.sinks, self.policy, self.clock, self.update, self._so_far,
                                 lambda reason, step: self.pause(reason, step=step))
        #: Why the checks are paused (None while they run); see :meth:`pause` and :meth:`resume`.
        self.paused: Optional[str] = None
        self._open_run()

    def _wire_parts(self, wrapping: Wrapping, grad_fn: Optional[GradFn], grad_scaler: Any) -> None:
        """The schedule, the trends, the memory meter, the planner, what the parts share, the parts and the runner."""
        config, model = self.config, self.model
        self.schedule = Schedule(config.every, config.overhead_budget, max_interval=config.max_interval)
        self.tracker = TrendTracker(**config.trend_kwargs())
        #: Training's own peak memory and the room a check has under ``memory_budget`` (:mod:`gradwatch.plan.memory`).
        self.memory = MemoryMeter(config.memory_budget, model_device(model))
        #: What each check covers (form, units, the cycle of K checks) and what the run has covered.
        self.planner = Planner(config.form, config.tensors_per_check, self._check_options.seed, config.memory_budget,
                               config.pace)
        # Training part: a forward pre-hook records what each training forward started from.
        self._recorder: Optional[ForwardRecorder] = ForwardRecorder(wrapping.root) if config.training else None
        #: What every part reads (:mod:`gradwatch.watch.parts.context`).
        self.context = WatchContext(model, self.objective, grad_fn, self._check_options, self.memory, self.dist,
                                    self._recorder, config.form, wrapping)
        if self.context.sharded:
            self.notes.append(self.context.sharding_note(SHARD_NOTE))
        #: The plan of each check: tensors, form, shadow, inner modules (:mod:`gradwatch.watch.parts.planning`).
        self.check_plan = CheckPlanner(self.context, self.planner, config)
        #: The weights of a step's micro-batches and ranks (``items=``, :mod:`gradwatch.parallel.step_objective`).
        self.step_objective = StepObjective(config.items)
        #: The parts (:class:`~gradwatch.watch.parts.context.Part`).
        self.backward = BackwardPart(self.context, self.check_plan)
        self.training = TrainingPart(self.context, self.step_objective, config.form, grad_scaler)
        self.inner = InnerPart(self.context, self.check_plan)
        self.independence = IndependencePart(config.independence, config.alert_cooldown)
        #: Runs one check: the plan, the parts, the ranks' results merged (:mod:`gradwatch.watch.runner`).
        self.runner = CheckRunner(self.context, self.check_plan, self.backward, self.training, self.inner,
                                  self.independence, self.schedule, self.tracker, self.step_objective, self.notes)

    def _open_run(self) -> None:
        """The run's id in every record (kept in the state: a resumed run goes on under it), and its first record."""
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
        return cls(model, loss_fn, config=path, **overrides)

    # ------------------------------------------------------------------ public state
    history = property(lambda self: self.tracker.history,
                       doc="Per-tensor history of checks (see :class:`~gradwatch.watch.trend.TrendTracker`).")
    coverage = property(lambda self: self.planner.coverage.fractions(self._watched_names()), doc=(
        "Per watched tensor, the share of its rows each part has probed in the run: ``{name: {\"backward\": fraction, "
        "\"training\": fraction}}`` (:mod:`gradwatch.plan.coverage`; :attr:`modules_checked` lists the modules whose "
        "own code was inside a checked unit)."))
    check_counts = property(lambda self: coverage_of(self.backward.counts, self._watched_names()),
                            doc="How many checks of the backward part each watched tensor has been in.")
    modules_checked = property(lambda self: dict(self.planner.coverage.modules), doc=(
        "Module form: module name -> checks in which its code (own code, or whole) was inside a checked unit."))
    cycle_length = property(lambda self: self.check_plan.cycle_length, doc=(
        "K: checks within which every unit and every parameter row is probed once (None before the first check)."))
    overhead_fraction = property(lambda self: self.clock.fraction(), doc=(
        "Share of wall time spent in the monitor since the first step, the baseline check at the first step included "
        "(with ``every=\"auto\"`` it dominates short runs; see :attr:`overhead_fraction_after_baseline`)."))
    overhead_fraction_after_baseline = property(lambda self: self.clock.after_baseline(), doc=(
        ":attr:`overhead_fraction` leaving out the baseline check at the first step (what ``overhead_budget`` governs)."))

    def _watched_names(self) -> List[str]:
        return self.context.watched_names()

    # ------------------------------------------------------------------ the loop
    def step(self, batch: Any = None, *, loss: Any = None, global_step: Optional[int] = None) -> Optional[CheckReport]:
        """Call once per optimizer step, after backward and before clipping and ``optimizer.step()``.

        Runs a check when the schedule says so.

        Args:
            batch: The current batch, passed untouched to ``loss_fn`` (under accumulation: the last micro-batch, or
                None when every micro-batch was given to :meth:`accumulate`).
            loss: Optional: training's value of ``loss_fn(model, batch)`` plus regularizers (read only when a check
                runs): the training part then also says when it differs from the objective's.
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

        The training part then judges ``.grad`` against the step's objective: every micro-batch weighing its share of
        the step's items (``items=``, :mod:`gradwatch.parallel.step_objective`). Without these calls a step whose
        ``.grad`` holds several micro-batches is "skipped: accumulating" (said once), never wrong.

        Args:
            batch: The micro-batch, as passed to ``loss_fn``.
            loss: Optional: training's value of ``loss_fn(model, batch)`` plus regularizers, before any division.

        Example:
            >>> model = nn.Linear(3, 1)
            >>> loss_fn = lambda m, b: m(b).pow(2).mean()
            >>> watch = GradWatch(model, loss_fn, every=1, tensorboard=False, jsonl=False)
            >>> for mb in [torch.randn(4, 3) for _ in range(2)]:
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
        """One check, then its records and alerts (:meth:`~gradwatch.watch.runner.CheckRunner.check`)."""
        if self._closed:
            raise RuntimeError("GradWatch is closed; create a new one to keep monitoring")
        return self.runner.check(step, batch, self.delivery, scheduled, pending)

    def _so_far(self) -> Dict[str, Any]:
        """What a check record says of the run so far."""
        return {"coverage": self.coverage, "check_counts": self.check_counts, "cycle_length": self.cycle_length}

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
        self.runner.emit(step, None, [self.policy.paused_alert(step, reason)], 0.0, self.delivery)

    def resume(self) -> None:
        """Undo :meth:`pause`: scheduled checks run again."""
        self.paused = None
        self.policy.succeeded()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume: schedule, trends, coverage, counters."""
        return {"version": STATE_VERSION, "run_id": self.run_id, "step": self._step, "checks": self.context.checks,
                **self.runner.state_dict(), **self.policy.state_dict(), **self.clock.state_dict(),
                **self.update.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the schedule and trends continue as if uninterrupted."""
        check_state(state, __version__)
        self._step = int(state["step"])
        self.runner.load_state_dict(state)
        for part in (self.policy, self.clock, self.update):  # each reads its own keys of the state
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


__all__ = ["MAX_CONSECUTIVE_FAILURES", "STATE_VERSION", "GradWatch"]
