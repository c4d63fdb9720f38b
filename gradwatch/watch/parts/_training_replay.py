"""The training part's replay stages: what the replay runs and how its gradients are taken.

The module tree's identity (:func:`same_tree`), the autocast a model's forward opens inside itself
(:class:`InnerAutocast`), a causal LM's label shift (:func:`shift_hint`), and :class:`ReplayStages`, the
:class:`~gradwatch.watch.parts.training.TrainingPart`'s stages of a replay: the step's objective planned, the
objective replayed (its repeated blocks checkpointed as the room needs, the backward part's capture riding on it, the
inner autocast noted), its gradients taken, and the step replayed again with another objective for a diagnosis.

Example:
    >>> from torch import nn
    >>> shift_hint(nn.Linear(2, 2)) is None
    True
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch import nn

from gradwatch.check.objective.checkpointed import grad_by_backward, reentrant_checkpoint_leaves
from gradwatch.check.replay import checkpoint_blocks as blocks_of
from gradwatch.check.replay.checkpoint_blocks import blocks_needed, checkpointing, repeated_blocks
from gradwatch.check.replay.reference import Replay, Step, autocast_state, replay_step, scalar_grad
from gradwatch.check.replay.rows import Differentiated, RowGrads
from gradwatch.parallel.shard_check import local
from gradwatch.parallel.sharded import is_dtensor
from gradwatch.parallel.step_objective import StepObjective, StepPlan
from gradwatch.parallel.wrappers import is_compiled, unwrap_model
from gradwatch.plan.memory import gradient_bytes
from gradwatch.watch.parts._term_weights import Again
from gradwatch.watch.parts.context import WatchContext
from gradwatch.watch.parts.replay_capture import Hooks, capturing

#: A total as :func:`~gradwatch.check.replay.reference.replay_step` evaluates it: ``(model, batch) -> total``.
Total = Callable[[nn.Module, Any], Any]


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


@dataclasses.dataclass
class ReplayChoice:
    """What a check's replay differentiates (:meth:`~gradwatch.watch.parts.training.TrainingPart.replay`).

    Attributes:
        model: The module the replay runs.
        live: Whether it is the live model (the replay calls what training called, where the recorder sits).
        entry: The module the objective is given (a compiled or Fabric module's wrapper on the live model).
        root: The module the recorder's forwards are replayed on.
        params: Every tensor replayed, whole or by rows.
        plist: The tensors differentiated whole.
        whole: The same with their names, in order.
        row_plan: The weights judged by a block of rows, ``{name: (first, end)}``.
        rowgrads: Their rows' gradients (None: no weight by rows).
        savings: What checkpointing each block saves the replay, counted (None: not counted).
    """

    model: nn.Module
    live: bool
    entry: nn.Module
    root: nn.Module
    params: Dict[str, torch.Tensor]
    plist: Tuple[torch.Tensor, ...]
    whole: List[Tuple[str, torch.Tensor]]
    row_plan: Dict[str, Tuple[int, int]]
    rowgrads: Optional[RowGrads]
    savings: Optional[List[int]]


class ReplayStages:
    """The :class:`~gradwatch.watch.parts.training.TrainingPart`'s stages of a replay (a mixin: the attributes below
    are the part's)."""

    watch: WatchContext
    step_objective: StepObjective
    replay_context: Optional[Callable[[], Any]]
    params: Callable[..., Dict[str, torch.Tensor]]
    _params_cache: Optional[Any]
    _blocks_cache: Optional[Tuple[Any, Any, List[int], Set[str]]]
    _modules_cache: List[nn.Module]
    _reentrant: Optional[bool]
    _mode: Optional[str]

    def _objective(self, chosen: ReplayChoice, micro: int, autocast: Any, room: Optional[int],
                   checkpoint_room: Optional[int], hooks: Optional[Hooks], faithful: Optional[List[bool]], saved: Any,
                   held: Optional[int]) -> Tuple[Total, Optional[InnerAutocast]]:
        """The objective the replay evaluates: training's total, its first repeated blocks checkpointed as the room
        needs (:meth:`_blocks_to_checkpoint`), the backward part's capture riding on it where it fits, and the autocast
        its forward opens inside itself noted (:class:`InnerAutocast`, returned)."""
        ctx = self.watch
        total: Total = ctx.objective.training_total
        sizing = room if room is not None else checkpoint_room
        blocks, capture = self._blocks_to_checkpoint(chosen.model, chosen.params, sizing, micro, chosen.savings,
                                                     held if hooks is not None else None,
                                                     saved.total if chosen.savings is not None else None) \
            if chosen.live and sizing is not None else (0, True)
        if not capture:  # even every block checkpointed, the capture's tensors would not fit: it takes its own forward
            hooks = None
        if blocks:
            total = checkpointing(chosen.root, total, blocks)
        if hooks is not None:  # the backward part's capture rides on the replay's forward
            total = capturing(total, chosen.model, hooks[0], hooks[1], faithful if faithful is not None else [],
                              dropout=bool(ctx.dropout_only) and ctx.one_process)
        # a forward that opens autocast itself (not a compiled one: a hook inside its graph would recompile it)
        inner = InnerAutocast(chosen.root) if chosen.live and not autocast and not is_compiled(chosen.root) else None
        if inner is not None:
            total = inner.wrap(total)
        return total, inner

    def _replays(self, root: nn.Module, entry: Optional[nn.Module], pending: Step, judged: Differentiated) -> Again:
        """This check's step replayed with another objective (the term-weight diagnosis's, only where the verdict
        fails), as :meth:`~gradwatch.watch.parts.training.TrainingPart.replay` replays it, the rows judged by rows
        differentiated again; the recorder left paused or not as it was."""
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


__all__ = ["InnerAutocast", "ReplayChoice", "ReplayStages", "Total", "same_tree", "shift_hint"]
