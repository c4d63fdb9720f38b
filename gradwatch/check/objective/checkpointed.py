"""Reading the autograd graph of the check objective: where ``autograd.grad`` cannot see.

``torch.utils.checkpoint(..., use_reentrant=True)`` hides the parameters used
inside the checkpointed function from the outer graph: ``torch.autograd.grad``
either misses them (a false "analytic gradient is zero") or raises ("incompatible
with .grad()"). ``backward()`` sees them, as it does in training, so the check
computes the analytic side that way when the graph holds such a checkpoint: into
``.grad`` of the leaves, each leaf's own ``.grad`` saved before and put back after.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List, Optional, Sequence, cast

import torch

from gradwatch.check.objective.functional_dropout import active_record, recomputed_alike

#: Names of the autograd nodes of ``torch.utils.checkpoint`` with ``use_reentrant=True``.
REENTRANT_NODES = ("CheckpointFunctionBackward",)
#: What a reentrant checkpoint warns when it runs without grad (every evaluation of the numeric side).
CHECKPOINT_NO_GRAD_WARNING = "None of the inputs have requires_grad=True"


def _nodes(value: torch.Tensor) -> Iterator[object]:
    """Every node of the graph behind ``value``, once each."""
    seen = set()
    stack = [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(child for child, _ in node.next_functions)


def reentrant_checkpoint_leaves(value: torch.Tensor) -> Optional[List[torch.Tensor]]:
    """The leaves of the graph behind ``value`` if it holds a reentrant checkpoint, else None.

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> w = torch.ones(2, requires_grad=True)
        >>> x = (w * 2).sum()
        >>> reentrant_checkpoint_leaves(x) is None
        True
        >>> y = checkpoint(lambda h: h.exp(), w * 2, use_reentrant=True).sum()
        >>> [t is w for t in reentrant_checkpoint_leaves(y)]
        [True]
    """
    if value.grad_fn is None:
        return None
    found = False
    leaves: List[torch.Tensor] = []
    for node in _nodes(value):
        name = type(node).__name__
        found = found or name in REENTRANT_NODES
        if name == "AccumulateGrad":
            leaves.append(cast(Any, node).variable)
    return leaves if found else None


def grad_by_backward(value: torch.Tensor, plist: List[torch.Tensor], leaves: Iterable[torch.Tensor],
                     retain: bool) -> List[Optional[torch.Tensor]]:
    """Gradients of ``value`` with respect to ``plist`` through ``backward()`` (None where unused).

    ``.grad`` of every tensor in ``plist`` and ``leaves`` is set aside first and put back after
    (the very same objects), so nothing the caller holds changes.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> w.grad = torch.full((2,), 7.0)
        >>> grad_by_backward((3 * w).sum(), [w], [w], retain=False)[0].tolist(), w.grad.tolist()
        ([3.0, 3.0], [7.0, 7.0])
    """
    owners = {id(t): t for t in list(plist) + list(leaves)}
    saved = [(t, t.grad) for t in owners.values()]
    try:
        for t, _ in saved:
            t.grad = None
        torch.autograd.backward(value, retain_graph=retain)
        return [None if p.grad is None else p.grad.detach().clone() for p in plist]
    finally:
        for t, grad in saved:
            t.grad = grad


def grad_through_checkpoints(value: torch.Tensor, plist: Sequence[torch.Tensor],
                             owners: Optional[Iterable[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """Gradients of ``value`` by ``plist`` (None where unused) on a graph that may hold checkpoints, never in ``.grad``.

    Both kinds of ``torch.utils.checkpoint`` recompute their forward in backward, where the torch function mode that
    keeps dropout off (:func:`~gradwatch.check.objective.dropout_off.dropout_off`) does not reach: the dropout functions
    are switched off for the backward as the forward had them (:func:`recomputed_alike`), or a non-reentrant
    checkpoint refuses the recomputed values ("different metadata") and a reentrant one differentiates other values.
    A reentrant checkpoint hides the parameters inside it from ``autograd.grad``: where the graph holds one, the
    gradients come through ``backward()`` (:func:`grad_by_backward`), every tensor of ``owners`` and of the graph's
    leaves with its ``.grad`` set aside and put back.

    Args:
        value: A scalar with a graph.
        plist: The tensors differentiated by.
        owners: Every tensor whose ``.grad`` a ``backward()`` may write (the model's trainable parameters, those inside a
            checkpoint included); None where a ``backward()`` would act on training (DDP's hooks, an optimizer
            stepping in backward): ``autograd.grad`` then refuses a reentrant checkpoint as torch does.

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> w = torch.ones(2, requires_grad=True)
        >>> w.grad = torch.full((2,), 7.0)
        >>> y = checkpoint(lambda h: (h * w).sum(), torch.ones(2, requires_grad=True), use_reentrant=True)
        >>> grad_through_checkpoints(y, [w], [w])[0].tolist(), w.grad.tolist()
        ([1.0, 1.0], [7.0, 7.0])
    """
    leaves = reentrant_checkpoint_leaves(value) if owners is not None else None
    with recomputed_alike(active_record()):
        if leaves is not None:
            return grad_by_backward(value, list(plist), leaves + list(cast(Iterable[torch.Tensor], owners)), retain=False)
        return list(torch.autograd.grad(value, list(plist), allow_unused=True))
