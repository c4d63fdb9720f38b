"""Which rank checks which piece of a sharded model (FSDP2, tensor parallel DTensors): pure functions of the plan and the layout.

FSDP2's ``fully_shard`` splits every parameter on dim 0 as ``torch.chunk`` does: rank ``r`` of ``W``
holds rows ``r * c`` to ``(r + 1) * c`` (``c = ceil(rows / W)``; the last ranks may hold fewer or none).
A Linear's output rows depend on its own weight and bias rows only, and an Embedding's token rows
likewise, so a slice of them is checked on the rank that holds it, with no gather:

- a piece of such a unit (a block of rows, or the whole unit) is cut at the shard bounds, and each rank
  takes the part it holds (:func:`assign`);
- every other piece (a unit's own code, a LayerNorm, an activation) is taken by one rank, and its parameters are
  gathered for that piece alone: round-robin in plan order, or, once earlier checks measured what each unit's
  pieces cost (``costs``), the costliest first, each to the rank with the least work so far, the rows it checks
  counted (:func:`owners`); either way ``loss_fn``'s own code and the root's go to different ranks
  (:data:`OUTPUT_HOLDERS`: each needs a capture forward of its own, which every rank makes);
- where several ranks hold the same rows (a 2-D mesh: the tensor parallel ranks of one FSDP2 shard, or the
  FSDP2 ranks of one tensor parallel shard), those replicas take turns at the unit's pieces, the turn running on
  from one such unit to the next (with per-unit turns, a check of 5 blocks of the embedding, the head and ``fc1``
  gave rank 0 three of each, and far more time of row groups than rank 1: docs/costs.md).

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
from statistics import median_high
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from gradwatch.plan.cycle import Piece
from gradwatch.plan.units import LOSS_FN


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


#: What earlier checks measured: unit name -> ``(seconds, rows)`` (rows 0: checked whole), as in
#: :attr:`gradwatch.check.judging.report.CheckReport.piece_seconds`.
Costs = Mapping[str, Tuple[float, int]]


def repeated(unit: str) -> str:
    """``unit``'s name with its indices in a module list starred: the units of repeated blocks share it.

    Example:
        >>> repeated("blocks.3.attn.q"), repeated("layers.10"), repeated("head")
        ('blocks.*.attn.q', 'layers.*', 'head')
    """
    return ".".join("*" if part.isdigit() else part for part in unit.split("."))


def piece_cost(costs: Costs, unit: str, rows: Optional[int]) -> float:
    """Seconds a piece of ``unit`` is likely to take: its last measured time, per row for ``rows`` rows of a unit
    measured by rows (a piece checked whole: the whole time); for a unit never measured, the mean of the measured
    units of the same name in other repeated blocks (:func:`repeated`: ``blocks.1.fc1`` for ``blocks.2.fc1``), else
    the median of the measured ones (per row for ``rows``), 1.0 a piece where none is; none for no rows.

    Example:
        >>> costs = {"fc": (0.4, 200), "attn": (0.3, 0), "blocks.0.ln": (0.02, 0)}
        >>> piece_cost(costs, "fc", 50), piece_cost(costs, "attn", None), piece_cost(costs, "ln", None)
        (0.1, 0.3, 0.3)
        >>> piece_cost(costs, "fc2", 100)  # never measured: fc's per row
        0.2
        >>> piece_cost(costs, "blocks.1.ln", None)  # another block's
        0.02
    """
    if rows == 0:
        return 0.0
    if unit in costs:
        seconds, measured = costs[unit]
        return seconds * rows / measured if rows is not None and measured else seconds
    key = repeated(unit)
    if key != unit:
        alike = [(s, r) for u, (s, r) in costs.items() if repeated(u) == key and (rows is None) == (not r)]
        if alike:
            if rows is None:
                return sum(s for s, _ in alike) / len(alike)
            return sum(s / r for s, r in alike) / len(alike) * rows
    if rows is None:
        typical = [s for s, r in costs.values() if not r]
        return median_high(typical) if typical else 1.0
    per_row = [s / r for s, r in costs.values() if r]
    return median_high(per_row) * rows if per_row else 1.0


#: The units whose inputs hold the model's output: ``loss_fn``'s own code (the model a stub returning it) and the
#: root module's own code (the outputs of the modules it calls, the last one's included). A language model's logits
#: put each over the capture's budget alone, so each is copied by a capture forward of its own, which every rank makes
#: in step (:mod:`gradwatch.check.modules.capture`): checked on different ranks, they share one such forward.
OUTPUT_HOLDERS = (LOSS_FN, "")


def owners(pieces: Sequence[Piece], held: Mapping[str, Holding], world: int, costs: Costs) -> Dict[int, int]:
    """Which rank checks each piece that is checked whole (index in ``pieces`` -> rank), by cost
    (:func:`piece_cost`): each rank starts with the rows it holds of the pieces checked by rows (spread evenly
    where replicas share them); the pieces of :data:`OUTPUT_HOLDERS` go first, each to a rank that has fewest of
    them (then the least load); then the other whole pieces, costliest first, go each to the rank with the least so
    far (the lowest on a tie). Every rank computes the same from the same ``costs`` (the merged report's).

    Example:
        >>> costs = {"attn": (0.3, 0), "block": (0.2, 0), "ln": (0.05, 0), "fc": (0.4, 8)}
        >>> pieces = [Piece("attn"), Piece("ln"), Piece("block"), Piece("fc", (0, 4))]
        >>> owners(pieces, {"fc": Holding(8, world=2)}, 2, costs)  # rank 0 holds fc's rows 0:4 (0.2 s)
        {0: 1, 2: 0, 1: 1}
    """
    load = [0.0] * world
    free: List[Tuple[float, int]] = []
    for i, piece in enumerate(pieces):
        holding = held.get(piece.unit)
        if holding is None:
            free.append((piece_cost(costs, piece.unit, None), i))
            continue
        lo, hi = piece.rows if piece.rows is not None else (0, holding.rows)
        if holding.world == world and holding.replicas == 1:  # split over every rank: rank j holds the j-th rows
            for j in range(world):
                first, end = rows_held(holding.rows, j, world)
                load[j] += piece_cost(costs, piece.unit, max(0, min(hi, end) - max(lo, first)))
        else:
            for j in range(world):
                load[j] += piece_cost(costs, piece.unit, hi - lo) / world
    out: Dict[int, int] = {}
    holders = [0] * world  # output holders per rank
    for cost, i in sorted(free, key=lambda ci: (pieces[ci[1]].unit not in OUTPUT_HOLDERS, -ci[0], ci[1])):
        if pieces[i].unit in OUTPUT_HOLDERS:
            least = min(range(world), key=lambda j: (holders[j], load[j], j))
            holders[least] += 1
        else:
            least = min(range(world), key=lambda j: (load[j], j))
        out[i] = least
        load[least] += cost
    return out


def assign(pieces: Sequence[Piece], held: Mapping[str, Holding], rank: int, world: int,
           costs: Optional[Costs] = None) -> List[Tuple[Piece, int]]:
    """This rank's pieces, each with the offset of the rows it holds (0 for a piece checked whole).

    Args:
        pieces: The check's pieces, the same on every rank (:meth:`gradwatch.plan.planner.Planner.module_pieces`).
        held: Unit name -> how its rows are held (:class:`Holding`), for the units checked on the ranks that hold
            their rows (a Linear or an Embedding whose weight is sharded on dim 0). Where several ranks hold the same
            rows (their replicas), they take turns at its pieces, the turn running on to the next such unit.
        rank: This rank (of the process group).
        world: The process group's size: every rank takes its turn at the pieces checked whole.
        costs: What earlier checks measured (:data:`Costs`): the pieces checked whole are shared out by cost
            (:func:`owners`) instead of in turn.

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
    shared = 0  # pieces of units held by replicas so far
    chosen = owners(pieces, held, world, costs) if costs else None
    holders = 0  # in turn too, the output holders each to another rank
    for i, piece in enumerate(pieces):
        holding = held.get(piece.unit)
        if holding is None:
            if chosen is not None:
                mine = chosen[i] == rank
            elif piece.unit in OUTPUT_HOLDERS:
                mine, holders = holders % world == rank, holders + 1
            else:
                mine = turn % world == rank
            if mine:
                out.append((piece, 0))
            turn += 1
            continue
        if holding.replicas > 1:  # in turn over every replicated unit's pieces: an odd count starts the next unit
            seen, shared = shared, shared + 1  # on another replica, so none takes every unit's extra piece
            if seen % holding.replicas != holding.replica:
                continue
        lo, hi = piece.rows if piece.rows is not None else (0, holding.rows)
        first, end = rows_held(holding.rows, holding.rank, holding.world)
        part: Optional[Tuple[int, int]] = (max(lo, first), min(hi, end))
        if part is not None and part[0] < part[1]:
            out.append((Piece(piece.unit, part), first))
    return out
