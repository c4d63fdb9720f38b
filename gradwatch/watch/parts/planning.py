"""The plan of a check: which tensors, which form, the shadow it runs on, the inner modules that fit.

:class:`CheckPlanner` decides; the parts do (:mod:`gradwatch.watch.parts.backward`,
:mod:`gradwatch.watch.parts.training`, :mod:`gradwatch.watch.parts.inner`). It wraps the run's
:class:`~gradwatch.plan.planner.Planner` (the units, pieces and coverage of the module form) with what
depends on the watch: the rotation of the tensors, the form chosen under ``memory_budget`` (with the
float64 shadow cached between checks), this rank's share under DDP, the leaf modules whose double
backward fits the budget, and the announcement of the cycle.

Example:
    >>> from torch import nn
    >>> from gradwatch.check.objective.terms import Objective
    >>> from gradwatch.config import GradWatchConfig
    >>> from gradwatch.plan.memory import MemoryMeter
    >>> from gradwatch.plan.planner import Planner
    >>> from gradwatch.watch.parts.context import WatchContext
    >>> config = GradWatchConfig()
    >>> ctx = WatchContext(nn.Linear(2, 1), Objective(lambda m, b: m(b).sum(), {}, 0.0), None,
    ...                    config.check_options(), MemoryMeter(None, None), None, None, "auto")
    >>> planner = CheckPlanner(ctx, Planner(), config)
    >>> planner.tensors({})
    ['weight', 'bias']
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
from torch import nn

from gradwatch.check.higher_order.inner import leaf_modules
from gradwatch.check.judging.report import CheckReport, not_checked_in
from gradwatch.check.model import trainable_names
from gradwatch.check.modules.activations import Saved, saved_bytes
from gradwatch.check.modules.module_form import units_signature
from gradwatch.check.numerics.sampling import rotate
from gradwatch.check.objective.generators import HeldGenerators
from gradwatch.check.objective.shadow import Shadow
from gradwatch.check.probes.batched import compiled_modules
from gradwatch.config import GradWatchConfig
from gradwatch.plan.memory import SAFETY, mb, module_bytes, objective_activations
from gradwatch.plan.planner import Planner
from gradwatch.trees import tensor_leaves
from gradwatch.watch.parts.context import CheckContext, Plan, WatchContext

logger = logging.getLogger("gradwatch")

#: A form decision: ``(form, estimate in bytes or None, a note or None)``.
Form = Tuple[str, Optional[int], Optional[str]]


class CheckPlanner:
    """Decides what each check covers and how; holds the shadow copy the objective form reuses.

    Args:
        watch: The watch's setting.
        planner: The run's planner of units, pieces and coverage (``GradWatch.planner``).
        config: The watch's options (``form``, ``tensors_per_check``, ``every``).

    Example:
        See the module's example.
    """

    def __init__(self, watch: WatchContext, planner: Planner, config: GradWatchConfig) -> None:
        self.watch = watch
        self.planner = planner
        self.config = config
        #: The float64 (``dtype``) copy of the model the objective form checks on, kept while it matches.
        self.shadow: Optional[Shadow] = None
        #: K: checks within which every unit and every parameter row is probed once (None before the first check).
        self.cycle_length: Optional[int] = None
        self._mark: Optional[Tuple[Any, Optional[bool]]] = None
        #: What a forward of a batch saves for its backward, by the batch's shapes (:meth:`activations`).
        self._saved: Dict[Tuple, Optional[Saved]] = {}

    # ------------------------------------------------------------------ tensors
    def names_to_check(self) -> List[str]:
        """The watched tensors, or a ValueError saying none is matched any more."""
        names = self.watch.watched_names()
        if not names:
            raise ValueError(
                f"tensors: {self.watch.options.tensors!r} match no trainable parameter any more (frozen with "
                f"requires_grad=False since the watch started?); trainable now: {trainable_names(self.watch.model)[:8]}; "
                "no tensor was checked — change the tensors option to follow the parameters you train"
            )
        return names

    def tensors(self, counts: Dict[str, int]) -> List[str]:
        """The check's tensors: the least-checked ``tensors_per_check`` of them (per rank, distributed), or, shard
        by shard, every watched one (the planner's pieces are split by the shards)."""
        if self.watch.by_shard:
            return self.watch.watched_names()
        coord, per_check = self.watch.dist, self.config.tensors_per_check
        return rotate(self.names_to_check(), coord.tensors_per_check(per_check) if coord else per_check, counts)

    def mine(self, names: List[str], plan: Optional[Plan]) -> List[str]:
        """This rank's round-robin share of ``names`` under DDP (all of them in the module form, whose pieces are
        shared instead, shard by shard, and in one process)."""
        coord = self.watch.dist
        if coord is not None and not self.watch.by_shard and (plan is None or plan.form_name != "module"):
            return coord.share(names)
        return names

    # ------------------------------------------------------------------ the form
    def choose_form(self, model: nn.Module, names: List[str], room: Optional[int], batch: Any = None) -> Form:
        """``(form, estimate in bytes, a note or None)`` from the planner (:meth:`Planner.choose_form`), the whole
        objective's activations counted on ``batch`` where it can be (:meth:`activations`)."""
        dtype = self.watch.options.torch_dtype
        held = dtype is not None and self.shadow is not None and self.shadow.matches(model)
        objective = self.watch.objective
        plain = not (objective.regularizers or objective.weight_decay or objective.differentiates)
        saved = self.activations(model, batch) if room is not None and batch is not None else None
        transient = objective_activations(saved.total) if saved is not None else self.watch.memory.transient(model)
        return self.planner.choose_form(model, names, room, dtype, held, transient,
                                        self.watch.grad_fn is not None, plain=plain)

    def activations(self, model: nn.Module, batch: Any) -> Optional[Saved]:
        """What one forward of ``model`` on ``batch`` saves for its backward, in the model's dtypes
        (:func:`~gradwatch.check.modules.activations.saved_bytes`), counted once per shape of batch; None where it is
        not counted: ranks (a DDP forward with grad expects its backward), compiled modules (grad mode is one of their
        guards: a new graph), or ``loss_fn`` raised on it (the check itself then says so)."""
        if not self.watch.one_process or model is not self.watch.model \
                or compiled_modules(model):
            return None
        key = tuple(tuple(t.shape) for t in tensor_leaves(batch))
        if key not in self._saved:
            if len(self._saved) >= 16:  # variable shapes (padded to each batch's longest): the oldest goes
                self._saved.pop(next(iter(self._saved)))
            try:
                held = HeldGenerators.of(self.watch.held_generators())
                self._saved[key] = saved_bytes(model, self.watch.objective.loss, batch, self.watch.options.seed,
                                               held=held)
            except Exception:  # noqa: BLE001 - the objective's own evaluation raises it where it matters
                self._saved[key] = None
        return self._saved[key]

    def form_for(self, check: CheckContext) -> Form:
        """The form of this check: rank 0's (DDP), the module form shard by shard, else chosen here (one process;
        a distributed replica is checked whole)."""
        if check.plan is not None:
            return check.plan.form
        if self.watch.by_shard:
            return ("module", None, None)
        return self.choose_form(check.target, check.names, check.room, check.batch) if check.judge \
            else ("objective", None, None)

    def shadow_for(self, target: nn.Module, opts: Any) -> Optional[Shadow]:
        """The shadow copy of ``target`` in ``opts.dtype`` (made again only when the model changed)."""
        if opts.dtype is not None and (self.shadow is None or not self.shadow.matches(target)):
            self.shadow = None  # the old copy goes before the new one is made
            self.shadow = Shadow(target, cast(torch.dtype, opts.torch_dtype))
        return self.shadow

    def drop_shadow(self) -> None:
        """A whole copy of the model is what the module form avoids."""
        self.shadow = None

    def module_pieces(self, check: CheckContext, room: Optional[int]) -> Tuple[Any, Any]:
        """The units of ``check.target`` and this check's pieces of the cycle (:meth:`Planner.module_pieces`)."""
        target, opts = check.target, check.opts
        return self.planner.module_pieces(target, self.watch.objective.loss, check.batch, self.watch.watched_names(),
                                          key=units_signature(target), seed=opts.seed, room=room,
                                          surrogates=opts.surrogates)

    def pace_seconds(self, check: CheckContext, spent: float = 0.0) -> Optional[float]:
        """Seconds this module-form check's pieces may take, ``spent`` seconds of planning taken already (one process
        only: ranks keep one plan; :meth:`gradwatch.plan.planner.Planner.pace_seconds`)."""
        if self.watch.dist is not None or self.watch.by_shard:
            return None
        return self.planner.pace_seconds(check.step_seconds, spent)

    def for_ranks(self, room: Optional[int], training: Any) -> Plan:
        """Rank 0's plan under DDP: the form, and the training part's tensors when a room bounds them (``training``:
        ``(room) -> names`` or None when the training part is off)."""
        form = self.choose_form(self.watch.model, self.watch.watched_names(), room)
        only = None
        if room is not None and training is not None and self.config.form != "objective":
            only = list(training(room))
        return Plan(form, only)

    # ------------------------------------------------------------------ shard by shard
    def mark(self) -> None:
        """Shard by shard: remember the plan before the check (a check that failed on some rank is undone)."""
        self._mark = (self.planner.mark(), self.watch.objective.differentiates)

    def rewind(self) -> None:
        """The same plan on every rank again (it may have moved on some) after a check failed on a rank."""
        if self.watch.by_shard and self._mark is not None:
            self.planner.rewind(self._mark[0])
            self.watch.objective.differentiates = self._mark[1]

    # ------------------------------------------------------------------ inner modules
    def inner_modules(self, target: nn.Module, report: CheckReport, counts: Dict[str, int],
                      per_check: int) -> Tuple[List[str], List[str]]:
        """The leaf modules whose double backward this check covers, least-checked first, and their model order.

        Leaves that own watched parameters or sit beside modules that do (an activation); under a
        ``memory_budget`` only those whose float64 copy and check fit (the others get a note in ``report``).
        """
        owners = {n.rsplit(".", 1)[0] if "." in n else "" for n in self.watch.watched_names()}

        def related(leaf: str) -> bool:  # owns watched parameters, or sits beside modules that do (an activation)
            parent = leaf.rsplit(".", 1)[0] if "." in leaf else ""
            return leaf in owners or not parent or any(o == parent or o.startswith(parent + ".") for o in owners)

        leaves = [n for n in leaf_modules(target) if related(n)]
        room = self.watch.memory.room()
        if room is not None:  # each module's float64 copy and its check must fit memory_budget, as the units' do
            modules = dict(target.named_modules())
            big = {n: module_bytes(modules[n].parameters(), ()) for n in leaves}
            for n in [n for n in leaves if big[n] > SAFETY * room]:
                leaves.remove(n)
                report.notes.append(f"{n}'s double backward not checked: its float64 copy and check ({mb(big[n])}) "
                                    f"do not fit the room memory_budget leaves ({mb(room)})")
        chosen = sorted(leaves, key=lambda n: (counts.get(n, 0), leaves.index(n)))[:per_check]
        return chosen, leaves

    # ------------------------------------------------------------------ after a check
    def record(self, step: int, report: CheckReport) -> None:
        """A check's coverage recorded; the plan and what stays unchecked said once."""
        watched = self.watch.watched_names()
        self.planner.attach(self.watch.model, watched)
        self.planner.record(report)
        if self.watch.dist is None:  # one process: pieces its room could not hold come first next time (ranks keep one plan)
            self.planner.owe(report.unfit)
            paced = self.planner.pace(report.later)  # and those its time could not: the cycle spreads the units wider
            if paced is not None:
                report.notes.append(f"module form: {paced}")
        self.announce(report, watched)
        for note in self.planner.unchecked_news(report):
            if not_checked_in([note]):
                continue  # a not_checked alert says it (and logs it)
            logger.warning("gradwatch: step %d: %s (said once; every check's record repeats it)", step, note)

    def announce(self, report: CheckReport, watched: List[str]) -> None:
        """Say once per plan what is checked within how many checks (K), and put K in the report."""
        k = self.planner.cycle_length if report.form == "module" else self.planner.objective_cycle(len(watched))
        self.cycle_length = k
        line = self.planner.describe(report.form, len(watched), self.config.every)
        if self.planner.announced != line:
            self.planner.announced = line
            logger.info("gradwatch: %s", line)
            report.notes.insert(0, line)


__all__ = ["CheckPlanner", "Form"]
