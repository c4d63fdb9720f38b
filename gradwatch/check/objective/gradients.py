"""The analytic side of a check: the objective's gradient by autograd, or by a hand-written ``grad_fn``, validated.

Autograd goes through ``backward()`` into the leaves a reentrant checkpoint hides from ``autograd.grad``
(:mod:`gradwatch.check.objective.checkpointed`); it never touches the caller's ``.grad``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from gradwatch.check.objective.checkpointed import grad_by_backward
from gradwatch.check.objective.terms import Objective
from gradwatch.errors import blame
from gradwatch.trees import dense


def validate_grads(grads: Any, params: Mapping[str, torch.Tensor], source: str) -> Dict[str, torch.Tensor]:
    """``grads`` as ``{name: dense tensor on the parameter's device}``, one per parameter of its shape.

    Raises:
        TypeError: ``grads`` is not a mapping (``source`` names who returned it).
        ValueError: A parameter has no gradient, or one of another shape.
    """
    if not isinstance(grads, Mapping):
        raise TypeError(f"{source} must return a mapping {{name: gradient}}, got {type(grads).__name__}")
    missing = [n for n in params if n not in grads]
    if missing:
        raise ValueError(
            f"{source} returned no gradient for {missing}; it returned {sorted(map(str, grads))}, "
            f"and the checked parameters are {list(params)}"
        )
    out = {}
    for n, p in params.items():
        g = grads[n]
        g = torch.as_tensor(np.asarray(g)) if not isinstance(g, torch.Tensor) else g
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"{source}: gradient for {n!r} has shape {tuple(g.shape)}, but the parameter has shape {tuple(p.shape)}")
        out[n] = dense(g.to(p.device))
    return out


def analytic_gradients(objective: Objective, terms_t: Mapping[str, torch.Tensor], total_t: torch.Tensor,
                       params: Mapping[str, torch.Tensor], target: nn.Module, batch: Any,
                       grad_fn: Optional[Callable[[nn.Module, Any], Mapping[str, torch.Tensor]]], per_term: bool,
                       leaves: Optional[List[torch.Tensor]] = None) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{tensor: {"total": grad, term: grad, ...}}``; through ``backward()`` into ``leaves`` when given
    (see :mod:`gradwatch.check.objective.checkpointed`)."""
    plist = list(params.values())
    out: Dict[str, Dict[str, torch.Tensor]] = {n: {} for n in params}
    if grad_fn is not None:
        try:
            with torch.enable_grad():
                given = validate_grads(grad_fn(target, batch), params, "grad_fn")
        except Exception as exc:
            blame(exc, "grad_fn")
            raise
        for n in params:
            out[n]["total"] = given[n]
    else:
        gs = _grad(total_t, plist, retain=per_term, leaves=leaves)
        for n, g in zip(params, gs):
            out[n]["total"] = g
    if per_term:
        for term in sorted(terms_t):
            gs = _grad(terms_t[term], plist, retain=True, leaves=leaves)
            for n, g in zip(params, gs):
                out[n][term] = g
    return out


def _grad(value: torch.Tensor, plist: List[torch.Tensor], retain: bool,
          leaves: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
    if not value.requires_grad:
        return [torch.zeros_like(p) for p in plist]
    gs: Sequence[Optional[torch.Tensor]]
    if leaves is not None:  # see gradwatch.check.objective.checkpointed
        gs = grad_by_backward(value, plist, leaves, retain)
    else:
        gs = torch.autograd.grad(value, plist, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(p) if g is None else dense(g) for g, p in zip(gs, plist)]
