"""Which rank checks which piece of a sharded model (FSDP2, tensor parallel DTensors): pure functions of the plan and the layout.

FSDP2's ``fully_shard`` splits every parameter on dim 0 as ``torch.chunk`` does: rank ``r`` of ``W``
holds rows ``r * c`` to ``(r + 1) * c`` (``c = ceil(rows / W)``; the last ranks may hold fewer or none).
A Linear's output rows depend on its own weight and bias rows only, and an Embedding's token rows
likewise, so a slice of them is checked on the rank that holds it, with no gather:

- a piece of such a unit (a block of rows, or the whole unit) is cut at the shard bounds, and each rank
  takes the part it holds (:func:`assign`);
- every other piece (a unit's own code, a LayerNorm, an activation) is taken by one rank (the dearest
  first, each to the least loaded rank, by the costs :class:`gradwatch.plan.costs.PieceCosts` learned; without
  costs, round-robin in plan order), and its parameters are gathered for that piece alone.

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
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

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
           turns: Optional[Tuple[int, int]] = None, cost: Optional[Callable[[Piece], float]] = None
           ) -> List[Tuple[Piece, int]]:
    """This rank's pieces, each with the offset of the rows it holds (0 for a piece checked whole), in plan order.

    Args:
        pieces: The check's pieces, the same on every rank (:meth:`gradwatch.plan.planner.Planner.module_pieces`).
        held: Unit name -> its rows, for the units checked on the ranks that hold their rows (a Linear or an
            Embedding whose weight is sharded on dim 0).
        rank: This rank.
        world: Ranks the parameters are sharded over.
        turns: ``(rank, world)`` of the split of the pieces checked whole (default: ``(rank, world)``); the process
            group's, where the rows are sharded over a smaller mesh (tensor parallel inside a 2-D mesh).
        cost: ``cost(piece) -> seconds``, the same on every rank (:class:`gradwatch.plan.costs.PieceCosts`): the
            pieces checked whole go, dearest first, each to the rank with the least to do so far, the rows each
            rank holds counted (where they are held over the same ranks); None: round-robin in plan order.

    Example:
        >>> assign([Piece("fc")], {"fc": 5}, rank=1, world=2)
        [(Piece(unit='fc', rows=(3, 5)), 3)]
        >>> cost = {"attn": 3.0, "ln1": 1.0, "ln2": 1.0, "fc": 0.5}.get
        >>> plan = [Piece("ln1"), Piece("attn"), Piece("ln2"), Piece("fc", (0, 4))]
        >>> [str(p) for p, _ in assign(plan, {"fc": 4}, 0, 2, cost=lambda p: cost(p.unit))]
        ['attn', 'fc[0:2]']
        >>> [str(p) for p, _ in assign(plan, {"fc": 4}, 1, 2, cost=lambda p: cost(p.unit))]
        ['ln1', 'ln2', 'fc[2:4]']
    """
    mine, everyone = turns if turns is not None else (rank, world)
    whole = [i for i, piece in enumerate(pieces) if piece.unit not in held]
    taken = set(whole[mine::everyone]) if cost is None else set(_balanced(pieces, whole, held, world, everyone, mine, cost))
    out: List[Tuple[Piece, int]] = []
    for i, piece in enumerate(pieces):
        rows = held.get(piece.unit)
        if rows is None:
            if i in taken:
                out.append((piece, 0))
            continue
        first, end = rows_held(rows, rank, world)
        part = _part(piece, rows, first, end)
        if part is not None:
            out.append((Piece(piece.unit, part), first))
    return out


def _part(piece: Piece, rows: int, first: int, end: int) -> Optional[Tuple[int, int]]:
    """The rows ``first:end`` of a unit of ``rows`` rows hold of ``piece`` (None: none)."""
    lo, hi = piece.rows if piece.rows is not None else (0, rows)
    part = (max(lo, first), min(hi, end))
    return part if part[0] < part[1] else None


def _balanced(pieces: Sequence[Piece], whole: Sequence[int], held: Mapping[str, int], world: int, everyone: int,
              mine: int, cost: Callable[[Piece], float]) -> List[int]:
    """The indices of the whole pieces rank ``mine`` of ``everyone`` takes: dearest first, each to the least loaded
    rank (the lowest of equals), each rank's held rows counted first where they are held over the same ranks."""
    load = [0.0] * everyone
    if world == everyone:
        for piece in pieces:
            rows = held.get(piece.unit)
            if rows is None:
                continue
            for r in range(world):
                part = _part(piece, rows, *rows_held(rows, r, world))
                load[r] += cost(Piece(piece.unit, part)) if part is not None else 0.0
    taken = []
    for i in sorted(whole, key=lambda i: -cost(pieces[i])):  # a stable sort: plan order among equals
        r = min(range(everyone), key=lambda r: (load[r], r))
        load[r] += cost(pieces[i])
        if r == mine:
            taken.append(i)
    return taken
