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

import collections
import contextlib
import functools
import operator
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, cast

import torch
from torch import nn

from gradwatch.check.judging.report import CheckReport, TrainingCheck
from gradwatch.check.judging.training_judge import compute_dtype, gradient_scale, judge_training, tolerance_for
from gradwatch.check.model import validate_grads
from gradwatch.check.numerics.sampling import match_names
from gradwatch.check.objective.checkpointed import grad_by_backward, reentrant_checkpoint_leaves
from gradwatch.check.probes.experts import by_expert
from gradwatch.check.replay import checkpoint_blocks as blocks_of
from gradwatch.check.replay.checkpoint_blocks import blocks_needed, checkpointing, repeated_blocks
from gradwatch.check.replay.reference import Replay, Step, autocast_state, replay_step, scalar_grad
from gradwatch.check.replay.rows import Differentiated, RowGrads, sliceable_linears
from gradwatch.check.replay.subset import replay_subset
from gradwatch.check.replay.window import PartialWindow
from gradwatch.errors import first_line
from gradwatch.parallel.shard_check import backward_on_shards, is_partial, local, settled_pairs
from gradwatch.parallel.sharded import is_dtensor
from gradwatch.parallel.step_objective import StepObjective, StepPlan
from gradwatch.parallel.wrappers import is_compiled, unwrap_model
from gradwatch.parallel.zero import is_partitioned, loss_scale, whole_grad, zero_part
from gradwatch.plan.memory import gradient_bytes, mb, peak_bytes, release_freed
from gradwatch.trees import dense
from gradwatch.watch.parts._accumulation import AccumulationWindow
from gradwatch.watch.parts._nonfinite_grads import NonfiniteGrads
from gradwatch.watch.parts._term_weights import Again, TermWeights
from gradwatch.watch.parts.context import CheckContext, TrendAlerting, WatchContext
from gradwatch.watch.parts.replay_capture import Hooks, capturing
from gradwatch.watch.trend import Alert

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def same_tree(tree: List[Tuple[Dict[str, Any], Tuple[str, ...], Tuple[Any, ...]]]) -> bool:
    """Every ``_modules``/``_parameters`` dict still holds exactly the keys and values it held, in order
    (by identity: a key set again keeps its key object, so only a real change reads as one).

    Example:
        >>> d = {"a": 1}
        >>> same_tree([(d, tuple(d), tuple(d.values()))]), same_tree([(d, (), ())])
        (True, False)
    """
    for d, keys, values in tree:
        if len(d) != len(keys) or not all(map(operator.is_, d.values(), values)) or not all(map(operator.is_, d, keys)):
            return False
    return True


class InnerAutocast:
    """The autocast state a model's forward opens inside itself, seen from its first submodule's forward.

    Training's recorded forward starts outside such a region (accelerate wraps a Trainer's model's ``forward`` in
    autocast: TRL's bf16 default), so the recorded state says plain precision while the model computes in bfloat16.
    The replay computes the same, and where a step's micro-batches are weighed (``loss * n_i / N`` against training's
    ``sum / N``) the last bit of the scale can round a bfloat16 value the other way: judged at float32's tolerance, a
    correct step failed. A pre-hook on the first submodule notes the state there, so the judge takes the precision
    the forward ran in.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # as accelerate wraps it
        >>> inner = InnerAutocast(model)
        >>> _ = inner.wrap(lambda m, x: m(x).float().sum())(model, torch.ones(1, 2))
        >>> inner.seen
        (('cpu', True, torch.bfloat16),)
    """

    def __init__(self, model: nn.Module) -> None:
        self.first = next((m for m in model.modules() if m is not model), None)
        #: The state seen inside the first forward (empty: none seen, or plain precision).
        self.seen: Tuple[Tuple[str, bool, torch.dtype], ...] = ()

    def wrap(self, total: Callable[[nn.Module, Any], Any]) -> Callable[[nn.Module, Any], Any]:
        """``total`` with the pre-hook on while it runs."""
        first = self.first
        if first is None:
            return total

        def note(module: nn.Module, args: Any) -> None:
            if not self.seen:
                self.seen = autocast_state()

        note._gradwatch_hook = True  # type: ignore[attr-defined]  # gradwatch's own: kept in the replay's isolation

        def evaluate(model: nn.Module, batch: Any) -> Any:
            handle = first.register_forward_pre_hook(note)
            try:
                return total(model, batch)
            finally:
                handle.remove()

        return evaluate


def shift_hint(model: nn.Module) -> Optional[int]:
    """1 for a model known to shift its labels by one position (a Hugging Face causal LM), else None.

    Example:
        >>> shift_hint(nn.Linear(2, 2)) is None
        True
    """
    loss_type = getattr(model, "loss_type", None)
    return 1 if loss_type == "ForCausalLM" or type(model).__name__.endswith("ForCausalLM") else None


class TrainingPart(TrendAlerting):
    """Replays the step's objective as training computed it and judges the live ``.grad`` against it.

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
        19 MB to 33 MB under tensor parallel at 20.8M, ``benchmarks/parallel.py``, 0 to 9 MB on its 1x2 mesh)."""
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
        check walk again (a few microseconds to tell; a walk costs 30-50 us on a small model).
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
        if ctx.mixed is not None and not ctx.by_shard:
            return Replay(None, None, None, f"not judged: FSDP2's MixedPrecisionPolicy ({ctx.mixed}) computes "
                                            "training in another precision than the parameters'; the training part "
                                            "does not replay it yet")
        model = ctx.model if model is None else model
        # The live model: the replay calls what training called (a compiled or Fabric module), where the recorder sits
        live = model is ctx.model
        entry, root = (ctx.wrapping.entry, ctx.recorder.root) if live else (model, model)
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

        scaler = self.grad_scaler if self.grad_scaler is not None and self.grad_scaler.is_enabled() else None
        with ctx.wrapping.fabric_backward():
            plan = self._plan_step(pending, entry, {n: p for n, p in params.items() if n not in row_plan} or params, seed)
        if plan.weights is None:
            return Replay(None, None, None, plan.reason)
        weight_of = {id(mb.batch): w for mb, w in zip(pending.micro, plan.weights)}

        def grad_of(total: torch.Tensor, batch: Any) -> Dict[str, torch.Tensor]:
            if ctx.grad_fn is not None:
                grads = validate_grads(ctx.grad_fn(model, batch), params, "grad_fn")
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
                                     before=ctx.lockstep.point if ctx.lockstep is not None else None)
                  if ctx.by_shard and not ctx.zero
                  else self._replay_grads(model, total, plist, leaves))
            out = {n: torch.zeros_like(p) if g is None else dense(g) for (n, p), g in zip(whole, gs[:len(plist)])}
            if rowgrads is not None:  # weights judged by rows: the gradient of those rows only
                out.update(rowgrads.split(list(gs[len(plist):])))
            if inv is not None:
                out = {n: g * inv.to(g.device) for n, g in out.items()}
            return out

        autocast = next((mb.records[0].autocast for mb in pending.micro if mb.records), ())
        dtypes = {p.dtype for p in plist}  # a few distinct dtypes, however many tensors
        worst = compute_dtype(max(dtypes, key=tolerance_for, default=torch.float32), autocast)
        total: Callable[[nn.Module, Any], Any] = ctx.objective.training_total
        sizing = room if room is not None else checkpoint_room
        blocks, capture = self._blocks_to_checkpoint(model, params, sizing, len(pending.micro), savings,
                                                     held if hooks is not None else None,
                                                     saved.total if savings is not None else None) \
            if live and sizing is not None else (0, True)
        if not capture:  # even every block checkpointed, the capture's tensors would not fit: it takes its own forward
            hooks = None
        if blocks:
            total = checkpointing(root, total, blocks)
        if hooks is not None:  # the backward part's capture rides on the replay's forward
            total = capturing(total, model, hooks[0], hooks[1], faithful if faithful is not None else [],
                              dropout=bool(ctx.dropout_only) and ctx.one_process)
        # a forward that opens autocast itself (not a compiled one: a hook inside its graph would recompile it)
        inner = InnerAutocast(root) if live and not autocast and not is_compiled(root) else None
        if inner is not None:
            total = inner.wrap(total)
        with rowgrads if rowgrads is not None else contextlib.nullcontext(), ctx.wrapping.fabric_backward():
            replay = replay_step(root, ctx.recorder, pending, total, grad_of, params,
                                 loss_tolerance=10 * tolerance_for(worst), context=self.replay_context,
                                 generators=ctx.held_generators(), modules=self._modules_cache,
                                 lockstep=ctx.by_shard, weights=plan.weights,
                                 each=self.step_objective.each(seed) if plan.cut and not plan.equal else None,
                                 entry=entry, prefer=self._mode)
            if replay.how and "+" not in replay.how:
                self._mode = replay.how  # the next check's replay tries it first
            replay.unran = rowgrads.unran() if rowgrads is not None else []
        if inner is not None and inner.seen and not replay.autocast:
            replay.autocast = inner.seen
        replay.params = params
        replay.rows = row_plan
        replay.plan = plan
        self.window.replayed(replay.accumulating, replay.forwards)
        self._again = None
        if live and replay.grads is not None and ctx.grad_fn is None and ctx.one_process and not (ctx.zero or scaler):
            # the rows judged too, where no regularizer reads their whole weight
            judged = Differentiated(dict(whole), rowgrads.plan if rowgrads is not None and not ctx.objective.regularizers
                                    else None)
            self._again = (self._replays(root, entry, pending, judged), entry or root, judged, seed)
        return replay

    def _replays(self, root: nn.Module, entry: Optional[nn.Module], pending: Step, judged: Differentiated) -> Again:
        """This check's step replayed with another objective (the term-weight diagnosis's, only where the verdict
        fails), as :meth:`replay` replays it, the rows judged by rows differentiated again; the recorder left paused or
        not as it was."""
        ctx = self.watch
        recorder = cast(Any, ctx.recorder)
        params = judged.whole

        def again(evaluate: Any, grad_of: Any, weights: Sequence[float], each: Any) -> Replay:
            paused = recorder.paused
            try:
                with ctx.wrapping.fabric_backward(), judged.opened():
                    return replay_step(root, recorder, pending, evaluate, grad_of, params, loss_tolerance=1.0,
                                       context=self.replay_context, generators=ctx.held_generators(),
                                       modules=self._modules_cache, weights=list(weights), each=each, entry=entry,
                                       prefer=self._mode)
            finally:
                recorder.paused = paused

        return again

    def _blocks_to_checkpoint(self, model: nn.Module, params: Dict[str, torch.Tensor], room: int, micro: int = 1,
                              savings: Optional[List[int]] = None, captures: Optional[int] = None,
                              counted: Optional[int] = None) -> Tuple[int, bool]:
        """How many of the model's repeated blocks the replay checkpoints (:mod:`gradwatch.check.replay.checkpoint_blocks`;
        the first ones, whose activations live longest), and whether a capture may ride on it: as many as keep
        training's ``.grad`` held now and the replayed gradients within what the room leaves above training's
        activations (training's forward ran with no ``.grad``); none where they fit, or where the model checkpoints
        already. Each block saves its counted share of those activations (``savings``: :meth:`_counted`, the excess
        bounded by ``counted``; where none was counted, its share of them and of ``.grad``, and half again). A
        capture holds up to ``captures`` bytes through it, some inside the checkpointed blocks: counted too, and where
        every block checkpointed does not save them, the capture takes a forward of its own (False).

        FSDP2, tensor and sequence parallel (shard by shard: ``checkpoint_room``), each rank counts its own shards and
        the ranks take the largest count (an agreement point: the recomputed forwards' collectives must be the same on
        every rank). An FSDP2 block's recomputed forward runs between its pre-backward all-gather and its
        reduce-scatter, on its gathered parameters, as with activation checkpointing in training. There the replayed
        gradients of a step of one micro-batch (``micro``) count only for the parameters that are not DTensors (a
        replicated embedding or head: their replayed ``.grad`` is new): :func:`backward_on_shards` hands back a
        DTensor's live shard where the replayed one is the same bits, and copies any other as the backward frees the
        activations it came from."""
        ctx = self.watch
        sharded = ctx.by_shard and ctx.lockstep is not None
        if ((ctx.dist is not None or ctx.by_shard) and not sharded) or ctx.grad_fn is not None or self._reentrant \
                or ctx.zero:  # ZeRO-3's hooks gather in a recomputed forward too: not tried, so never
            return 0, True
        modules = self._modules_cache or list(model.modules())
        if any(getattr(m, "gradient_checkpointing", False) is True for m in modules):
            return 0, True
        held = gradient_bytes(local(p.grad) for p in model.parameters() if p.grad is not None)
        replayed = gradient_bytes(local(p) for p in params.values() if not (sharded and micro == 1 and is_dtensor(p)))
        activations = ctx.memory.transient()
        excess = blocks_of.counted_excess(held, replayed, room, activations, counted)
        if savings is not None:
            if captures and excess + captures > 0:
                if sum(savings) >= excess + captures:
                    return blocks_of.blocks_for(excess + captures, savings), True
                return blocks_of.blocks_for(excess, savings), False
            return blocks_of.blocks_for(excess, savings), True
        count = 0  # it fits: no walk of the module tree for its blocks, at every check
        if excess > 0:
            count = blocks_needed(held, replayed, room, activations, len(repeated_blocks(model)))
        if sharded:
            count = -cast(int, cast(Any, ctx.lockstep).point(-count))  # the largest count of the ranks
        return count, True

    def _counted(self, model: nn.Module, saved: Any, room: int
                 ) -> Tuple[Optional[List[int]], Optional[Tuple[int, Set[str]]]]:
        """One process, from ``saved`` (:class:`~gradwatch.check.modules.activations.Saved`): what checkpointing each
        block saves the replay, and the replayed gradients' cap outside the blocks (``outside_cap``, and the watched
        tensors it caps). The module tree is walked once a counted batch shape and tree, not at every check."""
        ctx = self.watch
        if saved is None or not saved.own or not ctx.one_process or ctx.grad_fn is not None or ctx.zero:
            return None, None
        params = self.params(model)  # (first: a changed tree replaces the cache the walk is kept against)
        if self._blocks_cache is None or self._blocks_cache[0] is not saved or self._blocks_cache[1] is not self._params_cache:
            inside = {id(p) for block in repeated_blocks(model) for p in block.parameters()}
            self._blocks_cache = (saved, self._params_cache, blocks_of.block_counts(model, saved.own),
                                  {n for n, p in params.items() if id(p) not in inside})
        activations = ctx.memory.transient()
        savings = blocks_of.block_savings(self._blocks_cache[2], saved.total, activations)
        held = gradient_bytes(p.grad for p in model.parameters() if p.grad is not None)
        cap = blocks_of.outside_cap(savings, held, room, activations, saved.total)
        return savings, None if cap is None else (cap, self._blocks_cache[3])

    def _plan_step(self, pending: Step, model: nn.Module, params: Dict[str, torch.Tensor], seed: int) -> StepPlan:
        """The step's objective (:class:`~gradwatch.parallel.step_objective.StepObjective`): on every rank alike (an
        exchange of counts when distributed); probes evaluate the live model in one process and under DDP."""
        ctx = self.watch
        probe = not ctx.sharded and ctx.grad_fn is None
        # (the hint is read only where there is something to weigh: several micro-batches, or ranks)
        hint = shift_hint(unwrap_model(model)) if ctx.dist is not None or len(pending.micro) != 1 else None
        with ctx.recorder_paused():
            return self.step_objective.plan([mb.batch for mb in pending.micro], model if probe else None,
                                            ctx.objective.loss, params, ctx.dist, seed, probe=probe, shift_hint=hint)

    def _replay_grads(self, model: nn.Module, total: torch.Tensor, plist: Tuple[torch.Tensor, ...],
                      leaves: Sequence[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
        """The replayed objective's gradients by ``plist`` (then ``leaves``: rows), never written to ``.grad``.

        ``torch.utils.checkpoint(..., use_reentrant=True)`` (a plain loop's, or a Hugging Face model's
        ``gradient_checkpointing_enable``) hides the parameters inside each checkpoint from ``autograd.grad`` (torch
        raises "incompatible with .grad()"): in one process, with no rows to judge, those gradients come through
        ``backward()`` instead, each ``.grad`` set aside and put back (the same objects), as the backward part does
        (:mod:`gradwatch.check.objective.checkpointed`; a walk of the graph tells). Under DDP, or with a hook that
        runs after a gradient is accumulated (an optimizer stepping in backward), a ``backward()`` would act on
        training, so there it raises as before.

        The walk costs a few percent of a small model's replay, so once a replay found no reentrant checkpoint,
        later ones do not walk, until ``autograd.grad`` refuses one (the model started checkpointing): that check
        fails as before, and the next walks again.
        """
        found = None
        if total.requires_grad and not leaves and self.watch.dist is None and self._reentrant is not False:
            found = reentrant_checkpoint_leaves(total)
            self._reentrant = found is not None
        if found is not None and not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters()):
            return grad_by_backward(total, list(plist), found + list(plist), retain=False)
        try:
            return scalar_grad(total, plist + tuple(leaves))
        except RuntimeError as err:
            if "use_reentrant=True" in str(err):
                self._reentrant = None  # look again at the next check
            raise

    # ------------------------------------------------------------------ the verdicts
    def judge(self, report: CheckReport, replay: Optional[Replay], grads: Optional[Dict[str, torch.Tensor]] = None,
              rows: Optional[List[torch.Tensor]] = None) -> None:
        """Judge every watched tensor's live ``.grad`` against the replayed gradient; fills ``report.training``.
        A partial accumulation window is judged as one (:meth:`_partial_window`); else, on a cut step, a failure is
        named by the weights training gave the micro-batches (``rows``: every rank's sketches, distributed; this
        rank's by default)."""
        if replay is None:
            return
        if replay.grads is None:
            report.training_note = replay.reason
            return
        grads = dict(grads if grads is not None else replay.grads)
        params = replay.params if replay.params is not None else self.params()
        scales: List[float] = []  # computed only if some tensor's .grad is not bitwise the replayed gradient

        def scale() -> float:
            if not scales:
                scales.append(gradient_scale(list(grads.values())))
            return scales[0]

        options = self.watch.options
        bands, fail_at, autocast = options.bands, options.fail_verdict, replay.autocast
        dtypes: Dict[torch.dtype, torch.dtype] = {}  # parameter dtype -> compute dtype, once per dtype
        sliced = getattr(replay, "rows", None) or {}
        lives: Dict[str, Optional[torch.Tensor]] = {}
        notes_before: List[str] = []
        judged: Dict[str, Tuple[torch.Tensor, torch.dtype]] = {}  # what each tensor was judged on (a window judges again)
        partial = [n for n, p in params.items() if is_partial(p.grad)]
        zero = self.watch.by_shard and self.watch.zero
        if (partial or zero) and self.watch.lockstep is not None:
            self.watch.lockstep.point()  # the reductions below are collectives: every rank is here
        if zero and self.watch.dist is not None:  # ZeRO: each rank's whole gradients averaged, as ZeRO averages
            grads.update(cast(Any, self.watch.dist).average(grads, in_place=self.watch.grad_fn is None))
        zero_scale = loss_scale(self.watch.engine) if self.watch.zero else 1.0
        # ZeRO 1 and 2: the step's whole gradient of each tensor, read on every rank in the same order (collectives)
        wholes = {n: whole_grad(p, grads[n], zero_scale) for n, p in params.items()
                  if not is_partitioned(p)} if zero else {}
        # sequence parallel's norms: .grad is a Partial(sum) until the optimizer reduces it (the live and the replayed
        # reduced together; the same tensors on every rank, so none reduces where none is partial)
        reduced = dict(zip(partial, settled_pairs([(cast(torch.Tensor, params[n].grad), grads[n]) for n in partial]))) \
            if partial else {}
        for n in partial:
            grads[n] = reduced[n][1]
        for n, p in params.items():
            dtype = dtypes.get(p.dtype) or dtypes.setdefault(p.dtype, compute_dtype(p.dtype, autocast))
            live = p.grad
            if is_partitioned(p):  # ZeRO-3: this rank's partition of the parameter, of ZeRO's gradient, of the replay's
                p, live, grads[n] = zero_part(p, grads[n], zero_scale)
            elif n in wholes:
                live = wholes[n]
            elif is_dtensor(p):  # sharded: this rank's shard of both (the ranks' verdicts are merged, worst first)
                live = None if live is None else reduced[n][0] if n in partial else local(live)
                p = local(p)
            if n in sliced:  # judged by a block of rows: the live .grad's rows against the replayed rows
                first, end = sliced[n]
                p, live = p[first:end], None if live is None else live[first:end]
                if n in replay.unran and live is not None and bool(live.ne(0).any()):
                    self._read_directly(n, notes_before)
                    continue
            lives[n], judged[n] = live, (p, dtype)
            report.training[n] = judge_training(n, live, grads[n], p, dtype, bands, fail_at, scale=scale)
        report.training_rows = {n: rows for n, rows in sliced.items() if n in report.training}
        first = dict(report.training)  # a fused expert tensor's whole verdict, judged again expert by expert below
        plan: Optional[StepPlan] = getattr(replay, "plan", None)
        notes = [f"replayed from the {replay.how} RNG state" if replay.how else ""] + notes_before
        if zero and self.watch.dist is not None:
            whose = "each rank judged its partition of ZeRO's gradient" if self.watch.zero3 \
                else "ZeRO's gradient read one tensor at a time"
            notes.append(f"the reference is averaged over {cast(Any, self.watch.dist).world_size} ranks, as ZeRO averages "
                         f"its gradient; {whose}")
        found = self._partial_window(report, plan, lives, grads, judged, scale)
        if found is not None:
            notes.insert(0, f"a partial accumulation window, the step's tensors judged against its objective's "
                            f"gradient times {found.micro_batches}/{found.window}: {found.text()}")
        if plan is not None:
            report.training_items = plan.record()
            notes.insert(0, plan.note or "")
            cut = self.step_objective.explain(plan, report.training, lives, rows, folded=self.watch.by_shard) \
                if found is None else None
            if found is None and cut is None:
                named = self._term_weights(report, plan, lives, grads, judged, scale)
                if named is not None:
                    notes.insert(1, f"a term weighted otherwise than the step's objective weighs it: {named}")
        report.training = by_expert(report.training, first, lives, grads, judged, functools.partial(
            judge_training, bands=bands, fail_at=fail_at, scale=scale))
        if replay.loss_gap is not None:
            given, replayed = replay.loss_gap
            notes.append(
                f"training's loss {given:.6g} differs from the objective's {replayed:.6g} at the same point "
                f"(by {given - replayed:+.3g}): the training loss has a term the objective lacks, or the reverse"
            )
        report.training_note = "; ".join(n for n in notes if n) or None

    def _read_directly(self, name: str, notes: List[str]) -> None:
        """``name``'s module never ran in the replay, yet training gave its rows a gradient: other code reads the weight
        itself, so its rows' gradient cannot be taken at its module. Not judged at this check; whole from now on."""
        self.read_directly.add(name)
        self.counts[name] = max(0, self.counts.get(name, 0) - 1)  # its turn comes again
        notes.append(f"{name} not judged at this check: its module never ran in the replay while training gave it a "
                     f"gradient, so other code reads the weight itself (as a fused LM head does); judged whole from now "
                     f"on, at a check with room for its gradient")

    def _term_weights(self, report: CheckReport, plan: StepPlan, lives: Dict[str, Optional[torch.Tensor]],
                      grads: Dict[str, torch.Tensor], judged: Dict[str, Tuple[torch.Tensor, torch.dtype]],
                      scale: Callable[[], float]) -> Optional[str]:
        """Where tensors still fail: a term of the loss weighted otherwise by training, named and judged as such
        (:mod:`gradwatch.watch.parts._term_weights`; one process, this check's step replayed again)."""
        again, self._again, self.terms.found = self._again, None, None
        failing = [tc for tc in report.training.values() if tc.failed]
        explained = all(tc.ratio is not None for tc in failing) and not (plan.cut and self.watch.objective.regularizers)
        if again is None or plan.weights is None or not failing or explained:
            return None  # nothing failed, or the judge's words explain each (a factor; an L2 term, on a step not cut)
        replays, model, judged_again, seed = again
        options = self.watch.options

        def rejudge(n: str, reference: torch.Tensor) -> TrainingCheck:
            p, dtype = judged[n]
            return judge_training(n, lives[n], reference, p, dtype, options.bands, options.fail_verdict, scale=scale)

        return self.terms.diagnose(replays, model, self.watch.objective, judged_again.tensors(), plan.weights,
                                   report.training, lives, grads, rejudge, seed, judged_again)

    def _partial_window(self, report: CheckReport, plan: Optional[StepPlan], lives: Dict[str, Optional[torch.Tensor]],
                        grads: Dict[str, torch.Tensor], judged: Dict[str, Tuple[torch.Tensor, torch.dtype]],
                        scale: Callable[[], float]) -> Optional[PartialWindow]:
        """Where tensors failed: a partial accumulation window that explains them (:mod:`gradwatch.watch.parts._accumulation`:
        each failing tensor judged again against the step's objective times ``n / K``), kept in
        ``report.training_window`` (not on a sharded model: each rank holds a shard)."""
        if plan is None or not plan.parts or self.watch.sharded or not any(tc.failed for tc in report.training.values()):
            return None
        each = set(collections.Counter(part.rank for part in plan.parts).values())  # micro-batches on each rank
        options = self.watch.options

        def again(n: str, factor: float) -> TrainingCheck:
            p, dtype = judged[n]
            return judge_training(n, lives[n], grads[n] * factor, p, dtype, options.bands, options.fail_verdict,
                                  scale=lambda: factor * scale())

        found = self.window.judge(report.training, lives, grads, each.pop() if len(each) == 1 else None, again)
        if found is not None:
            report.training_window = found.record()
        return found

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

    def judge_across_ranks(self, merged: CheckReport, replay: Optional[Replay],
                           statuses: List[Optional[Tuple[bool, Optional[str]]]],
                           rows: Optional[List[Optional[List[torch.Tensor]]]] = None) -> None:
        """The training part on every rank alike: the replayed gradients averaged over the ranks (as DDP and
        FSDP average ``.grad``; each rank's replay weighed its micro-batches by their share of the step's items),
        the live ``.grad`` judged against them, and rank 0's verdicts taken everywhere. ``rows``: every rank's
        sketches of its micro-batches' gradients (they name a step cut wrongly).

        Every branch depends on the gathered ``statuses`` only, so every rank makes the same collectives.
        """
        coord = self.watch.dist
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
            averaged = coord.average(replay.grads, in_place=self.watch.grad_fn is None)  # grad_fn's may be .grad itself
        except Exception as exc:  # noqa: BLE001 - a collective that fails must not stop training
            merged.training_note = (f"not judged: averaging the replayed gradients over the ranks failed "
                                    f"({first_line(exc)})")
            return
        try:
            every = [row for rank in rows or () for row in rank or ()]
            self.judge(merged, replay, averaged, rows=every if rows and all(r is not None for r in rows) else None)
            merged.training_note = ((merged.training_note + "; ") if merged.training_note else "") + (
                f"the reference is averaged over {coord.world_size} ranks, as DDP and FSDP average .grad")
        except Exception as exc:  # noqa: BLE001 - the broadcast below must still happen on every rank
            merged.training, merged.training_window = {}, None
            merged.training_note = f"not judged on rank {coord.rank}: judging it failed ({first_line(exc)})"
        # A gradient DDP did not synchronize differs from rank to rank: every rank takes rank 0's judgement,
        # so trends and alerts stay identical everywhere.
        try:
            merged.training, merged.training_note, merged.training_window = coord.from_main(
                (merged.training, merged.training_note, merged.training_window))
        except Exception as exc:  # noqa: BLE001
            merged.training, merged.training_window = {}, None
            merged.training_note = f"not judged: sharing rank 0's training verdicts failed ({first_line(exc)})"


__all__ = ["TrainingPart", "dense", "same_tree", "shift_hint"]
