"""GradWatch: the training-loop monitor (schedule, budget, wiring).

Data flow of :meth:`GradWatch.step`: schedule says no -> return at once;
schedule says yes -> rotating tensor subset -> check (float64 shadow,
deterministic, side-effect free) -> trend tracker (alerts) -> sinks
(logging, TensorBoard, JSONL) -> alert policy (``on_alert``, ``raise_on``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import torch
from torch import nn

from ._version import __version__ as _version
from .check import GradFn, run_model_check, trainable_names
from .config import GradWatchConfig, load_config
from .context import Shadow
from .distributed import DEFAULT_TIMEOUT, DistributedCoordinator, unwrap_model
from .errors import GradientDriftError
from .numeric import Verdict
from .objective import Objective, coupled_weight_decay
from .records import check_record, run_record
from .report import CheckReport
from .sampling import coverage as coverage_of
from .sampling import match_names, rotate
from .schedule import ANNOUNCE_AS_WARNING_ABOVE, Schedule
from .sinks import SinkSet, build_sinks
from .trend import Alert

logger = logging.getLogger("gradwatch")

#: Consecutive failed checks after which the watch pauses its checks (see :meth:`GradWatch.pause`).
MAX_CONSECUTIVE_FAILURES = 3

#: Option names that are Python objects, never YAML keys.
OBJECT_OPTIONS = ("optimizer", "grad_fn", "on_alert", "writer", "distributed", "distributed_timeout")


def _alert_from_dict(d: Mapping[str, Any]) -> Alert:
    """Inverse of :meth:`Alert.to_dict` (``"nan"``/``"inf"`` strings back to floats)."""
    fields = {k: v for k, v in d.items() if k in Alert.__dataclass_fields__}
    fields["value"] = float(fields["value"]) if fields.get("value") is not None else math.nan
    if fields.get("baseline") is not None:
        fields["baseline"] = float(fields["baseline"])
    return Alert(**fields)


class GradWatch:
    """Watches a training run for wrong gradients.

    Call :meth:`step` once per optimizer step, after ``loss.backward()`` and
    before ``optimizer.step()``. At the first step and then on the schedule
    (``every=N`` or ``every="auto"`` within ``overhead_budget``) it checks a
    rotating subset of parameter tensors against two-sided numerical
    gradients of the full objective (loss + regularizers + coupled weight
    decay), on a float64 shadow copy with dropout off, and logs the trend
    per tensor. Training is left exactly as it would have been: parameters,
    ``.grad``, buffers and RNG streams are not touched.

    Args:
        model: The model being trained.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (the training loss).
        optimizer: Optional; its coupled ``weight_decay`` joins the objective.
        grad_fn: Optional hand-written backprop ``grad_fn(model, batch) -> {name: grad}``.
        on_alert: Optional callback ``on_alert(alert)``; if it raises, the error is
            logged and training goes on.
        writer: Optional existing ``SummaryWriter`` to log through (e.g. Lightning's).
        distributed: ``"auto"`` (default): coordinate the ranks when ``torch.distributed`` is
            initialized with 2+ ranks (see :mod:`gradwatch.distributed`); ``False``: act as a
            single process. A DDP/DataParallel wrapper is always unwrapped (``model.module``).
        distributed_timeout: Seconds gradwatch's own collectives wait for a missing rank.
        **options: Every option of :class:`~gradwatch.config.GradWatchConfig`
            (``every``, ``overhead_budget``, ``tensors_per_check``, ``raise_on``,
            ``log_dir``, ``coords``, ``directions``, ``regularizers``, ...).

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
        >>> sorted(watch.coverage.values())
        [2, 2, 2, 2]
        >>> watch.alerts
        []
    """

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
        **options: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable loss_fn(model, batch) -> scalar tensor, got {type(loss_fn).__name__}")
        if on_alert is not None and not callable(on_alert):
            raise TypeError(f"on_alert must be callable on_alert(alert), got {type(on_alert).__name__}")
        self.config = options.pop("config", None) or GradWatchConfig()
        if options:
            self.config = self.config.replace(**options)
        model = unwrap_model(model)  # DDP/DataParallel: check the inner module, so no collective fires in a check
        self.model = model
        self.loss_fn = loss_fn
        self.grad_fn = grad_fn
        self.on_alert = on_alert
        self.optimizer = optimizer
        self._check_options = self.config.check_options()
        names = trainable_names(model)
        if not names:
            raise ValueError(f"{type(model).__name__} has no trainable floating-point parameters to watch")
        match_names(names, self._check_options.tensors)  # fail now on a pattern matching nothing
        weight_decay, notes = coupled_weight_decay(model, optimizer)
        self.notes: List[str] = notes
        self.objective = Objective(loss_fn, self.config.regularizers, weight_decay)
        self.schedule = Schedule(self.config.every, self.config.overhead_budget, max_interval=self.config.max_interval)
        self.tracker = self.config.trend_tracker()
        # Distributed (an initialized group of 2+ ranks): a coordinator, and file sinks on rank 0 only.
        self.dist = DistributedCoordinator.create(model, distributed, distributed_timeout)
        self.sinks: SinkSet = SinkSet([]) if self.dist is not None and not self.dist.is_main else build_sinks(
            self.config.log_dir, tensorboard=self.config.tensorboard, jsonl=self.config.jsonl, writer=writer
        )
        self.alerts: List[Alert] = []
        self._counts: Dict[str, int] = {}
        self._step = 0
        self._checks = 0
        self._last_call: Optional[float] = None
        self._monitor_seconds = 0.0
        self._started: Optional[float] = None
        self._wall_before = 0.0
        self._shadow: Optional[Shadow] = None
        self._closed = False
        self._checking = False  # a check is running: a step() from inside it (the objective stepping an optimizer) is ignored
        self._failures = 0  # consecutive failed checks
        self._failure_counts: Dict[str, int] = {}  # "Type: message" -> how many checks failed with it
        #: Why the checks are paused (None while they run); see :meth:`pause` and :meth:`resume`.
        self.paused: Optional[str] = None
        self._explained = False  # every="auto": its interval announced once both a check and a step were timed
        self._baseline_seconds: Optional[float] = None  # the first check's time (the baseline, at the first step)
        #: Names this run in every record; kept in the state, so a resumed run goes on under the same id.
        self.run_id = uuid.uuid4().hex[:12]
        self.sinks.run_id = self.run_id
        for sink in self.sinks:
            if getattr(sink, "appending", False):
                logger.warning("gradwatch: %s already holds records; this run's (run_id %s) are appended, and "
                               "`gradwatch report` keeps the runs apart (or joins a resumed run)", sink.path, self.run_id)
        self.sinks.write_run(run_record(self.config.to_dict(), _version))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(
        cls,
        path: Union[str, Path],
        *,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        **overrides: Any,
    ) -> "GradWatch":
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
        """Per-tensor history of checks (see :class:`~gradwatch.trend.TrendTracker`)."""
        return self.tracker.history

    @property
    def coverage(self) -> Dict[str, int]:
        """How many times each trainable tensor has been checked."""
        return coverage_of(self._counts, self._watched_names())

    @property
    def overhead_fraction(self) -> Optional[float]:
        """Share of wall time spent in the monitor since the first step, the baseline check at the first step
        included (with ``every="auto"`` it dominates short runs; see :attr:`overhead_fraction_after_baseline`)."""
        if self._started is None:
            return None
        wall = self._wall_before + (time.perf_counter() - self._started)
        return self._monitor_seconds / wall if wall > 0 else None

    def _fraction_with(self, seconds: float) -> Optional[float]:
        """:attr:`overhead_fraction` counting a check still in progress (its ``seconds`` are not yet added)."""
        if self._started is None:
            return None
        wall = self._wall_before + (time.perf_counter() - self._started)
        return min(1.0, (self._monitor_seconds + seconds) / wall) if wall > 0 else None

    @property
    def overhead_fraction_after_baseline(self) -> Optional[float]:
        """:attr:`overhead_fraction` leaving out the baseline check at the first step (what ``overhead_budget`` governs)."""
        if self._started is None or self._baseline_seconds is None:
            return None
        wall = self._wall_before + (time.perf_counter() - self._started) - self._baseline_seconds
        return max(0.0, self._monitor_seconds - self._baseline_seconds) / wall if wall > 0 else None

    def _after_baseline_with(self, seconds: float) -> Optional[float]:
        """:attr:`overhead_fraction_after_baseline` counting a check in progress (None at the baseline check)."""
        if self._started is None or self._baseline_seconds is None or self._checks <= 1:
            return None
        wall = self._wall_before + (time.perf_counter() - self._started) - self._baseline_seconds
        return min(1.0, max(0.0, self._monitor_seconds + seconds - self._baseline_seconds) / wall) if wall > 0 else None

    def _announce_interval(self) -> None:
        """Say once which interval ``every="auto"`` chose and why (a warning when checks are far apart)."""
        text = self.schedule.explain()
        if text is None:
            return
        self._explained = True
        far = self.schedule.interval() > ANNOUNCE_AS_WARNING_ABOVE
        logger.log(logging.WARNING if far else logging.INFO, "gradwatch: %s", text)

    def _watched_names(self) -> List[str]:
        return match_names(trainable_names(self.model), self._check_options.tensors)

    # ------------------------------------------------------------------ the loop
    def step(self, batch: Any, *, global_step: Optional[int] = None) -> Optional[CheckReport]:
        """Call once per optimizer step; runs a check when the schedule says so.

        Args:
            batch: The current batch, passed untouched to ``loss_fn``.
            global_step: Step number to log under (default: an internal counter).

        Returns:
            The :class:`CheckReport` when a check ran, else None.

        Raises:
            GradientDriftError: After logging, when ``raise_on`` matches an alert.
        """
        if self._checking:  # called from inside a check (e.g. the objective stepped an optimizer): never re-enter
            return None
        now = time.perf_counter()
        if self._started is None:
            self._started = now
        elif self._last_call is not None:
            self.schedule.record_step_seconds(now - self._last_call)
            if not self._explained:
                self._announce_interval()
        step = self._step if global_step is None else int(global_step)
        self._step = step + 1
        if self.paused is not None:
            return None
        try:
            if not (self.schedule.due(step) if self.dist is None else self.dist.due(step, self.schedule)):
                return None
            return self._run(step, batch)
        finally:
            end = time.perf_counter()
            self._monitor_seconds += end - now
            self._last_call = end

    def check(self, batch: Any, *, global_step: Optional[int] = None) -> Optional[CheckReport]:
        """Run a check now, whatever the schedule (returns None if ``loss_fn`` raised).

        An ``every=N`` schedule keeps its steps (0, N, 2N, ...); with ``every="auto"`` the
        next scheduled check is counted from this one, as its cost is paid.
        """
        step = self._step if global_step is None else int(global_step)
        start = time.perf_counter()
        try:
            return self._run(step, batch, scheduled=False)
        finally:
            self._monitor_seconds += time.perf_counter() - start

    def _run(self, step: int, batch: Any, scheduled: bool = True) -> Optional[CheckReport]:
        if self._closed:
            raise RuntimeError("GradWatch is closed; create a new one to keep monitoring")
        if self.dist is not None:
            return self.dist.run(self, step, batch, scheduled=scheduled)
        names = rotate(self._watched_names(), self.config.tensors_per_check, self._counts)
        opts = dataclasses.replace(self._check_options, seed=self._check_options.seed + self._checks)
        start = time.perf_counter()
        self._checking = True
        try:
            if self._check_options.dtype is not None and (self._shadow is None or not self._shadow.matches(self.model)):
                self._shadow = Shadow(self.model, self._check_options.dtype)
            report = run_model_check(self.model, self.objective, batch, opts, grad_fn=self.grad_fn, names=names, shadow=self._shadow)
        except Exception as exc:  # noqa: BLE001 - the user's code raised: log it, keep training
            seconds = time.perf_counter() - start
            self.schedule.record_check(step, seconds, scheduled)
            self._failed(step, exc, seconds)
            return None
        finally:
            self._checking = False
        seconds = time.perf_counter() - start
        self._failures = 0
        if self._baseline_seconds is None:
            self._baseline_seconds = seconds
        report.notes[:0] = self.notes
        self._checks += 1
        for n in report.tensors:
            self._counts[n] = self._counts.get(n, 0) + 1
        self.schedule.record_check(step, seconds, scheduled)
        alerts = self.tracker.update(step, report)
        self._emit(step, report, alerts, seconds)
        return report

    def _failed(self, step: int, exc: Exception, seconds: float) -> None:
        """A check raised: log its cause once per kind of failure, count it, and pause after a few in a row."""
        self._failures += 1
        key = f"{type(exc).__name__}: {exc}"[:500]
        seen = self._failure_counts.get(key, 0)
        self._failure_counts[key] = seen + 1
        if seen == 0:  # the cause and the fix; the alert below says it in one line
            logger.error(
                "gradwatch: the check at step %d raised %s (in loss_fn); the check is skipped and training goes on. "
                "Fix: make loss_fn(model, batch) compute the training loss of the batch without side effects "
                "(no backward, no optimizer step). Later failures like this one are counted, not printed.\n%s",
                step, key, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
        else:
            logger.debug("gradwatch: the check at step %d failed again (%d times): %s", step, seen + 1, key)
        alert = self.tracker.error(step, exc)
        self._emit(step, None, [alert] if alert is not None else [], seconds)
        if self._failures >= MAX_CONSECUTIVE_FAILURES and self.paused is None:
            self.pause(f"{self._failures} checks in a row failed (last: {key})", step=step)

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
        message = (f"step {step}: gradwatch paused its checks: {reason}. Training goes on unchecked; "
                   "fix the cause and call watch.resume() (or restart the run) to check again")
        self._emit(step, None, [Alert(step=step, tensor="*", kind="paused", severity="warning", value=math.nan,
                                      baseline=None, message=message)], 0.0)

    def resume(self) -> None:
        """Undo :meth:`pause`: scheduled checks run again."""
        self.paused = None
        self._failures = 0

    def _emit(self, step: int, report: Optional[CheckReport], alerts: List[Alert], seconds: float) -> None:
        if report is not None:
            record = check_record(step, report, seconds=seconds, overhead_fraction=self._fraction_with(seconds),
                                  coverage=self.coverage)
            record["overhead_fraction_after_baseline"] = self._after_baseline_with(seconds)
            self.sinks.write_check(record, alerts)
        elif alerts:
            self.sinks.write_alerts(alerts)
        self.alerts.extend(alerts)
        for alert in alerts:
            if self.on_alert is not None:
                try:
                    self.on_alert(alert)
                except Exception:  # noqa: BLE001 - a user callback must not kill training
                    logger.error("gradwatch: on_alert callback raised for %s alert on %s; training goes on:\n%s",
                                 alert.kind, alert.tensor, traceback.format_exc())
        raising = [a for a in alerts if self._should_raise(a)]
        if raising:
            raise GradientDriftError(
                f"gradwatch: raise_on={self.config.raise_on!r} matched at step {step}:\n"
                + "\n".join(f"  - {a.message}" for a in raising),
                alerts=raising,
            )

    def _should_raise(self, alert: Alert) -> bool:
        level = self.config.raise_on
        if level is None:
            return False
        if alert.kind == "threshold":
            return Verdict.from_value(alert.value, self._check_options.bands).is_failure(Verdict.parse(level))
        return alert.kind == "drift" and Verdict.parse(level) == Verdict.SUSPICIOUS

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume: schedule, trends, coverage, counters."""
        return {
            "version": 1,
            "run_id": self.run_id,
            "step": self._step,
            "checks": self._checks,
            "counts": dict(self._counts),
            "schedule": self.schedule.state_dict(),
            "tracker": self.tracker.state_dict(),
            "alerts": [a.to_dict() for a in self.alerts],
            "monitor_seconds": self._monitor_seconds,
            "baseline_seconds": self._baseline_seconds,
            "wall_seconds": self._wall_before + ((time.perf_counter() - self._started) if self._started else 0.0),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the schedule and trends continue as if uninterrupted."""
        if not isinstance(state, Mapping) or "tracker" not in state:
            raise ValueError("load_state_dict expects a dict produced by GradWatch.state_dict()")
        self._step = int(state["step"])
        self._checks = int(state["checks"])
        self._counts = dict(state["counts"])
        self.schedule.load_state_dict(state["schedule"])
        self.tracker.load_state_dict(state["tracker"])
        self.alerts = [_alert_from_dict(a) for a in state.get("alerts", [])]
        self._monitor_seconds = float(state.get("monitor_seconds", 0.0))
        self._wall_before = float(state.get("wall_seconds", 0.0))
        baseline = state.get("baseline_seconds")
        self._baseline_seconds = None if baseline is None else float(baseline)
        self._started = None
        self._last_call = None
        run_id = state.get("run_id")
        if run_id and str(run_id) != self.run_id:  # a resumed run: its records go on under its id
            self.run_id = self.sinks.run_id = str(run_id)
            self.sinks.write_run({**run_record(self.config.to_dict(), _version), "resumed_at_step": self._step})

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Flush and close the sinks (idempotent)."""
        if not self._closed:
            self._closed = True
            self.sinks.close()
            if self.dist is not None:
                self.dist.close()

    def __enter__(self) -> "GradWatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GradWatch(every={self.config.every!r}, checks={self._checks}, alerts={len(self.alerts)})"
