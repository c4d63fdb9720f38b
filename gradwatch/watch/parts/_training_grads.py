"""The training part's gradient of one replayed micro-batch's objective, as training took it.

:class:`TrainingGrads` is the ``grad_of`` the training part hands :func:`~gradwatch.check.replay.reference.replay_step`:
the replayed total's gradient by the watched tensors (the whole ones, then the rows of those judged by rows), never
written to ``.grad``; under a ``GradScaler`` scaled and unscaled as training's loop does; shard by shard through the
model's own backward; with a ``grad_fn``, what it gives, weighed by the micro-batch's share of the step.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch import GradWatch
    >>> model = nn.Linear(2, 1)
    >>> watch = GradWatch(model, lambda m, b: m(b).sum(), every=1, log_dir=None)
    >>> params = dict(model.named_parameters())
    >>> grads = TrainingGrads(watch.training.watch, model, params, list(params.items()), tuple(params.values()),
    ...                       None, None, {}, None, lambda m, total, plist, leaves: torch.autograd.grad(total, plist))
    >>> sorted((n, tuple(g.shape)) for n, g in grads(model(torch.ones(3, 2)).sum(), None).items())
    [('bias', (1,)), ('weight', (1, 2))]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from gradwatch.check.model import GradFn, validate_grads
from gradwatch.check.replay.rows import RowGrads
from gradwatch.parallel.shard_check import backward_on_shards
from gradwatch.trees import dense
from gradwatch.watch.parts.context import WatchContext

#: ``(model, total, plist, leaves) -> gradients``: the replayed total's gradients by ``plist``, then by ``leaves``.
ReplayGrads = Callable[[nn.Module, torch.Tensor, Tuple[torch.Tensor, ...], Sequence[torch.Tensor]],
                       Sequence[Optional[torch.Tensor]]]


@dataclasses.dataclass
class TrainingGrads:
    """``grad_of(total, batch)`` of one replay: ``{name: gradient}`` of each watched tensor (see the module's docstring).

    Attributes:
        watch: The watch's setting (its ``grad_fn``, whether it runs shard by shard, its lockstep).
        model: The module the replay runs.
        params: Every tensor replayed, whole or by rows (what ``grad_fn``'s gradients are validated against).
        whole: The tensors differentiated whole, in order.
        plist: Their tensors, the ``autograd.grad`` inputs before the rows' leaves.
        rowgrads: The weights judged by rows (None: none).
        scaler: An enabled ``GradScaler`` (None: none).
        weight_of: Each micro-batch's weight, by the id of its batch (``grad_fn``'s gradients are weighed here).
        pending: The step replayed.
        replay_grads: The part's gradients of a total in one process (:meth:`~gradwatch.watch.parts._training_replay.
            ReplayStages._replay_grads`).
    """

    watch: WatchContext
    model: nn.Module
    params: Dict[str, torch.Tensor]
    whole: List[Tuple[str, torch.Tensor]]
    plist: Tuple[torch.Tensor, ...]
    rowgrads: Optional[RowGrads]
    scaler: Any
    weight_of: Dict[int, float]
    pending: Any
    replay_grads: ReplayGrads

    def __call__(self, total: torch.Tensor, batch: Any) -> Dict[str, torch.Tensor]:
        grad_fn = self.watch.grad_fn
        if grad_fn is not None:
            return self._given(grad_fn, batch)
        rowgrads = self.rowgrads
        leaves = rowgrads.leaves() if rowgrads is not None else ()
        if not total.requires_grad:
            out = {n: torch.zeros_like(p) for n, p in self.whole}
            out.update(rowgrads.split([None] * len(leaves)) if rowgrads is not None else {})
            return out
        inv = None
        scaler = self.scaler
        if scaler is not None:  # scaler.scale(loss).backward(), then unscale_: times the float32 reciprocal
            inv = torch.tensor(float(scaler.get_scale()), dtype=torch.float64).reciprocal().float()
            total = scaler.scale(total)
        gs = self._differentiated(total, leaves)
        plist = self.plist
        out = {n: torch.zeros_like(p) if g is None else dense(g) for (n, p), g in zip(self.whole, gs[:len(plist)])}
        if rowgrads is not None:  # weights judged by rows: the gradient of those rows only
            out.update(rowgrads.split(list(gs[len(plist):])))
        if inv is not None:
            out = {n: g * inv.to(g.device) for n, g in out.items()}
        return out

    def _given(self, grad_fn: GradFn, batch: Any) -> Dict[str, torch.Tensor]:
        """``grad_fn``'s gradients of the micro-batch, weighed by its share of the step."""
        grads = validate_grads(grad_fn(self.model, batch), self.params, "grad_fn")
        weight = self.weight_of.get(id(batch), 1.0)  # grad_fn gives the micro-batch's own gradient: weighed here
        return grads if weight == 1.0 else {n: g * weight for n, g in grads.items()}

    def _differentiated(self, total: torch.Tensor, leaves: Sequence[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
        """The total's gradients by the whole tensors, then by the rows' leaves: shard by shard the model's own
        backward (FSDP2, tensor and sequence parallel), else the part's."""
        ctx = self.watch
        if ctx.by_shard and not ctx.zero:
            return backward_on_shards(self.model, total, self.plist, reuse=len(self.pending.micro) == 1,
                                      before=ctx.lockstep.point if ctx.lockstep is not None else None)
        return self.replay_grads(self.model, total, self.plist, leaves)


__all__ = ["ReplayGrads", "TrainingGrads"]
