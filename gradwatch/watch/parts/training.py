"""The training part of a watch: is the gradient training applies the gradient of the objective?

Every watched tensor's live ``.grad`` is judged against the objective's gradient recomputed the way
training computed it (:func:`gradwatch.check.replay.reference.replay_step`: the live model and dtype,
the same dropout masks and autocast state, ``GradScaler``'s scaling, each micro-batch weighed by its
share of the step's items, :mod:`gradwatch.parallel.step_objective`). Under a ``memory_budget`` only the
tensors whose replayed gradient fits are judged, least-judged first, the big weights by blocks of rows.
Distributed, the replays are averaged over the ranks and rank 0's verdicts taken everywhere.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch import GradWatch
    >>> model = nn.Linear(3, 1)
    >>> watch = GradWatch(model, lambda m, b: m(b).pow(2).mean(), every=1, log_dir=None)
    >>> sorted(watch.training.params())
    ['bias', 'weight']
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union, cast

import torch
from torch import nn

from gradwatch.check.judging.report import CheckReport
from gradwatch.check.judging.training_judge import compute_dtype, tolerance_for
from gradwatch.check.numerics.sampling import match_names
from gradwatch.check.replay.reference import Replay, Step, replay_step
from gradwatch.check.replay.rows import Differentiated, RowGrads, sliceable_linears
from gradwatch.check.replay.subset import replay_subset
from gradwatch.parallel.shard_check import local
from gradwatch.parallel.step_objective import StepObjective, StepPlan
from gradwatch.plan.memory import mb, peak_bytes, release_freed
from gradwatch.trees import dense
from gradwatch.watch.parts._accumulation import AccumulationWindow
from gradwatch.watch.parts._nonfinite_grads import NonfiniteGrads
from gradwatch.watch.parts._term_weights import Again, TermWeights
from gradwatch.watch.parts._training_grads import TrainingGrads
from gradwatch.watch.parts._training_replay import ReplayChoice, ReplayStages, Total, same_tree, shift_hint
from gradwatch.watch.parts._training_verdicts import Verdicts
from gradwatch.watch.parts.context import CheckContext, TrendAlerting, WatchContext
from gradwatch.watch.parts.replay_capture import Hooks
from gradwatch.watch.trend import Alert

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class TrainingPart(ReplayStages, Verdicts, TrendAlerting):
    """Replays the step's objective as training computed it and judges the live ``.grad`` against it.

    The replay's stages are :class:`~gradwatch.watch.parts._training_replay.ReplayStages`'s (its gradients a
    :class:`~gradwatch.watch.parts._training_grads.TrainingGrads`), the verdicts
    :class:`~gradwatch.watch.parts._training_verdicts.Verdicts`'s.

    Args:
        watch: The watch's setting (its ``recorder`` is None when the part is off).
        step_objective: The weights of the step's micro-batches and ranks (``items=``).
        form: The ``form`` option (``"objective"``: every watched tensor, whatever the room).
        grad_scaler: Optional ``torch.amp.GradScaler`` of a float16 AMP loop.

    Example:
        See the module's example.
    """

    name = "training"

    def __init__(self, watch: WatchContext, step_objective: StepObjective, form: str, grad_scaler: Any = None) -> None:
        self.watch = watch
        self.step_objective = step_objective
        self.form = form
        #: A float16 AMP loop's ``GradScaler`` (by default a Fabric module's: :mod:`gradwatch.parallel.wrappers`).
        self.grad_scaler = grad_scaler if grad_scaler is not None else watch.wrapping.grad_scaler()
        #: For integrations: ``() -> context manager`` that training's loss runs in; the replay runs in it too (under
        #: Fabric none: its module opens its precision's context around the forward itself).
        self.replay_context: Optional[Callable[[], Any]] = watch.wrapping.region()
        #: Judgments per tensor, when not all fit the room.
        self.counts: Dict[str, int] = {}
        #: The next row of each weight judged by rows.
        self.row_cursor: Dict[str, int] = {}
        #: Weights read outside their own module (their module never ran in a replay while training gave their rows a
        #: gradient, as TRL's fused head reads ``lm_head.weight``): judged whole, never by rows.
        self.read_directly: Set[str] = set()
        self._params_cache: Optional[Any] = None
        #: (the counted forward, the params cache it was walked against, bytes counted in each block, the watched tensors
        #: outside the blocks): :meth:`_counted`'s walk of the module tree.
        self._blocks_cache: Optional[Tuple[Any, Any, List[int], Set[str]]] = None
        self._watched_cache: Optional[Any] = None  # (trainable names, the watched ones among them)
        self._modules_cache: List[nn.Module] = []
        #: Whether the replay's graph holds a reentrant checkpoint: None until a replay looked (:meth:`_replay_grads`).
        self._reentrant: Optional[bool] = None
        self._mode: Optional[str] = None  # the replay mode that reproduced the last step ("forward", "start")
        #: The run's accumulation window: a partial one found and said once (:mod:`gradwatch.watch.parts._accumulation`).
        self.window = AccumulationWindow()
        #: Shard by shard: bytes by which earlier replays rose above the check's ceiling (:meth:`_learn_overshoot`);
        #: the next replays checkpoint their blocks for that much less room.
        self.overshoot = 0
        #: A term weighted otherwise than the step's objective weighs it, named where the verdict failed
        #: (:mod:`gradwatch.watch.parts._term_weights`); ``_again`` replays this check's step with another objective.
        self.terms = TermWeights()
        #: The watched tensors whose ``.grad`` is NaN or inf at a check: an alert whatever the replay says.
        self.nonfinite = NonfiniteGrads()
        self._float16 = False  # the latest replayed step ran under float16 autocast
        self._again: Optional[Tuple[Again, nn.Module, Differentiated, int]] = None

    def state_dict(self) -> Dict[str, Any]:
        """``{"training": ...}``: the accumulation window learned (a resumed run names a partial window at once) and
        the term weightings said."""
        said = {"terms": self.terms.state_dict()} if self.terms.said else {}
        nonfinite = self.nonfinite.state_dict() if self.nonfinite.found else {}
        return {"training": {**self.window.state_dict(), **said, **nonfinite}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.window.load_state_dict(state.get("training") or {})
        self.terms.load_state_dict((state.get("training") or {}).get("terms") or {})
        self.nonfinite.load_state_dict(state.get("training") or {})

    @property
    def enabled(self) -> bool:
        return self.watch.recorder is not None

    def run(self, check: CheckContext) -> Optional[Replay]:
        """The check's replay (None when the part is off); judged into a new report with ``check.judge``,
        else kept in ``check.replay`` for the ranks to average. With ``check.hooks`` (the backward part's capture,
        :mod:`gradwatch.watch.parts.replay_capture`), its forward runs them, ``check.faithful`` says whether that
        forward computed the isolated forward's values, and its blocks are checkpointed for ``check.held`` bytes less
        room (what the captures may hold through it)."""
        ctx, hooks, held = self.watch, check.hooks, check.held
        if ctx.by_shard:
            release_freed()  # what training's backward freed: the replay's own backward allocates on top of it
        # (FSDP2, tensor and sequence parallel: the replay is the model's own backward, whole, its shards let go as they
        # come, its blocks checkpointed as the room needs, as in one process; ZeRO-3: autograd.grad by the tensors that
        # fit the room, the smallest room of the ranks: every rank gathers for the same backward)
        zero = ctx.by_shard and ctx.zero
        room = None if ctx.by_shard and not zero else check.room
        if zero and room is not None:
            if ctx.lockstep is not None:
                room = cast(int, ctx.lockstep.point(room))  # the smallest of the ranks' rooms
            if not ctx.zero3:
                room //= 2  # ZeRO 1 and 2: the judge reads ZeRO's whole gradients beside the replayed ones
        dtensor = ctx.by_shard and not ctx.zero
        sizing = None if not dtensor or check.room is None else max(0, check.room - self.overshoot)
        if sizing is not None and hooks is not None and held is not None:
            sizing = max(0, sizing - held)  # the capture's copies, held beside it
        before = None if sizing is None else peak_bytes(ctx.memory.device)
        faithful: List[bool] = []  # (capturing appends whether the fused forward computed the isolated one's values)
        replay = self.replay(check.pending, check.target, room, only=None if check.plan is None else check.plan.training,
                             seed=check.opts.seed, checkpoint_room=sizing, hooks=hooks, faithful=faithful,
                             saved=check.saved, held=held)
        check.faithful = faithful[0] if faithful else None
        if before is not None:
            self._learn_overshoot(before)
        check.replay = replay
        # a float16 autocast step overflows by design where a GradScaler runs it (the Trainer's, not handed to the watch)
        self._float16 = replay is not None and any(on and dtype == torch.float16 for _, on, dtype in replay.autocast)
        return replay

    def _learn_overshoot(self, before: int) -> None:
        """Shard by shard: where the replay raised the process's peak (``before``: as it began) above the check's
        ceiling (:meth:`~gradwatch.plan.memory.MemoryMeter.ceiling`), the next replays checkpoint for that much less
        room (:attr:`overshoot`): what the sharded backward adds (collectives' buffers, FSDP2's gathered parameters;
        measured by ``benchmarks/parallel.py``)."""
        meter = self.watch.memory
        ceiling = meter.ceiling()
        after = peak_bytes(meter.device)
        if ceiling is not None and after > max(before, ceiling):
            self.overshoot += after - max(before, ceiling)

    # ------------------------------------------------------------------ what is replayed
    def params(self, model: Optional[nn.Module] = None) -> Dict[str, torch.Tensor]:
        """The watched live parameters of ``model`` (default: the model; a sharded one's replica has the
        same names); the patterns are matched again only when the trainable set changes.

        The last walk's result is reused while the module tree is the same (the same submodules and parameters by
        identity, each with its ``requires_grad``): a replaced layer, a frozen, unfrozen or new parameter makes the next
        check walk again (telling is much cheaper than walking).
        """
        model = self.watch.model if model is None else model
        cached = self._params_cache
        if (cached is not None and cached[3] is model and same_tree(cached[1])
                and list(map(_REQUIRES_GRAD, cached[2][0])) == cached[2][1]):
            return cast(Dict[str, torch.Tensor], cached[0])
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
            self._watched_cache = (key, set(match_names(list(key), self.watch.options.tensors, strict=False)))
        watched = self._watched_cache[1]
        params = {n: p for n, p in named if n in watched}
        self._params_cache = (params, tree, (flags, list(map(_REQUIRES_GRAD, flags))), model)
        return params

    def subset(self, params: Dict[str, torch.Tensor], room: int, count: bool = True, rows: bool = True,
               cap: Optional[Tuple[int, Set[str]]] = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, Tuple[int, int]]]:
        """The watched tensors whose replayed gradients fit in ``room`` (:func:`~gradwatch.check.replay.subset.
        replay_subset`), with ``rows`` some judged by a block of rows; ``count``: count them as judged (and move the
        row blocks on). ``cap``: the most those outside the checkpointed blocks take (:meth:`_counted`)."""
        linears = {n: m for n, m in sliceable_linears(self.watch.model).items() if n not in self.read_directly} \
            if rows else {}
        out, sliced = replay_subset(params, self.counts, self.row_cursor, room,
                                    self.watch.memory.transient(self.watch.model), linears, cap)
        for n in out if count else ():
            self.counts[n] = self.counts.get(n, 0) + 1
            if n in sliced:
                self.row_cursor[n] = sliced[n][1] % params[n].shape[0]
        return out, sliced

    def fitting(self, room: int) -> List[str]:
        """Rank 0's choice under DDP: the tensors whose replayed gradients fit ``room`` (not counted yet)."""
        return list(self.subset(self.params(), room, count=False, rows=False)[0])

    def count(self, names: Sequence[str]) -> None:
        """Count ``names`` as judged (under DDP: rank 0's choice, taken by every rank)."""
        for n in names:
            self.counts[n] = self.counts.get(n, 0) + 1

    # ------------------------------------------------------------------ the replay
    def replay(self, pending: Optional[Step], model: Optional[nn.Module] = None,
               room: Optional[int] = None, only: Optional[Sequence[str]] = None, seed: int = 0,
               checkpoint_room: Optional[int] = None, hooks: Optional[Hooks] = None,
               faithful: Optional[List[bool]] = None, saved: Any = None, held: Optional[int] = None
               ) -> Optional[Replay]:
        """The objective's gradient recomputed as training computed it (None when the part is off).

        ``model`` is the module the replay runs (default: the model; a sharded model's gathered replica,
        whose parameters hold the gathered ``.grad``). With a ``room`` (bytes, from ``memory_budget``),
        the replay takes the gradient of only as many watched tensors as fit beside training's
        activations, least-judged first (they rotate from check to check); without one, of every
        watched tensor; with ``only`` (names, under DDP: rank 0's choice), of those. An exception of
        ``loss_fn`` in the replay propagates: the check is skipped with an error alert. Each micro-batch weighs its
        share of the step's items (:mod:`gradwatch.parallel.step_objective`, agreed with the other ranks first).
        ``saved`` (one process: a forward's saved bytes, counted) sizes its checkpointed blocks; ``held``: the capture's.
        """
        ctx = self.watch
        if ctx.recorder is None or pending is None:
            return None
        self.window.observe(len(pending.micro))
        chosen = self._choose(ctx.recorder.root, model, room, only, saved)
        if isinstance(chosen, Replay):
            return chosen
        scaler = self.grad_scaler if self.grad_scaler is not None and self.grad_scaler.is_enabled() else None
        with ctx.wrapping.fabric_backward():
            plan = self._plan_step(pending, chosen.entry,
                                   {n: p for n, p in chosen.params.items() if n not in chosen.row_plan} or chosen.params,
                                   seed)
        if plan.weights is None:
            return Replay(None, None, None, plan.reason)
        grad_of = TrainingGrads(ctx, chosen.model, chosen.params, chosen.whole, chosen.plist, chosen.rowgrads, scaler,
                                {id(mb.batch): w for mb, w in zip(pending.micro, plan.weights)}, pending,
                                self._replay_grads)
        autocast = next((mb.records[0].autocast for mb in pending.micro if mb.records), ())
        total, inner = self._objective(chosen, len(pending.micro), autocast, room, checkpoint_room, hooks, faithful,
                                       saved, held)
        replay = self._replayed(chosen, pending, total, grad_of, plan, seed, autocast)
        if inner is not None and inner.seen and not replay.autocast:
            replay.autocast = inner.seen
        self._record(replay, chosen, pending, plan, seed, scaler)
        return replay

    def _choose(self, recorded: nn.Module, model: Optional[nn.Module], room: Optional[int],
                only: Optional[Sequence[str]], saved: Any) -> Union[Replay, ReplayChoice]:
        """What the replay differentiates (:meth:`replay`'s arguments), or why it judges nothing (a not-judged
        :class:`Replay`): the watched tensors of ``model`` (``recorded``: the recorder's root, where the replay runs the
        live model), under a ``room`` those that fit (:meth:`subset`, counted as judged), some by a block of rows."""
        ctx = self.watch
        if ctx.mixed is not None and not ctx.by_shard:
            return Replay(None, None, None, f"not judged: FSDP2's MixedPrecisionPolicy ({ctx.mixed}) computes "
                                            "training in another precision than the parameters'; the training part "
                                            "does not replay it yet")
        model = ctx.model if model is None else model
        # The live model: the replay calls what training called (a compiled or Fabric module), where the recorder sits
        live = model is ctx.model
        entry, root = (ctx.wrapping.entry, recorded) if live else (model, model)
        params = self.params(model)
        plist = tuple(params.values())
        if not ctx.zero and all(p.grad is None for p in plist):  # ZeRO's are in its partitions (at_boundary said)
            return Replay(None, None, None, "not judged: no watched parameter has a .grad yet (watch.step or check "
                                            "before the first backward)")
        row_plan: Dict[str, Tuple[int, int]] = {}
        savings, cap = self._counted(model, saved, room) if live and room is not None and only is None else (None, None)
        if only is not None or (room is not None and self.form != "objective"):
            if only is not None:
                params = {n: params[n] for n in only if n in params}
            else:
                params, row_plan = self.subset(params, cast(int, room), rows=ctx.grad_fn is None and not ctx.zero, cap=cap)
            if not params:
                return Replay(None, None, None, f"not judged: the replayed gradient of the smallest watched tensor does "
                                                f"not fit in the room memory_budget leaves ({mb(room)})")
            plist = tuple(p for n, p in params.items() if n not in row_plan)
        linears = sliceable_linears(model) if row_plan else {}
        rowgrads = RowGrads({n: (linears[n], params[n], rows) for n, rows in row_plan.items()}) if row_plan else None
        whole = [(n, p) for n, p in params.items() if n not in row_plan]
        return ReplayChoice(model, live, entry, root, params, plist, whole, row_plan, rowgrads, savings)

    def _replayed(self, chosen: ReplayChoice, pending: Step, total: Total, grad_of: TrainingGrads, plan: StepPlan,
                  seed: int, autocast: Any) -> Replay:
        """The step replayed (:func:`~gradwatch.check.replay.reference.replay_step`), its loss compared at the
        tolerance of the least precise tensor's compute dtype; the mode that reproduced it tried first next time."""
        ctx = self.watch
        dtypes = {p.dtype for p in chosen.plist}  # a few distinct dtypes, however many tensors
        worst = compute_dtype(max(dtypes, key=tolerance_for, default=torch.float32), autocast)
        rowgrads = chosen.rowgrads
        with rowgrads if rowgrads is not None else contextlib.nullcontext(), ctx.wrapping.fabric_backward():
            replay = replay_step(chosen.root, cast(Any, ctx.recorder), pending, total, grad_of, chosen.params,
                                 loss_tolerance=10 * tolerance_for(worst), context=self.replay_context,
                                 generators=ctx.held_generators(), modules=self._modules_cache,
                                 lockstep=ctx.by_shard, weights=plan.weights,
                                 each=self.step_objective.each(seed) if plan.cut and not plan.equal else None,
                                 entry=chosen.entry, prefer=self._mode)
            if replay.how and "+" not in replay.how:
                self._mode = replay.how  # the next check's replay tries it first
            replay.unran = rowgrads.unran() if rowgrads is not None else []
        return replay

    def _record(self, replay: Replay, chosen: ReplayChoice, pending: Step, plan: StepPlan, seed: int,
                scaler: Any) -> None:
        """What the judge reads on ``replay`` (the tensors, their rows, the step's plan); the replays seen by the
        accumulation window; and, in one process, the step kept for a replay with another objective (the term-weight
        diagnosis, :meth:`_term_weights`)."""
        ctx = self.watch
        replay.params = chosen.params
        replay.rows = chosen.row_plan
        replay.plan = plan
        self.window.replayed(replay.accumulating, replay.forwards)
        self._again = None
        rowgrads = chosen.rowgrads
        if chosen.live and replay.grads is not None and ctx.grad_fn is None and ctx.one_process \
                and not (ctx.zero or scaler):
            # the rows judged too, where no regularizer reads their whole weight
            judged = Differentiated(dict(chosen.whole), rowgrads.plan if rowgrads is not None
                                    and not ctx.objective.regularizers else None)
            self._again = (self._replays(chosen.root, chosen.entry, pending, judged), chosen.entry or chosen.root,
                           judged, seed)

    def alerts(self, step: int, results: Any) -> List[Alert]:
        """The run's accumulation, said once (:meth:`~gradwatch.watch.parts._accumulation.AccumulationWindow.alerts`): a
        partial window a check found, micro-batches the watch was not handed; and a term weighted otherwise than the
        step's objective weighs it, once for the run (:meth:`~gradwatch.watch.parts._term_weights.TermWeights.alerts`); before
        them a ``.grad`` with NaN or inf, whatever the verdicts say (:mod:`gradwatch.watch.parts._nonfinite_grads`)."""
        if not isinstance(results, CheckReport):
            return []
        scaler = self.grad_scaler
        scaled = scaler is not None and bool(scaler.is_enabled()) or self._float16
        self.nonfinite.look({n: None if p.grad is None else local(p.grad) for n, p in self.params().items()}, scaled)
        note = self.nonfinite.note()
        if note is not None:
            results.notes.append(note)
        return self.nonfinite.alerts(step) + self.window.alerts(step, results) + self.terms.alerts(step)



__all__ = ["TrainingPart", "dense", "same_tree", "shift_hint"]
