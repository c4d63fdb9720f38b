"""Which rank checks which piece of a sharded model (FSDP2, tensor parallel DTensors): pure functions of the plan and the layout.

FSDP2's ``fully_shard`` splits every parameter on dim 0 as ``torch.chunk`` does: rank ``r`` of ``W``
holds rows ``r * c`` to ``(r + 1) * c`` (``c = ceil(rows / W)``; the last ranks may hold fewer or none).
A Linear's output rows depend on its own weight and bias rows only, and an Embedding's token rows
likewise, so a slice of them is checked on the rank that holds it, with no gather:

- a piece of such a unit (a block of rows, or the whole unit) is cut at the shard bounds, and each rank
  takes the part it holds (:func:`assign`);
- every other piece (a unit's own code, a LayerNorm, an activation) is taken by one rank, round-robin
  in plan order, and its parameters are gathered for that piece alone;
- where several ranks hold the same rows (a 2-D mesh: the tensor parallel ranks of one FSDP2 shard, or the
  FSDP2 ranks of one tensor parallel shard), those replicas take turns at the unit's pieces.

Every rank computes the same plan: the assignment needs no message but, with replicas, one exchange of the
ranks' splits (:func:`gradwatch.watch.shard_check.replicas`).

Example:
    >>> from gradwatch.plan.cycle import Piece
    >>> pieces = [Piece("attn"), Piece("head", (0, 256)), Piece("norm")]
    >>> [(str(p), offset) for p, offset in assign(pieces, {"head": Holding(1000, rank=0, world=2)}, rank=0, world=2)]
    [('attn', 0), ('head[0:256]', 0)]
    >>> [(str(p), offset) for p, offset in assign(pieces, {"head": Holding(1000, rank=1, world=2)}, rank=1, world=2)]
    [('norm', 0)]
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

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


class Holding(NamedTuple):
    """How a unit's rows are held: ``rows`` split on dim 0 over ``world`` ranks (this one holds its ``rank``'s share,
    :func:`rows_held`), and ``replicas`` ranks holding that same share (this one the ``replica``-th of them)."""

    rows: int
    rank: int = 0
    world: int = 1
    replica: int = 0
    replicas: int = 1


def assign(pieces: Sequence[Piece], held: Mapping[str, Holding], rank: int, world: int) -> List[Tuple[Piece, int]]:
    """This rank's pieces, each with the offset of the rows it holds (0 for a piece checked whole).

    Args:
        pieces: The check's pieces, the same on every rank (:meth:`gradwatch.plan.planner.Planner.module_pieces`).
        held: Unit name -> how its rows are held (:class:`Holding`), for the units checked on the ranks that hold
            their rows (a Linear or an Embedding whose weight is sharded on dim 0). Where several ranks hold the same
            rows (their replicas), they take turns at its pieces.
        rank: This rank (of the process group).
        world: The process group's size: every rank takes its turn at the pieces checked whole.

    Example:
        >>> assign([Piece("fc")], {"fc": Holding(5, rank=1, world=2)}, rank=1, world=2)
        [(Piece(unit='fc', rows=(3, 5)), 3)]
        >>> both = Holding(8, replicas=2)  # every row on both ranks (a 2-D mesh's replicas): one each in turn
        >>> [[str(p) for p, _ in assign([Piece("fc", (0, 4)), Piece("fc", (4, 8))], {"fc": both._replace(replica=r)},
        ...                             rank=r, world=2)] for r in (0, 1)]
        [['fc[0:4]'], ['fc[4:8]']]
    """
    out: List[Tuple[Piece, int]] = []
    turn = 0
    turns: Dict[str, int] = {}  # per unit held by replicas: its pieces so far
    for piece in pieces:
        holding = held.get(piece.unit)
        if holding is None:
            if turn % world == rank:
                out.append((piece, 0))
            turn += 1
            continue
        if holding.replicas > 1:
            seen = turns.get(piece.unit, 0)
            turns[piece.unit] = seen + 1
            if seen % holding.replicas != holding.replica:
                continue
        lo, hi = piece.rows if piece.rows is not None else (0, holding.rows)
        first, end = rows_held(holding.rows, holding.rank, holding.world)
        part: Optional[Tuple[int, int]] = (max(lo, first), min(hi, end))
        if part is not None and part[0] < part[1]:
            out.append((Piece(piece.unit, part), first))
    return out
