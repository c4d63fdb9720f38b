"""What the parts of a watch share: its setting, one check's context, and the interface of a part.

A :class:`~gradwatch.GradWatch` is a façade over parts (backward, training, inner derivatives,
independence; :mod:`gradwatch.watch.parts.backward`, :mod:`gradwatch.watch.parts.training`,
:mod:`gradwatch.watch.parts.inner`, :mod:`gradwatch.watch.parts.independence`). The parts never import each
other: what they all read lives here, below them.

- :class:`WatchContext`: the watch's setting for the whole run (the model, the objective, the watched
  tensors, the memory meter, the ranks, the shards, the recorder of training's forwards).
- :class:`CheckContext`: one check (its step, batch, options, tensors, room and plan), handed to each
  part's ``run``.
- :class:`Part`: the interface every part has.

Example:
    >>> from torch import nn
    >>> from gradwatch.check.objective.terms import Objective
    >>> from gradwatch.config import GradWatchConfig
    >>> from gradwatch.plan.memory import MemoryMeter
    >>> model = nn.Linear(2, 1)
    >>> ctx = WatchContext(model, Objective(lambda m, b: m(b).sum(), {}, 0.0), None,
    ...                    GradWatchConfig().check_options(), MemoryMeter(None, None), None, None, "auto")
    >>> ctx.watched_names(), ctx.sharded
    (['weight', 'bias'], False)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Iterator, List, Mapping, Optional, Protocol, Tuple, runtime_checkable

from torch import nn

from gradwatch.check.judging.report import CheckReport
from gradwatch.check.model import GradFn, trainable_names
from gradwatch.check.numerics.sampling import match_names
from gradwatch.check.objective.generators import find_generators
from gradwatch.check.objective.terms import Objective
from gradwatch.check.replay.reference import ForwardRecorder, MicroBatch, Replay, StartState, Step
from gradwatch.options import CheckOptions
from gradwatch.parallel.coordinator import DistributedCoordinator
from gradwatch.parallel.lockstep import Lockstep
from gradwatch.parallel.sharded import REPLICA_NOTE, Replica, is_sharded, layout, mixed_precision
from gradwatch.parallel.wrappers import Wrapping
from gradwatch.parallel.zero import ZeroReplica, at_boundary, engine_of, zero3, zero_layout, zero_params
from gradwatch.plan.memory import MemoryMeter
from gradwatch.watch.trend import Alert

#: The note every report of a model trained with DeepSpeed ZeRO checked with ``form="objective"`` carries.
ZERO_NOTE = ("the model is trained with DeepSpeed ZeRO: the check ran on a replica gathered through ZeRO's own "
             "GatheredParameters and safe_get_full_grad on every rank, never on the live engine")
#: The note every report of a ZeRO-3 model checked piece by piece carries.
ZERO3_NOTE = ("the model is trained with DeepSpeed ZeRO-3: checked piece by piece on the live model, ZeRO's hooks "
              "gathering each module's parameters as in training; each rank gathers its pieces' parameters through "
              "GatheredParameters and judges its partition of ZeRO's gradient (safe_get_local_grad)")
#: The note every report of a ZeRO-1 or ZeRO-2 model checked on the live model carries.
ZERO12_NOTE = ("the model is trained with DeepSpeed ZeRO (stage 1 or 2): checked on the live model, the ranks "
               "splitting its pieces; ZeRO's gradient read one tensor at a time through safe_get_full_grad")



@dataclasses.dataclass(frozen=True)
class Plan:
    """Under DDP, rank 0's decisions for a check, taken by every rank.

    Attributes:
        form: ``(form, estimate in bytes or None, a note or None)``: ``"objective"`` or ``"module"``.
        training: The training part's tensors where a room bounds them (None: all of them).

    Example:
        >>> Plan(("module", None, None), ["fc.weight"]).form_name
        'module'
    """

    form: Tuple[str, Optional[int], Optional[str]]
    training: Optional[List[str]] = None

    @property
    def form_name(self) -> str:
        """The form's name: ``"objective"`` or ``"module"``."""
        return self.form[0]


def check_arguments(model: Any, loss_fn: Any, on_alert: Any = None, grad_scaler: Any = None) -> None:
    """Refuse, with a TypeError saying what is expected, arguments a :class:`~gradwatch.GradWatch` cannot use.

    Example:
        >>> check_arguments(nn.Linear(2, 1), lambda m, b: m(b).sum())
        >>> check_arguments(nn.Linear(2, 1), "loss")
        Traceback (most recent call last):
        TypeError: loss_fn must be callable loss_fn(model, batch) -> scalar tensor, got str
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable loss_fn(model, batch) -> scalar tensor, got {type(loss_fn).__name__}")
    if on_alert is not None and not callable(on_alert):
        raise TypeError(f"on_alert must be callable on_alert(alert), got {type(on_alert).__name__}")
    if grad_scaler is not None and not (callable(getattr(grad_scaler, "scale", None))
                                        and callable(getattr(grad_scaler, "get_scale", None))):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")


class WatchContext:
    """The watch's setting that every part reads (one per watch, for the whole run).

    Args:
        model: The (unwrapped) model being trained.
        objective: The check objective (loss, regularizers, coupled weight decay).
        grad_fn: Optional hand-written backprop.
        options: The check options (``tensors`` patterns, bands, seed, dtype...).
        memory: Training's peak memory and the room a check has.
        dist: The coordinator of the ranks (None in one process).
        recorder: The recorder of training's forwards (None when the training part is off).
        form: The ``form`` option (``"objective"`` makes a sharded model be checked on a gathered replica).
        wrapping: The wrappers training calls the model through (:mod:`gradwatch.parallel.wrappers`: the module the
            training part's replay hands ``loss_fn``, where the recorder sits); default: none.

    Example:
        See the module's example.
    """

    #: Checks between two searches for generators held by the model or the objective (a search walks closures).
    GENERATOR_SEARCH_EVERY = 16

    def __init__(self, model: nn.Module, objective: Objective, grad_fn: Optional[GradFn], options: CheckOptions,
                 memory: MemoryMeter, dist: Optional[DistributedCoordinator], recorder: Optional[ForwardRecorder],
                 form: str, wrapping: Optional[Wrapping] = None) -> None:
        self.model = model
        #: The wrappers around the model (:class:`~gradwatch.parallel.wrappers.Wrapping`; ``model`` is its ``model``).
        self.wrapping = wrapping if wrapping is not None else Wrapping(model, model, model)
        self.objective = objective
        self.grad_fn = grad_fn
        self.options = options
        self.memory = memory
        self.dist = dist
        self.recorder = recorder
        #: Checks completed (or failed) so far.
        self.checks = 0
        fsdp = is_sharded(model)
        #: DeepSpeed ZeRO (the engine, or parameters that are ZeRO's): checked on the live model, or with
        #: ``form="objective"`` on a gathered replica (:mod:`gradwatch.parallel.zero`).
        self.zero = self.wrapping.engine is not None or zero_params(model)
        #: DeepSpeed's engine (given, or around ``model`` when the watch was given ``engine.module``).
        self.engine = self.wrapping.engine if self.wrapping.engine is not None else engine_of(model) if self.zero else None
        # A sharded (FSDP2, ZeRO) model: checked shard by shard, or on a plain replica gathered at each check.
        self.sharded = fsdp or self.zero
        self.mixed: Optional[str] = mixed_precision(model) if fsdp else None
        #: ZeRO-3: the parameters are placeholders, partitioned over the ranks (fixed when the engine is built).
        self.zero3 = self.zero and zero3(model)
        #: FSDP2 and ZeRO: by default shard by shard (:mod:`gradwatch.parallel.shard_check`), the module form on every
        #: rank's share of the pieces (a failure is named by its module); ``form="objective"`` gathers a replica.
        self.by_shard = (fsdp or self.zero) and form != "objective"
        self.replica: Optional[Replica] = None  # built at the first check
        self.last_micro: Any = None  # training part off: the last batch given to GradWatch.accumulate()
        #: Shard by shard, during a check: its agreement points (:mod:`gradwatch.parallel.lockstep`).
        self.lockstep: Optional[Lockstep] = None
        self._generator_cache: Optional[Tuple[int, List[Any]]] = None
        #: One process: all the randomness an isolated forward of the objective met was dropout (None: not known),
        #: so the training part's replay, dropout on, can be the module form's capture
        #: (:mod:`gradwatch.watch.parts.replay_capture`).
        self.dropout_only: Optional[bool] = None

    @property
    def one_process(self) -> bool:
        """No other rank to agree with: not distributed (DDP) and not sharded (FSDP2, ZeRO)."""
        return self.dist is None and not self.sharded

    def close_micro_batch(self, batch: Any, loss: Any = None) -> None:
        """A micro-batch's backward is done (:meth:`GradWatch.accumulate`): recorded, or kept as the last one."""
        if self.recorder is not None:
            self.recorder.close_micro_batch(batch, loss)
        else:
            self.last_micro = batch

    def take(self, batch: Any, loss: Any) -> Step:
        """The step's micro-batches for a check (the recorded ones, or just ``batch``)."""
        if self.recorder is not None:
            pending = self.recorder.take(batch, loss)
        else:
            last = batch if batch is not None else self.last_micro
            pending = Step([MicroBatch(last, loss, StartState.now())])
        self.last_micro = None
        if pending.micro[-1].batch is None:
            raise TypeError("GradWatch.step() needs the batch (or GradWatch.accumulate(micro_batch) calls before it)")
        return pending

    def watched_names(self) -> List[str]:
        """The trainable parameters the ``tensors`` patterns match now, in model order."""
        # Not strict: a pattern may stop matching when its tensors are frozen mid-run (checked at construction).
        return match_names(trainable_names(self.model), self.options.tensors, strict=False)

    @contextlib.contextmanager
    def recorder_paused(self) -> Iterator[None]:
        """The checks' own evaluations (in place with ``dtype=None``) are not training forwards."""
        if self.recorder is None:
            yield
            return
        self.recorder.paused = True
        try:
            yield
        finally:
            self.recorder.paused = False

    def held_generators(self) -> List[Any]:
        """Generators the model, ``loss_fn``, regularizers or ``grad_fn`` hold (searched again every few checks)."""
        cached = self._generator_cache
        if cached is None or self.checks - cached[0] >= self.GENERATOR_SEARCH_EVERY:
            roots = [self.objective.loss_fn, *self.objective.regularizers.values(), self.grad_fn, self.model]
            cached = self._generator_cache = (self.checks, find_generators(roots))
        return cached[1]

    def target(self) -> nn.Module:
        """The module a check evaluates: the model, or for a sharded (FSDP2) model its gathered replica.

        A sharded model's layout is agreed with the other ranks first, so that every rank gathers the
        same parameters in the same order (the only collectives of the model's group in a check).
        """
        if not self.sharded:
            return self.model
        if self.by_shard and self.zero:
            at_boundary(self.engine)  # before any collective: every rank raises alike
        if self.dist is not None:
            self.dist.same_everywhere(zero_layout(self.model) if self.zero else layout(self.model),
                                      "the parameters to gather (name, shape, dtype, has .grad)")
        if self.by_shard:
            return self.model  # checked shard by shard (gradwatch.parallel.shard_check)
        if self.replica is None or not self.replica.matches(self.model):
            self.replica = None  # the old copy goes before the new one is made
            self.replica = ZeroReplica(self.model, self.engine) if self.zero else Replica(self.model)
        return self.replica.refresh(self.model)

    def sharding_note(self, shard_note: str) -> str:
        """The note every report of a sharded model carries (``shard_note``: shard by shard's)."""
        if self.by_shard:
            return (ZERO3_NOTE if self.zero3 else ZERO12_NOTE) if self.zero else shard_note
        return ZERO_NOTE if self.zero else REPLICA_NOTE

    def release(self) -> None:
        """After a check: the replica's gathered ``.grad`` lives for one check only."""
        if self.replica is not None:
            self.replica.release()


@dataclasses.dataclass
class CheckContext:
    """One check, as the parts see it (filled as the check goes: the report by the backward part).

    Attributes:
        watch: The watch's setting.
        step: The training step checked.
        target: The module evaluated (the model, or a sharded model's replica).
        batch: The checked batch (the step's last micro-batch).
        opts: The check options, seeded for this check.
        pending: The step's recorded micro-batches (for the training part's replay).
        chosen: The check's tensors over every rank (merged by them).
        names: This rank's tensors for the backward part.
        room: Bytes ``memory_budget`` leaves the check (None: no budget).
        plan: Under DDP, rank 0's form and training tensors.
        judge: Judge the training part here (one process, or shard by shard); else its replay goes to the ranks.
        replay: The training part's replay, while it is not judged yet (distributed).
        report: The check's report (None until the backward part made it).
        step_seconds: A training step's seconds, as the schedule timed them (their median), or before it had one, as
            the training part's replay of the step took them (None: not known); a paced module form's pieces take a
            few of them (:meth:`gradwatch.plan.planner.Planner.pace_seconds`).
        saved: What one forward of the checked batch saves for its backward, counted
            (:class:`~gradwatch.check.modules.activations.Saved`; one process, under a room; None: not counted): the
            training part's replay checkpoints its blocks by their counted shares.
        fused: The training part's replay as the forward of the backward part's first capture
            (:mod:`gradwatch.watch.parts.replay_capture`; None: the backward part runs its own forward).
        held: Bytes the captures may hold through a fused replay (None: no room).
        hooks: The capture's hooks the training part's replay runs in its forward (set by the runner for a fused
            replay; None: a plain replay).
        faithful: Whether that fused forward computed the isolated forward's values (set by the training part; None:
            its forward ran without the hooks).

    Example:
        >>> CheckContext(None, 3, None, None, None).names
        []
    """

    watch: WatchContext
    step: int
    target: Any
    batch: Any
    opts: CheckOptions
    pending: Optional[Step] = None
    chosen: List[str] = dataclasses.field(default_factory=list)
    names: List[str] = dataclasses.field(default_factory=list)
    room: Optional[int] = None
    plan: Optional[Plan] = None
    judge: bool = True
    replay: Optional[Replay] = None
    report: Optional[CheckReport] = None
    step_seconds: Optional[float] = None
    saved: Any = None
    fused: Any = None
    held: Optional[int] = None
    hooks: Any = None
    faithful: Optional[bool] = None


@runtime_checkable
class Part(Protocol):
    """What every part of a watch offers the façade.

    ``run(check)`` does the part's work on one check and returns its results; ``alerts`` turns results
    into the part's own alerts (the backward, training and inner parts' verdicts alert through the
    watch's :class:`~gradwatch.watch.trend.TrendTracker`, so theirs is empty); ``state_dict`` is what a
    checkpoint keeps of the part.

    Example:
        >>> from gradwatch.watch.parts.independence import IndependencePart
        >>> isinstance(IndependencePart(None), Part)
        True
    """

    name: str

    @property
    def enabled(self) -> bool: ...

    def run(self, check: CheckContext) -> Any: ...

    def alerts(self, step: int, results: Any) -> List[Alert]: ...

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class TrendAlerting:
    """Defaults for a part whose verdicts alert through the watch's trend tracker and that a checkpoint does not keep.

    Example:
        >>> TrendAlerting().alerts(0, None), TrendAlerting().state_dict()
        ([], {})
    """

    def alerts(self, step: int, results: Any) -> List[Alert]:
        """None of its own: its verdicts alert through the watch's trend tracker."""
        return []

    def state_dict(self) -> Dict[str, Any]:
        """Nothing is kept in a checkpoint (its rotation starts again after a resume, as it always has)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


__all__ = ["ZERO12_NOTE", "ZERO3_NOTE", "ZERO_NOTE", "CheckContext", "Part", "Plan", "TrendAlerting", "WatchContext", "check_arguments"]
