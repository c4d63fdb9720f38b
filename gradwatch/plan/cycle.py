"""The cycle: which pieces each check covers, so that every unit and every row is probed within K checks.

Pure functions of the units and a seed. A unit is checked whole, or, when it has a parameter of many
rows (a Linear's output rows, an Embedding's token rows), in slices of at most
:data:`ROWS_PER_SLICE` rows: small enough that an error in a few rows stands above the noise of
the slice's random directions. Each check takes

- the next ``per_check`` whole units in model order (when ``per_check`` is 0: all of them where nothing is
  sliced, else as many as spread them evenly over the K checks the slices take), and
- from each sliced unit, the next ``ceil(slices / K)`` of its slices, in an order shuffled afresh
  at each pass (drawn without replacement: a pass probes every slice once),

where ``K`` (:attr:`Cycle.length`) is the number of checks in which every piece is probed once:
``max(ceil(whole units / per_check), CHECKS_PER_PASS)`` when slices exist, else
``ceil(whole units / per_check)``.

Example:
    >>> cycle = Cycle({"a": None, "b": None, "head": 1000}, per_check=0, seed=0)
    >>> cycle.length, [str(p) for p in cycle.pieces(0)], [str(p) for p in cycle.pieces(1)]
    (4, ['a', 'head[0:250]'], ['b', 'head[250:500]'])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch

#: Rows of one slice at most (a 20% error in 4 of 256 rows moves a dense directional derivative by ~2.5%).
ROWS_PER_SLICE = 256
#: Checks in one pass over the slices of the largest sliced unit (fewer when no unit has that many); a paced cycle
#: spreads its whole units over this many checks at most.
CHECKS_PER_PASS = 8
#: A paced cycle (one process): training steps a check's pieces may take (the ``pace`` option's default); the whole
#: units a check holds are then as many as fitted that time.
PIECE_STEPS = 2.0
#: ... and never fewer seconds than this ...
PACED_SECONDS = 0.1
#: ... where a training step takes this long at least: a small model's check costs less than a person notices
#: however many of its steps, and a test's small model on a loaded machine is not paced by chance (the pace is a
#: ratio of two times the load moves alike; a higher absolute floor paced a test's small model under a test suite's
#: workers: docs/costs.md, "A paced cycle").
PACED_STEP_SECONDS = 0.02
#: A paced cycle with row slices: the share of what its check held that each check is planned to hold (the rest of
#: its time takes the pieces owed by the checks before).
PACE_SHARE = 0.75


def fewest_whole(units: int) -> int:
    """Whole units a check takes at the least: the cycle spreads them over :data:`CHECKS_PER_PASS` checks at most.

    Example:
        >>> fewest_whole(117), fewest_whole(3)
        (15, 1)
    """
    return max(1, math.ceil(units / CHECKS_PER_PASS))


@dataclass(frozen=True)
class Piece:
    """One unit, or one block of its rows, to check.

    Example:
        >>> str(Piece("lm_head", (0, 256)))
        'lm_head[0:256]'
    """

    unit: str
    rows: Optional[Tuple[int, int]] = None

    def __str__(self) -> str:
        return self.unit if self.rows is None else f"{self.unit}[{self.rows[0]}:{self.rows[1]}]"


def next_pass(checks: int, cycle: Optional[int]) -> Optional[int]:
    """For a part that runs once a pass of K checks: None when the check that follows ``checks`` checks is the first
    of a pass (or K is 1 or not known yet: every check), else the number of the check that begins the next pass.

    Example:
        >>> [next_pass(n, 4) for n in range(6)], next_pass(3, None)
        ([None, 4, 4, 4, None, 8], None)
    """
    if cycle is None or cycle <= 1 or checks % cycle == 0:
        return None
    return checks + cycle - checks % cycle


def row_slices(rows: int, per_slice: int = ROWS_PER_SLICE) -> List[Tuple[int, int]]:
    """Blocks of at most ``per_slice`` rows covering ``rows``, of near-equal size.

    Example:
        >>> row_slices(600)
        [(0, 200), (200, 400), (400, 600)]
    """
    count = max(1, math.ceil(rows / per_slice))
    bounds = [round(i * rows / count) for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(count)]


def _shuffled(n: int, seed: int) -> List[int]:
    gen = torch.Generator().manual_seed(int(seed) % (2**63))
    return torch.randperm(n, generator=gen).tolist()


class Cycle:
    """Which pieces check number ``i`` covers (a pure function of ``i``).

    Args:
        units: Unit name -> rows to slice it by (None: checked whole), in model order.
        per_check: Whole units per check (``tensors_per_check``; 0: all of them where no unit is sliced, else
            spread evenly over the checks a pass of the slices takes).
        seed: The watch's seed (the slices' order in each pass follows it).
        per_slice: Unit name -> rows of one of its slices, where fewer than :data:`ROWS_PER_SLICE` fit the room.
        checks: Where units are sliced, K is at least this many checks (a paced cycle whose check could not hold a
            pass's :data:`CHECKS_PER_PASS`-th: its slices and whole units are spread over more checks).

    Example:
        >>> Cycle({"a": None, "head": 1000}, checks=8).length, Cycle({"a": None, "head": 1000}, checks=8).take
        (8, {'head': 1})
    """

    def __init__(self, units: Mapping[str, Optional[int]], per_check: int = 0, seed: int = 0,
                 per_slice: Optional[Mapping[str, int]] = None, checks: int = 0) -> None:
        size = {n: max(1, min(ROWS_PER_SLICE, (per_slice or {}).get(n, ROWS_PER_SLICE))) for n in units}
        self.whole = [n for n, rows in units.items() if rows is None or rows <= size[n]]
        self.slices: Dict[str, List[Tuple[int, int]]] = {
            n: row_slices(rows, size[n]) for n, rows in units.items() if rows is not None and rows > size[n]}
        most = max((len(s) for s in self.slices.values()), default=0)
        passes = max(min(CHECKS_PER_PASS, most), checks if most else 0)
        if per_check <= 0 and passes > 1:
            # The slices take K checks anyway: the whole units are spread over the same K, each checked once a
            # pass, instead of all of them at every check (a check then costs about a K-th of a pass).
            per_check = math.ceil(len(self.whole) / passes)
        self.per_check = per_check if 0 < per_check < len(self.whole) else max(1, len(self.whole))
        self.seed = seed
        whole_checks = math.ceil(len(self.whole) / self.per_check) if self.whole else 1
        self.length = max(whole_checks, passes) if most else whole_checks
        self.take = {n: math.ceil(len(s) / self.length) for n, s in self.slices.items()}

    @property
    def pass_size(self) -> int:
        """Pieces in one pass: every whole unit and every slice.

        Example:
            >>> Cycle({"a": None, "head": 1000}).pass_size
            5
        """
        return len(self.whole) + sum(len(s) for s in self.slices.values())

    def pieces(self, i: int) -> List[Piece]:
        """The pieces of check ``i`` (0, 1, ...): whole units first, then slices, in model order of units."""
        pass_no, at = divmod(int(i), self.length)
        out: List[Piece] = []
        if self.whole:
            start = (at * self.per_check) % len(self.whole)
            chosen = set((start + j) % len(self.whole) for j in range(min(self.per_check, len(self.whole))))
            out += [Piece(n) for j, n in enumerate(self.whole) if j in chosen]
        for unit_no, (n, blocks) in enumerate(self.slices.items()):
            order = _shuffled(len(blocks), self.seed * 1_000_003 + pass_no * 7919 + unit_no)
            take = self.take[n]
            out += [Piece(n, blocks[k]) for k in order[at * take:(at + 1) * take]]
        return out

    def describe(self) -> str:
        """One line: how many units, slices and checks make a pass.

        Example:
            >>> Cycle({"a": None, "head": 1000}).describe()
            '1 unit whole and 4 slices of 1 big unit, probed within K = 4 checks'
        """
        sliced = sum(len(s) for s in self.slices.values())
        whole = f"{len(self.whole)} unit{'s' if len(self.whole) != 1 else ''} whole"
        big = f" and {sliced} slices of {len(self.slices)} big unit{'s' if len(self.slices) != 1 else ''}" if sliced else ""
        return f"{whole}{big}, probed within K = {self.length} checks"
