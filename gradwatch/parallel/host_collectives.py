"""A check's collectives through shared memory, for ranks that share one host.

Inside a check, tensor and sequence parallel models make their collectives through torch's functional collective
operators (``torch.ops._c10d_functional.all_reduce``, ...), which :mod:`gradwatch.parallel.lockstep` wraps to make an
agreement point before each; FSDP2 and DeepSpeed call ``torch.distributed`` functions, which a check's region wraps
too. Where the points meet in shared memory (:mod:`gradwatch.parallel.host_points`), a collective of CPU tensors over
every rank is made there: each rank copies its input into its data slot, makes the point, and reads the others'
inputs, a slot at a time (a bigger tensor in rounds, a point each). Over gloo, each of a tensor parallel check's many
activation all-reduces is a TCP round trip; through the slots it is a copy in and a sum (docs/costs.md has the
figures). The coordinator's own averages and gathers of objects (:mod:`gradwatch.parallel.coordinator`) use the same
slots.

What it makes is what the process group would: an all-reduce's sum taken in rank order, on every rank alike (with 2
ranks, the same bits as gloo's, addition being commutative), an all-gather's inputs put end to end, a
reduce-scatter's sum of this rank's chunk. Only ``all_reduce``, ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (and the ``torch.distributed`` functions of :data:`FUNCTIONS`) of dense CPU tensors, over a
group of every rank in order, with ``sum``, ``avg``, ``max`` or ``min``, go this way; every other collective
(autograd collectives, a sub-group of a 2-D mesh, a GPU tensor) stays the process group's. The choice depends only on
what every rank's call has alike (the operator, the group, the input's shape and dtype), so every rank chooses the
same. Training's own collectives are never touched: the operators are wrapped only inside a check.

Example:
    >>> import torch
    >>> from gradwatch.parallel.host_points import HostPoints
    >>> points = HostPoints.open(lambda mine: [mine], rank=0, world=1, timeout=5.0)  # alone: every rank one host
    >>> combine(points, "all_gather_into_tensor", torch.arange(4.0).view(2, 2), None, point=lambda: points.smallest(0))
    tensor([[0., 1.],
            [2., 3.]])
    >>> points.close()
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import torch

from gradwatch.parallel.host_points import HostPoints

__all__ = ["combine", "function_through_host", "gather_objects", "through_host"]

#: The functional operators made through the slots, and whether each takes a reduction.
OPERATORS = {"all_reduce": True, "all_gather_into_tensor": False, "reduce_scatter_tensor": True}
#: The ``torch.distributed`` functions made through the slots (FSDP2's are the ``_single`` ones), and whether each
#: takes a reduction.
FUNCTIONS = {"all_gather_single": False, "all_gather_into_tensor": False, "reduce_scatter_single": True,
             "reduce_scatter_tensor": True}
#: The reductions made through the slots (the lower-case names the functional collectives pass).
REDUCTIONS = ("sum", "avg", "max", "min")

#: group name -> the global ranks of its group, in group order.
_RANKS: Dict[str, List[int]] = {}


def group_ranks(group: Any) -> Optional[List[int]]:
    """The global ranks of a collective's group (its name, the group, or None: the default group), in group order;
    None where torch cannot resolve it."""
    import torch.distributed as dist

    if group is None:
        group = dist.group.WORLD
    key = group if isinstance(group, str) else getattr(group, "group_name", None)
    if isinstance(key, str) and key in _RANKS:
        return _RANKS[key]
    try:
        pg = group if isinstance(group, dist.ProcessGroup) else dist.distributed_c10d._resolve_process_group(group)
        ranks = list(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - not a group torch knows: the process group's own collective
        return None
    if isinstance(key, str):
        _RANKS[key] = ranks
    return ranks


def _reduction(op: Any) -> Optional[str]:
    """The name of a reduction (a functional collective's string, or a ``ReduceOp``) made here, else None."""
    import torch.distributed as dist

    if isinstance(op, str):
        return op.lower() if op.lower() in REDUCTIONS else None
    for name in REDUCTIONS:
        if op == getattr(dist.ReduceOp, name.upper()):
            return name
    return None


def _dense(tensor: Any) -> bool:
    """Whether ``tensor`` can go through the slots: a plain, dense, non-empty CPU tensor."""
    return isinstance(tensor, torch.Tensor) and type(tensor) is torch.Tensor and tensor.device.type == "cpu" \
        and tensor.layout == torch.strided and tensor.numel() > 0


def _every_rank(points: HostPoints, group: Any) -> bool:
    """Whether ``group`` is every rank of the points, in order (alike on every rank)."""
    return group_ranks(group) == list(range(points.world))


def _rounds(points: HostPoints, flat: torch.Tensor, k: int, point: Callable[..., Any]
            ) -> Iterator[Tuple[int, int, List[torch.Tensor]]]:
    """``flat`` seen as ``k`` rows, exchanged a slot at a time: per round (one point), ``(start, stop, parts)`` with
    every rank's columns ``start:stop`` of its rows, by rank (views, read before the next round)."""
    m = flat.numel() // k
    per = max(1, points.data // (flat.element_size() * k))
    rows = flat.view(k, m)
    for start in range(0, m, per):
        stop = min(m, start + per)
        if not points.put(rows[:, start:stop]):  # pragma: no cover - a round is sized to a slot
            raise RuntimeError(f"a round of {k * (stop - start)} elements does not fit a slot of {points.data} bytes")
        point()
        yield start, stop, [p.view(k, stop - start) for p in points.parts(flat.dtype, k * (stop - start))]


def _reduce(parts: Sequence[torch.Tensor], reduction: str, out: torch.Tensor) -> None:
    """``out`` = the ranks' ``parts`` reduced in rank order (the same bits on every rank)."""
    out.copy_(parts[0])
    for part in parts[1:]:
        if reduction in ("sum", "avg"):
            out.add_(part)
        elif reduction == "max":
            torch.maximum(out, part, out=out)
        else:
            torch.minimum(out, part, out=out)
    if reduction == "avg":
        out.div_(len(parts))


def combine(points: HostPoints, name: str, tensor: torch.Tensor, reduction: Optional[str],
            point: Callable[..., Any], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``name``'s result on this rank (``all_reduce``, ``all_gather_into_tensor`` or ``reduce_scatter_tensor`` over
    every rank; in ``out`` where given, else a new tensor), ``tensor`` exchanged through the slots a slot at a time,
    with ``point()`` after each rank has put its part (see the module docstring)."""
    world = points.world
    flat = tensor.reshape(-1)
    if name == "all_gather_into_tensor":
        result = out if out is not None else torch.empty((world * tensor.shape[0], *tensor.shape[1:]),
                                                         dtype=tensor.dtype)
        gathered = result.view(world, -1)
        for start, stop, parts in _rounds(points, flat, 1, point):
            for r, part in enumerate(parts):
                gathered[r, start:stop].copy_(part[0])
        return result
    k = world if name == "reduce_scatter_tensor" else 1
    shape = (tensor.shape[0] // world, *tensor.shape[1:]) if k > 1 else tuple(tensor.shape)
    result = out if out is not None else torch.empty(shape, dtype=tensor.dtype)
    target = result.view(-1)
    row = points.rank if k > 1 else 0
    for start, stop, parts in _rounds(points, flat, k, point):
        _reduce([p[row] for p in parts], cast(str, reduction), target[start:stop])
    return result


def gather_objects(points: HostPoints, value: Any, point: Callable[..., Any]) -> List[Any]:
    """Every rank's ``value`` (picklable), by rank, through the slots: the pickles' lengths, then the pickles, each
    padded to the longest (``all_gather_object``'s work without a gloo round trip).

    Example:
        >>> points = HostPoints.open(lambda mine: [mine], rank=0, world=1, timeout=5.0)
        >>> gather_objects(points, {"rank": 0}, lambda: points.smallest(0))
        [{'rank': 0}]
        >>> points.close()
    """
    data = pickle.dumps(value)
    sizes = combine(points, "all_gather_into_tensor", torch.tensor([len(data)], dtype=torch.int64), None, point)
    longest = int(sizes.max())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = combine(points, "all_gather_into_tensor", mine, None, point)
    return [pickle.loads(every[r * longest:r * longest + int(sizes[r])].numpy().tobytes())  # noqa: S301 - our ranks
            for r in range(points.world)]


def through_host(points: Optional[HostPoints], name: str, args: Sequence[Any], kwargs: Dict[str, Any],
                 point: Callable[..., Any]) -> Optional[torch.Tensor]:
    """The functional collective ``name(*args, **kwargs)`` (``torch.ops._c10d_functional``) made through the shared
    slots, each round's point made with ``point``; None (nothing done, no point made) where it goes to the process
    group instead. The choice depends only on what every rank's call has alike."""
    if points is None or not points.data or name not in OPERATORS or kwargs or not args:
        return None
    tensor, group = args[0], args[-1]
    if not _dense(tensor) or tensor.dim() == 0 or not _every_rank(points, group):
        return None
    reduction = None
    if OPERATORS[name]:
        reduction = _reduction(args[1]) if isinstance(args[1], str) else None
        if reduction is None:
            return None
    if name != "all_reduce" and (args[-2] != points.world or (name == "reduce_scatter_tensor"
                                                              and tensor.shape[0] % points.world)):
        return None
    return combine(points, name, tensor, reduction, point)


def function_through_host(points: Optional[HostPoints], name: str, bound: Dict[str, Any],
                          point: Callable[..., Any]) -> Optional[Tuple[Any]]:
    """The ``torch.distributed`` function ``name`` (arguments ``bound`` by name) made through the shared slots:
    ``(what it returns,)`` (a completed ``Work`` when ``async_op``, else None), or None where it goes to the process
    group instead."""
    if points is None or not points.data or name not in FUNCTIONS:
        return None
    made: Any = getattr(torch._C._distributed_c10d, "_create_work_from_future", None)  # a finished Work (torch 2.1 on)
    if bound.get("async_op") and made is None:
        return None
    values = list(bound.values())
    out, tensor, group = values[0], values[1], bound.get("group")
    if not (_dense(tensor) and _dense(out)) or out.dtype != tensor.dtype or not out.is_contiguous() \
            or not _every_rank(points, group):
        return None
    reduction = None
    if FUNCTIONS[name]:
        reduction = _reduction(bound.get("op"))
        if reduction is None or tensor.numel() != points.world * out.numel():
            return None
        combine(points, "reduce_scatter_tensor", tensor, reduction, point, out=out)
    else:
        if out.numel() != points.world * tensor.numel():
            return None
        combine(points, "all_gather_into_tensor", tensor, None, point, out=out)
    if not bound.get("async_op"):
        return (None,)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result([out])
    return (made(done),)
