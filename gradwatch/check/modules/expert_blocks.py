"""A block of a unit's experts checked in place: the unit's copy at its full size, only the block's experts moved.

A mixture of experts that holds its E experts in fused tensors (transformers 5's ``experts.gate_up_proj`` of shape
``(E, 2 * intermediate, hidden)``) is one unit of the module form, and its float64 check holds every entry of those
tensors several times over (the copy, its gradient, the engine's copies): at 8 experts of a 256-wide model, more
than a check's room beside training. Such a unit is cut by experts, as a Linear by output rows
(:mod:`gradwatch.plan.cycle`): each piece checks a block of experts ``first:end``. Its copy keeps the fused tensors
whole, as plain float64 constants, and at each call writes into them each expert of the block from a leaf of its own,
``name[expert i]`` (:class:`ExpertsInPlace`). So the unit's own forward runs as in training (the same routing, every
expert at its real index, a grouped kernel over all of them), and the check holds the whole unit once in float64 and
only the block's experts as what it perturbs and differentiates. The unit's other parameters, and the outputs of the
modules its own code calls, are checked with the first block.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Experts(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = nn.Parameter(torch.randn(4, 3, 2, dtype=torch.float64))
    ...     def forward(self, x, index):
    ...         return torch.einsum("nh,noh->no", x, self.w[index])
    >>> block, params = expert_block(Experts(), {"w": None}, ["w"], (1, 3))
    >>> sorted(params), block(torch.ones(5, 2, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 1])).shape
    (['w[expert 1]', 'w[expert 2]'], torch.Size([5, 3]))
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from gradwatch.check.probes.experts import expert_key


def take_out(inner: nn.Module, name: str) -> Tuple[nn.Module, str, torch.Tensor]:
    """Parameter ``name`` of a unit's copy taken out of it and left as a plain constant in its place: ``(the module
    that held it, its attribute, the constant)``, into which a block's leaves are written in place at each call.

    Example:
        >>> lin = nn.Linear(2, 3)
        >>> owner, attr, base = take_out(lin, "weight")
        >>> attr, "weight" in lin._parameters, lin.weight is base
        ('weight', False, True)
    """
    owner_name, _, attr = name.rpartition(".")
    owner = inner.get_submodule(owner_name) if owner_name else inner
    taken = owner._parameters.pop(attr)
    assert taken is not None
    base = taken.detach()
    owner.__dict__[attr] = base
    return owner, attr, base


class ExpertsInPlace(nn.Module):
    """Runs a copy of a unit whose fused expert tensors are rebuilt at each call from the block's leaves.

    Args:
        inner: The unit's copy (its fused tensors float64 parameters of it, which are taken out of it).
        fused: The fused tensors' names within ``inner``.
        rows: The block of experts ``(first, end)``.

    Attributes:
        leaves: ``{"name[expert i]": leaf}`` for each fused tensor and each expert of the block.

    Example:
        See the module's example.
    """

    def __init__(self, inner: nn.Module, fused: Sequence[str], rows: Tuple[int, int]) -> None:
        super().__init__()
        self.inner = inner
        first, end = rows
        self.index = torch.arange(first, end)
        self.leaves: Dict[str, torch.Tensor] = {}
        self._fused: List[Tuple[nn.Module, str, torch.Tensor, List[torch.Tensor]]] = []
        for name in fused:
            owner, attr, base = take_out(inner, name)
            block: List[torch.Tensor] = [nn.Parameter(base[i].clone(), requires_grad=True) for i in range(first, end)]
            self.leaves.update({expert_key(name, i): leaf for i, leaf in zip(range(first, end), block)})
            self._fused.append((owner, attr, base, block))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for owner, attr, base, block in self._fused:
            # in place, through a view of the copy: the gradient reaches each leaf through the write
            owner.__dict__[attr] = base.detach().index_copy_(0, self.index.to(base.device), torch.stack(block))
        return self.inner(*args, **kwargs)


def expert_block(inner: nn.Module, params: Mapping[str, Optional[torch.Tensor]], fused: Sequence[str],
                 rows: Tuple[int, int]) -> Tuple[ExpertsInPlace, Dict[str, Any]]:
    """``inner`` (a unit's float64 copy, whose parameters the check would take as ``params``) cut to the experts
    ``rows`` of its ``fused`` tensors: ``(the copy to run, the leaves to check)``, the latter each expert of the block
    (``name[expert i]``) and, with the first block only, the rest of ``params``."""
    block = ExpertsInPlace(inner, fused, rows)
    out: Dict[str, Any] = {} if rows[0] else {k: v for k, v in params.items() if k not in fused}
    out.update(block.leaves)
    return block, out


__all__ = ["ExpertsInPlace", "expert_block", "take_out"]
