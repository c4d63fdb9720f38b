"""The update part on sharded parameters (FSDP2, tensor and sequence parallel, 2-D meshes): what each rank holds.

A DTensor parameter, its ``.grad`` and its optimizer state hold this rank's shard (``to_local``): the coordinates a
check samples, the factor its clipping applied and the update its step made are read there (:func:`local`). What
needs the whole gradient is made with the ranks together, at the check and right after the step, every rank making
the same collectives in the same order:

- :func:`world_norm`: the whole gradient's norm in float64, each shard counted once (a tensor replicated over a mesh
  dimension is counted once, not once per rank; one with a pending sum is gathered first);
- :func:`gathered_factors`: every rank's clipping factors, each named with its rank, to compare across ranks;
- :class:`Layout`: for an optimizer with no elementwise form (Muon, Shampoo, Adafactor: one matrix's update depends on
  all of it), the update training applied to one sampled tensor against the one the same optimizer class computes on
  the gathered tensor in one process: a step run per shard, where the algorithm needs the whole matrix, departs.

Example:
    >>> local(torch.ones(2)).tolist(), sharded_params(nn.Linear(2, 1))
    ([1.0, 1.0], False)
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn

from gradwatch.check.objective.dtensor import is_dtensor, whole
from gradwatch.check.update.clipping import Factor


def _placement(t: Any, kind: str) -> List[bool]:
    """For each of a DTensor's placements, whether it is a ``kind`` (``"Replicate"``, ``"Partial"``; the package is
    imported only where a DTensor exists: a plain model's check imports no distributed package)."""
    from torch.distributed.tensor import Partial, Replicate

    cls = {"Replicate": Replicate, "Partial": Partial}[kind]
    return [isinstance(p, cls) for p in t.placements]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself where it is a plain tensor)."""
    return cast(Any, t).to_local() if is_dtensor(t) else t


def sharded_params(model: nn.Module) -> bool:
    """Whether some parameter of ``model`` is a DTensor (FSDP2, tensor or sequence parallel).

    Example:
        >>> sharded_params(nn.Linear(2, 1))
        False
    """
    return any(is_dtensor(p) for p in model.parameters())


def refusal(model: nn.Module) -> Optional[str]:
    """Why the update of this sharded model is not verified (None: it is, or the model is not sharded): DTensors
    without a process group, or ranks that hold different parameters (pipeline stages: the whole gradient is not the
    sum of what each rank holds alike). A collective where the model is sharded: every rank calls it once.

    A tensor on a mesh of some ranks only (FSDP2 over the data-parallel dimension of a 2-D mesh) is held alike by the
    ranks of the other dimensions: its norm is counted once over them (:func:`world_norm`).

    Example:
        >>> refusal(nn.Linear(2, 1)) is None
        True
    """
    if not sharded_params(model):
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return "DTensor parameters without an initialized process group"
    names = sorted(n for n, _ in model.named_parameters())
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, names)
    odd = [rank for rank, got in enumerate(every) if got != every[0]]
    if odd:
        return (f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} hold other parameters than rank 0 "
                "(pipeline stages are not verified yet)")
    return None


def _replicas(t: Any) -> int:
    """Ranks that hold each entry of a DTensor alike: the sizes of its mesh's replicated dimensions, times the ranks
    outside its mesh (a mesh of some ranks only: the other dimensions of a 2-D mesh hold it alike); 1 for a shard on a
    mesh of every rank."""
    mesh = t.device_mesh
    outside = max(1, dist.get_world_size() // max(1, mesh.size()))
    return outside * math.prod(mesh.size(i) for i, replicated in enumerate(_placement(t, "Replicate")) if replicated)


def replica_key(p: Any, world: int) -> Optional[str]:
    """For a DTensor this rank holds as a replica (a ``Replicate`` placement, or a mesh of some of the ``world`` ranks
    only), what to add to its name so that only the ranks holding the same shard compare it (``""`` where it is not
    sharded, ``" [shard 1]"``); None where no other rank holds the same entries."""
    replicated, mesh = _placement(p, "Replicate"), p.device_mesh
    if not any(replicated) and mesh.size() >= world:
        return None
    coordinate = mesh.get_coordinate() or []
    shard = [str(c) for c, r in zip(coordinate, replicated) if not r]
    return f" [shard {','.join(shard)}]" if shard else ""


def pending(g: Any) -> bool:
    """Whether a DTensor gradient holds a pending sum (``Partial``: each rank's part, reduced by the step's ops)."""
    return is_dtensor(g) and any(_placement(g, "Partial"))


def misplaced(param: Any, grad: Any) -> bool:
    """Whether a DTensor gradient is laid out otherwise than its parameter: a pending sum (``Partial``), or other
    placements (a row-parallel embedding's gradient left whole): its values are redistributed to the parameter's
    before this rank's coordinates are read there (:func:`aligned`)."""
    return is_dtensor(grad) and is_dtensor(param) and (
        pending(grad) or tuple(grad.placements) != tuple(param.placements))


def aligned(param: Any, grad: Any) -> torch.Tensor:
    """This rank's values of ``grad`` where ``param``'s shard lies: a gradient laid out otherwise (:func:`misplaced`)
    redistributed to the parameter's placements first (a collective: every rank calls it for the same tensors, in the
    same order); else the local shard.

    Example:
        >>> aligned(nn.Parameter(torch.ones(2)), torch.full((2,), 3.0)).tolist()
        [3.0, 3.0]
    """
    if misplaced(param, grad):
        return cast(Any, grad).redistribute(device_mesh=param.device_mesh, placements=param.placements).to_local()
    return local(grad)


def world_norm(grads: Mapping[str, torch.Tensor]) -> float:
    """The norm of the whole gradient made of ``grads`` (name -> ``.grad``), in float64, summed over the ranks where
    any is a DTensor: each shard's squared norm once, a replicated tensor's once (divided by its replicas), a plain
    tensor's once (divided by the world: every rank holds it), a gradient with a pending sum (``Partial``) gathered
    first. Every rank must call it with the same names (a collective per pending sum, one all-reduce in all).

    Example:
        >>> round(world_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}), 6)
        5.0
    """
    sharded = any(is_dtensor(g) for g in grads.values()) and dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if sharded else 1
    by_device: Dict[torch.device, List[torch.Tensor]] = {}  # squared norms summed where they are: one sync a device
    for name in sorted(grads):
        g = grads[name].detach()
        if pending(g):
            summed = whole(g)  # (a collective: every rank, in this order)
            square, share = square_sum64(summed), world
        else:
            share = _replicas(g) if is_dtensor(g) else world
            square = square_sum64(local(g))
        by_device.setdefault(square.device, []).append(square / share)
    total = torch.zeros((), dtype=torch.float64)
    for squares in by_device.values():
        total += torch.stack(squares).sum().cpu()
    if sharded:
        total = all_reduce_cpu(total)
    return float(total.sqrt())


#: Elements summed at a time (2**20): ``vector_norm(g, dtype=float64)`` casts the whole tensor first, a
#: float64 copy twice a float32 gradient's bytes, and a float32 norm of a whole tensor is not precise enough (the
#: figures: docs/costs.md, "Stop 83" and "Stop 84").
SQUARE_CHUNK = 1 << 20
#: A chunk's float32 sum of squares below this (or not finite) is taken again in float64: its squares may have
#: underflowed (entries under about 1e-19) or overflowed (over about 1e19).
SQUARE_TINY = 2.0 ** -100


def square_sum64(t: torch.Tensor) -> torch.Tensor:
    """``sum(|t|**2)``, a float64 0-d tensor where ``t`` is: each :data:`SQUARE_CHUNK` elements' squares summed in
    float32 (torch's cascade sum: about 1e-7 relative, where the clipping threshold is judged to 1e-3), added in
    float64; a chunk whose float32 sum may have underflowed or overflowed (:data:`SQUARE_TINY`) in float64; a float64
    tensor in float64 throughout; a complex one as its real and imaginary parts.

    Example:
        >>> float(square_sum64(torch.tensor([3.0, 4.0])))
        25.0
        >>> tiny, huge = torch.tensor([1e-25, 1e-25]), torch.tensor([1e30])  # squares under and over float32's range
        >>> float(square_sum64(tiny)) == 2 * float(tiny[0].double()) ** 2, float(square_sum64(huge)) == float(huge.double()) ** 2
        (True, True)
    """
    flat = t.detach().reshape(-1)
    if flat.is_complex():  # |z|**2 = re**2 + im**2: its real and imaginary parts as entries of their own
        flat = torch.view_as_real(flat.resolve_conj()).reshape(-1)
    parts = flat.split(SQUARE_CHUNK)
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=flat.device)
    if flat.dtype == torch.float64:
        return torch.stack([part.pow(2).sum() for part in parts]).sum()
    sums = torch.stack([part.float().pow(2).sum() for part in parts]).to(torch.float64)
    for i, value in enumerate(sums.tolist()):  # (one sync for the tensor)
        if not math.isfinite(value) or (value < SQUARE_TINY and bool(parts[i].any())):
            sums[i] = parts[i].to(torch.float64).pow(2).sum()
    return sums.sum()


def all_reduce_cpu(t: torch.Tensor, op: Any = None) -> torch.Tensor:
    """``t`` (a small CPU tensor) reduced over every rank (a sum, or ``op``): through the current CUDA device where
    the process group is NCCL's, which reduces no CPU tensor.

    Example:
        >>> all_reduce_cpu(torch.ones(2)).tolist()  # one process: as it is
        [1.0, 1.0]
    """
    if not (dist.is_available() and dist.is_initialized()):
        return t
    op = dist.ReduceOp.SUM if op is None else op
    if dist.get_backend() == "nccl":
        on = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on, op=op)
        return on.cpu()
    dist.all_reduce(t, op=op)
    return t


def gathered_factors(found: Mapping[str, Factor], group_of: Mapping[str, int]
                     ) -> Tuple[Dict[str, Factor], Dict[str, int], Dict[str, int]]:
    """Every rank's factors, each tensor named with its rank (``"w (rank 1)"``), its parameter group and its rank:
    ``(factors, group_of, rank_of)``. A collective: every rank calls it once after each verified step.

    Example:
        >>> gathered_factors({"w": Factor(0.5)}, {"w": 0})[2]  # one process: as it is, no rank
        {}
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(found), dict(group_of), {}
    mine = {n: (f.value, f.misfit, group_of.get(n, 0)) for n, f in found.items()}
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    factors, groups, ranks = {}, {}, {}
    for rank, got in enumerate(every):
        for n, (value, misfit, group) in (got or {}).items():
            key = f"{n} (rank {rank})"
            factors[key], groups[key], ranks[key] = Factor(value, misfit), group, rank
    return factors, groups, ranks


def _hyperparameters(cls: type, group: Mapping[str, Any]) -> Dict[str, Any]:
    """The group's values that ``cls``'s constructor takes by name."""
    try:
        names = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in names.values()):
        return {k: v for k, v in group.items() if k != "params"}
    return {k: v for k, v in group.items() if k in names and k != "params"}


class Layout:
    """One sampled tensor's update against the same optimizer class's on the gathered tensor (layout invariance).

    At the check, :meth:`take` gathers the chosen parameter and its optimizer state (every rank, the same tensor: the
    choice follows the step, not the rank); after the step, :meth:`judge` gathers its gradient and the parameter
    again, builds a new instance of the optimizer's class with the group's hyperparameters on a plain copy, loads the
    gathered state, steps it, and returns the relative difference of the two updates (None where it could not be
    made, with :attr:`why`).

    Example:
        >>> lay = Layout()
        >>> p = nn.Parameter(torch.ones(2, 2)); opt = torch.optim.SGD([p], lr=0.1)
        >>> lay.take("w", p, opt); p.grad = torch.ones(2, 2); opt.step()
        >>> lay.judge(opt, {"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
        ...                 "maximize": False, "foreach": None, "differentiable": False, "fused": None})
        0.0
    """

    def __init__(self) -> None:
        self.name: Optional[str] = None
        self.why: Optional[str] = None
        self._param: Optional[nn.Parameter] = None
        self._before: Optional[torch.Tensor] = None
        self._state: Dict[str, Any] = {}

    def take(self, name: str, param: nn.Parameter, optimizer: Any) -> None:
        """At the check: the parameter and its optimizer state, gathered (collectives)."""
        self.name, self._param, self.why = name, param, None
        self._before = whole(param.detach()).clone()
        self._state = {k: (whole(v.detach()).clone() if isinstance(v, torch.Tensor) else v)
                       for k, v in optimizer.state.get(param, {}).items()}

    def judge(self, optimizer: Any, group: Mapping[str, Any]) -> Optional[float]:
        """After the step: ``‖training's update - the reference's‖ / ‖the reference's‖`` over the whole tensor
        (collectives: the gradient and the parameter gathered); None where no reference could be made."""
        param, before = self._param, self._before
        self._param, self._before = None, None
        if param is None or before is None or param.grad is None:
            return None
        grad, after = whole(param.grad.detach()), whole(param.detach())
        copy = nn.Parameter(before.clone())
        copy.grad = grad.clone()
        cls = type(optimizer)
        try:
            reference = cls([copy], **_hyperparameters(cls, group))
            if self._state:
                reference.state[copy] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                         for k, v in self._state.items()}
            reference.step()
        except Exception as exc:  # noqa: BLE001 - a class that cannot be built on one tensor: said, not judged
            self.why = f"{cls.__name__} could not be built and stepped on the gathered tensor alone ({exc})"
            return None
        theirs = (after - before).to(torch.float64)
        ours = (copy.detach() - before).to(torch.float64)
        scale = float(torch.linalg.vector_norm(ours))
        if scale == 0.0:
            return 0.0 if float(torch.linalg.vector_norm(theirs)) == 0.0 else math.inf
        return float(torch.linalg.vector_norm(theirs - ours)) / scale


__all__ = ["Layout", "aligned", "all_reduce_cpu", "gathered_factors", "is_dtensor", "local", "misplaced", "pending",
           "refusal", "replica_key", "sharded_params", "world_norm"]
