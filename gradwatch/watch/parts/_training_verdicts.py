"""The training part's verdicts: each watched tensor's live ``.grad`` judged against the replayed gradient.

:class:`Verdicts` is the :class:`~gradwatch.watch.parts.training.TrainingPart`'s judging: the replayed gradients made
comparable with the live ``.grad`` (averaged over the ranks under ZeRO, reduced with it where a sequence-parallel
``.grad`` is a partial sum, this rank's partition or shard of both), each tensor judged
(:func:`~gradwatch.check.judging.training_judge.judge_training`, a fused expert tensor expert by expert), and what
explains a failure named in the notes: a partial accumulation window, a step cut otherwise, a term weighted otherwise.
Distributed, the replays are averaged over the ranks and rank 0's verdicts taken everywhere (:meth:`Verdicts.
judge_across_ranks`).

Example:
    >>> scale = LazyScale({"w": torch.ones(4)})
    >>> scale(), scale.value
    (1.0, 1.0)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, cast

import torch
from torch import nn

from gradwatch.check.judging.report import CheckReport, TrainingCheck
from gradwatch.check.judging.training_judge import compute_dtype, gradient_scale, judge_training
from gradwatch.check.probes.experts import by_expert
from gradwatch.check.replay.reference import Replay
from gradwatch.check.replay.rows import Differentiated
from gradwatch.check.replay.window import PartialWindow
from gradwatch.errors import first_line
from gradwatch.parallel.shard_check import is_partial, local, settled_pairs
from gradwatch.parallel.sharded import is_dtensor
from gradwatch.parallel.step_objective import StepObjective, StepPlan
from gradwatch.parallel.zero import is_partitioned, loss_scale, whole_grad, zero_part
from gradwatch.watch.parts._accumulation import AccumulationWindow
from gradwatch.watch.parts._term_weights import Again, TermWeights
from gradwatch.watch.parts.context import WatchContext

Lives = Dict[str, Optional[torch.Tensor]]
#: What each tensor was judged on: ``{name: (the tensor or its judged rows, the dtype training computed in)}``.
Judged = Dict[str, Tuple[torch.Tensor, torch.dtype]]


class LazyScale:
    """The replayed gradients' scale (:func:`~gradwatch.check.judging.training_judge.gradient_scale`), computed at
    the first call only: only where some tensor's ``.grad`` is not bitwise the replayed gradient. ``grads`` is read
    then, as the judge left it (reduced, averaged, partitioned)."""

    def __init__(self, grads: Dict[str, torch.Tensor]) -> None:
        self.grads = grads
        self.value: Optional[float] = None

    def __call__(self) -> float:
        if self.value is None:
            self.value = gradient_scale(list(self.grads.values()))
        return self.value


@dataclasses.dataclass
class References:
    """The replayed gradients made comparable with the live ``.grad`` (:meth:`Verdicts._references`).

    Attributes:
        zero: Whether ZeRO holds the gradients (shard by shard).
        zero_scale: ZeRO's loss scale (1.0: none).
        wholes: ZeRO 1 and 2: the step's whole gradient of each tensor ZeRO does not partition.
        partial: The tensors whose ``.grad`` is a partial sum (sequence parallel's norms).
        reduced: Theirs, ``{name: (the live .grad, the replayed gradient)}``, reduced together.
    """

    zero: bool
    zero_scale: float
    wholes: Dict[str, Optional[torch.Tensor]]
    partial: List[str]
    reduced: Dict[str, Tuple[torch.Tensor, torch.Tensor]]

    def on_rank(self, n: str, p: torch.Tensor, grads: Dict[str, torch.Tensor]
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(the tensor, its live .grad)`` this rank judges of ``n`` (``p``: its parameter), against ``grads[n]``."""
        live = p.grad
        if is_partitioned(p):  # ZeRO-3: this rank's partition of the parameter, of ZeRO's gradient, of the replay's
            p, live, grads[n] = zero_part(p, grads[n], self.zero_scale)
        elif n in self.wholes:
            live = self.wholes[n]
        elif is_dtensor(p):  # sharded: this rank's shard of both (the ranks' verdicts are merged, worst first)
            live = None if live is None else self.reduced[n][0] if n in self.partial else local(live)
            p = local(p)
        return p, live


class Verdicts:
    """The :class:`~gradwatch.watch.parts.training.TrainingPart`'s verdicts (a mixin: the attributes below are the
    part's)."""

    watch: WatchContext
    step_objective: StepObjective
    window: AccumulationWindow
    terms: TermWeights
    read_directly: Set[str]
    counts: Dict[str, int]
    params: Callable[..., Dict[str, torch.Tensor]]
    _again: Optional[Tuple[Again, nn.Module, Differentiated, int]]

    def judge(self, report: CheckReport, replay: Optional[Replay], grads: Optional[Dict[str, torch.Tensor]] = None,
              rows: Optional[List[torch.Tensor]] = None) -> None:
        """Judge every watched tensor's live ``.grad`` against the replayed gradient; fills ``report.training``.
        A partial accumulation window is judged as one (:meth:`_partial_window`); else, on a cut step, a failure is
        named by the weights training gave the micro-batches (``rows``: every rank's sketches, distributed; this
        rank's by default)."""
        if replay is None:
            return
        if replay.grads is None:
            report.training_note = replay.reason
            return
        grads = dict(grads if grads is not None else replay.grads)
        params = replay.params if replay.params is not None else self.params()
        scale = LazyScale(grads)  # computed only if some tensor's .grad is not bitwise the replayed gradient
        refs = self._references(params, grads)
        lives, judged, notes_before = self._judge_tensors(report, replay, params, grads, refs, scale)
        first = dict(report.training)  # a fused expert tensor's whole verdict, judged again expert by expert below
        notes = [f"replayed from the {replay.how} RNG state" if replay.how else ""] + notes_before
        if refs.zero and self.watch.dist is not None:
            whose = "each rank judged its partition of ZeRO's gradient" if self.watch.zero3 \
                else "ZeRO's gradient read one tensor at a time"
            notes.append(f"the reference is averaged over {cast(Any, self.watch.dist).world_size} ranks, as ZeRO averages "
                         f"its gradient; {whose}")
        self._diagnose(report, getattr(replay, "plan", None), lives, grads, judged, scale, rows, notes)
        options = self.watch.options
        report.training = by_expert(report.training, first, lives, grads, judged, functools.partial(
            judge_training, bands=options.bands, fail_at=options.fail_verdict, scale=scale))
        if replay.loss_gap is not None:
            given, replayed = replay.loss_gap
            notes.append(
                f"training's loss {given:.6g} differs from the objective's {replayed:.6g} at the same point "
                f"(by {given - replayed:+.3g}): the training loss has a term the objective lacks, or the reverse"
            )
        report.training_note = "; ".join(n for n in notes if n) or None

    def _references(self, params: Dict[str, torch.Tensor], grads: Dict[str, torch.Tensor]) -> References:
        """The replayed gradients made comparable with the live ``.grad``, ``grads`` updated in place: under ZeRO
        averaged over the ranks (as ZeRO averages) and, for ZeRO 1 and 2, ZeRO's whole gradients read; a partial
        ``.grad`` (sequence parallel's norms) reduced with its replayed gradient. The reductions are collectives: every
        rank makes them, in the same order."""
        ctx = self.watch
        partial = [n for n, p in params.items() if is_partial(p.grad)]
        zero = ctx.by_shard and ctx.zero
        if (partial or zero) and ctx.lockstep is not None:
            ctx.lockstep.point()  # the reductions below are collectives: every rank is here
        if zero and ctx.dist is not None:  # ZeRO: each rank's whole gradients averaged, as ZeRO averages
            grads.update(cast(Any, ctx.dist).average(grads, in_place=ctx.grad_fn is None))
        zero_scale = loss_scale(ctx.engine) if ctx.zero else 1.0
        # ZeRO 1 and 2: the step's whole gradient of each tensor, read on every rank in the same order (collectives)
        wholes = {n: whole_grad(p, grads[n], zero_scale) for n, p in params.items()
                  if not is_partitioned(p)} if zero else {}
        # sequence parallel's norms: .grad is a Partial(sum) until the optimizer reduces it (the live and the replayed
        # reduced together; the same tensors on every rank, so none reduces where none is partial)
        reduced = dict(zip(partial, settled_pairs([(cast(torch.Tensor, params[n].grad), grads[n]) for n in partial]))) \
            if partial else {}
        for n in partial:
            grads[n] = reduced[n][1]
        return References(zero, zero_scale, wholes, partial, reduced)

    def _judge_tensors(self, report: CheckReport, replay: Replay, params: Dict[str, torch.Tensor],
                       grads: Dict[str, torch.Tensor], refs: References, scale: Callable[[], float]
                       ) -> Tuple[Lives, Judged, List[str]]:
        """Each tensor's verdict into ``report.training`` (a weight by rows: its judged rows); returns the live
        ``.grad`` judged, what each was judged on, and the notes of weights not judged (:meth:`_read_directly`)."""
        options = self.watch.options
        bands, fail_at, autocast = options.bands, options.fail_verdict, replay.autocast
        dtypes: Dict[torch.dtype, torch.dtype] = {}  # parameter dtype -> compute dtype, once per dtype
        sliced = getattr(replay, "rows", None) or {}
        lives: Lives = {}
        notes_before: List[str] = []
        judged: Judged = {}  # what each tensor was judged on (a window judges again)
        for n, p in params.items():
            dtype = dtypes.get(p.dtype) or dtypes.setdefault(p.dtype, compute_dtype(p.dtype, autocast))
            p, live = refs.on_rank(n, p, grads)
            if n in sliced:  # judged by a block of rows: the live .grad's rows against the replayed rows
                first, end = sliced[n]
                p, live = p[first:end], None if live is None else live[first:end]
                if n in replay.unran and live is not None and bool(live.ne(0).any()):
                    self._read_directly(n, notes_before)
                    continue
            lives[n], judged[n] = live, (p, dtype)
            report.training[n] = judge_training(n, live, grads[n], p, dtype, bands, fail_at, scale=scale)
        report.training_rows = {n: rows for n, rows in sliced.items() if n in report.training}
        return lives, judged, notes_before

    def _diagnose(self, report: CheckReport, plan: Optional[StepPlan], lives: Lives, grads: Dict[str, torch.Tensor],
                  judged: Judged, scale: Callable[[], float], rows: Optional[List[torch.Tensor]], notes: List[str]) -> None:
        """What explains the failures, first in ``notes``: a partial accumulation window (:meth:`_partial_window`), else
        the step's plan (its items recorded; a step cut otherwise, :meth:`~gradwatch.parallel.step_objective.
        StepObjective.explain`), else a term weighted otherwise (:meth:`_term_weights`)."""
        found = self._partial_window(report, plan, lives, grads, judged, scale)
        if found is not None:
            notes.insert(0, f"a partial accumulation window, the step's tensors judged against its objective's "
                            f"gradient times {found.micro_batches}/{found.window}: {found.text()}")
        if plan is not None:
            report.training_items = plan.record()
            notes.insert(0, plan.note or "")
            cut = self.step_objective.explain(plan, report.training, lives, rows, folded=self.watch.by_shard) \
                if found is None else None
            if found is None and cut is None:
                named = self._term_weights(report, plan, lives, grads, judged, scale)
                if named is not None:
                    notes.insert(1, f"a term weighted otherwise than the step's objective weighs it: {named}")

    def _read_directly(self, name: str, notes: List[str]) -> None:
        """``name``'s module never ran in the replay, yet training gave its rows a gradient: other code reads the weight
        itself, so its rows' gradient cannot be taken at its module. Not judged at this check; whole from now on."""
        self.read_directly.add(name)
        self.counts[name] = max(0, self.counts.get(name, 0) - 1)  # its turn comes again
        notes.append(f"{name} not judged at this check: its module never ran in the replay while training gave it a "
                     f"gradient, so other code reads the weight itself (as a fused LM head does); judged whole from now "
                     f"on, at a check with room for its gradient")

    def _term_weights(self, report: CheckReport, plan: StepPlan, lives: Dict[str, Optional[torch.Tensor]],
                      grads: Dict[str, torch.Tensor], judged: Dict[str, Tuple[torch.Tensor, torch.dtype]],
                      scale: Callable[[], float]) -> Optional[str]:
        """Where tensors still fail: a term of the loss weighted otherwise by training, named and judged as such
        (:mod:`gradwatch.watch.parts._term_weights`; one process, this check's step replayed again)."""
        again, self._again, self.terms.found = self._again, None, None
        failing = [tc for tc in report.training.values() if tc.failed]
        explained = all(tc.ratio is not None for tc in failing) and not (plan.cut and self.watch.objective.regularizers)
        if again is None or plan.weights is None or not failing or explained:
            return None  # nothing failed, or the judge's words explain each (a factor; an L2 term, on a step not cut)
        replays, model, judged_again, seed = again
        options = self.watch.options

        def rejudge(n: str, reference: torch.Tensor) -> TrainingCheck:
            p, dtype = judged[n]
            return judge_training(n, lives[n], reference, p, dtype, options.bands, options.fail_verdict, scale=scale)

        return self.terms.diagnose(replays, model, self.watch.objective, judged_again.tensors(), plan.weights,
                                   report.training, lives, grads, rejudge, seed, judged_again)

    def _partial_window(self, report: CheckReport, plan: Optional[StepPlan], lives: Dict[str, Optional[torch.Tensor]],
                        grads: Dict[str, torch.Tensor], judged: Dict[str, Tuple[torch.Tensor, torch.dtype]],
                        scale: Callable[[], float]) -> Optional[PartialWindow]:
        """Where tensors failed: a partial accumulation window that explains them (:mod:`gradwatch.watch.parts._accumulation`:
        each failing tensor judged again against the step's objective times ``n / K``), kept in
        ``report.training_window`` (not on a sharded model: each rank holds a shard)."""
        if plan is None or not plan.parts or self.watch.sharded or not any(tc.failed for tc in report.training.values()):
            return None
        each = set(collections.Counter(part.rank for part in plan.parts).values())  # micro-batches on each rank
        options = self.watch.options

        def again(n: str, factor: float) -> TrainingCheck:
            p, dtype = judged[n]
            return judge_training(n, lives[n], grads[n] * factor, p, dtype, options.bands, options.fail_verdict,
                                  scale=lambda: factor * scale())

        found = self.window.judge(report.training, lives, grads, each.pop() if len(each) == 1 else None, again)
        if found is not None:
            report.training_window = found.record()
        return found

    def judge_across_ranks(self, merged: CheckReport, replay: Optional[Replay],
                           statuses: List[Optional[Tuple[bool, Optional[str]]]],
                           rows: Optional[List[Optional[List[torch.Tensor]]]] = None) -> None:
        """The training part on every rank alike: the replayed gradients averaged over the ranks (as DDP and
        FSDP average ``.grad``; each rank's replay weighed its micro-batches by their share of the step's items),
        the live ``.grad`` judged against them, and rank 0's verdicts taken everywhere. ``rows``: every rank's
        sketches of its micro-batches' gradients (they name a step cut wrongly).

        Every branch depends on the gathered ``statuses`` only, so every rank makes the same collectives.
        """
        coord = self.watch.dist
        assert coord is not None
        if any(s is None for s in statuses):
            if any(s is not None for s in statuses):
                merged.training_note = "not judged: the replay failed on another rank"
            return
        failed = [(rank, s[1]) for rank, s in enumerate(statuses) if s is not None and not s[0]]
        if failed:
            rank, reason = failed[0]
            merged.training_note = f"rank {rank}: {reason}"
            return
        assert replay is not None and replay.grads is not None
        try:
            averaged = coord.average(replay.grads, in_place=self.watch.grad_fn is None)  # grad_fn's may be .grad itself
        except Exception as exc:  # noqa: BLE001 - a collective that fails must not stop training
            merged.training_note = (f"not judged: averaging the replayed gradients over the ranks failed "
                                    f"({first_line(exc)})")
            return
        try:
            every = [row for rank in rows or () for row in rank or ()]
            self.judge(merged, replay, averaged, rows=every if rows and all(r is not None for r in rows) else None)
            merged.training_note = ((merged.training_note + "; ") if merged.training_note else "") + (
                f"the reference is averaged over {coord.world_size} ranks, as DDP and FSDP average .grad")
        except Exception as exc:  # noqa: BLE001 - the broadcast below must still happen on every rank
            merged.training, merged.training_window = {}, None
            merged.training_note = f"not judged on rank {coord.rank}: judging it failed ({first_line(exc)})"
        # A gradient DDP did not synchronize differs from rank to rank: every rank takes rank 0's judgement,
        # so trends and alerts stay identical everywhere.
        try:
            merged.training, merged.training_note, merged.training_window = coord.from_main(
                (merged.training, merged.training_note, merged.training_window))
        except Exception as exc:  # noqa: BLE001
            merged.training, merged.training_window = {}, None
            merged.training_note = f"not judged: sharing rank 0's training verdicts failed ({first_line(exc)})"


__all__ = ["Judged", "LazyScale", "Lives", "References", "Verdicts"]
