"""GradWatch: the training-loop monitor (schedule, budget, wiring).

Data flow of :meth:`GradWatch.step`: schedule says no -> return at once;
schedule says yes -> rotating tensor subset -> check (float64 shadow,
deterministic, side-effect free) -> trend tracker (alerts) -> sinks
(logging, TensorBoard, JSONL) -> alert policy (``on_alert``, ``raise_on``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import operator
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn

from .._version import __version__ as _version
from ..check import model as _check
from ..check.generators import find_generators
from ..check.inner import check_inner_derivatives, leaf_modules
from ..check.isolation import Shadow, preserved_rng
from ..check.memory import SAFETY, MemoryMeter, gradient_bytes, mb, model_device, module_bytes, release_freed
from ..check.model import GradFn, trainable_names
from ..check.modular import run_module_check, units_signature
from ..check.numeric import Verdict
from ..check.objective import Objective, coupled_weight_decay
from ..check.replay import ForwardRecorder, Replay, Step, replay_step, scalar_grad
from ..check.report import CheckReport
from ..check.row_replay import RowGrads, sliceable_linears
from ..check.sampling import coverage as coverage_of
from ..check.sampling import match_names, rotate
from ..check.surrogate import name_straight_through
from ..check.training import compute_dtype, gradient_scale, judge_training, tolerance_for
from ..config import GradWatchConfig, load_config
from ..errors import GradientDriftError, blamed, error_key
from ..io.records import check_record, run_record
from ..io.sinks import SinkSet, build_sinks
from ..plan.planner import Planner
from ..plan.units import isolated_forward
from .distributed import DEFAULT_TIMEOUT, DistributedCoordinator, RankResult, merge_results, unwrap_model
from .independence import IndependencePart
from .lockstep import Lockstep, PeerFailed
from .schedule import ANNOUNCE_AS_WARNING_ABOVE, Schedule
from .shard_check import SHARD_NOTE, ShardView, backward_on_shards, local, plan_shards, reshard
from .sharded import (
    REPLICA_NOTE,
    Replica,
    is_dtensor,
    is_sharded,
    layout,
    live_forward_forbidden,
    mixed_precision,
    refuse_unsupported,
)
from .step_objective import StepObjective, StepPlan
from .trend import WHOLE_CHECK, Alert

logger = logging.getLogger("gradwatch")

#: Under DDP, rank 0's decisions for a check: ``((form, estimate, note), training tensors or None for all)``.
Plan = Tuple[Tuple[str, Optional[int], Optional[str]], Optional[List[str]]]

#: Consecutive failed checks after which the watch pauses its checks (see :meth:`GradWatch.pause`).
MAX_CONSECUTIVE_FAILURES = 3

#: Option names that are Python objects, never YAML keys.
OBJECT_OPTIONS = ("optimizer", "grad_fn", "on_alert", "writer", "distributed", "distributed_timeout", "grad_scaler")


def _dense(g: torch.Tensor) -> torch.Tensor:
    """A gradient as a strided tensor (``Embedding(sparse=True)`` gives sparse ones)."""
    if g.layout != torch.strided:
        return g.detach().to_dense()
    return g.detach() if g.requires_grad else g  # autograd.grad's results need no detach (one less view)


def _alert_from_dict(d: Mapping[str, Any]) -> Alert:
    """Inverse of :meth:`Alert.to_dict` (``"nan"``/``"inf"`` strings back to floats)."""
    fields = {k: v for k, v in d.items() if k in Alert.__dataclass_fields__}
    fields["value"] = float(fields["value"]) if fields.get("value") is not None else math.nan
    if fields.get("baseline") is not None:
        fields["baseline"] = float(fields["baseline"])
    return Alert(**fields)


#: Version of :meth:`GradWatch.state_dict`'s layout (raise it when a key changes meaning; older ones still load).
STATE_VERSION = 1


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _same_tree(tree: List[Tuple[Dict[str, Any], Tuple[str, ...], Tuple[Any, ...]]]) -> bool:
    """Every ``_modules``/``_parameters`` dict still holds exactly the keys and values it held, in order
    (by identity: a key set again keeps its key object, so only a real change reads as one)."""
    for d, keys, values in tree:
        if len(d) != len(keys) or not all(map(operator.is_, d.values(), values)) or not all(map(operator.is_, d, keys)):
            return False
    return True


def _shift_hint(model: nn.Module) -> Optional[int]:
    """1 for a model known to shift its labels by one position (a Hugging Face causal LM), else None."""
    loss_type = getattr(model, "loss_type", None)
    return 1 if loss_type == "ForCausalLM" or type(model).__name__.endswith("ForCausalLM") else None


class GradWatch:
    """Watches a training run for wrong gradients.

    Call :meth:`step` once per optimizer step, after ``loss.backward()`` and
    before gradient clipping and ``optimizer.step()``. At the first step and
    then on the schedule (``every=N`` or ``every="auto"`` within
    ``overhead_budget``) a check gives two verdicts per tensor:

    - **backward**: a rotating subset of parameter tensors against two-sided
      numerical gradients of the full objective (loss + regularizers + coupled
      weight decay), on a float64 shadow copy with dropout off: are the
      backward formulas right?
    - **training** (``training=True``, the default): every watched tensor's live
      ``.grad`` against the objective's gradient recomputed the way training
      computed it (live model and dtype, the same dropout masks and autocast
      state; see :mod:`gradwatch.check.replay`): is the gradient training applies the
      gradient of the objective?

    Under gradient accumulation call :meth:`accumulate` after each micro-batch's
    backward. Training is left exactly as it would have been: parameters,
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
            initialized with 2+ ranks (see :mod:`gradwatch.watch.distributed`); ``False``: act as a
            single process. A DDP/DataParallel wrapper is always unwrapped (``model.module``).
        distributed_timeout: Seconds gradwatch's own collectives wait for a missing rank.
        grad_scaler: Optional ``torch.amp.GradScaler`` of a float16 AMP loop. The training part then
            replays ``scaler.scale(loss).backward()`` and the unscaling as training ran them (the same
            bits), so call :meth:`step` after ``scaler.unscale_(optimizer)``.
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
        >>> sorted(watch.check_counts.values()), watch.coverage["0.weight"], watch.cycle_length
        ([2, 2, 2, 2], {'backward': 1.0, 'training': 1.0}, 1)
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
        grad_scaler: Any = None,
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
        refuse_unsupported(model)  # FSDP1; FSDP2 is checked on a gathered replica (see gradwatch.watch.sharded)
        self.model = model
        self.loss_fn = loss_fn
        self.grad_fn = grad_fn
        self.on_alert = on_alert
        self.optimizer = optimizer
        if grad_scaler is not None and not (callable(getattr(grad_scaler, "scale", None))
                                            and callable(getattr(grad_scaler, "get_scale", None))):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        self.grad_scaler = grad_scaler
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
        self._straight_through_named = False  # an undeclared straight-through's module is looked for once
        # A sharded (FSDP2) model is checked on a plain replica gathered at each check (see gradwatch.watch.sharded).
        self._sharded = is_sharded(model)
        self._replica: Optional[Replica] = None  # built at the first check
        self._mixed: Optional[str] = mixed_precision(model) if self._sharded else None
        # By default shard by shard (gradwatch.watch.shard_check); form="objective" gathers a replica.
        self._by_shard = self._sharded and self.config.form != "objective"
        if self._sharded:
            self.notes.append(SHARD_NOTE if self._by_shard else REPLICA_NOTE)
        #: Training's own peak memory and the room a check has under ``memory_budget`` (:mod:`gradwatch.check.memory`).
        self.memory = MemoryMeter(self.config.memory_budget, model_device(model))
        #: What each check covers (form, units, the cycle of K checks) and what the run has covered.
        self.planner = Planner(self.config.form, self.config.tensors_per_check, self._check_options.seed,
                               self.config.memory_budget)
        self._training_counts: Dict[str, int] = {}  # training part: judgments per tensor, when not all fit
        self._row_cursor: Dict[str, int] = {}  # training part: the next row of each weight judged by rows
        self._inner_counts: Dict[str, int] = {}  # modules whose double backward was checked (differentiating objectives)
        self._closed = False
        self._cycle_length: Optional[int] = None
        # Training part: a forward pre-hook records what each training forward started from.
        self._recorder: Optional[ForwardRecorder] = ForwardRecorder(model) if self.config.training else None
        #: Independence checks on the checked batch (``independence=``, :mod:`gradwatch.watch.independence`).
        self.independence = IndependencePart(self.config.independence, self.config.alert_cooldown)
        #: The step's objective of the training part: the weights of a step's micro-batches and ranks (``items=``,
        #: :mod:`gradwatch.watch.step_objective`).
        self.step_objective = StepObjective(self.config.items)
        self._last_micro: Any = None  # training=False: the last batch given to accumulate()
        #: For integrations: ``() -> context manager`` that training's loss runs in (e.g. Lightning's
        #: precision context with its autocast); the training part's replay runs in it too.
        self.replay_context: Optional[Callable[[], Any]] = None
        self._generator_cache: Optional[Any] = None  # (checks when searched, generators) for the replay
        self._watched_cache: Optional[Any] = None  # (trainable names, the watched ones among them)
        self._mark: Optional[Tuple[Any, Optional[bool]]] = None  # shard by shard: the plan before the check
        self._lockstep: Optional[Lockstep] = None  # shard by shard, during a check: its agreement points (lockstep.py)
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
        return coverage_of(self._counts, self._watched_names())

    @property
    def modules_checked(self) -> Dict[str, int]:
        """Module form: module name -> checks in which its code (own code, or whole) was inside a checked unit."""
        return dict(self.planner.coverage.modules)

    @property
    def cycle_length(self) -> Optional[int]:
        """K: checks within which every unit and every parameter row is probed once (None before the first check)."""
        return self._cycle_length

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
        # Not strict: a pattern may stop matching when its tensors are frozen mid-run (checked at construction).
        return match_names(trainable_names(self.model), self._check_options.tensors, strict=False)

    def _names_to_check(self) -> List[str]:
        names = self._watched_names()
        if not names:
            raise ValueError(
                f"tensors: {self._check_options.tensors!r} match no trainable parameter any more (frozen with "
                f"requires_grad=False since the watch started?); trainable now: {trainable_names(self.model)[:8]}; "
                "no tensor was checked — change the tensors option to follow the parameters you train"
            )
        return names

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
        try:
            if self.paused is not None or not self._due(step):
                return None
            pending = self._take(batch, loss)
            return self._run(step, pending.micro[-1].batch, pending=pending)
        finally:
            if self._recorder is not None:  # a new step starts: forget this one's forwards
                self._recorder.discard(full=self._due(step + 1))  # every generator's state only if it is checked
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
            pending = self._take(batch, None)
            return self._run(step, pending.micro[-1].batch, scheduled=False, pending=pending)
        finally:
            self._monitor_seconds += time.perf_counter() - start

    def accumulate(self, batch: Any, *, loss: Any = None) -> None:
        """Gradient accumulation: call after each micro-batch's backward, then :meth:`step` once.

        The training part then compares ``.grad`` with the gradient of the step's objective: the
        objective over every micro-batch of the step, each weighing its share of the step's items
        (``items=``; :mod:`gradwatch.watch.step_objective`), as one batch would. Without these
        calls, a step whose ``.grad`` holds several micro-batches is recorded as
        "skipped: accumulating", never as wrong.

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
        if self._recorder is not None:
            self._recorder.close_micro_batch(batch, loss)
        else:
            self._last_micro = batch

    def start_batch(self) -> None:
        """For integrations: a micro-batch's ``loss_fn`` starts now, with no random draw before it.

        The replay of the training part can then start every generator from here (see
        :mod:`gradwatch.check.replay`), even when training never calls the model's own forward.
        """
        if self._recorder is not None:
            self._recorder.mark(exact=True, full=self.paused is None and self._due(self._step))

    def _take(self, batch: Any, loss: Any) -> Step:
        """The step's micro-batches for a check (the recorded ones, or just ``batch``)."""
        if self._recorder is not None:
            pending = self._recorder.take(batch, loss)
        else:
            from ..check.replay import MicroBatch, StartState

            last = batch if batch is not None else self._last_micro
            pending = Step([MicroBatch(last, loss, StartState.now())])
        self._last_micro = None
        if pending.micro[-1].batch is None:
            raise TypeError("GradWatch.step() needs the batch (or GradWatch.accumulate(micro_batch) calls before it)")
        return pending

    def _due(self, step: int) -> bool:
        return self.schedule.due(step) if self.dist is None else self.dist.due(step, self.schedule)

    def _run(self, step: int, batch: Any, scheduled: bool = True, pending: Optional[Step] = None) -> Optional[CheckReport]:
        try:
            return self._run_check(step, batch, scheduled, pending)
        finally:
            if self._replica is not None:
                self._replica.release()  # the gathered .grad lives for one check only

    def _run_check(self, step: int, batch: Any, scheduled: bool, pending: Optional[Step]) -> Optional[CheckReport]:
        """One check: both parts on this process's model (or its share, distributed), then trends, sinks, alerts.

        Distributed, it calls the coordinator at fixed points, the same on every rank: the layout of a
        sharded model agreed and gathered first (before anything that may raise), then this rank's share
        of the tensors, then every rank's result gathered and merged (:meth:`_finish_distributed`).
        """
        if self._closed:
            raise RuntimeError("GradWatch is closed; create a new one to keep monitoring")
        coord = self.dist
        if coord is not None and coord.broken is not None:
            return None
        opts = dataclasses.replace(self._check_options, seed=self._check_options.seed + self._checks)
        start = time.perf_counter()
        self._checking = True
        report: Optional[CheckReport] = None
        replay: Optional[Replay] = None
        error: Optional[Exception] = None
        names: List[str] = []
        try:
            # The memory budget holds in one process and under DDP (rank 0 decides for all, every rank holding
            # the whole model); under FSDP2 every rank checks the whole objective on its gathered replica.
            room: Optional[int] = None
            plan: Optional[Plan] = None
            if coord is None or not self._sharded or self._by_shard:
                self.memory.observe()
                room = self.memory.room()
            if coord is not None and self._by_shard:
                # Every rank plans from the same state (a check that failed on some rank is undone on every rank,
                # in _finish_distributed) and with the smallest room (measured after the replay, _check_locally).
                self._mark = (self.planner.mark(), self.objective.differentiates)
            if coord is not None and not self._sharded:
                room, plan = self._agreed_plan(coord, room)
            with preserved_rng():  # one guard for both parts: every generator as training left it afterwards
                target = self._check_target()  # the model, or the replica gathered from a sharded one
                per_check = self.config.tensors_per_check
                if self._by_shard:  # the planner's pieces, split by the shards (every rank the same collectives)
                    names = self._watched_names()
                else:
                    names = rotate(self._names_to_check(), coord.tensors_per_check(per_check) if coord else per_check,
                                   self._counts)
                mine = coord.share(names) if coord is not None and not self._by_shard and (
                    plan is None or plan[0][0] != "module") else names
                if self._by_shard and coord is not None:
                    self._lockstep = Lockstep(coord, self.model)
                with live_forward_forbidden(self.model) if self._sharded and not self._by_shard \
                        else self._lockstep or contextlib.nullcontext():
                    report, replay = self._check_locally(target, mine, batch, opts, pending, room,
                                                         judge=coord is None or self._by_shard, plan=plan)
                if report is not None and (coord is None or coord.is_main):
                    self._check_inner(report, target, batch, opts)
                    self._check_independence(report, batch, opts.seed)
            if coord is None:
                if report is None:
                    raise ValueError(f"no tensor was chosen for the check at step {step} (tensors_per_check="
                                     f"{self.config.tensors_per_check!r})")
                self.memory.checked()
        except Exception as exc:  # noqa: BLE001 - the user's code raised: log it, keep training
            error = exc
        finally:
            self._checking = False
            waited = self._lockstep.waited if self._lockstep is not None else 0.0
            self._lockstep = None
        seconds = time.perf_counter() - start
        self.schedule.record_check(step, seconds, scheduled)
        if coord is not None:
            try:
                return self._finish_distributed(step, names, opts, report, replay, error, seconds, waited)
            finally:
                if not self._sharded or self._by_shard:
                    self.memory.checked()  # after the replays' averaging: its peak is the check's, not training's
        if error is not None:
            self._failed(step, error, seconds)
            return None
        assert report is not None
        self._failures = 0
        if self._baseline_seconds is None:
            self._baseline_seconds = seconds
        self._emit(step, report, self._completed(step, report), seconds)
        return report

    def _check_locally(self, target: nn.Module, names: List[str], batch: Any, opts: Any, pending: Optional[Step],
                       room: Optional[int] = None, judge: bool = True,
                       plan: Optional[Plan] = None) -> Tuple[Optional[CheckReport], Optional[Replay]]:
        """Both parts on this process, with no collective: the training part's replay of ``target`` (the
        model, or a sharded model's replica), then the backward part on ``names`` (None when there are none).

        With ``judge`` (one process), the training part is judged first and its replayed gradients freed
        before the backward part allocates; the report carries it and no replay is returned. Without
        (distributed), the replay is returned for the coordinator to average over ranks. ``room``
        (bytes, from ``memory_budget``) bounds both: the replay's tensors, and the backward part's form.
        ``plan`` (DDP): rank 0's form and training tensors; in the module form this rank checks its
        round-robin share of the check's pieces.
        """
        if self._by_shard:
            release_freed()  # what training's backward freed: the replay's own backward allocates on top of it
        # (sharded: the replay is FSDP2's own backward, whole; its shards are let go as they come)
        replay = self._training_replay(pending, target, None if self._by_shard else room,
                                       only=None if plan is None else plan[1], seed=opts.seed)
        judged: Optional[CheckReport] = None
        if judge:
            judged = CheckReport(tensors={})
            self._attach_training(judged, replay)
            replay = None
            if room is not None or self._by_shard:
                release_freed()  # the replayed gradients, before the backward part allocates
        if self._by_shard and room is not None:
            # What the replay left held counts against the room (measured again now); every rank plans the same
            # pieces with the smallest room (an agreement point: a rank that raised above stops the others here).
            room = self.memory.room()
            if self._lockstep is not None:
                room = self._lockstep.point(room)
        if not names:
            return None, replay
        estimate: Optional[int] = None
        with self._recorder_paused():
            form, estimate, why = (plan[0] if plan is not None else ("module", None, None) if self._by_shard else
                                   self._choose_form(target, names, room) if judge else ("objective", None, None))
            if form == "objective":
                if opts.dtype is not None and (self._shadow is None or not self._shadow.matches(target)):
                    self._shadow = None  # the old copy goes before the new one is made
                    self._shadow = Shadow(target, cast(torch.dtype, opts.torch_dtype))
                # through the module: a spy on gradwatch.check.model.run_model_check sees every check
                alone = self.grad_fn is None and self.dist is None  # one process: what it cannot resolve, on modules
                report = _check.run_model_check(target, self.objective, batch, opts, grad_fn=self.grad_fn, names=names,
                                                shadow=self._shadow, mark_unseen=alone)
                if alone:
                    _check.judge_unseen_on_modules(report, target, self.objective, batch, opts, screen=True)
                if not self._straight_through_named:
                    self._straight_through_named = name_straight_through(report, target, self.objective.loss, batch, opts)
            else:
                self._shadow = None  # a whole copy of the model is what the module form avoids
                held = 0 if replay is None or replay.grads is None else gradient_bytes(replay.grads.values())
                piece_room = None if room is None else int(SAFETY * max(0, room - held))  # DDP holds the replay
                if self.objective.differentiates is None:  # once: does loss_fn differentiate inside (a penalty)?
                    isolated_forward(target, self.objective.loss, batch, opts.seed)
                units, pieces = self.planner.module_pieces(target, self.objective.loss, batch, self._watched_names(),
                                                           key=units_signature(target), seed=opts.seed, room=piece_room,
                                                           surrogates=opts.surrogates)
                view = None
                if self._by_shard:  # FSDP2: rows on the rank that holds them, the rest gathered piece by piece
                    if self._lockstep is not None:
                        self._lockstep.point()  # the gathers are collectives: every rank's capture went well
                    reshard(target)  # a forward that found the units left the root's parameters gathered
                    pieces, gathered, offsets = plan_shards(target, units, pieces)
                    view = ShardView(target, gathered, offsets)
                elif self.dist is not None:
                    pieces = self.dist.share(pieces)  # DDP: the ranks split the plan
                try:
                    report = run_module_check(target, self.objective, batch, opts, units=units, pieces=pieces,
                                              room=piece_room, view=view, screen=True)
                finally:
                    if view is not None:
                        reshard(target)
                        release_freed()  # the pieces' copies, before training's next forward
                estimate = report.memory.get("estimate_bytes")
            if why:
                report.notes.append(why)
        if judged is not None:
            report.training, report.training_note = judged.training, judged.training_note
            report.training_rows, report.training_items = judged.training_rows, judged.training_items
        if judged is not None or plan is not None:
            report.memory = self.memory.summary(room, estimate)
        return report, replay

    #: Modules whose double backward a check of an objective that differentiates inside checks (least-checked first).
    INNER_PER_CHECK = 8

    def _check_inner(self, report: CheckReport, target: nn.Module, batch: Any, opts: Any) -> None:
        """An objective that differentiates through the model: its leaf modules' double backward, a few per check
        (:mod:`gradwatch.check.inner`), as report entries ``"<module>:double_backward"``."""
        if not self.objective.differentiates:
            return
        if self._by_shard:
            report.notes.append("double backward not checked: a model sharded with FSDP2 is checked shard by shard, "
                                "which does not check it yet (form='objective' checks it on a gathered replica)")
            return
        owners = {n.rsplit(".", 1)[0] if "." in n else "" for n in self._watched_names()}

        def related(leaf: str) -> bool:  # owns watched parameters, or sits beside modules that do (an activation)
            parent = leaf.rsplit(".", 1)[0] if "." in leaf else ""
            return leaf in owners or not parent or any(o == parent or o.startswith(parent + ".") for o in owners)

        leaves = [n for n in leaf_modules(target) if related(n)]
        room = self.memory.room()
        if room is not None:  # each module's float64 copy and its check must fit memory_budget, as the units' do
            modules = dict(target.named_modules())
            big = {n: module_bytes(modules[n].parameters(), ()) for n in leaves}
            for n in [n for n in leaves if big[n] > SAFETY * room]:
                leaves.remove(n)
                report.notes.append(f"{n}'s double backward not checked: its float64 copy and check ({mb(big[n])}) "
                                    f"do not fit the room memory_budget leaves ({mb(room)})")
        chosen = sorted(leaves, key=lambda n: (self._inner_counts.get(n, 0), leaves.index(n)))[:self.INNER_PER_CHECK]
        with self._recorder_paused():
            checks = check_inner_derivatives(target, self.objective.loss, batch, names=sorted(chosen, key=leaves.index),
                                             seed=opts.seed, fail_at=report.fail_at)
        for name in chosen:
            self._inner_counts[name] = self._inner_counts.get(name, 0) + 1
        report.tensors.update(checks)

    def _check_independence(self, report: CheckReport, batch: Any, seed: int) -> None:
        """The independence part on the batch's model call (:mod:`gradwatch.watch.independence`); a failure is a note."""
        if not self.independence.enabled:
            return
        if self._sharded:
            report.notes.append("independence not checked: a sharded (FSDP2) model is not supported by it yet")
            return
        try:
            with self._recorder_paused():
                report.independence, why = self.independence.run(self.model, self.objective.loss_fn, batch, seed,
                                                                 self._held_generators())
        except Exception as exc:  # noqa: BLE001 - the user's model or inputs: say it, keep the other parts
            why = f"independence not checked: {type(exc).__name__}: {exc}"
        if why:
            report.notes.append(why)

    def _agreed_plan(self, coord: DistributedCoordinator, room: Optional[int]) -> Tuple[Optional[int], Plan]:
        """Under DDP: rank 0's room, form and training tensors, taken by every rank (one gather, every rank).

        Every rank holds the whole model, so rank 0's measure of the room stands for all, and all ranks make the
        same decisions: the same form, the same pieces of the cycle (split between them), the same tensors
        replayed by the training part (their replays are averaged).
        """
        local: Any = None
        if coord.is_main:
            try:
                form = self._choose_form(self.model, self._watched_names(), room)
                only = None
                if room is not None and self._recorder is not None and self.config.form != "objective":
                    only = list(self._training_subset(self._training_params(), room, count=False, rows=False)[0])
                local = (room, (form, only))
            except Exception as exc:  # noqa: BLE001 - every rank must still reach the gather below
                local = ("error", f"{type(exc).__name__}: {exc}")
        room, plan = coord.main_decision(local, "the form and the training part's tensors")
        for n in plan[1] or ():
            self._training_counts[n] = self._training_counts.get(n, 0) + 1
        return room, plan

    def _completed(self, step: int, report: CheckReport) -> List[Alert]:
        """A check that has a report: notes, counters and coverage, then its trends' alerts."""
        report.notes[:0] = self.notes
        self._checks += 1
        for n in report.tensors:
            self._counts[n] = self._counts.get(n, 0) + 1
        watched = self._watched_names()
        self.planner.attach(self.model, watched)
        self.planner.record(report)
        self._announce_plan(report, watched)
        for note in self.planner.unchecked_news(report):
            logger.warning("gradwatch: step %d: %s (said once; every check's record repeats it)", step, note)
        return self.tracker.update(step, report) + self.independence.alerts(step, report.independence)

    def _announce_plan(self, report: CheckReport, watched: List[str]) -> None:
        """Say once per plan what is checked within how many checks (K), and put K in the report."""
        k = self.planner.cycle_length if report.form == "module" else self.planner.objective_cycle(len(watched))
        self._cycle_length = k
        line = self.planner.describe(report.form, len(watched), self.config.every)
        if self.planner.announced != line:
            self.planner.announced = line
            logger.info("gradwatch: %s", line)
            report.notes.insert(0, line)

    def _check_target(self) -> nn.Module:
        """The module a check evaluates: the model, or for a sharded (FSDP2) model its gathered replica.

        A sharded model's layout is agreed with the other ranks first, so that every rank gathers the
        same parameters in the same order (the only collectives of the model's group in a check).
        """
        if not self._sharded:
            return self.model
        if self.dist is not None:
            self.dist.same_everywhere(layout(self.model), "the parameters to gather (name, shape, dtype, has .grad)")
        if self._by_shard:
            return self.model  # checked shard by shard (gradwatch.watch.shard_check)
        if self._replica is None or not self._replica.matches(self.model):
            self._replica = Replica(self.model)
        return self._replica.refresh(self.model)

    def _finish_distributed(self, step: int, names: List[str], opts: Any, report: Optional[CheckReport],
                            replay: Optional[Replay], error: Optional[Exception], seconds: float,
                            waited: float = 0.0) -> Optional[CheckReport]:
        """This rank's share gathered with the others' and merged alike on every rank; trends, sinks, alerts."""
        coord = self.dist
        assert coord is not None
        result = RankResult(rank=coord.rank, report=report, seconds=seconds, waited=waited, interval=self.schedule.interval(),
                            training=None if replay is None else (replay.grads is not None, replay.reason),
                            cut=list(self.step_objective.rows) if replay is not None and replay.grads is not None else None)
        if isinstance(error, PeerFailed):  # the rank that raised says what; this one only stopped with it
            logger.info("gradwatch: the check at step %d stopped on rank %d: %s", step, coord.rank, error)
        elif error is not None:
            logger.error("gradwatch: the check at step %d raised on rank %d; training goes on:\n%s", step, coord.rank,
                         "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip())
            result.error, result.where = f"{type(error).__name__}: {error}", blamed(error)
        results = coord.gather(result)
        if results is None:  # once: the coordinator is broken and checks no more
            gave_up = Alert(step=int(step), tensor=WHOLE_CHECK, kind="error", severity="error", value=math.nan,
                            baseline=None, message=f"step {step}: {coord.broken}; training continues")
            self._emit(step, None, [gave_up], seconds)
            return None
        merged = merge_results(results, names, opts)
        if merged.error is not None and self._by_shard and self._mark is not None:
            self.planner.rewind(self._mark[0])  # the same plan on every rank again (it may have moved on some)
            self.objective.differentiates = self._mark[1]
        alerts: List[Alert] = []
        if merged.report is not None:
            self._training_across_ranks(merged.report, replay, merged.training, [r.cut for r in results])
            alerts = self._completed(step, merged.report)
        else:
            self._checks += 1
        if merged.error is not None:
            alert = self.tracker.error(step, merged.error, where=merged.where)
            alerts.extend([alert] if alert is not None else [])
        self._emit(step, merged.report, alerts, merged.seconds)
        return merged.report

    def _training_across_ranks(self, merged: CheckReport, replay: Optional[Replay],
                               statuses: List[Optional[Tuple[bool, Optional[str]]]],
                               rows: Optional[List[Optional[List[torch.Tensor]]]] = None) -> None:
        """The training part on every rank alike: the replayed gradients averaged over the ranks (as DDP and
        FSDP average ``.grad``; each rank's replay weighed its micro-batches by their share of the step's items),
        the live ``.grad`` judged against them, and rank 0's verdicts taken everywhere. ``rows``: every rank's
        sketches of its micro-batches' gradients (they name a step cut wrongly).

        Every branch depends on the gathered ``statuses`` only, so every rank makes the same collectives.
        """
        coord = self.dist
        assert coord is not None
        if any(s is None for s in statuses):
            if any(s is not None for s in statuses):
                merged.training_note = "not judged: the replay failed on another rank"
            return
        failed = [(rank, s[1]) for rank, s in enumerate(statuses) if s is not None and not s[0]]
        if failed:
            rank, reason = failed[0]
            merged.training_note = f"rank {rank}: {reason}"
            return
        assert replay is not None and replay.grads is not None
        try:
            averaged = coord.average(replay.grads, in_place=self.grad_fn is None)  # grad_fn's may be .grad itself
        except Exception as exc:  # noqa: BLE001 - a collective that fails must not stop training
            merged.training_note = (f"not judged: averaging the replayed gradients over the ranks failed "
                                    f"({type(exc).__name__}: {exc})")
            return
        try:
            every = [row for rank in rows or () for row in rank or ()]
            self._attach_training(merged, replay, averaged, rows=every if rows and all(r is not None for r in rows) else None)
            merged.training_note = ((merged.training_note + "; ") if merged.training_note else "") + (
                f"the reference is averaged over {coord.world_size} ranks, as DDP and FSDP average .grad")
        except Exception as exc:  # noqa: BLE001 - the broadcast below must still happen on every rank
            merged.training = {}
            merged.training_note = f"not judged on rank {coord.rank}: {type(exc).__name__}: {exc}"
        # A gradient DDP did not synchronize differs from rank to rank: every rank takes rank 0's judgement,
        # so trends and alerts stay identical everywhere.
        try:
            merged.training, merged.training_note = coord.from_main((merged.training, merged.training_note))
        except Exception as exc:  # noqa: BLE001
            merged.training = {}
            merged.training_note = f"not judged: sharing rank 0's training verdicts failed ({type(exc).__name__}: {exc})"

    # ------------------------------------------------------------------ the training part
    @contextlib.contextmanager
    def _recorder_paused(self) -> Iterator[None]:
        """The backward part's evaluations (in place with ``dtype=None``) are not training forwards."""
        if self._recorder is None:
            yield
            return
        self._recorder.paused = True
        try:
            yield
        finally:
            self._recorder.paused = False

    def _training_params(self, model: Optional[nn.Module] = None) -> Dict[str, torch.Tensor]:
        """The watched live parameters of ``model`` (default: the model; a sharded one's replica has the
        same names); the patterns are matched again only when the trainable set changes.

        The last walk's result is reused while the module tree is the same: every module still holds
        the same submodules and parameters (compared by identity, with nothing added or removed) and
        each still has its ``requires_grad``. A replaced layer, a frozen, unfrozen or new parameter makes the next
        check walk again. Checking that costs a few microseconds; a walk costs 30-50 us on a small model.
        """
        model = self.model if model is None else model
        cached = getattr(self, "_params_cache", None)
        if (cached is not None and cached[3] is model and _same_tree(cached[1])
                and list(map(_REQUIRES_GRAD, cached[2][0])) == cached[2][1]):
            return cached[0]
        self._modules_cache = list(model.modules())  # current while the tree is: the replay's guards walk it
        tree = []
        named = []
        flags: List[torch.Tensor] = []  # every parameter (its requires_grad: one frozen or unfrozen changes the watched set)
        seen = set()
        for mname, module in model.named_modules():
            tree.append((module._modules, tuple(module._modules), tuple(module._modules.values())))
            tree.append((module._parameters, tuple(module._parameters), tuple(module._parameters.values())))
            for attr, p in module._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    flags.append(p)
                    if p.requires_grad and (p.is_floating_point() or p.is_complex()):
                        named.append((f"{mname}.{attr}" if mname else attr, p))
        key = tuple(n for n, _ in named)
        if self._watched_cache is None or self._watched_cache[0] != key:
            self._watched_cache = (key, set(match_names(list(key), self._check_options.tensors, strict=False)))
        watched = self._watched_cache[1]
        params = {n: p for n, p in named if n in watched}
        self._params_cache = (params, tree, (flags, list(map(_REQUIRES_GRAD, flags))), model)
        return params

    def _training_replay(self, pending: Optional[Step], model: Optional[nn.Module] = None,
                         room: Optional[int] = None, only: Optional[Sequence[str]] = None, seed: int = 0) -> Optional[Replay]:
        """The objective's gradient recomputed as training computed it (None when the part is off).

        ``model`` is the module the replay runs (default: the model; a sharded model's gathered replica,
        whose parameters hold the gathered ``.grad``). With a ``room`` (bytes, from ``memory_budget``),
        the replay takes the gradient of only as many watched tensors as fit beside training's
        activations, least-judged first (they rotate from check to check); without one, of every
        watched tensor; with ``only`` (names, under DDP: rank 0's choice), of those. An exception of
        ``loss_fn`` in the replay propagates: the check is skipped with an error alert. Each micro-batch weighs its
        share of the step's items (:mod:`gradwatch.watch.step_objective`, agreed with the other ranks first).
        """
        if self._recorder is None or pending is None:
            return None
        if self._mixed is not None and not self._by_shard:
            return Replay(None, None, None, f"not judged: FSDP2's MixedPrecisionPolicy ({self._mixed}) computes "
                                            "training in another precision than the parameters'; the training part "
                                            "does not replay it yet")
        model = self.model if model is None else model
        params = self._training_params(model)
        plist = tuple(params.values())
        if all(p.grad is None for p in plist):
            return Replay(None, None, None, "not judged: no watched parameter has a .grad yet (watch.step or check "
                                            "before the first backward)")
        row_plan: Dict[str, Tuple[int, int]] = {}
        if only is not None or (room is not None and self.config.form != "objective"):
            if only is not None:
                params = {n: params[n] for n in only if n in params}
            else:
                params, row_plan = self._training_subset(params, cast(int, room), rows=self.grad_fn is None)
            if not params:
                return Replay(None, None, None, f"not judged: the replayed gradient of the smallest watched tensor does "
                                                f"not fit in the room memory_budget leaves ({mb(room)})")
            plist = tuple(p for n, p in params.items() if n not in row_plan)
        linears = sliceable_linears(model) if row_plan else {}
        rowgrads = RowGrads({n: (linears[n], params[n], rows) for n, rows in row_plan.items()}) if row_plan else None
        whole = [(n, p) for n, p in params.items() if n not in row_plan]

        scaler = self.grad_scaler if self.grad_scaler is not None and self.grad_scaler.is_enabled() else None
        plan = self._plan_step(pending, model, {n: p for n, p in params.items() if n not in row_plan} or params, seed)
        if plan.weights is None:
            return Replay(None, None, None, plan.reason)
        weight_of = {id(mb.batch): w for mb, w in zip(pending.micro, plan.weights)}

        def grad_of(total: torch.Tensor, batch: Any) -> Dict[str, torch.Tensor]:
            if self.grad_fn is not None:
                from ..check.model import _validate_grads

                grads = _validate_grads(self.grad_fn(model, batch), params, "grad_fn")
                weight = weight_of.get(id(batch), 1.0)  # grad_fn gives the micro-batch's own gradient: weighed here
                return grads if weight == 1.0 else {n: g * weight for n, g in grads.items()}
            leaves = rowgrads.leaves() if rowgrads is not None else ()
            if not total.requires_grad:
                out = {n: torch.zeros_like(p) for n, p in whole}
                out.update(rowgrads.split([None] * len(leaves)) if rowgrads is not None else {})
                return out
            inv = None
            if scaler is not None:  # scaler.scale(loss).backward(), then unscale_: times the float32 reciprocal
                inv = torch.tensor(float(scaler.get_scale()), dtype=torch.float64).reciprocal().float()
                total = scaler.scale(total)
            gs = (backward_on_shards(model, total, plist, reuse=len(pending.micro) == 1,
                                     before=self._lockstep.point if self._lockstep is not None else None)
                  if self._by_shard
                  else scalar_grad(total, plist + leaves))
            out = {n: torch.zeros_like(p) if g is None else _dense(g) for (n, p), g in zip(whole, gs[:len(plist)])}
            if rowgrads is not None:  # weights judged by rows: the gradient of those rows only
                out.update(rowgrads.split(list(gs[len(plist):])))
            if inv is not None:
                out = {n: g * inv.to(g.device) for n, g in out.items()}
            return out

        autocast = next((mb.records[0].autocast for mb in pending.micro if mb.records), ())
        dtypes = {p.dtype for p in plist}  # a few distinct dtypes, however many tensors
        worst = compute_dtype(max(dtypes, key=tolerance_for, default=torch.float32), autocast)
        with rowgrads if rowgrads is not None else contextlib.nullcontext():
            replay = replay_step(model, self._recorder, pending, self.objective.training_total, grad_of, params,
                                 loss_tolerance=10 * tolerance_for(worst), context=self.replay_context,
                                 generators=self._held_generators(), modules=self._modules_cache,
                                 lockstep=self._by_shard, weights=plan.weights,
                                 each=self.step_objective.each(seed) if plan.cut and not plan.equal else None)
        replay.params = params
        replay.rows = row_plan
        replay.plan = plan
        return replay

    def _plan_step(self, pending: Step, model: nn.Module, params: Dict[str, torch.Tensor], seed: int) -> StepPlan:
        """The step's objective (:class:`~gradwatch.watch.step_objective.StepObjective`): on every rank alike (an
        exchange of counts when distributed); probes evaluate the live model in one process and under DDP."""
        probe = not self._sharded and self.grad_fn is None
        with self._recorder_paused():
            return self.step_objective.plan([mb.batch for mb in pending.micro], model if probe else None,
                                            self.objective.loss, params, self.dist, seed, probe=probe,
                                            shift_hint=_shift_hint(model))

    def _training_subset(self, params: Dict[str, torch.Tensor], room: int, count: bool = True, rows: bool = True
                         ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Tuple[int, int]]]:
        """The watched tensors whose replayed gradients fit in ``room`` beside the replay's activations (all when they
        fit; else least-judged first, in model order among equals), and with ``rows`` the weights judged by a block
        of rows (:mod:`gradwatch.check.row_replay`; the next block at the next turn). ``count``: count them as
        judged (and move the row blocks on).

        Only a weight bigger than a quarter of the free share is judged by rows, at its turn, in an equal part of
        half the share (the other half for the whole tensors): a smaller weight waits for a turn with room for it
        whole (a few fit each check), and the big weights never starve the rest.
        """
        transient = self.memory.transient(self.model)
        # The safe share beside the replay's activations; at least a quarter of what the room leaves beside them
        # (a transient near half the room would otherwise leave nothing, and one tensor a check).
        free = max(SAFETY * room - transient, SAFETY * SAFETY * (room - transient))
        if gradient_bytes(params.values()) <= free:
            return params, {}
        names = list(params)
        order = sorted(range(len(names)), key=lambda i: (self._training_counts.get(names[i], 0), i))
        linears = sliceable_linears(self.model) if rows else {}
        big = {n for n in names if n in linears and params[n].dim() == 2 and params[n].shape[0] > 1
               and gradient_bytes([params[n]]) > free / 4}
        share = free / (2 * max(1, len(big)))
        least = min(self._training_counts.get(n, 0) for n in names)
        chosen = []
        sliced: Dict[str, Tuple[int, int]] = {}
        for i in order:  # the big weights' blocks first (an equal part each), then whole tensors in what is left
            n, p = names[i], params[names[i]]
            if n not in big or self._training_counts.get(n, 0) != least:
                continue
            per_row = 2 * p.shape[1] * p.element_size()  # the rows' copy and their gradient
            k = min(int(share // per_row), p.shape[0] - 1)
            if k >= 1:
                first = self._row_cursor.get(n, 0) % p.shape[0]
                end = min(first + k, p.shape[0])
                sliced[n] = (first, end)
                chosen.append(i)
                free -= (end - first) * per_row
        for i in order:
            need = gradient_bytes([params[names[i]]])
            if names[i] not in big and need <= free:
                chosen.append(i)
                free -= need
        if not chosen and order and gradient_bytes([params[names[order[0]]]]) <= room:
            chosen.append(order[0])  # a tensor bigger than the safe share still gets its turn, alone, within the room
        out = {names[i]: params[names[i]] for i in sorted(chosen)}
        for n in out if count else ():
            self._training_counts[n] = self._training_counts.get(n, 0) + 1
            if n in sliced:
                self._row_cursor[n] = sliced[n][1] % params[n].shape[0]
        return out, sliced

    def _choose_form(self, model: nn.Module, names: List[str], room: Optional[int]) -> Tuple[str, Optional[int], Optional[str]]:
        """``(form, estimate in bytes, a note or None)`` from the planner (:meth:`Planner.choose_form`)."""
        dtype = self._check_options.torch_dtype
        held = dtype is not None and self._shadow is not None and self._shadow.matches(model)
        return self.planner.choose_form(model, names, room, dtype, held, self.memory.transient(model), self.grad_fn is not None)

    #: Checks between two searches for generators held by the model or the objective (a search walks closures).
    GENERATOR_SEARCH_EVERY = 16

    def _held_generators(self) -> List[Any]:
        """Generators the model, ``loss_fn``, regularizers or ``grad_fn`` hold (searched again every few checks)."""
        cached = self._generator_cache
        if cached is None or self._checks - cached[0] >= self.GENERATOR_SEARCH_EVERY:
            roots = [self.objective.loss_fn, *self.objective.regularizers.values(), self.grad_fn, self.model]
            cached = self._generator_cache = (self._checks, find_generators(roots))
        return cached[1]

    def _attach_training(self, report: CheckReport, replay: Optional[Replay],
                         grads: Optional[Dict[str, torch.Tensor]] = None,
                         rows: Optional[List[torch.Tensor]] = None) -> None:
        """Judge every watched tensor's live ``.grad`` against the replayed gradient; fills ``report.training``.
        On a cut step, a failure is named by the weights training gave the micro-batches (``rows``: every rank's
        sketches, distributed; this rank's by default)."""
        if replay is None:
            return
        if replay.grads is None:
            report.training_note = replay.reason
            return
        grads = grads if grads is not None else replay.grads
        params = replay.params if replay.params is not None else self._training_params()
        scales: List[float] = []  # computed only if some tensor's .grad is not bitwise the replayed gradient

        def scale() -> float:
            if not scales:
                scales.append(gradient_scale(list(grads.values())))
            return scales[0]

        bands, fail_at, autocast = self._check_options.bands, self._check_options.fail_verdict, replay.autocast
        dtypes: Dict[torch.dtype, torch.dtype] = {}  # parameter dtype -> compute dtype, once per dtype
        sliced = getattr(replay, "rows", None) or {}
        lives: Dict[str, Optional[torch.Tensor]] = {}
        for n, p in params.items():
            dtype = dtypes.get(p.dtype) or dtypes.setdefault(p.dtype, compute_dtype(p.dtype, autocast))
            live = p.grad
            if is_dtensor(p):  # sharded: this rank's shard of both (the ranks' verdicts are merged, worst first)
                p, live = local(p), None if live is None else local(live)
            if n in sliced:  # judged by a block of rows: the live .grad's rows against the replayed rows
                first, end = sliced[n]
                p, live = p[first:end], None if live is None else live[first:end]
            lives[n] = live
            report.training[n] = judge_training(n, live, grads[n], p, dtype, bands, fail_at, scale=scale)
        report.training_rows = dict(sliced)
        plan: Optional[StepPlan] = getattr(replay, "plan", None)
        notes = [f"replayed from the {replay.how} RNG state" if replay.how else ""]
        if plan is not None:
            report.training_items = plan.record()
            notes.insert(0, plan.note or "")
            if plan.cut:
                self.step_objective.explain(plan, report.training, lives, rows, folded=self._by_shard)
        if replay.loss_gap is not None:
            given, replayed = replay.loss_gap
            notes.append(
                f"training's loss {given:.6g} differs from the objective's {replayed:.6g} at the same point "
                f"(by {given - replayed:+.3g}): the training loss has a term the objective lacks, or the reverse"
            )
        report.training_note = "; ".join(n for n in notes if n) or None

    def _failed(self, step: int, exc: Exception, seconds: float) -> None:
        """A check raised: log its cause once per kind of failure, count it, and pause after a few in a row."""
        self._failures += 1
        key = error_key(exc)
        seen = self._failure_counts.get(key, 0)
        self._failure_counts[key] = seen + 1
        if seen == 0:  # the cause and the fix; the alert below says it in one line
            logger.error(
                "gradwatch: the check at step %d raised %s (in %s); the check is skipped and training goes on. "
                "Fix: make loss_fn(model, batch) compute the training loss of the batch without side effects "
                "(no backward, no optimizer step). Later failures like this one are counted, not printed.\n%s",
                step, key, blamed(exc) or "gradwatch", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
        else:
            logger.debug("gradwatch: the check at step %d failed again (%d times): %s", step, seen + 1, key)
        alert = self.tracker.error(step, exc, where=blamed(exc))
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
                                  coverage=self.coverage, check_counts=self.check_counts,
                                  cycle_length=self._cycle_length)
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
        if alert.kind == "independence":  # a confirmed leak is wrong at any level
            return True
        if alert.kind == "threshold":
            return Verdict.from_value(alert.value, self._check_options.bands).is_failure(Verdict.parse(level))
        return alert.kind == "drift" and Verdict.parse(level) == Verdict.SUSPICIOUS

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume: schedule, trends, coverage, counters."""
        return {
            "version": STATE_VERSION,
            "run_id": self.run_id,
            "step": self._step,
            "checks": self._checks,
            "counts": dict(self._counts),
            "plan": self.planner.state_dict(),
            "schedule": self.schedule.state_dict(),
            "tracker": self.tracker.state_dict(),
            "independence": self.independence.state_dict(),
            "alerts": [a.to_dict() for a in self.alerts],
            "monitor_seconds": self._monitor_seconds,
            "baseline_seconds": self._baseline_seconds,
            "wall_seconds": self._wall_before + ((time.perf_counter() - self._started) if self._started else 0.0),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the schedule and trends continue as if uninterrupted."""
        if not isinstance(state, Mapping) or "tracker" not in state:
            raise ValueError("load_state_dict expects a dict produced by GradWatch.state_dict()")
        version = state.get("version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= STATE_VERSION:
            raise ValueError(f"load_state_dict: the state has version {version!r}, this gradwatch "
                             f"({_version}) reads versions 1 to {STATE_VERSION}: a checkpoint written by a newer "
                             "gradwatch; upgrade gradwatch, or drop the 'gradwatch' entry to start the watch afresh")
        self._step = int(state["step"])
        self._checks = int(state["checks"])
        self._counts = dict(state["counts"])
        self.planner.load_state_dict(state.get("plan", {}))
        self.schedule.load_state_dict(state["schedule"])
        self.tracker.load_state_dict(state["tracker"])
        self.independence.load_state_dict(state.get("independence", {}))
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
        """Flush and close the sinks and remove the forward hook from the model (idempotent)."""
        if not self._closed:
            self._closed = True
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
        return f"GradWatch(every={self.config.every!r}, checks={self._checks}, alerts={len(self.alerts)})"
