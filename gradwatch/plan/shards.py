"""Which rank checks which piece of a sharded model (FSDP2, tensor parallel DTensors): pure functions of the plan and the layout.

FSDP2's ``fully_shard`` splits every parameter on dim 0 as ``torch.chunk`` does: rank ``r`` of ``W``
holds rows ``r * c`` to ``(r + 1) * c`` (``c = ceil(rows / W)``; the last ranks may hold fewer or none).
A Linear's output rows depend on its own weight and bias rows only, and an Embedding's token rows
likewise, so a slice of them is checked on the rank that holds it, with no gather:

- a piece of such a unit (a block of rows, or the whole unit) is cut at the shard bounds, and each rank
  takes the part it holds (:func:`assign`);
- every other piece (a unit's own code, a LayerNorm, an activation) is taken by one rank, round-robin
  in plan order, and its parameters are gathered for that piece alone.

Every rank computes the same plan, so the assignment needs no message.

Example:
    >>> from gradwatch.plan.cycle import Piece
    >>> pieces = [Piece("attn"), Piece("head", (0, 256)), Piece("norm")]
    >>> held = {"head": 1000}
    >>> [(str(p), offset) for p, offset in assign(pieces, held, rank=0, world=2)]
    [('attn', 0), ('head[0:256]', 0)]
    >>> [(str(p), offset) for p, offset in assign(pieces, held, rank=1, world=2)]
    [('norm', 0)]
"""

from __future__ import annotations

import math
from typing import List, Mapping, Optional, Sequence, Tuple

from gradwatch.plan.cycle import Piece


def rows_held(rows: int, rank: int, world: int) -> Tuple[int, int]:
    """``(first, end)`` of the rows of a dim-0 sharded tensor of ``rows`` rows that ``rank`` holds.

    Example:
        >>> [rows_held(3, r, 2) for r in range(2)], rows_held(1, 1, 2)
        ([(0, 2), (2, 3)], (1, 1))
    """
    chunk = math.ceil(rows / world) if world > 0 else rows
    first = min(rows, rank * chunk)
    return first, min(rows, first + chunk)


def assign(pieces: Sequence[Piece], held: Mapping[str, int], rank: int, world: int,
           turns: Optional[Tuple[int, int]] = None) -> List[Tuple[Piece, int]]:
    """This rank's pieces, each with the offset of the rows it holds (0 for a piece checked whole).

    Args:
        pieces: The check's pieces, the same on every rank (:meth:`gradwatch.plan.planner.Planner.module_pieces`).
        held: Unit name -> its rows, for the units checked on the ranks that hold their rows (a Linear or an
            Embedding whose weight is sharded on dim 0).
        rank: This rank.
        world: Ranks the parameters are sharded over.
        turns: ``(rank, world)`` of the round-robin of the pieces checked whole (default: ``(rank, world)``);
            the process group's, where the rows are sharded over a smaller mesh (tensor parallel inside a
            2-D mesh).

    Example:
        >>> assign([Piece("fc")], {"fc": 5}, rank=1, world=2)
        [(Piece(unit='fc', rows=(3, 5)), 3)]
    """
    out: List[Tuple[Piece, int]] = []
    turn = 0
    mine, everyone = turns if turns is not None else (rank, world)
    for piece in pieces:
        rows = held.get(piece.unit)
        if rows is None:
            if turn % everyone == mine:
                out.append((piece, 0))
            turn += 1
            continue
        lo, hi = piece.rows if piece.rows is not None else (0, rows)
        first, end = rows_held(rows, rank, world)
        part: Optional[Tuple[int, int]] = (max(lo, first), min(hi, end))
        if part is not None and part[0] < part[1]:
            out.append((Piece(piece.unit, part), first))
    return out
