"""What each rank sends after its share of a check, and the one report every rank merges from them.

:class:`RankResult` travels to every rank at the gather (:meth:`~gradwatch.parallel.coordinator.DistributedCoordinator.gather`);
:func:`merge_reports` makes one :class:`CheckReport` of the ranks' reports (the worse verdict of each tensor) and
:func:`slow_ranks` names a rank whose own work ran much slower than the others'. The same on every rank, as every rank
has them all (:func:`gradwatch.parallel.coordinator.merge_results` puts them together).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from gradwatch.check.independence.report import merge_ranks
from gradwatch.check.judging.report import CheckReport, TensorCheck, worse


@dataclasses.dataclass
class RankResult:
    """What one rank sends after its share of a check.

    Attributes:
        rank: The sender.
        report: Its share's :class:`CheckReport` (None when it checked nothing or its check raised).
        error: ``"Type: message"`` of the exception its check raised, if any.
        where: What raised it (``"loss_fn"``...; see :func:`gradwatch.errors.blamed`).
        seconds: How long its check took.
        interval: Its schedule's next interval (rank 0's is the one every rank follows).
        training: ``(replayed, reason)`` of its training part; None when that part did not run.
        waited: Of ``seconds``, how long it waited for the other ranks at agreement points
            (:mod:`gradwatch.parallel.lockstep`).
        cut: Sketches of its replayed micro-batches' gradients (:mod:`gradwatch.parallel.step_objective`), or None.
        replicas: ``{name: 64-bit hash}`` of its replicated parameters (DDP), or None
            (:func:`gradwatch.watch.parts.update.replica_hashes`).

    Example:
        >>> RankResult(rank=1, error="KeyError: 'labels'").failed
        True
    """

    rank: int
    report: Optional[CheckReport] = None
    error: Optional[str] = None
    where: Optional[str] = None
    seconds: float = 0.0
    interval: int = 1
    training: Optional[Tuple[bool, Optional[str]]] = None
    waited: float = 0.0
    cut: Optional[List[torch.Tensor]] = None
    replicas: Optional[Dict[str, int]] = None

    @property
    def failed(self) -> bool:
        """True when this rank's check raised."""
        return self.error is not None


#: A rank whose check took this many times the fastest rank's, and at least SLOW_SECONDS more, is named as slow
#: (low enough that a stall of a good part of a check's own work is named).
SLOW_FACTOR, SLOW_SECONDS = 1.5, 1.0


def slow_ranks(results: Sequence[RankResult]) -> Optional[str]:
    """A note naming the ranks whose own work in a check (its time, less its waits for the others) ran much
    slower than the fastest rank's (None: none did).

    Example:
        >>> slow_ranks([RankResult(0, seconds=3.6, waited=3.1), RankResult(1, seconds=3.5)])
        'rank 1 ran slow in this check: 3.5 s of its own, against 0.5 s on rank 0 (every rank waits for the slowest)'
        >>> slow_ranks([RankResult(0, seconds=0.5), RankResult(1, seconds=0.7)]) is None
        True
        >>> slow_ranks([RankResult(0, seconds=8.0), RankResult(1, seconds=8.1, waited=3.0)])[:42]
        'rank 0 ran slow in this check: 8.0 s of it'
        >>> slow_ranks([RankResult(0, seconds=6.0), RankResult(1, seconds=5.0)]) is None  # 1.2x: shares differ
        True
    """
    if len(results) < 2:
        return None
    own = {r.rank: max(0.0, r.seconds - r.waited) for r in results}
    fastest = min(own, key=lambda rank: own[rank])
    slow = [rank for rank, t in own.items() if t > SLOW_FACTOR * own[fastest] and t - own[fastest] >= SLOW_SECONDS]
    if not slow:
        return None
    return (f"rank{'s' if len(slow) > 1 else ''} {', '.join(map(str, slow))} ran slow in this check: "
            f"{', '.join(f'{own[rank]:.1f} s' for rank in slow)} of its own, against {own[fastest]:.1f} s on rank "
            f"{fastest} (every rank waits for the slowest)")


def _worse(a: Any, b: Any) -> bool:
    """True when training verdict ``a`` is worse than ``b``: failed first, then the larger judged difference
    (a verdict with no figure, NaN, counts as the worst).

    Example:
        >>> from gradwatch.check.judging.report import TrainingCheck
        >>> _worse(TrainingCheck("w", (2,), judged_rel_diff=0.5), TrainingCheck("w", (2,), judged_rel_diff=0.0))
        True
    """
    def key(t: Any) -> Tuple[bool, float]:
        value = float(t.judged_rel_diff)
        return bool(t.failed), math.inf if value != value else value

    return key(a) > key(b)


def merge_reports(reports: Sequence[Any], order: Sequence[str], opts: Any) -> CheckReport:
    """One :class:`CheckReport` from the per-rank reports of one check (``[(rank, report), ...]``).

    Tensors come in ``order``, each with the worse of the ranks' verdicts on it
    (:func:`~gradwatch.check.judging.report.worse`); the objective and terms are rank 0's (each rank
    evaluates its own batch), unless some rank's objective is not finite;
    evaluations add up; seconds is the slowest rank's.
    """
    ranked = sorted(reports, key=lambda rr: rr[0])
    first = ranked[0][1]
    tensors: Dict[str, TensorCheck] = {}
    for name in order:  # ranks that judged other rows of one tensor (pieces split, FSDP2 shards): the worse verdict
        for _, r in ranked:
            if name in r.tensors:
                tensors[name] = worse(tensors.get(name), r.tensors[name])
    for _, r in ranked:  # anything not in order (should not happen), after
        for name, t in r.tensors.items():
            tensors.setdefault(name, t)
    bad = next((r for _, r in ranked if not math.isfinite(r.objective)), None)
    source = bad if bad is not None else first
    merged = CheckReport(
        tensors=tensors,
        fail_at=first.fail_at,
        dtype=first.dtype,
        objective=source.objective,
        terms=dict(source.terms),
        evaluations=sum(r.evaluations for _, r in ranked),
        seconds=max(r.seconds for _, r in ranked),
        seed=first.seed,
        nondeterministic=any(r.nondeterministic for _, r in ranked),
        nonfinite=any(r.nonfinite for _, r in ranked),
    )
    merged.form, merged.memory = first.form, dict(first.memory)
    merged.independence = merge_ranks([(rank, r.independence) for rank, r in ranked])  # every rank's batch
    for _, r in ranked:
        for name, tc in r.training.items():  # each rank's verdict on its shard (FSDP2 shard by shard): the worst
            have = merged.training.get(name)
            if have is None or _worse(tc, have):
                merged.training[name] = tc
        merged.training_note = merged.training_note or r.training_note
        merged.probed.extend(r.probed)  # the module form: each rank probed its share of the pieces
        merged.pieces.extend(r.pieces)
        for unit, (seconds, rows) in r.piece_seconds.items():  # parts of one unit on several ranks: summed
            merged.spent(unit, seconds, rows)
        for note in r.notes:
            if note not in merged.notes:
                merged.notes.append(note)
        for term, checks in r.term_checks.items():
            merged.term_checks.setdefault(term, {}).update(checks)
        merged.localized.extend(r.localized)
    return merged


__all__ = ["SLOW_FACTOR", "SLOW_SECONDS", "RankResult", "merge_reports", "slow_ranks"]
