"""Blocks of the rows of an own code's big parameter, checked in place: several in one piece, on a few positions.

TRL's ``SFTTrainer`` gives the model a fused LM head: the model's own code multiplies the hidden states by
``lm_head.weight`` in chunks inside a custom ``autograd.Function``, without calling the ``Linear``. That weight is a
parameter of the root's own code (:func:`~gradwatch.plan.units.in_place_param`), at a 32,000-token vocabulary far too
big for the room whole. The planner cuts such a unit by the weight's rows, as it cuts an LM head
(:func:`~gradwatch.plan.planner.own_rows`), and a check's blocks are checked here in one piece:

- the own code's float64 copy holds the weight whole, as a constant into which the blocks' rows are written from one
  leaf at each call (:class:`RowBlocksInPlace`), so the fused function runs as in training and only the blocks are
  perturbed and differentiated;
- every evaluation computes all the vocabulary's logits, whatever the blocks: the piece runs on the first
  :data:`OWN_POSITIONS` positions of the batch's first sample (the head's gradient sums over positions, as a Linear
  group's does on :data:`~gradwatch.check.modules.row_groups.GROUP_POSITIONS`);
- the unit's other parameters, its inputs' and its called modules' outputs are checked with the group that holds the
  weight's first block.

Example:
    >>> from torch import nn
    >>> head = nn.Linear(2, 10).double()
    >>> local, leaves = row_blocks(head, {"weight": head.weight, "bias": head.bias}, "weight", [(0, 2), (6, 9)])
    >>> sorted(leaves), local(torch.ones(1, 2, dtype=torch.float64)).shape
    (['bias', 'weight[2 blocks]'], torch.Size([1, 10]))
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from gradwatch.check.modules.batch_cut import batch_dims, first_of_capture
from gradwatch.check.modules.expert_blocks import take_out
from gradwatch.check.modules.own_code import OwnCode
from gradwatch.check.modules.piece_cuts import float_entries
from gradwatch.check.modules.row_groups import block_key
from gradwatch.plan.memory import MODULE_BYTES_PER_ENTRY, float_bytes
from gradwatch.plan.units import Unit, in_place_bytes, in_place_param

Block = Tuple[int, int]

#: Positions of the batch's first sample a group of an own code's row blocks is checked on, at most: each evaluation
#: computes every row's output (a vocabulary's logits) on them.
OWN_POSITIONS = 32


class RowBlocksInPlace(nn.Module):
    """Runs a unit's copy whose parameter ``name`` is rebuilt at each call with the ``blocks`` of its rows from leaves.

    Args:
        inner: The unit's copy (``name`` a ``dtype`` parameter of it, taken out of it).
        name: The parameter's name within ``inner``.
        blocks: Its row blocks ``(first, end)`` that are leaves.

    Attributes:
        leaves: ``{key: leaf}``: the blocks' rows as one leaf (``"name[first:end]"`` for one block, ``"name[n blocks]"``
            for more). Each row of an LM head's weight moves the loss by about its softmax share (a 32,000-token
            vocabulary: 1/32,000 of a label row), so a block's directional derivative is small against the
            finite differences' floor and takes widened probes: one leaf takes them once for the group.

    Example:
        See the module's example.
    """

    def __init__(self, inner: nn.Module, name: str, blocks: Sequence[Block]) -> None:
        super().__init__()
        self.inner = inner
        self._owner, self._attr, self._base = take_out(inner, name)
        self._index = torch.cat([torch.arange(a, b) for a, b in blocks]).to(self._base.device)
        key = block_key(name, blocks[0]) if len(blocks) == 1 else f"{name}[{len(blocks)} blocks]"
        self.leaves: Dict[str, torch.Tensor] = {key: nn.Parameter(self._base[self._index].clone())}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # in place, through a view of the copy: the gradient reaches the leaf through the write
        (rows,) = self.leaves.values()
        self._owner.__dict__[self._attr] = self._base.detach().index_copy_(0, self._index, rows)
        return self.inner(*args, **kwargs)


def row_blocks(inner: nn.Module, params: Mapping[str, Any], name: str, blocks: Sequence[Block]
               ) -> Tuple[RowBlocksInPlace, Dict[str, Any]]:
    """``inner`` (a unit's copy, whose leaves the check would take as ``params``) cut to the ``blocks`` of its
    parameter ``name``'s rows: ``(the copy to run, the leaves to check)``, the latter each block and, where the blocks
    hold the first, the rest of ``params``."""
    local = RowBlocksInPlace(inner, name, blocks)
    out: Dict[str, Any] = {k: v for k, v in params.items() if k != name} if min(a for a, _ in blocks) == 0 else {}
    out.update(local.leaves)
    return local, out


def own_rows_cost(unit: Unit, inputs: Any, children: Mapping[str, List[Any]]) -> Tuple[int, float]:
    """``(fixed bytes, bytes per row)`` of a group of an own code's row blocks on its captured (float64) ``inputs``
    and called modules' outputs (``children``) as cut to :data:`OWN_POSITIONS`: the parameter's copies and the rest's
    (:func:`~gradwatch.plan.units.in_place_bytes`), the inputs three times and the outputs at
    :data:`~gradwatch.plan.memory.MODULE_BYTES_PER_ENTRY` an entry."""
    fixed, per_row = in_place_bytes(unit)
    size, seq = batch_dims(inputs)
    share = min(1.0, OWN_POSITIONS / max(1, size * seq))
    return fixed + int(share * (3 * float_bytes(inputs) + float_entries(children) * MODULE_BYTES_PER_ENTRY)), float(per_row)


def few_positions(inputs: Tuple[Any, Any], children: Dict[str, List[Any]], constants: Set[int]
                  ) -> Tuple[Tuple[Any, Any], Dict[str, List[Any]], Set[int], Optional[str]]:
    """``inputs`` and ``children`` cut to the first sample's first :data:`OWN_POSITIONS` positions where they hold more
    (:func:`~gradwatch.check.modules.batch_cut.first_of_capture`), with what was kept said (None: nothing cut)."""
    size, seq = batch_dims(inputs)
    if size * seq <= OWN_POSITIONS:
        return inputs, children, constants, None
    keep, length = (1, min(seq, OWN_POSITIONS)) if seq > 1 else (min(size, OWN_POSITIONS), None)
    cut_inputs, cut_children, kept, what = first_of_capture(inputs, children, constants, keep, length)
    return cut_inputs, cut_children, kept, what


def own_group(unit: Unit, blocks: List[Block], inputs: Tuple[Any, Any], children: Dict[str, List[Any]],
              constants: Set[int], dtype: torch.dtype, canonical: Mapping[int, str],
              copy_of: Callable[..., Tuple[nn.Module, List[Any], Dict[str, Any]]]
              ) -> Tuple[nn.Module, Tuple[Any, Any], Dict[str, Any], Set[int], List[Tuple[str, Any]], str]:
    """Row ``blocks`` of an own code's big parameter as one piece (the module's docstring): ``(the copy to check, its
    inputs, its leaves, the ids of its constants, what it probes (parameter name, rows), what it is, said)``.
    ``copy_of(unit, children, dtype)`` makes the unit's copy, as ``(copy, stubs, leaves)``."""
    name = in_place_param(unit)
    assert name is not None
    prefix = f"{unit.name}." if unit.name else ""
    names = {k: canonical.get(id(p), k) for k, p in unit.params.items()}
    inputs, children, constants, what = few_positions(inputs, children, constants)
    inner, stubs, params = copy_of(unit, children, dtype)
    local, leaves = row_blocks(inner, params, name[len(prefix):], blocks)
    probed: List[Tuple[str, Any]] = [(names[name], b) for b in blocks]
    if min(a for a, _ in blocks) == 0:
        probed += [(names[k], None) for k in unit.params if k != name] + [(unit.name, "code")]
    kind = (f"{type(unit.module).__name__}, own code, {name} rows {blocks[0][0]}:{blocks[-1][1]}, {len(blocks)} blocks "
            f"(in place){'' if what is None else f', on {what}'}")
    return OwnCode(local, stubs), inputs, leaves, constants, probed, kind


__all__ = ["OWN_POSITIONS", "RowBlocksInPlace", "own_group", "few_positions", "own_rows_cost", "row_blocks"]
