"""The training part's replay run as the backward part's capture: one forward of the model a check, not two.

Shard by shard under tensor and sequence parallel and 2-D meshes, a check ran the model twice: the training part's
replay of the step (a forward and backward of the sharded model, as training ran it), then the backward part's
capture (a forward without grad that copies the chosen units' inputs, every DTensor gathered). On 2 CPU ranks a
forward of the sharded model costs more than the same forward in one process (DTensor's dispatch, the collectives), so
where the replay's forward computes what the capture's would, the capture's hooks ride on it
(:class:`ReplayCapture`) and the second forward is not run. In one process the same holds from the second check on
(the first learns whether ``loss_fn`` differentiates inside), with nothing to agree: a module-form check's capture
then takes no forward of its own, or a shorter one for the units left over (docs/costs.md, stop 87: the median
check of a UNet, a CNN, LoRA GPT-2 or an MoE model shorter). A check that takes the whole objective's
form, or captures nothing, runs the replay on its own after it.

The two forwards compute the same values where nothing random runs and nothing is autocast: the replay runs the step
as training did (its dropout masks, its autocast), the capture an isolated forward (dropout off, reseeded, no
autocast). Both suspend the hooks your code registered and hold ``spectral_norm``'s power iteration. So the replay's
forward is used when, from the model's call on, it drew no random number (torch's generators as the replay set them
there) and ran with autocast off, on every rank (an agreement point); otherwise the capture runs its own forward, as
before, and the watch stops trying (a model that draws once draws at every step). In one process, where the first
check's isolated forward met no randomness but dropout (no layerdrop, noise or other draw:
``WatchContext.dropout_only``), the replay with training's dropout masks captures too: each unit is checked at the
inputs training's own forward gave it (an own-code unit with its children's outputs as training had them), with its
own dropout off as always; a backward's derivative is checked at any point, and the units' calls are the same with and
without the masks (layerdrop, which changes them, keeps the isolated capture). Only the first call of ``loss_fn`` runs
the hooks, and only where the step is one micro-batch, the check's batch, with no regularizer and no ``grad_fn``. The
capture's copies are held through the replay's backward: under a room they hold at most :func:`held_budget` (the units
over it are captured by another forward after the replay), and shard by shard the replay checkpoints its blocks for
that much less room. In one process they are not copies but the tensors the forward made with a graph (most of them
saved for its backward anyway; the batch, parameters and buffers are copied), their versions checked after it: one
changed in place later in the forward has the capture taken again by a forward of its own
(:func:`gradwatch.check.modules.capture.capture`): copies would add to the replay's peak (docs/costs.md, stop 87).

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    >>> seen = []
    >>> total = capturing(lambda m, b: m(b).sum(), model, {"0": lambda m, a, k: seen.append(a[0].shape)}, {}, [])
    >>> float(total(model, torch.ones(3, 2))) == float(model(torch.ones(3, 2)).sum()), seen
    (True, [torch.Size([3, 2])])
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from gradwatch.check.objective.precision import any_autocast
from gradwatch.check.replay.reference import StartState
from gradwatch.watch.parts.context import CheckContext, WatchContext

#: The capture's hooks: forward pre-hooks (with kwargs) and forward hooks, by module name.
Hooks = Tuple[Dict[str, Callable[..., Any]], Dict[str, Callable[..., Any]]]


def _same(a: StartState, b: StartState) -> bool:
    """Whether torch's generators (the CPU one, and CUDA's where initialized) are in the same states in ``a``, ``b``."""
    if not torch.equal(a.rng, b.rng) or (a.cuda is None) != (b.cuda is None):
        return False
    if a.cuda is None or b.cuda is None:
        return True  # both None: CUDA not initialized
    return len(a.cuda) == len(b.cuda) and all(torch.equal(x, y) for x, y in zip(a.cuda, b.cuda))


def capturing(total: Callable[[nn.Module, Any], Any], model: nn.Module, pre: Dict[str, Callable[..., Any]],
              post: Dict[str, Callable[..., Any]], faithful: List[bool], dropout: bool = False
              ) -> Callable[[nn.Module, Any], Any]:
    """``total`` with the capture's hooks on ``model``'s modules during its first call only (a checkpointed block's
    recomputation in the backward, a second micro-batch, run without them); ``faithful`` gets one entry for that
    call: whether it called ``model``, drew no random number from torch's generators from that call on (the replay
    sets training's states as the model's forward begins, and checks the model's inputs are training's) and ran with
    autocast off: its values the isolated forward's. With ``dropout`` (the model's randomness is known to be dropout
    only) its draws are allowed: see the module docstring."""

    def run(module: nn.Module, batch: Any) -> Any:
        if faithful:
            return total(module, batch)
        named = dict(model.named_modules())
        before: List[StartState] = []
        still = not any_autocast()

        def start(module: nn.Module, args: Any) -> None:  # after the replay's probe set training's generator states
            if not before:
                before.append(StartState.now(full=False))

        setattr(start, "_gradwatch_hook", True)  # noqa: B010 - gradwatch's own
        handles = [model.register_forward_pre_hook(start)]
        try:
            for name, hook in pre.items():
                handles.append(named[name].register_forward_pre_hook(hook, with_kwargs=True))
            for name, hook in post.items():
                handles.append(named[name].register_forward_hook(hook, always_call=True))
            out = total(module, batch)
        finally:
            for h in handles:
                h.remove()
            faithful.append(still and bool(before) and (dropout or _same(before[0], StartState.now(full=False))))
        return out

    return run


class ReplayCapture:
    """The first capture's forward (:data:`gradwatch.check.modules.capture.Forward`): the training part's replay
    with the capture's hooks (see the module docstring).

    Args:
        replay: Runs the training part's replay (and judges it) with the hooks given, or without hooks for None;
            returns the step's objective (None where the replay did not run) and whether its forward was faithful
            (None where it ran without the hooks: no room for what they hold beside it, or no forward).
        agree: An agreement point taking a value and returning the ranks' smallest
            (:meth:`gradwatch.parallel.lockstep.Lockstep.point`).

    Attributes:
        usable: After the call: every rank's replay forward computed the isolated forward's values.
        ran: Whether it was called (in one process, a check whose backward part captured nothing, or took the whole
            objective's form, runs the replay on its own after it).
        declined: The replay ran without the hooks (not usable, this check only: the next one tries again).

    Example:
        >>> fused = ReplayCapture(lambda hooks: (1.5, True), lambda value: value)
        >>> fused({}, {}), fused.usable
        (1.5, True)
    """

    def __init__(self, replay: Callable[[Optional[Hooks]], Tuple[Optional[float], Optional[bool]]],
                 agree: Callable[[int], Any]) -> None:
        self.replay = replay
        self.agree = agree
        self.usable = False
        self.ran = False
        self.declined = False

    def __call__(self, pre: Dict[str, Callable[..., Any]], post: Dict[str, Callable[..., Any]]) -> Optional[float]:
        self.ran = True
        objective, faithful = self.replay((pre, post))
        self.declined = faithful is None
        self.usable = self.agree(1 if faithful else 0) == 1
        return objective


def held_budget(watch: WatchContext, room: Optional[int]) -> Optional[int]:
    """Bytes the captures may hold through the replay's backward (None: no bound): the captures' third of ``room``, at
    most half what the budget aims at above training's peak (the replay peaks about as training did, or above it):
    captures of a whole third of the room held through it had raised a tensor parallel model's ranks' peaks well above
    what the check added without them. Units over it are captured by a forward of their own after the replay, on
    every rank alike."""
    if room is None:
        return None
    aimed = watch.memory.aimed()
    return room // 3 if aimed is None else min(room // 3, aimed // 2)


def fusable(watch: WatchContext, check: CheckContext) -> bool:
    """Whether this rank's check, shard by shard through DTensors in a lockstep region (where the caller asks, and a
    point then agrees on the answer), can run its replay as its capture: the training part on, one micro-batch (the
    check's) replayed on the model training calls, the backward part's units known (``loss_fn`` known not to
    differentiate inside), no ``grad_fn``, no regularizer (one that runs the model would add its calls to
    ``loss_fn``'s)."""
    pending = check.pending
    return (watch.recorder is not None and check.judge and bool(check.names) and check.target is watch.model
            and not watch.objective.regularizers
            and pending is not None and len(pending.micro) == 1 and pending.micro[0].batch is check.batch
            and watch.wrapping.entry is watch.model and watch.grad_fn is None
            and watch.objective.differentiates is False)


__all__ = ["Hooks", "ReplayCapture", "capturing", "fusable", "held_budget"]
