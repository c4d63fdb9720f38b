"""How a piece of the module form that does not fit its room is cut: a block of a Linear's output rows, the first
samples (or one sample's first positions) of what a forward captured, and what a piece holds whatever its batch.

Pure sizing and slicing of captured tensors: no forward runs here (the module form's other cut, a forward on fewer
samples, is :func:`gradwatch.check.modules.module_form.run_module_check`'s).

Example:
    >>> from gradwatch.plan.units import Unit
    >>> lin = nn.Linear(64, 32)
    >>> x = torch.zeros(16, 64, dtype=torch.float64)
    >>> row_block(Unit("", lin, dict(lin.named_parameters())), ((x,), {}), 16 * 32 * 8, 40_000, 0)
    (0, 4, 39104)
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Set, Tuple, cast

import torch
from torch import nn

from gradwatch.check.modules.batch_cut import batch_dims, cuts_to_try, first_of_capture
from gradwatch.plan.memory import MODULE_BYTES_PER_ENTRY, float_bytes, numel_of
from gradwatch.plan.units import Unit, block_bytes, block_rows, faithful_rows, sliceable_rows
from gradwatch.trees import tensor_leaves


def rows_cost(unit: Unit, inputs: Any, out_bytes: int, positions: float = 1.0) -> Tuple[int, float]:
    """``(fixed bytes, bytes per row)`` of checking blocks of a unit's rows: its inputs three times (captured, working,
    fresh per call), and per row its share of the parameters' entries and four times its share of the output (of the
    ``positions`` share of the input a group is checked on)."""
    per_row = (numel_of(unit.params.values()) * MODULE_BYTES_PER_ENTRY + 4 * out_bytes * positions) / max(1, rows_of(unit) or 1)
    return 3 * float_bytes(inputs), per_row


#: Where torch's own modules live: their ``forward`` on plain tensors makes no collective.


def in_place_weight_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """What checking a block of a Linear or Embedding subclass in place adds: a ``dtype`` copy of its whole weight
    (:class:`~gradwatch.check.modules.own_code.RowsInPlace`).

    Example:
        >>> in_place_weight_bytes(nn.Linear(3, 10), torch.float64)
        240
    """
    return numel_of([cast(torch.Tensor, module.weight)]) * dtype.itemsize


def float_entries(children: Mapping[str, List[Any]]) -> int:
    """Floating entries of what the modules an own code calls gave it (the stubs' outputs, by module, call by call).

    Example:
        >>> float_entries({"fc": [torch.zeros(2, 3), (torch.zeros(4), torch.zeros(5, dtype=torch.long))]})
        10
    """
    return numel_of(t for outs in children.values() for o in outs for t in tensor_leaves(o) if t.is_floating_point())


def rows_of(unit: Unit) -> Optional[int]:
    """Rows a unit can be sliced by: a Linear's output rows, an Embedding's token rows (None for any other)."""
    return sliceable_rows(unit.module) if unit.kind == "module" else None


def row_block(unit: Unit, inputs: Any, output_bytes: int, room: int, seed: int,
               within: Optional[Tuple[int, int]] = None) -> Optional[Tuple[int, int, int]]:
    """For a Linear too big for the room: ``(first row, end row, bytes)`` of the largest block of output rows
    (within ``within``, default all) that fits (rows ``i`` of the output depend on rows ``i`` of the weight and
    bias alone), at an offset that moves with the check's seed; None for any other module, or when not one row fits."""
    module = unit.module
    if not isinstance(module, nn.Linear) or unit.kind != "module" or not faithful_rows(module):
        return None
    rows = module.out_features
    lo, hi = within if within is not None else (0, rows)
    per_row = (module.in_features + (1 if module.bias is not None else 0)) * MODULE_BYTES_PER_ENTRY \
        + 4 * output_bytes // max(rows, 1)
    fixed = 3 * float_bytes(inputs)
    k = min(hi - lo, (room - fixed) // per_row) if room > fixed else 0
    if k < 1:
        return None
    first = lo + (seed * k) % (hi - lo)
    first = min(first, hi - k)
    return first, first + k, fixed + k * per_row


def piece_params_bytes(unit: Unit, rows: Optional[Tuple[int, int]]) -> int:
    """What a piece's check holds for its parameters whatever the batch: :data:`MODULE_BYTES_PER_ENTRY` per entry of
    the unit's parameters, or of ``rows`` of them (a block checked in place: :func:`~gradwatch.plan.units.block_bytes`).

    Example:
        >>> from gradwatch.plan.units import Unit
        >>> lin = nn.Linear(4, 10)
        >>> piece_params_bytes(Unit("", lin, dict(lin.named_parameters())), None), \\
        ...     piece_params_bytes(Unit("", lin, dict(lin.named_parameters())), (0, 5))
        (2400, 1200)
    """
    if rows is not None and block_rows(unit):  # a block of experts, or rows, in place in the whole unit's copy
        fixed, per_row = block_bytes(unit)
        return fixed + per_row * (rows[1] - rows[0])
    whole = numel_of(unit.params.values()) * MODULE_BYTES_PER_ENTRY
    total = rows_of(unit)
    return whole * (rows[1] - rows[0]) // total if rows is not None and total else whole


def rows_of_one_sample(unit: Unit, inputs: Tuple[Any, Any], children: Dict[str, List[Any]], constants: Set[int],
                        out_bytes: int, room: int, seed: int, rows: Optional[Tuple[int, int]] = None
                        ) -> Optional[Tuple[Tuple[Any, Any], Dict[str, List[Any]], Set[int], Tuple[int, int, int], str]]:
    """For a Linear (or ``rows`` of it) whose row block does not fit the room on the whole batch's captured inputs, nor
    the whole piece on fewer samples (a sharded model: no other forward may run): a block of its rows on one sample's
    captured inputs, as ``(inputs, children, constants, (first, end, bytes), what)``; None where not one row fits.

    Example:
        >>> lin = nn.Linear(64, 32)
        >>> x = torch.zeros(16, 64, dtype=torch.float64)
        >>> unit = Unit("", lin, dict(lin.named_parameters()))
        >>> row_block(unit, ((x,), {}), 16 * 32 * 8, 40_000 // 2, 0) is None  # three copies of x fill half the room
        True
        >>> (args, _), _, _, block, what = rows_of_one_sample(unit, ((x,), {}), {}, set(), 16 * 32 * 8, 40_000, 0)
        >>> args[0].shape, block, what
        (torch.Size([1, 64]), (0, 5, 17296), "1 of the batch's 16 samples (cut from the forward's capture)")
    """
    size, _ = batch_dims(inputs)
    if size <= 1:
        return None
    cut_inputs, cut_children, kept, what = first_of_capture(inputs, children, constants, 1)
    block = row_block(unit, cut_inputs, out_bytes // size, room // 2, seed, rows)
    return None if block is None else (cut_inputs, cut_children, kept, block, what)


def cut_samples(unit: Unit, inputs: Tuple[Any, Any], children: Dict[str, List[Any]], constants: Set[int], need: int,
                 room: int, rows: Optional[Tuple[int, int]] = None
                 ) -> Optional[Tuple[Tuple[Any, Any], Dict[str, List[Any]], int, str, Set[int]]]:
    """For a unit (or its ``rows``) too big for the room, when no other forward may run (a sharded model): its captured inputs and
    stubs' outputs cut to their first samples (every tensor whose first dimension is the batch size), as many as
    fit, or, when one sample does not fit, to one sample's first positions (every tensor whose second dimension
    is the sequence length, and one position fewer where it is one shorter: next-token logits beside the ids),
    in :func:`_fewer_samples`' form; None when no cut fits, or the inputs hold no batch. As there, the piece's share
    of the parameters stays whatever the cut: the cut is sized on the rest, and none fits where that share fills the room.

    Example:
        >>> ids, logits = torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 7, 3)
        >>> from gradwatch.plan.units import Unit
        >>> code = Unit("", nn.Identity(), {})  # no parameters: the whole need is the batch's
        >>> (args, _), children, need, what, _ = cut_samples(code, ((ids,), {}), {"h": [logits]}, set(), 64, 4)
        >>> args[0].shape, children["h"][0].shape, need
        (torch.Size([1, 2]), torch.Size([1, 1, 3]), 4)
        >>> what
        "1 of the batch's 4 samples, its first 2 of 8 positions (cut from the forward's capture)"
    """
    fixed = piece_params_bytes(unit, rows)
    if fixed >= room:
        return None
    size, seq = batch_dims(inputs)
    variable = max(need - fixed, 1)
    cuts = cuts_to_try(size, seq, variable, room - fixed)  # the first: as many samples, or positions, as fit
    if not cuts:
        return None
    keep, length = cuts[0]
    cut_inputs, cut_children, kept, what = first_of_capture(inputs, children, constants, keep, length)
    return cut_inputs, cut_children, fixed + variable * keep * (length or seq) // (size * seq), what, kept


__all__ = ["cut_samples", "float_entries", "in_place_weight_bytes", "piece_params_bytes", "row_block", "rows_cost",
           "rows_of", "rows_of_one_sample"]
