"""What each piece of the module form costs to check, learned from the checks so far (seconds, pure state).

Sharded or under DDP, the ranks split a check's pieces (:func:`gradwatch.plan.shards.assign`); a split by count
leaves one rank with an attention's own code and an LM head's rows while another checks two LayerNorms, and every
rank then waits for the slowest at the check's end. :class:`PieceCosts` keeps each unit's measured seconds (per row
for a block of rows) from the merged report every rank records alike, so that every rank computes the same split,
balanced by what the pieces cost, with no message. A unit never measured yet costs what a measured piece costs on
average (1 before any).

Example:
    >>> from gradwatch.plan.cycle import Piece
    >>> costs = PieceCosts()
    >>> costs(Piece("attn")), costs(Piece("head", (0, 100)))
    (1.0, 1.0)
    >>> costs.record([("attn", None, 0.2), ("head", (0, 100), 0.5)])
    >>> costs(Piece("attn")), costs(Piece("head", (100, 150))), costs(Piece("norm"))
    (0.2, 0.25, 0.35)
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

from gradwatch.plan.cycle import Piece

#: The weight of the newest measurement of a piece against what was known of it (an exponential mean).
NEWEST = 0.5


class PieceCosts:
    """Seconds a piece's check takes: each unit's whole, or per row of a block, averaged over the checks.

    Every rank must hold the same figures (they decide the split of the pieces): record only what every rank
    knows alike, the merged report's :attr:`~gradwatch.check.judging.report.CheckReport.piece_seconds`.
    """

    def __init__(self) -> None:
        self._seconds: Dict[Tuple[str, bool], float] = {}  # (unit, by rows) -> seconds (per row when by rows)
        self._typical = 1.0  # a measured piece's mean seconds, for a unit not measured yet

    def record(self, measured: Iterable[Tuple[str, Optional[Tuple[int, int]], float]]) -> None:
        """``(unit, rows or None, seconds)`` of each piece a check checked."""
        seen = []
        for unit, rows, seconds in measured:
            seen.append(float(seconds))
            key, value = (unit, rows is not None), float(seconds)
            if rows is not None:
                value /= max(1, rows[1] - rows[0])
            old = self._seconds.get(key)
            self._seconds[key] = value if old is None else (1 - NEWEST) * old + NEWEST * value
        if seen:
            self._typical = sum(seen) / len(seen)

    def known(self) -> List[Tuple[str, bool, float]]:
        """``(unit, by rows, seconds)`` of every unit measured (seconds per row when by rows), sorted: what every rank
        must hold alike."""
        return sorted((unit, rows, seconds) for (unit, rows), seconds in self._seconds.items())

    def __call__(self, piece: Piece) -> float:
        """The piece's expected seconds."""
        known = self._seconds.get((piece.unit, piece.rows is not None))
        if known is None:
            return self._typical
        return known * (piece.rows[1] - piece.rows[0]) if piece.rows is not None else known


__all__ = ["NEWEST", "PieceCosts"]
