"""Reading the autograd graph of the check objective: where ``autograd.grad`` cannot see.

``torch.utils.checkpoint(..., use_reentrant=True)`` hides the parameters used
inside the checkpointed function from the outer graph: ``torch.autograd.grad``
either misses them (a false "analytic gradient is zero") or raises ("incompatible
with .grad()"). ``backward()`` sees them, as it does in training, so the check
computes the analytic side that way when the graph holds such a checkpoint: into
``.grad`` of the leaves, each leaf's own ``.grad`` saved before and put back after.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List, Optional, cast

import torch

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
