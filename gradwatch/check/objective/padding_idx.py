"""Rows whose gradient torch defines as zero: the check holds them constant, as torch differentiates.

``nn.Embedding(padding_idx=i)`` reads row ``i`` in the forward (a padding token
gets whatever that row holds) while torch's backward gives the row a zero
gradient by design: the row is a constant of training, not a parameter it
learns. Finite differences of the plain forward see the row move the loss,
and the check would call a correct model WRONG. During a check the output
rows at padding positions are therefore replaced by the row's value at the
start of the check (a constant): the objective is then the function torch
differentiates, its derivative along the padding row is 0 on both sides, and
every other row is checked as before. ``EmbeddingBag`` needs nothing: its
bags skip padding entries in the forward too.

The functional ``F.embedding(..., padding_idx=i)`` called outside an
``nn.Embedding`` is not covered (gradwatch cannot tell which parameter holds
the table); wrap it in an ``nn.Embedding`` or check with ``tensors=`` excluding it.

Example:
    >>> import torch
    >>> from torch import nn
    >>> emb = nn.Embedding(4, 2, padding_idx=0)
    >>> with padding_rows_constant(emb) as held:
    ...     held
    ['weight row 0 (padding_idx)']
    >>> "forward" in vars(emb)
    False
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator, List

import torch
from torch import nn

from gradwatch.check.objective.guards import instance_forwards


def _holding_forward(module: nn.Embedding, row: torch.Tensor):
    assert module.padding_idx is not None  # only modules with a padding row get a holding forward
    index = int(module.padding_idx)
    plain = type(module).forward

    def forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
        out = plain(self, input)
        at_padding = (input == index).unsqueeze(-1)
        return torch.where(at_padding, row.to(out.dtype), out)

    return types.MethodType(forward, module)


@contextlib.contextmanager
def padding_rows_constant(model: nn.Module) -> Iterator[List[str]]:
    """For the duration, every ``nn.Embedding`` with a ``padding_idx`` reads its padding row as a constant.

    Yields one line per held row (``"emb.weight row 0 (padding_idx)"``) for the report.
    The row's value is taken when the context is entered: enter it before any parameter
    is perturbed. Each module's ``forward`` is put back exactly as it was on exit.

    Example:
        >>> emb = nn.Embedding(3, 2, padding_idx=0)
        >>> ids = torch.tensor([0, 1])
        >>> with padding_rows_constant(emb):
        ...     with torch.no_grad():
        ...         _ = emb.weight.add_(1.0)  # a perturbation of the check
        ...     moved = emb(ids).detach()
        >>> torch.equal(moved[0], emb.weight[0] - 1.0), torch.equal(moved[1], emb.weight[1])
        (True, True)
    """
    patches = []
    held: List[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Embedding) or module.padding_idx is None:
            continue
        weight = module.weight
        if weight is None or not weight.is_floating_point():
            continue
        row = weight.detach()[module.padding_idx].clone()
        patches.append((module, _holding_forward(module, row)))
        prefix = f"{name}." if name else ""
        held.append(f"{prefix}weight row {module.padding_idx % module.num_embeddings} (padding_idx)")
    with instance_forwards(patches):
        yield held


def padding_note(held: List[str]) -> str:
    """The report's note on held rows.

    Example:
        >>> padding_note(["emb.weight row 0 (padding_idx)"])[:40]
        'not checked: emb.weight row 0 (padding_i'
    """
    return (f"not checked: {', '.join(held)}: torch defines the gradient of an Embedding's padding row as zero "
            "while the forward reads it, so the check holds the row constant, as training does")
