"""Agreement points for a check whose collectives run inside the user's code (FSDP2, shard by shard).

Checked shard by shard, a check runs the live sharded model: its forwards all-gather and the replayed
backward reduce-scatters, on the model's own process group, inside ``loss_fn``. A rank whose
``loss_fn`` raised there would leave the others in the next collective until that group's timeout
(with gloo, mismatched collectives can abort them). :class:`Lockstep` puts an agreement point before
each FSDP2 module's forward (before its all-gather) and before the replayed backward: a one-element
all-reduce on gradwatch's own group, bounded by ``distributed_timeout``
(:meth:`~gradwatch.watch.distributed.DistributedCoordinator.agree`).

A rank whose check raised joins the next point saying so; every other rank stops at that same point
(:class:`PeerFailed`) before any further collective, so every rank has made the same collectives.
FSDP2's per-iteration state is then reset (``reset_iter_state``) and training goes on. A rank that
stalls past ``distributed_timeout`` at a point breaks the coordinator on every rank (the check is an
error record and checks stop), with the same collectives made everywhere. What a point cannot cover:
a rank that raises *inside* a collective or inside the replayed backward (a custom backward, out of
memory) leaves the others in FSDP2's collective until the model's process group times out.

Example:
    >>> from torch import nn
    >>> class Agreeing:  # a coordinator whose ranks always agree
    ...     def agree(self, ok):
    ...         return True
    >>> with Lockstep(Agreeing(), nn.Linear(2, 2)) as step:
    ...     step.point()
    >>> step.points, step.failed
    (2, False)
"""

from __future__ import annotations

import time
from typing import Any, List, cast

from torch import nn

from .distributed import DistributedCheckError
from .sharded import _FSDPModule

__all__ = ["Lockstep", "PeerFailed", "reset_fsdp"]


class PeerFailed(DistributedCheckError):
    """Another rank's check raised; this rank stopped at the same agreement point, before any further collective."""


def reset_fsdp(model: nn.Module) -> None:
    """FSDP2's per-iteration state reset after a forward or backward stopped midway (``reset_iter_state`` on the
    root, where torch has it; otherwise every module resharded)."""
    if _FSDPModule is None:
        return
    for m in model.modules():
        if isinstance(m, _FSDPModule):
            reset = getattr(m, "reset_iter_state", None)
            try:
                if reset is not None:
                    reset()  # the root's: every state of the tree
                    return
            except RuntimeError:  # not the root
                continue
    for m in model.modules():
        if isinstance(m, _FSDPModule):
            cast(Any, m).reshard()


class Lockstep:
    """``with Lockstep(coord, model) as step:`` a region of a check whose collectives must stay in step.

    Inside, every FSDP2 module's forward first calls :meth:`point`; the caller calls it where else a
    collective follows user code (before the replayed backward). Leaving the region normally is a last
    point; leaving it by an exception of this rank tells the others at their next point.

    Args:
        coord: The :class:`~gradwatch.watch.distributed.DistributedCoordinator` (its ``agree``).
        model: The live sharded model.

    Attributes:
        failed: Some rank's check raised in the region (seen at a point).
        points: Agreement points made.
        waited: Seconds spent at them (waiting for the other ranks).
    """

    def __init__(self, coord: Any, model: nn.Module) -> None:
        self.coord = coord
        self.model = model
        self.failed = False
        self.points = 0
        self.waited = 0.0
        self._handles: List[Any] = []

    def _agree(self, ok: bool) -> bool:
        start = time.perf_counter()
        try:
            return bool(self.coord.agree(ok))
        finally:
            self.waited += time.perf_counter() - start

    def point(self) -> None:
        """Return when every rank reached this point fine; raise :class:`PeerFailed` when another rank's check raised.

        Raises:
            PeerFailed: Another rank failed (then every later point raises at once, with no collective).
            DistributedCheckError: A rank did not arrive within ``distributed_timeout``.
        """
        if self.failed:
            raise PeerFailed("another rank's check raised; this rank stopped at the same point")
        self.points += 1
        if not self._agree(True):
            self.failed = True
            raise PeerFailed("another rank's check raised; this rank stopped at the same point, before any further "
                             "collective")

    def __enter__(self) -> "Lockstep":
        def hook(module: nn.Module, args: Any) -> None:
            self.point()

        hook._gradwatch_hook = True  # type: ignore[attr-defined]  # gradwatch's own: kept when user hooks are suspended
        if _FSDPModule is not None:
            self._handles = [m.register_forward_pre_hook(hook, prepend=True)  # before FSDP2's all-gather
                             for m in self.model.modules() if isinstance(m, _FSDPModule)]
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if kind is None:
            if not self.failed:
                self.points += 1
                self.failed = not self._agree(True)  # this rank's own work stands; the merge names the failure
            return
        if not isinstance(exc, DistributedCheckError) and not self.failed:
            self.failed = True
            try:
                self._agree(False)  # the others stop at their next point
            except DistributedCheckError:
                pass  # the coordinator is broken: every rank gives up checking
        reset_fsdp(self.model)
