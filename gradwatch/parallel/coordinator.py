"""GradWatch under ``torch.distributed``: DDP, Lightning's DDP strategies, and FSDP2 (``fully_shard``).

:class:`DistributedCoordinator` shares, gathers and merges; it runs no check.
:class:`gradwatch.GradWatch` runs its own check and calls it at fixed points,
the same on every rank:

1. **Agree on the schedule** (:meth:`~DistributedCoordinator.due`). ``every=N``
   is a pure function of the step count; ``every="auto"`` follows rank 0's
   interval, which travels with the gathered results of each check.
2. **Agree on a sharded model's layout** (:meth:`~DistributedCoordinator.same_everywhere`),
   FSDP2 only: every rank then gathers the same parameters in the same order
   into its replica (:mod:`gradwatch.parallel.sharded`), the only collectives of the
   model's own group a check makes.
3. **Share the tensors** (:meth:`~DistributedCoordinator.share`). The rotating
   subset is chosen alike on every rank (:meth:`~DistributedCoordinator.tensors_per_check`
   tensors in all), then split round-robin: rank ``r`` checks tensors
   ``r, r + W, ...`` on its own batch. A check's cost is per sampled point,
   not per element, so splitting by tensor balances the work. The check itself
   runs on the unwrapped module (DDP) or on the gathered replica (FSDP2): it
   makes no collective, so ranks whose checks differ in length never send
   mismatched collectives.
4. **Gather and merge** (:meth:`~DistributedCoordinator.gather`,
   :func:`merge_results`): each rank's :class:`RankResult` (its report, or the
   exception its check raised) travels to every rank behind a monitored
   barrier, on a separate gloo group created with a timeout; every rank merges
   them into the same report, so trends, alerts, ``raise_on`` and the next
   schedule decision are identical everywhere. Only rank 0 writes files.
5. **The training part across ranks** (:meth:`~DistributedCoordinator.average`,
   :meth:`~DistributedCoordinator.from_main`): the replayed gradients are
   averaged over the ranks, as DDP and FSDP average ``.grad``, and every rank
   takes rank 0's verdicts.

**Nobody waits forever.** A rank that does not arrive at a gather (crashed,
hung in its ``loss_fn``) is detected by a ``monitored_barrier`` within
``distributed_timeout`` seconds: the others mark the coordinator broken, raise
an ``error`` alert naming the missing ranks, stop checking (their group is no
longer usable) and return to training.

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
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from gradwatch.check.judging.report import CheckReport
from gradwatch.config import parse_distributed
from gradwatch.errors import GradWatchError, blamed
from gradwatch.parallel._rank_results import RankResult, merge_reports, slow_ranks
from gradwatch.parallel.host_collectives import combine, gather_objects
from gradwatch.parallel.host_points import HostPoints
from gradwatch.parallel.wrappers import unwrap_model  # noqa: F401  (its home was here: old imports still work)

_T = TypeVar("_T")

logger = logging.getLogger("gradwatch")

#: What a rank with no value sends to an agreement point (above any byte count).
_NO_VALUE = 2**62
#: What a rank that is not ok sends to an agreement point (below any value).
_FAILED = -(2**63)
#: The agreement points' channel before the first point opens it.
_UNOPENED = object()
#: Default seconds gradwatch's own collectives wait for the other ranks.
DEFAULT_TIMEOUT = 300.0


class DistributedCheckError(GradWatchError, RuntimeError):
    """A check failed on another rank, or a rank did not take part in gradwatch's collectives."""


class PeerFailed(DistributedCheckError):
    """Another rank's check raised; this rank stopped at the same agreement point, before any further collective."""


def _mode(distributed: Any) -> Optional[bool]:
    """``distributed`` (``"auto"``, ``"on"``/True, ``"off"``/False/None) as None (auto), True or False."""
    return {"auto": None, "on": True, "off": False}[parse_distributed(distributed)]


@dataclasses.dataclass
class MergedCheck:
    """The ranks' results of one check merged alike on every rank (:func:`merge_results`).

    Attributes:
        report: One report of every rank's tensors (None when no rank has one).
        error: A :class:`DistributedCheckError` naming every rank whose check raised, or None.
        where: What raised on each of those ranks (``"loss_fn on rank 1"``).
        seconds: The slowest rank's time.
        training: Each rank's ``(replayed, reason)`` of the training part, by rank.
    """

    report: Optional[CheckReport]
    error: Optional[DistributedCheckError]
    where: Optional[str]
    seconds: float
    training: List[Optional[Tuple[bool, Optional[str]]]]


class DistributedCoordinator:
    """The distributed seam of :class:`gradwatch.GradWatch`: schedule agreement, sharing, gathering, merging.

    Build it with :meth:`create`, on every rank at the same point of the program
    (it creates a process group, itself a collective). It holds no reference to the
    watch: GradWatch calls it at the points listed in :mod:`gradwatch.parallel.coordinator`.

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
        #: The agreed interval of ``every="auto"`` (rank 0's, from the last gather).
        self.interval = 1
        #: Why this coordinator gave up (a rank missing at a gather); None while it works.
        self.broken: Optional[str] = None
        #: Where the agreement points meet (:meth:`agree`): shared memory when every rank is on one host
        #: (:class:`~gradwatch.parallel.host_points.HostPoints`), else None (gloo); opened at the first point.
        self._host: Any = _UNOPENED

    @classmethod
    def create(cls, model: nn.Module, distributed: Any = "auto", timeout: float = DEFAULT_TIMEOUT) -> Optional["DistributedCoordinator"]:
        """A coordinator when running distributed (``distributed="auto"``: an initialized group of 2+ ranks), else None.

        Raises:
            ValueError: ``distributed=True`` without an initialized process group, ``distributed=False``
                for a model sharded over 2+ ranks (its ranks must gather it together), or a bad value.
        """
        mode = _mode(distributed)
        active = dist.is_available() and dist.is_initialized()
        if mode is True and not active:
            raise ValueError(
                "distributed=True, but torch.distributed is not initialized: call "
                "torch.distributed.init_process_group() first (or leave distributed='auto')"
            )
        if mode is False and active and dist.get_world_size() > 1:
            from gradwatch.parallel.sharded import is_sharded

            if is_sharded(model):
                raise ValueError(
                    f"distributed=False, but {type(model).__name__} is sharded (FSDP2 / DTensor parameters) over "
                    f"{dist.get_world_size()} ranks: its ranks must gather it together at every check; leave "
                    "distributed='auto'"
                )
        if mode is False or not active or (mode is None and dist.get_world_size() < 2):
            return None
        return cls(timeout)

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that writes TensorBoard and JSONL."""
        return self.rank == 0

    # ------------------------------------------------------------------ 1. schedule
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

    # ------------------------------------------------------------------ 2. agreement before collectives
    def same_everywhere(self, value: Any, what: str) -> None:
        """Gather ``value`` from every rank; return when all are equal.

        Raises:
            DistributedCheckError: The ranks differ (naming them and ``what``), or a rank did not
                arrive within ``distributed_timeout`` (the coordinator is then broken). Every rank
                that arrived raises alike.
        """
        gathered = self._gather({"phase": "agree", "rank": self.rank, "value": value})
        if gathered is None:
            raise DistributedCheckError(self.broken or "a rank did not arrive")
        differ = [g["rank"] for g in gathered if g["value"] != gathered[0]["value"]]
        if differ:
            first = _first_difference(gathered[0]["value"], gathered[differ[0]]["value"])
            raise DistributedCheckError(
                f"the ranks disagree on {what}: rank {', '.join(map(str, differ))} differ{'s' if len(differ) == 1 else ''} "
                f"from rank 0 ({first[0]!s} on rank 0, {first[1]!s} on rank {differ[0]}), so they cannot gather the "
                "same tensors; nothing was gathered"
            )

    def main_decision(self, value: Any, what: str) -> Any:
        """Rank 0's ``value`` on every rank (each rank passes its own; only rank 0's is used).

        Under DDP every rank holds the whole model, so rank 0 can decide for all what only it measured
        (the room ``memory_budget`` leaves, the form, the training part's tensors).

        Raises:
            DistributedCheckError: A rank did not arrive within ``distributed_timeout`` (the coordinator
                is then broken), or rank 0 could not decide (its ``value`` is ``("error", text)``).
        """
        gathered = self._gather({"phase": "decide", "rank": self.rank, "value": value})
        if gathered is None:
            raise DistributedCheckError(self.broken or "a rank did not arrive")
        decided = gathered[0]["value"]
        if isinstance(decided, tuple) and len(decided) == 2 and decided[0] == "error":
            raise DistributedCheckError(f"rank 0 could not decide {what}: {decided[1]}")
        return decided

    def everyone(self, value: Any, what: str) -> List[Any]:
        """Every rank's ``value``, by rank (each rank passes its own; a small picklable object).

        Raises:
            DistributedCheckError: A rank did not arrive within ``distributed_timeout`` (the coordinator is then
                broken), naming ``what`` was being exchanged.
        """
        gathered = self._gather({"phase": "exchange", "rank": self.rank, "value": value})
        if gathered is None:
            raise DistributedCheckError(f"exchanging {what}: {self.broken or 'a rank did not arrive'}")
        return [g["value"] for g in sorted(gathered, key=lambda g: g["rank"])]

    def host(self) -> Optional[HostPoints]:
        """The shared memory the agreement points meet in (every rank on one host), once the first point opened it;
        else None."""
        return self._host if isinstance(self._host, HostPoints) else None

    def agree(self, ok: bool, value: Optional[int] = None) -> Tuple[bool, Optional[int]]:
        """One agreement point inside a check (:mod:`gradwatch.parallel.lockstep`): whether every rank says ``ok``,
        and the smallest of the ranks' ``value`` (a byte count; None when no rank gives one).

        Raises:
            DistributedCheckError: A rank did not arrive within ``distributed_timeout`` (the coordinator is then
                broken: its group can no longer be trusted).
        """
        # One element (a point is a round trip, and one element is the cheapest): a rank that is not ok sends the least
        # int64, below any value
        code = _FAILED if not ok else _NO_VALUE if value is None else int(value)
        if self._host is _UNOPENED:  # the first point, on every rank: through shared memory where all share a host
            self._host = HostPoints.open(lambda mine: self.everyone(mine, "where the agreement points meet"),
                                         self.rank, self.world_size, self.timeout)
        try:
            if self._host is not None:
                smallest = self._host.smallest(code)
            else:
                mine = torch.tensor([code], dtype=torch.int64)
                dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=self.group)
                smallest = int(mine.item())
        except Exception as exc:  # noqa: BLE001 - a missing rank: said once, then no more checks
            raise DistributedCheckError(self._give_up("inside a check", exc)) from exc
        if smallest == _FAILED:
            return False, None
        return True, None if smallest == _NO_VALUE else smallest

    def plan_from_main(self, room: Optional[int], decide: Callable[[], Any]) -> Tuple[Optional[int], Any]:
        """Under DDP: rank 0's room and plan (``decide()``, run on rank 0 only), taken by every rank (one gather).

        Every rank holds the whole model, so rank 0's measure of the room stands for all, and all ranks make the
        same decisions: the same form, the same pieces of the cycle (split between them), the same tensors
        replayed by the training part (their replays are averaged).

        Raises:
            DistributedCheckError: As :meth:`main_decision` (rank 0's ``decide`` raised, or a rank is missing).
        """
        local: Any = None
        if self.is_main:
            try:
                local = (room, decide())
            except Exception as exc:  # noqa: BLE001 - every rank must still reach the gather below
                local = ("error", f"{type(exc).__name__}: {exc}")
        room, plan = self.main_decision(local, "the form and the training part's tensors")
        return room, plan

    # ------------------------------------------------------------------ 3. sharing
    def tensors_per_check(self, per_rank: int) -> int:
        """How many tensors one check rotates in: ``tensors_per_check`` per rank (0: all)."""
        return per_rank * self.world_size if per_rank > 0 else 0

    def share(self, items: Sequence[_T]) -> List[_T]:
        """This rank's round-robin share of the tensors (or, in the module form, the pieces) chosen for a check."""
        return list(items[self.rank :: self.world_size])

    # ------------------------------------------------------------------ 4. gathering
    def gather(self, result: RankResult) -> Optional[List[RankResult]]:
        """Every rank's :class:`RankResult`, by rank; None when a rank is missing (``broken`` is then set).

        Also takes rank 0's ``interval`` as the agreed one.
        """
        if self.broken is not None:
            return None
        gathered = self._gather({"phase": "result", "rank": self.rank, "result": result})
        if gathered is None:
            return None
        results = sorted((g["result"] for g in gathered), key=lambda r: r.rank)
        self.interval = int(results[0].interval)
        return results

    def gather_check(self, step: int, result: RankResult, error: Optional[BaseException]) -> Optional[List[RankResult]]:
        """This rank's check (``error``: what it raised, said here and sent with it), gathered with every rank's.

        Returns:
            Every rank's result, by rank; None when a rank is missing (the coordinator is then broken).
        """
        if isinstance(error, PeerFailed):  # the rank that raised says what; this one only stopped with it
            logger.info("gradwatch: the check at step %d stopped on rank %d: %s", step, self.rank, error)
        elif error is not None:
            logger.error("gradwatch: the check at step %d raised on rank %d; training goes on:\n%s", step, self.rank,
                         "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip())
            result.error, result.where = f"{type(error).__name__}: {error}", blamed(error)
        return self.gather(result)

    # ------------------------------------------------------------------ 5. training part
    def average(self, tensors: Dict[str, torch.Tensor], in_place: bool = False) -> Dict[str, torch.Tensor]:
        """The mean over ranks of each tensor, as DDP averages ``.grad``: summed in the tensor's own precision
        (float32 for lower ones), the small ones of a dtype together (:func:`buckets`: one all-reduce of a few
        MB, not one per tensor). With ``in_place`` (the replay's own gradients, which nothing else holds), a float32
        or float64 CPU tensor is averaged where it is, so averaging holds no copy of them all.

        Raises:
            Exception: The all-reduce failed (the caller records it; training goes on).
        """
        works: Dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            work = t.detach() if in_place else t.detach().clone()
            if work.device.type != "cpu" or work.dtype not in (torch.float32, torch.float64):
                work = work.to("cpu", torch.float64 if work.dtype == torch.float64 else torch.float32)
            works[name] = work
        for bucket in buckets([(name, w.dtype, w.numel()) for name, w in works.items()]):
            if len(bucket) == 1:
                self._sum(works[bucket[0]])
                continue
            flat = torch.cat([works[name].reshape(-1) for name in bucket])
            self._sum(flat)
            start = 0
            for name in bucket:
                n = works[name].numel()
                works[name].copy_(flat[start:start + n].view(works[name].shape))
                start += n
        out = {}
        for name, t in tensors.items():
            work = works[name]
            work /= self.world_size
            out[name] = work.to(t.device, t.dtype)  # no copy where it already is
        return out

    def _sum(self, tensor: torch.Tensor) -> None:
        """``tensor`` summed over the ranks, in place: through the points' shared memory where every rank is on one
        host (:mod:`gradwatch.parallel.host_collectives`: no gloo round trip), else gloo's all-reduce."""
        host = self.host()
        if host is not None and host.data and tensor.device.type == "cpu" and tensor.is_contiguous():
            combine(host, "all_reduce", tensor, "sum", point=lambda: host.smallest(0), out=tensor)
        else:
            dist.all_reduce(tensor, group=self.group)

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a broadcast; every rank must call it)."""
        shared = [value if self.rank == 0 else None]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        return shared[0]

    def _give_up(self, where: str, exc: Exception) -> str:
        """Break the coordinator after a collective of its group failed (a rank missing ``where``); the reason."""
        text = str(exc).strip()
        self.broken = (
            f"rank {self.rank} waited {self.timeout:g}s (distributed_timeout) for the other ranks {where} and gave up: "
            f"{type(exc).__name__}: {text.splitlines()[0] if text else ''} — a rank crashed, stalled or hung in its "
            "check (look at that rank's log); gradwatch stops checking in this process"
        )
        logger.error("gradwatch: %s", self.broken)
        return self.broken

    def _gather(self, payload: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
        """``all_gather_object`` behind a monitored barrier; None (and ``broken`` set) when a rank is missing. Where
        the points meet in shared memory, through it (:func:`~gradwatch.parallel.host_collectives.gather_objects`: its
        points wait ``distributed_timeout`` and name a missing rank, as the barrier does, without gloo's round trips)."""
        try:
            host = self.host()
            out: List[Any] = [None] * self.world_size
            if host is not None and host.data:
                out = gather_objects(host, payload, lambda: host.smallest(0))
            else:
                dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=self.timeout),
                                       wait_all_ranks=True)
                dist.all_gather_object(out, payload, group=self.group)
        except Exception as exc:  # noqa: BLE001 - a missing rank must not stop training here
            self._give_up("after a check", exc)
            return None
        phases = {g.get("phase") for g in out}
        if len(phases) > 1:  # the ranks are at different points of a check: nothing gathered can be trusted
            self.broken = (f"the ranks reached different points of a check ({sorted(map(str, phases))}); "
                           "gradwatch stops checking in this process")
            logger.error("gradwatch: %s", self.broken)
            return None
        return out

    def close(self) -> None:
        """Release the process group and the shared memory (best effort)."""
        host, self._host = self._host, None
        if isinstance(host, HostPoints):
            host.close()
        group, self.group = self.group, None
        if group is not None and self.broken is None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001
                pass


def _first_difference(a: Any, b: Any) -> Tuple[Any, Any]:
    """The first differing items of two sequences (or the lengths, or the values themselves).

    Example:
        >>> _first_difference([1, 2, 3], [1, 5, 3])
        (2, 5)
    """
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for x, y in zip(a, b):
            if x != y:
                return x, y
        return f"{len(a)} entries", f"{len(b)} entries"
    return a, b


#: Elements of one coalesced all-reduce of :meth:`DistributedCoordinator.average` (2**20: a few MB in float32).
BUCKET = 1 << 20


def buckets(sizes: Sequence[Tuple[str, torch.dtype, int]], limit: Optional[int] = None) -> List[List[str]]:
    """The names of ``sizes`` (``(name, dtype, elements)``, in order) in runs of one dtype of at most ``limit``
    (default :data:`BUCKET`) elements together; a tensor over ``limit`` alone. The same sizes give the same runs on
    every rank: few all-reduces a check where one a tensor made many (see docs/costs.md).

    Example:
        >>> f, d = torch.float32, torch.float64
        >>> buckets([("a", f, 3), ("b", f, 4), ("c", f, 9), ("d", d, 1), ("e", d, 2)], limit=8)
        [['a', 'b'], ['c'], ['d', 'e']]
    """
    limit = BUCKET if limit is None else limit
    out: List[List[str]] = []
    total, kind = 0, None
    for name, dtype, n in sizes:
        if out and dtype == kind and total + n <= limit:
            out[-1].append(name)
            total += n
        else:
            out.append([name])
            total, kind = n, dtype
    return out


def merge_results(results: Sequence[RankResult], order: Sequence[str], opts: Any) -> MergedCheck:
    """Merge the ranks' results of one check (the same on every rank, as every rank has them all).

    Example:
        >>> merged = merge_results([RankResult(0), RankResult(1, error="KeyError: 'y'", where="loss_fn")], [], None)
        >>> merged.report is None, str(merged.error), merged.where
        (True, "rank 1: KeyError: 'y'", 'loss_fn on rank 1')
        >>> str(merge_results([RankResult(0, error="E: x"), RankResult(1, error="E: x")], [], None).error)
        'ranks 0, 1: E: x'

    """
    reports = [(r.rank, r.report) for r in results if r.report is not None]
    failed = [r for r in results if r.failed]
    by_error: Dict[str, List[int]] = {}  # the same error on several ranks: said once
    for r in failed:
        by_error.setdefault(str(r.error), []).append(r.rank)
    error = DistributedCheckError("; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}" for text, ranks in by_error.items())
    ) if failed else None
    # What raised, where the user's code did (None when gradwatch itself refused: its message says why).
    where = "; ".join(f"{r.where} on rank {r.rank}" for r in failed if r.where) or None
    merged = merge_reports(reports, order, opts) if reports else None
    slow = slow_ranks(results)
    if merged is not None and slow:
        merged.notes.append(slow)
    return MergedCheck(
        report=merged,
        error=error,
        where=where,
        seconds=max((float(r.seconds) for r in results), default=0.0),
        training=[r.training for r in results],
    )
