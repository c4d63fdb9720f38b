"""GradWatch under ``torch.distributed`` (DistributedDataParallel, Lightning's DDP strategies).

What changes when the process group has more than one rank:

- **The check never calls a collective.** It runs on the unwrapped module
  (``model.module`` of a DDP/DataParallel wrapper), through the ``loss_fn``'s
  model argument, so DDP's forward buffer broadcast and backward all-reduce
  hooks never fire inside a check.
- **Every rank decides alike when to check.** ``every=N`` is a pure function
  of the step count. ``every="auto"`` is agreed: after each check, rank 0's
  next interval (from its own timings) travels with the gathered results, and
  every rank follows it. So the only collectives gradwatch makes are the ones
  right after a check, at the same point on every rank, and none on the steps
  between checks.
- **Each rank checks its share.** The rotating subset of tensors is chosen
  alike on every rank (``tensors_per_check`` tensors per rank), then split
  round-robin: rank ``r`` checks tensors ``r, r + W, ...`` on its own batch.
  A check's cost is per sampled point (one forward each), not per element, so
  splitting by tensor balances the work.
- **Rank 0 writes.** Results are gathered (``all_gather_object``) on a
  separate gloo group created with a timeout. Every rank merges them into the
  same report, so trends, alerts, ``raise_on`` and the next schedule decision
  are identical everywhere; only rank 0 builds file sinks (TensorBoard, JSONL)
  and logs.
- **Nobody waits forever.** An exception in one rank's check is caught there
  and sent with the results (an ``error`` alert naming the rank). A rank that
  does not arrive at all (crashed, hung in its ``loss_fn``) is detected by a
  ``monitored_barrier`` within ``distributed_timeout`` seconds: the others
  raise an ``error`` alert naming the missing ranks, stop checking (their
  group is no longer usable) and return to training.

Example:
    >>> unwrap_model(nn.DataParallel(nn.Linear(2, 1))).__class__.__name__
    'Linear'
    >>> DistributedCoordinator.create(nn.Linear(2, 1), "auto") is None  # not distributed
    True
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import time
import traceback
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import torch.distributed as dist
from torch import nn

from ..errors import GradWatchError, blamed
from ..check.report import CheckReport
from ..check.sampling import rotate
from .trend import WHOLE_CHECK, Alert

if TYPE_CHECKING:  # pragma: no cover
    from .gradwatch import GradWatch

logger = logging.getLogger("gradwatch")

#: Default seconds gradwatch's own collectives wait for the other ranks.
DEFAULT_TIMEOUT = 300.0
_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


class DistributedCheckError(GradWatchError, RuntimeError):
    """A check failed on another rank, or a rank did not take part in gradwatch's collectives."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel / DataParallel wrappers (any depth); others as they are.

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> unwrap_model(lin) is lin
        True
    """
    while isinstance(model, _WRAPPERS):
        model = model.module
    return model


def _mode(distributed: Any) -> Optional[bool]:
    if isinstance(distributed, str) and distributed.lower() == "auto":
        return None
    if isinstance(distributed, bool):
        return distributed
    raise ValueError(f"distributed: got {distributed!r}, expected 'auto', True or False")


class DistributedCoordinator:
    """The distributed half of :class:`gradwatch.GradWatch`: schedule agreement, sharding, gathering.

    Build it with :meth:`create`, on every rank at the same point of the program
    (it creates a process group, itself a collective).

    Args:
        timeout: Seconds gradwatch's collectives wait for the other ranks.
        group: Process group to use (default: a new gloo group with ``timeout``).
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, group: Any = None) -> None:
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"distributed_timeout: got {timeout!r}, expected a number of seconds > 0")
        self.timeout = float(timeout)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # gloo, whatever the training backend: objects travel as CPU tensors, and this group has its own
        # timeout, so a missing rank never blocks gradwatch for the default group's 30 minutes.
        self.group = group if group is not None else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=self.timeout)
        )
        self.interval = 1
        self.broken: Optional[str] = None

    @classmethod
    def create(cls, model: nn.Module, distributed: Any = "auto", timeout: float = DEFAULT_TIMEOUT) -> Optional["DistributedCoordinator"]:
        """A coordinator when running distributed (``distributed="auto"``: an initialized group of 2+ ranks), else None.

        Raises:
            ValueError: ``distributed=True`` without an initialized process group, or a bad value.
        """
        mode = _mode(distributed)
        active = dist.is_available() and dist.is_initialized()
        if mode is True and not active:
            raise ValueError(
                "distributed=True, but torch.distributed is not initialized: call "
                "torch.distributed.init_process_group() first (or leave distributed='auto')"
            )
        if mode is False or not active or (mode is None and dist.get_world_size() < 2):
            return None
        return cls(timeout)

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that writes TensorBoard and JSONL."""
        return self.rank == 0

    # ------------------------------------------------------------------ schedule
    def due(self, step: int, schedule: Any) -> bool:
        """The agreed decision: ``every=N`` by step count; ``"auto"`` by rank 0's last interval."""
        if self.broken is not None:
            return False
        if schedule.every != "auto":
            return schedule.due(step)
        last = schedule.last_check_step
        if last is None or int(step) < last:
            return True
        return int(step) - last >= self.interval

    # ------------------------------------------------------------------ one check
    def share(self, names: Sequence[str]) -> List[str]:
        """This rank's round-robin share of the tensors chosen for a check."""
        return list(names[self.rank :: self.world_size])

    def run(self, watch: "GradWatch", step: int, batch: Any, scheduled: bool = True, pending: Any = None) -> Optional[CheckReport]:
        """One distributed check: local share, gather, merge, then the usual trend/sink/alert path.

        The backward part is sharded by tensor. The training part runs on every rank for every
        watched tensor (one forward and backward of the local batch): the replayed gradients are
        averaged over the ranks, as DDP averages the live ``.grad``, so a gradient that was not
        synchronized differs from the reference.

        Every rank must call it at the same step (``GradWatch.step`` ensures that; a direct
        ``GradWatch.check`` must be called on every rank alike).
        """
        if self.broken is not None:
            return None
        from ..check.model import run_model_check
        from ..check.isolation import Shadow, preserved_rng

        per_rank = watch.config.tensors_per_check
        opts = dataclasses.replace(watch._check_options, seed=watch._check_options.seed + watch._checks)
        payload: Dict[str, Any] = {"rank": self.rank, "report": None, "error": None, "training": None}
        start = time.perf_counter()
        names: List[str] = []
        replay = None
        try:
            names = rotate(watch._names_to_check(), per_rank * self.world_size if per_rank > 0 else 0, watch._counts)
            mine = self.share(names)
            with preserved_rng():  # one guard for both parts
                replay = watch._training_replay(pending)
                if replay is not None:
                    payload["training"] = (replay.grads is not None, replay.reason)
                if mine:
                    with watch._recorder_paused():
                        if opts.dtype is not None and (watch._shadow is None or not watch._shadow.matches(watch.model)):
                            watch._shadow = Shadow(watch.model, opts.dtype)
                        payload["report"] = run_model_check(
                            watch.model, watch.objective, batch, opts, grad_fn=watch.grad_fn, names=mine,
                            shadow=watch._shadow
                        )
        except Exception as exc:  # noqa: BLE001 - reported to every rank through the gather
            logger.error("gradwatch: the check at step %d raised on rank %d; training goes on:\n%s",
                         step, self.rank, traceback.format_exc())
            payload["error"] = f"{type(exc).__name__}: {exc}"
            payload["where"] = blamed(exc) or "the check"
        seconds = time.perf_counter() - start
        watch.schedule.record_check(step, seconds, scheduled)
        payload["seconds"] = seconds
        payload["interval"] = watch.schedule.interval()

        gathered = self._gather(payload)
        if gathered is None:  # once: this coordinator is broken and checks no more
            alert = Alert(step=int(step), tensor=WHOLE_CHECK, kind="error", severity="error", value=math.nan,
                          baseline=None, message=f"step {step}: {self.broken}; training continues")
            watch._emit(step, None, [alert], seconds)
            return None

        self.interval = int(gathered[0]["interval"])
        seconds = max(float(g["seconds"]) for g in gathered)
        watch._checks += 1
        reports = [(g["rank"], g["report"]) for g in gathered if g["report"] is not None]
        errors = [f"rank {g['rank']}: {g['error']}" for g in gathered if g["error"] is not None]
        merged = merge_reports(reports, names, opts) if reports else None
        if merged is not None:
            self._training(watch, merged, replay, [g.get("training") for g in gathered])
        alerts = []
        if merged is not None:
            merged.notes[:0] = watch.notes
            for n in merged.tensors:
                watch._counts[n] = watch._counts.get(n, 0) + 1
            alerts.extend(watch.tracker.update(step, merged))
        if errors:
            where = "; ".join(f"{g.get('where', 'loss_fn')} on rank {g['rank']}" for g in gathered if g["error"] is not None)
            alert = watch.tracker.error(step, DistributedCheckError("; ".join(errors)), where=where)
            alerts.extend([alert] if alert is not None else [])
        watch._emit(step, merged, alerts, seconds)
        return merged

    def _training(self, watch: "GradWatch", merged: CheckReport, replay: Any, statuses: List[Any]) -> None:
        """The training part on every rank alike: average the replayed gradients, judge the live ``.grad``."""
        if replay is None or any(s is None for s in statuses):
            if any(s is not None for s in statuses):
                merged.training_note = "not judged: the replay failed on another rank"
            return
        failed = [(rank, s[1]) for rank, s in enumerate(statuses) if not s[0]]
        if failed:
            rank, reason = failed[0]
            merged.training_note = f"rank {rank}: {reason}"
            return
        import torch

        grads = replay.grads
        try:
            flat = torch.cat([g.detach().reshape(-1).to("cpu", torch.float64) for g in grads.values()])
            dist.all_reduce(flat, group=self.group)
            flat /= self.world_size
        except Exception as exc:  # noqa: BLE001 - a collective that fails must not stop training
            merged.training_note = f"not judged: averaging the replayed gradients over the ranks failed ({type(exc).__name__}: {exc})"
            return
        averaged, offset = {}, 0
        for name, g in grads.items():
            averaged[name] = flat[offset:offset + g.numel()].reshape(g.shape).to(g.device, g.dtype)
            offset += g.numel()
        watch._attach_training(merged, replay, averaged)
        merged.training_note = ((merged.training_note + "; ") if merged.training_note else "") + (
            f"the reference is averaged over {self.world_size} ranks, as DDP averages .grad")
        # A gradient DDP did not synchronize differs from rank to rank: every rank takes rank 0's judgement,
        # so trends and alerts stay identical everywhere.
        try:
            shared = [(merged.training, merged.training_note) if self.rank == 0 else None]
            dist.broadcast_object_list(shared, src=0, group=self.group)
            merged.training, merged.training_note = shared[0]
        except Exception as exc:  # noqa: BLE001
            merged.training = {}
            merged.training_note = f"not judged: sharing rank 0's training verdicts failed ({type(exc).__name__}: {exc})"

    def _gather(self, payload: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
        """``all_gather_object`` behind a monitored barrier; None (and ``broken`` set) when a rank is missing."""
        try:
            dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=self.timeout), wait_all_ranks=True)
            out: List[Any] = [None] * self.world_size
            dist.all_gather_object(out, payload, group=self.group)
            return out
        except Exception as exc:  # noqa: BLE001 - a missing rank must not stop training here
            self.broken = (
                f"rank {self.rank} waited {self.timeout:g}s (distributed_timeout) for the other ranks after a check and "
                f"gave up: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''} — a rank "
                "crashed or hung in its check (look at that rank's log); gradwatch stops checking in this process"
            )
            logger.error("gradwatch: %s", self.broken)
            return None

    def close(self) -> None:
        """Release the process group (best effort)."""
        group, self.group = self.group, None
        if group is not None and self.broken is None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001
                pass


def merge_reports(reports: Sequence[Any], order: Sequence[str], opts: Any) -> CheckReport:
    """One :class:`CheckReport` from the per-rank reports of one check (``[(rank, report), ...]``).

    Tensors come in ``order``; the objective and terms are rank 0's (each rank
    evaluates its own batch), unless some rank's objective is not finite;
    evaluations add up; seconds is the slowest rank's.
    """
    ranked = sorted(reports, key=lambda rr: rr[0])
    first = ranked[0][1]
    tensors = {}
    for name in order:
        for _, r in ranked:
            if name in r.tensors:
                tensors[name] = r.tensors[name]
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
    for _, r in ranked:
        for note in r.notes:
            if note not in merged.notes:
                merged.notes.append(note)
        for term, checks in r.term_checks.items():
            merged.term_checks.setdefault(term, {}).update(checks)
        merged.localized.extend(r.localized)
    return merged
