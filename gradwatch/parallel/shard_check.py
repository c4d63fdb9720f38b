"""A sharded (FSDP2, tensor parallel, DeepSpeed ZeRO) model checked shard by shard: no copy of the model, no gather
of it. (ZeRO: its pieces' parameters gathered through ``GatheredParameters``, its training part in
:mod:`gradwatch.parallel.zero`.)

Both parts of a check run on the live sharded model, the same collectives on every rank in the same
order:

- **the backward part** is the module form (:mod:`gradwatch.check.modules.module_form`) on the pieces of the
  planner's cycle, split between the ranks by :func:`gradwatch.plan.shards.assign`: a Linear's or an
  Embedding's rows are checked on the rank that holds them, from a view of its shard (no gather, no
  copy but the float64 slice); every other piece (own code, a norm, an activation) by one rank, its
  parameters gathered for it alone (:class:`ShardView`, the gathers first, in plan order, on every rank).
  The unit inputs come from one forward of the live model (its all-gathers, as in training).
- **the training part** replays the objective's backward on the live model (:func:`backward_on_shards`):
  FSDP2 reduce-scatters it as it did training's, in training's precision (a ``MixedPrecisionPolicy``
  included), and each rank compares its shard of the replayed gradient with its shard of ``.grad``;
  the ranks' verdicts are merged worst first.

Example:
    >>> from torch import nn
    >>> from gradwatch.plan.units import Unit
    >>> lin = nn.Linear(3, 4)
    >>> view = ShardView(lin, {}, {})
    >>> with view(Unit("", lin, dict(lin.named_parameters())), None) as (unit, offset):
    ...     type(unit.module).__name__, unit.module is lin, offset
    ('Linear', False, 0)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union, cast

import torch
from torch import nn

from gradwatch.check.judging.training_judge import same_bits
from gradwatch.check.modules.own_code import HOOK_DICTS
from gradwatch.check.objective.dtensor import is_dtensor
from gradwatch.parallel.sharded import FSDP_KEYS, fsdp_loaded, full_tensor, is_fsdp, plain_class
from gradwatch.parallel.zero import gathered, is_partitioned
from gradwatch.plan.cycle import Piece
from gradwatch.plan.shards import Costs, Holding, assign, rows_held
from gradwatch.plan.units import Unit, faithful_rows, sliceable_rows

__all__ = ["SHARD_NOTE", "ShardView", "backward_on_shards", "gather_wholes", "held_by", "held_rows", "is_partial",
           "plan_shards", "replicas", "reshard", "settled", "settled_pairs"]


#: The note every report of a model checked shard by shard carries.
SHARD_NOTE = ("the model is sharded (FSDP2 or tensor parallel DTensors): checked shard by shard on the live model: "
              "each rank checks the rows it holds, gathers only the small pieces it checks whole, and judges its shard "
              "of .grad (a Partial one once reduced)")


#: :func:`held_by`'s answers: ``id(parameter)`` -> (a weak reference to it, the layout read, the answer).
_HELD: Dict[int, Tuple[Any, Tuple[Any, ...], Optional[Tuple[int, int]]]] = {}


def held_by(p: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(rank, world)`` of a DTensor whose rows are split on dim 0 as ``torch.chunk`` does over one mesh dimension
    (FSDP2's layout; a tensor parallel ``Colwise`` shard), every other mesh dimension replicating it or of size 1
    (a 2-D mesh's FSDP2 over tensor parallel, one of them of size 1); None for any other layout.

    Kept per DTensor with its placements, mesh and shape, and read again when any changes: a check asks it of every
    parameter of every unit, and each fresh answer reads the rank's shard through DTensor's ``to_local``.

    Example:
        >>> held_by(torch.ones(2)) is None
        True
    """
    if not is_dtensor(p):
        return None
    mesh: Any = getattr(p, "device_mesh", None)
    placements: Sequence[Any] = tuple(getattr(p, "placements", ()))
    layout = (placements, id(mesh), tuple(p.shape))
    known = _HELD.get(id(p))
    if known is not None and known[0]() is p and known[1] == layout:
        return known[2]
    answer = _held_by(p, mesh, placements)
    if len(_HELD) > 4096:  # parameters gone: their entries dropped now and then
        for key in [k for k, v in _HELD.items() if v[0]() is None]:
            del _HELD[key]
    _HELD[id(p)] = (weakref.ref(p), layout, answer)
    return answer


def _held_by(p: torch.Tensor, mesh: Any, placements: Sequence[Any]) -> Optional[Tuple[int, int]]:
    if mesh is None or len(placements) != mesh.ndim:
        return None
    split: Optional[int] = None  # the mesh dimension the rows are split over
    rows_split = False
    for dim, place in enumerate(placements):
        kind = type(place).__name__
        if kind == "Shard" and getattr(place, "dim", None) == 0:
            rows_split = True
            if int(mesh.size(dim)) > 1:
                if split is not None:
                    return None  # rows split over two dimensions: gathered as a whole piece instead
                split = dim
        elif kind != "Replicate" and int(mesh.size(dim)) > 1:
            return None
    if not rows_split:
        return None
    rank, world = (0, 1) if split is None else (int(mesh.get_local_rank(split)), int(mesh.size(split)))
    first, end = rows_held(int(p.shape[0]), rank, world)
    if int(local(p).shape[0]) != end - first:
        return None  # another split than torch.chunk's: gathered as a whole piece instead
    return rank, world


def held_rows(units: Sequence[Unit]) -> Dict[str, Holding]:
    """The units checked on the ranks that hold their rows: name -> :class:`~gradwatch.plan.shards.Holding`
    (rows, and ``(rank, world)`` of their split; one replica, see :func:`replicas`).

    A unit qualifies when it is a Linear or an Embedding whose forward is the library's own
    (:func:`gradwatch.plan.units.faithful_rows`: a subclass is gathered whole and checked in place) called as
    a module and each of its parameters is sharded on dim 0 alike, with one row per output row.
    """
    out: Dict[str, Holding] = {}
    for u in units:
        rows = sliceable_rows(u.module) if u.kind == "module" and faithful_rows(u.module) else None
        params = [p for _, p in u.module.named_parameters()]
        places = [held_by(p) for p in params]
        if rows is None or not params or any(pl is None or pl != places[0] for pl in places) \
                or any(int(p.shape[0]) != rows for p in params):
            continue
        rank, world = cast(Tuple[int, int], places[0])
        out[u.name] = Holding(rows, rank, world)
    return out


def replicas(held: Mapping[str, Holding]) -> Dict[str, Holding]:
    """``held`` with each unit's replicas counted: where fewer ranks split its rows than the process group has (a 2-D
    mesh's tensor parallel ranks holding the same FSDP2 shard), the ranks holding the same rows take turns at its
    pieces. One exchange of the ranks' splits (a collective: every rank, with the same units); none where every
    unit is split over the whole group.
    """
    rank, world = _rank_world()
    spread = [name for name, h in held.items() if h.world < world]
    if not spread:
        return dict(held)
    import torch.distributed as dist

    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, [held[name].rank for name in spread])
    out = dict(held)
    for i, name in enumerate(spread):
        same = [r for r in range(world) if everyone[r][i] == everyone[rank][i]]
        out[name] = held[name]._replace(replica=same.index(rank), replicas=len(same))
    return out


def _subtree(unit: Unit, named: Mapping[str, nn.Module]) -> List[Tuple[str, nn.Module]]:
    """The modules whose parameters a unit's check reads: its module and submodules, without those it calls
    (stubbed), for the own code of ``loss_fn`` none; full names, in module order."""
    if unit.kind == "loss_fn":
        return []
    stubbed = set(unit.stubbed)
    prefix = f"{unit.name}." if unit.name else ""
    out = []
    for rel, m in unit.module.named_modules():
        full = prefix + rel if rel else unit.name
        if any(full == s or full.startswith(s + ".") for s in stubbed):
            continue
        out.append((full, m))
    return out


#: The whole parameters of a rank's pieces (``id(live parameter)`` -> tensor), or what gathers them later.
Gathered = Union[Dict[int, torch.Tensor], Callable[[], Dict[int, torch.Tensor]]]


def plan_shards(model: nn.Module, units: Sequence[Unit], pieces: Sequence[Piece], costs: Optional[Costs] = None,
                later: bool = False) -> Tuple[List[Piece], Gathered, Dict[str, int]]:
    """This rank's pieces, the whole parameters they need gathered (``id(live parameter)`` -> tensor) and the
    offset of each unit's rows on this rank (the whole pieces shared out by ``costs``, :func:`assign`, where given).

    Every rank gathers the parameters of every piece that is not checked by rows, in plan order, and keeps
    those of its own: the same collectives everywhere, here, before anything of the check that may raise; with
    ``later``, when :meth:`ShardView.ready` is called instead (on every rank at the same point: after the capture,
    so that the copies are not held through it, nor through a replay that is the capture's forward).
    """
    held = replicas(held_rows(units))
    mine = assign(pieces, held, *_rank_world(), costs=costs)
    own = {str(p) for p, _ in mine}
    named = dict(model.named_modules())
    by_name = {u.name: u for u in units}
    groups = []
    for piece in pieces:
        unit = by_name.get(piece.unit)
        if unit is not None and unit.name not in held:
            groups.append((str(piece) in own, [p for _, m in _subtree(unit, named) for p in m._parameters.values()]))
    offsets = {p.unit: off for p, off in mine if off}
    return [p for p, _ in mine], (lambda: gather_wholes(groups)) if later else gather_wholes(groups), offsets


def gather_wholes(groups: Sequence[Tuple[bool, Sequence[Optional[torch.Tensor]]]]) -> Dict[int, torch.Tensor]:
    """Every DTensor and ZeRO-3 placeholder of ``groups`` (``[(keep, tensors), ...]``, the same list on every rank
    but ``keep``) gathered whole, each once, in order (collectives: every rank makes the same ones); ``id(tensor)``
    -> the whole of those in a group this rank keeps. A ZeRO-3 parameter is gathered through ZeRO's own
    ``GatheredParameters`` and partitioned again at once: a rank holds only the copies it keeps.

    Example:
        >>> gather_wholes([(True, [torch.ones(2)])])  # plain tensors are not gathered
        {}
    """
    wanted = {id(t) for keep, tensors in groups if keep for t in tensors}
    seen: Set[int] = set()
    out: Dict[int, torch.Tensor] = {}
    for _, tensors in groups:
        for t in tensors:
            if t is None or not (is_dtensor(t) or is_partitioned(t)) or id(t) in seen:
                continue
            seen.add(id(t))  # once each, whichever groups share it: the same collectives on every rank
            if is_partitioned(t):
                with gathered(t), torch.no_grad():
                    if id(t) in wanted:
                        out[id(t)] = t.detach().clone()
                continue
            full = full_tensor(t)
            if id(t) in wanted:
                out[id(t)] = full
    return out


def _rank_world() -> Tuple[int, int]:
    """This process's rank and the world's size (every rank takes its turn at the pieces checked whole)."""
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def reshard(model: nn.Module) -> None:
    """Every FSDP2 module of ``model`` back to its sharded parameters (a no-grad forward leaves the root's
    gathered, as training's backward would have freed them)."""
    if not fsdp_loaded():
        return
    for m in model.modules():
        if is_fsdp(m):
            cast(Any, m).reshard()


class ShardView:
    """``view(unit, rows)``: the unit with plain parameters for one piece's check (see the module docstring).

    Args:
        model: The live sharded model.
        gathered: ``id(live parameter)`` -> its gathered whole (:func:`plan_shards`), or what gathers them when
            :meth:`ready` is called.
        offsets: Unit name -> the first of the rows this rank holds of it.
        agree: An agreement point (:meth:`gradwatch.parallel.lockstep.Lockstep.point`), made before the capture
            gathers a DTensor input (tensor and sequence parallel).
    """

    def __init__(self, model: nn.Module, gathered: Gathered, offsets: Dict[str, int],
                 agree: Optional[Callable[[], Any]] = None) -> None:
        self.model = model
        self.agree = agree
        self._gather = gathered if callable(gathered) else None
        self.gathered: Dict[int, torch.Tensor] = {} if callable(gathered) else gathered
        self.offsets = offsets
        self._named: Dict[str, nn.Module] = {}
        self._live: Dict[str, nn.Parameter] = {}

    def ready(self) -> None:
        """Gather the whole parameters now, where :func:`plan_shards` left it for later (collectives: called on every
        rank at the same point, once the capture is done); nothing where they are gathered already."""
        if self._gather is not None:
            gather, self._gather = self._gather, None
            self.gathered = gather()

    @contextlib.contextmanager
    def __call__(self, unit: Unit, rows: Optional[Tuple[int, int]]) -> Iterator[Tuple[Unit, int]]:
        if not self._named:  # at the first piece, after the capture's forward, which left the root gathered
            reshard(self.model)
            self._named = dict(self.model.named_modules())
            self._live = dict(self.model.named_parameters(remove_duplicate=False))
        offset = self.offsets.get(unit.name, 0) if rows is not None else 0
        made: Dict[int, nn.Parameter] = {}

        def plain(p: Optional[torch.Tensor]) -> Any:
            if p is None:
                return None
            if id(p) not in made:
                if id(p) in self.gathered:
                    value = self.gathered[id(p)]
                elif is_dtensor(p) or is_partitioned(p):
                    with torch.no_grad():
                        value = local(p).detach()  # this rank's rows (a ZeRO-3 partition, flat): a view, no copy
                else:
                    made[id(p)] = cast(nn.Parameter, p)
                    return p
                made[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
            return made[id(p)]

        skip: Set[int] = {id(self._named[s]) for s in unit.stubbed if s in self._named}
        module = _proxy(unit.module, plain, skip)
        if offset and getattr(module, "padding_idx", None) is not None:
            pad = cast(int, module.padding_idx)
            vars(module)["padding_idx"] = pad - offset  # embedding_rows_copy compares it with this shard's rows
        params = {n: plain(self._live.get(n, p)) for n, p in unit.params.items()}
        yield dataclasses.replace(unit, module=module, params=params), offset


def _proxy(m: nn.Module, plain: Any, skip: Set[int]) -> nn.Module:
    """A shallow copy of ``m`` in its own class (without FSDP), its parameters through ``plain``, its hooks and
    FSDP state left out, its submodules likewise (those in ``skip`` kept as they are: the check stubs them)."""
    cls = plain_class(m)
    new = object.__new__(cls)
    state = {k: v for k, v in m.__dict__.items() if not k.startswith("__composable_api") and k not in FSDP_KEYS}
    for attr in HOOK_DICTS:
        if attr in state:
            state[attr] = collections.OrderedDict()
    state["_parameters"] = {k: plain(p) for k, p in m._parameters.items()}
    state["_buffers"] = dict(m._buffers)
    state["_modules"] = {k: c if c is None or id(c) in skip else _proxy(c, plain, skip) for k, c in m._modules.items()}
    new.__dict__.update(state)
    return new


def backward_on_shards(model: nn.Module, total: torch.Tensor, params: Sequence[torch.Tensor],
                       reuse: bool = True, before: Optional[Callable[[], Any]] = None) -> List[torch.Tensor]:
    """The objective's gradient as FSDP2 gives it to training: ``total.backward()`` on the live sharded model
    (its reduce-scatter, in training's precision), returned as this rank's shard of each of ``params``; every
    parameter's ``.grad`` is put back as training left it.

    Each shard is taken as FSDP2 hands it over (its post-accumulate-grad hook) and the reduce-scatter buffer is
    let go at once, so the replay never holds a second gradient of the whole model: with ``reuse`` (one
    micro-batch), a shard bit-identical to the live ``.grad`` is returned as the live shard itself (no copy);
    only one that differs is copied. A parameter that is not a DTensor (tensor parallel's replicated embedding
    and head) is taken the same way as its gradient is accumulated: the head's (a large gradient), accumulated
    first, no longer lives beside the rest of the backward's activations.
    ``before`` (an agreement point, :mod:`gradwatch.parallel.lockstep`) is called first, before any collective.
    """
    if before is not None:
        before()
    # The objective's forward left the root's parameters gathered, and FSDP2 then lists its unsharded ones: back
    # to the sharded ones, which hold .grad (their backward gathers them again, as any module resharded after
    # its forward). Clearing the unsharded ones instead would let the reduce-scatter add into the live .grad.
    reshard(model)
    everything = [p for p in model.parameters() if p.requires_grad]
    kept = [p.grad for p in everything]
    live = {id(p): g for p, g in zip(everything, kept)}
    index = {id(p): i for i, p in enumerate(params)}
    out: List[Optional[torch.Tensor]] = [None] * len(params)

    def take(p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        i = index.get(id(p))
        if i is not None:
            mine = local(g)
            ref = live.get(id(p))
            ref_local = None if ref is None else local(ref)
            if out[i] is not None:  # a second accumulation: a term on the sharded parameter itself (a regularizer)
                out[i] = cast(torch.Tensor, out[i]) + mine
            else:
                out[i] = (ref_local if reuse and ref_local is not None and same_bits(mine, ref_local)
                          else mine.clone() if is_dtensor(g) else mine)
        p.grad = None  # its view of the reduce-scatter buffer goes: the buffer is freed with the last one

    handles = [p.register_post_accumulate_grad_hook(take) for p in everything]
    for p in everything:
        p.grad = None
    try:
        total.backward()
        for i, q in enumerate(params):
            if out[i] is None and q.grad is not None:  # written to .grad without an accumulation: no hook ran
                out[i] = local(q.grad)
        return [torch.zeros_like(local(q)) if g is None else g for q, g in zip(params, out)]
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(everything, kept):
            p.grad = g


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, its flat partition of a ZeRO-3 placeholder (the tensor itself for a plain
    one)."""
    if is_dtensor(t):
        return cast(Any, t).to_local()
    return cast(Any, t).ds_tensor if is_partitioned(t) else t


def is_partial(t: Any) -> bool:
    """True for a DTensor with a ``Partial`` placement (a gradient not yet reduced over a mesh dimension).

    Example:
        >>> is_partial(torch.zeros(2)), is_partial(None)
        (False, False)
    """
    return is_dtensor(t) and any(_partial(p) for p in cast(Any, t).placements)


def _partial(placement: Any) -> bool:
    """True for a ``Partial`` placement (any reduction)."""
    return type(placement).__name__ == "Partial"


def settled(live: torch.Tensor, replayed: Optional[torch.Tensor]) -> torch.Tensor:
    """This rank's part of a ``Partial`` gradient once reduced: the live ``.grad`` (``replayed`` None) or the
    replayed gradient's local part laid out as the live one (a collective: every rank, in the same order).

    The ``Partial`` mesh dimensions are reduced (``Replicate``); ``Shard`` ones stay this rank's shard.
    """
    from torch.distributed.tensor import DTensor, Replicate

    source = cast(Any, live)
    if replayed is not None:
        source = DTensor.from_local(replayed, source.device_mesh, source.placements, run_check=False,
                                    shape=source.shape, stride=source.stride())
    target = [Replicate() if _partial(p) else p for p in source.placements]
    with torch.no_grad():
        return local(source.redistribute(placements=target)).detach()


def settled_pairs(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`settled` of each ``(live .grad, replayed local part)`` pair: ``(live reduced, replayed reduced)``.

    The ``Partial(sum)`` gradients of one mesh, dtype and set of ``Partial`` dimensions are reduced together: the
    live parts in one buffer, the replayed ones in another laid out alike, one all-reduce of each per dimension
    (so each element of both is summed in the same order: bit-identical parts stay bit-identical), not two
    collectives and two agreement points per tensor (sequence parallel's norm gradients: docs/costs.md, "Fewer
    agreement points"). A collective on every rank, the pairs in the same order; any
    other reduction (``Partial("avg")``, ...) is :func:`settled`, one tensor at a time.

    Example:
        >>> settled_pairs([])
        []
    """
    import torch.distributed as dist

    out: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * len(pairs)
    batches: Dict[Tuple[Any, ...], List[int]] = {}
    for i, (live, replayed) in enumerate(pairs):
        placements = cast(Any, live).placements
        dims = tuple(d for d, p in enumerate(placements) if _partial(p))
        if dims and all(getattr(placements[d], "reduce_op", None) == "sum" for d in dims):
            mesh = cast(Any, live).device_mesh
            batches.setdefault((id(mesh), dims, live.dtype, replayed.dtype), []).append(i)
        else:
            out[i] = (settled(live, None), settled(live, replayed))
    for (_, dims, _, _), members in batches.items():
        mesh = cast(Any, pairs[members[0]][0]).device_mesh
        with torch.no_grad():
            lives = torch.cat([local(pairs[i][0]).detach().reshape(-1) for i in members])
            replays = torch.cat([pairs[i][1].detach().reshape(-1) for i in members])
            for d in dims:
                group = mesh.get_group(d)
                dist.all_reduce(lives, group=group)
                dist.all_reduce(replays, group=group)
        start = 0
        for i in members:
            shape = local(pairs[i][0]).shape
            n = shape.numel()
            out[i] = (lives[start:start + n].view(shape), replays[start:start + n].view(shape))
            start += n
    return cast(List[Tuple[torch.Tensor, torch.Tensor]], out)
