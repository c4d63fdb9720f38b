"""The objective evaluated as the engine probes it: the guarded setting of a check, and one evaluation in it.

:func:`evaluation_context` puts the target in the check's setting (generators held, dropout off, power iteration
frozen, padding rows constant, the user's hooks suspended, the prefix installed) and puts everything back after.
:class:`ObjectiveEvaluation` is the ``evaluate() -> {term: float}`` the :class:`~gradwatch.check.probes.lines.Evaluator`
calls: the objective's terms under ``no_grad``, reseeded alike each time, with the buffers the forward changed put back.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from gradwatch.check.objective.checkpointed import CHECKPOINT_NO_GRAD_WARNING
from gradwatch.check.objective.dropout_off import dropout_off
from gradwatch.check.objective.generators import HeldGenerators
from gradwatch.check.objective.guards import BufferGuard, frozen_power_iteration, suspended_hooks
from gradwatch.check.objective.padding_idx import padding_rows_constant
from gradwatch.check.objective.precision import ShadowPrecision
from gradwatch.check.objective.rng import preserved_rng
from gradwatch.check.objective.shadow import Shadow, restore_params, snapshot_params
from gradwatch.check.objective.surrogate import SurrogateCut
from gradwatch.check.objective.terms import Objective
from gradwatch.check.probes.lines import Evaluator, total
from gradwatch.check.probes.prefix import PrefixCache


@contextlib.contextmanager
def evaluation_context(target: nn.Module, in_place: bool, params: Dict[str, torch.Tensor],
                       roots: Sequence[Any], prefix: Optional[PrefixCache] = None,
                       ) -> Iterator[Tuple[BufferGuard, HeldGenerators, List[str], Any, List[str]]]:
    """The check's setting on ``target``: yields ``(buffer guard, held generators, hooks, dropout, padding)``.

    ``in_place``: the parameters are the live model's, snapshotted here and restored on exit. ``roots``: where the
    generators the objective holds are looked for.
    """
    saved = snapshot_params(params) if in_place else None
    held = HeldGenerators([*roots, target])
    try:
        with preserved_rng(), dropout_off(target) as dropout, frozen_power_iteration(target), \
                padding_rows_constant(target) as padding, suspended_hooks(target) as hooks, \
                (prefix.installed() if prefix is not None else contextlib.nullcontext()):
            # Inside: the attributes dropout_off switched are saved as switched (see AttributeGuard).
            guard = BufferGuard(target, attributes=True)
            try:
                yield guard, held, hooks, dropout, padding
            finally:
                guard.restore_changed()
    finally:
        held.reset()
        if saved is not None:
            restore_params(params, saved)


def hooks_note(hooks: List[str]) -> str:
    """The report's note naming the hooks the check did not run."""
    shown = "; ".join(hooks[:3]) + (f"; and {len(hooks) - 3} more" if len(hooks) > 3 else "")
    return (
        f"the check did not run {len(hooks)} hook(s) your code registered on the model ({shown}): at every "
        "evaluation of a check they would run again and their side effects would reach training; if one changes "
        "what its module returns, the check objective differs from the training loss (move that into forward())"
    )


class ObjectiveEvaluation:
    """``evaluate() -> {term: float}``: the objective's terms on ``target`` under ``no_grad``, as the engine probes them.

    Each evaluation is reseeded alike, runs in the shadow's precision ``mode`` where one is needed, is cut at the
    surrogates (``cut``), replays what the first evaluation kept (``prefix``: the first evaluation captures it, and
    its value is what the replay must give back), and puts back the buffers the forward changed. ``casting``: the
    shadow whose input-cast hooks come back when a module needs them after all. ``graph_leaves``: a reentrant
    checkpoint is in the objective (it warns at every evaluation without grad).
    """

    def __init__(self, objective: Objective, target: nn.Module, batch: Any, guard: BufferGuard,
                 reseed: Callable[[], None], *, mode: Optional[ShadowPrecision] = None,
                 cut: Optional[SurrogateCut] = None, casting: Optional[Shadow] = None,
                 prefix: Optional[PrefixCache] = None, graph_leaves: Optional[List[torch.Tensor]] = None) -> None:
        self.objective, self.target, self.batch, self.guard, self.reseed = objective, target, batch, guard, reseed
        self.mode, self.cut, self.casting, self.prefix, self.graph_leaves = mode, cut, casting, prefix, graph_leaves

    def __call__(self) -> Dict[str, float]:
        self.reseed()
        prefix = self.prefix
        capturing = prefix is not None and prefix.phase == "capture"
        if prefix is not None:
            prefix.begin()
        try:
            if self.graph_leaves is not None:  # checkpoint(use_reentrant=True) warns at every evaluation without grad
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=CHECKPOINT_NO_GRAD_WARNING)
                    terms = self.terms_no_grad() if not torch.is_grad_enabled() else _no_grad(self.terms_no_grad)
            elif torch.is_grad_enabled():
                with torch.no_grad():
                    terms = self.terms_no_grad()
            else:  # the engine probes under no_grad already; entering it again costs more than the check
                terms = self.terms_no_grad()
        finally:
            if capturing and prefix is not None:
                prefix.captured()  # (the first evaluation: what it kept is replayed from now on)
        self.guard.restore_fast()
        out = _floats(terms)
        if capturing and prefix is not None:
            prefix.expected = total(out)
        return out

    def terms_no_grad(self) -> Dict[str, torch.Tensor]:
        """The terms as tensors, in the precision mode where one is needed."""
        if self.mode is not None:
            with self.mode:
                return self._terms_cut()
        return self._terms_cut()

    def _terms_cut(self) -> Dict[str, torch.Tensor]:
        if self.cut is not None:
            with self.cut.cut():
                terms = self._terms_cast_retried()
            return {**terms, "surrogates": torch.tensor(self.cut.term(), dtype=torch.float64)}
        return self._terms_cast_retried()

    def _terms_cast_retried(self) -> Dict[str, torch.Tensor]:
        objective, casting = self.objective, self.casting
        try:
            return objective.terms(self.target, self.batch)
        except Exception as first:
            # A module that needed no input cast in the first evaluation needs one now: put the hooks back.
            casts = casting.casts() if casting is not None else 0
            if casting is None or not casting.restore_cast_hooks():
                raise
            self.guard.restore_changed()
            self.reseed()
            terms = objective.terms(self.target, self.batch)
            if casting.casts() == casts:
                raise first  # no module needed the cast: the user's code itself raised, retrying hid it
            return terms


class Both:
    """Two calls in one: the batched evaluations' reseeding, and the start of an evaluation's call count."""

    def __init__(self, first: Callable[[], None], second: Callable[[], None]) -> None:
        self.first, self.second = first, second

    def __call__(self) -> None:
        self.first()
        self.second()


def focus(prefix: PrefixCache, p: Optional[torch.Tensor], evaluator: Evaluator) -> None:
    """The engine probes ``p`` now: replay what it does not reach, once the replay is found exact (one evaluation)."""
    if p is not None and not prefix.verified and prefix.enabled:
        prefix.verify(lambda: total(evaluator()))
    prefix.focus(p)


class InMode:
    """A batched probe whose evaluations run inside a :class:`ShadowPrecision` mode."""

    def __init__(self, probe: Any, mode: ShadowPrecision) -> None:
        self._probe, self._mode = probe, mode

    def wants(self, name: str) -> bool:
        return self._probe.wants(name)

    def chunk(self, p: torch.Tensor) -> int:
        return self._probe.chunk(p)

    def __call__(self, *args: Any) -> Any:
        with self._mode:
            return self._probe(*args)


def _no_grad(fn: Callable[[], Any]) -> Any:
    with torch.no_grad():
        return fn()


def _floats(terms: Mapping[str, torch.Tensor]) -> Dict[str, float]:
    """Term values as Python floats, with one device sync for all of them (not one per term)."""
    if len(terms) == 1:
        return {k: float(v) for k, v in terms.items()}
    devices = {v.device for v in terms.values()}
    if all(d.type == "cpu" for d in devices):
        return {k: float(v) for k, v in terms.items()}
    dev = next(d for d in devices if d.type != "cpu")
    return dict(zip(terms, torch.stack([v.detach().to(dev, torch.float64).reshape(()) for v in terms.values()]).tolist()))
