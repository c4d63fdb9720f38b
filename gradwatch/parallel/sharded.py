"""Sharded models (FSDP2's ``fully_shard``, DTensor parameters): a plain replica gathered for the check.

A model sharded with ``torch.distributed.fsdp.fully_shard`` cannot be deep-copied,
and everything a check does to it in place makes collectives: its forward
all-gathers parameters, and an operation on a DTensor gradient (the ``topk`` that
picks coordinates) all-gathers it. Each rank checks its own share of the tensors,
so the ranks' collectives differ: with ``dtype=None``, rank 0 all-gathered
``0.weight``'s gradient while rank 1 all-gathered ``0.bias``'s, and gloo aborted
the process ("Received data size doesn't match expected size"); a kink, a failure
or a different number of evaluations does the same. So gradwatch never evaluates
the live sharded model in a check:

- :class:`Replica` is a plain copy of the model, the same module classes
  without FSDP (its hooks and state left out), holding the *full* parameters
  gathered with ``DTensor.full_tensor()``, one parameter at a time in
  ``named_parameters()`` order, the same on every rank, and their gathered
  ``.grad``. It is refreshed in place at every check; everything after the
  gather (both parts of the check) runs on it with no collective at all.
- :func:`live_forward_forbidden` makes a forward of the live sharded model
  during a check raise at once, before its all-gather: a ``loss_fn`` that
  calls the model from its closure instead of the one it is given becomes an
  error record, not a collective on one rank only.

Example:
    >>> is_sharded(nn.Linear(2, 1))
    False
    >>> live = nn.Linear(2, 1)
    >>> replica = Replica(live)  # the structure only; refresh() fills it (gathers a sharded model)
    >>> type(replica.refresh(live)).__name__, torch.equal(replica.module.weight, live.weight)
    ('Linear', True)
"""

from __future__ import annotations

import collections
import contextlib
import copy
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type, cast

import torch
from torch import nn

from gradwatch.check.objective.dtensor import is_dtensor, is_sharded, whole


def fsdp_module() -> Optional[type]:
    """FSDP2's ``FSDPModule`` class once ``torch.distributed.fsdp`` is loaded, else None.

    A model sharded with ``fully_shard`` has loaded it, so a model of a process that never did holds no
    FSDP2 module; not importing it here keeps ``import gradwatch`` a second faster (FSDP's import is heavy).

    Example:
        >>> import sys
        >>> fsdp_module() is None or fsdp_module().__name__ == "FSDPModule"
        True
    """
    loaded = sys.modules.get("torch.distributed.fsdp")
    return getattr(loaded, "FSDPModule", None) if loaded is not None else None


def fsdp_loaded() -> bool:
    """True once FSDP2 is loaded in this process (see :func:`fsdp_module`)."""
    return fsdp_module() is not None


def is_fsdp(module: Any) -> bool:
    """True for a module ``fully_shard`` has sharded.

    Example:
        >>> is_fsdp(nn.Linear(2, 2))
        False
    """
    fsdp = fsdp_module()
    return fsdp is not None and isinstance(module, fsdp)


def fsdp_communicates(module: nn.Module) -> bool:
    """True unless the FSDP2 ``module`` shards over one rank only (a 1x2 ``dp x tp`` mesh): there its all-gathers
    and reduce-scatters involve no other rank, so no other rank can wait in them. Where torch keeps the mesh out of
    reach, True.

    Example:
        >>> fsdp_communicates(nn.Linear(2, 2))  # no FSDP2 module: nothing told otherwise
        True
    """
    try:
        from torch.distributed.fsdp import fully_shard

        group = cast(Any, fully_shard).state(module)._fsdp_param_group  # no public getter in torch 2.13
        if group is None:  # no parameter of its own: it gathers nothing
            return False
        return int(group.mesh_info.mesh.size()) > 1
    except Exception:  # noqa: BLE001 - not FSDP2, or another torch: assume it communicates
        return True

__all__ = ["REPLICA_NOTE", "LiveForwardInCheck", "Replica", "is_dtensor", "is_sharded", "kept_hooks",
           "layout", "live_forward_forbidden", "live_forward_refused",
           "mixed_precision", "refuse_unsupported"]

#: Module attributes that belong to FSDP (state, flags), never copied into a replica.
FSDP_KEYS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
#: Hook dicts of a module, and the dicts keyed like them that flag a hook's kind.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def layout(model: nn.Module) -> List[Tuple[str, Tuple[int, ...], str, bool]]:
    """``(name, global shape, dtype, has .grad)`` of every parameter, in the order the gather follows.

    Every rank must gather the same tensors in the same order; comparing the ranks' layouts before
    a gather (:meth:`gradwatch.parallel.coordinator.DistributedCoordinator.same_everywhere`) makes sure of it.

    Example:
        >>> layout(nn.Linear(2, 1))
        [('weight', (1, 2), 'torch.float32', False), ('bias', (1,), 'torch.float32', False)]
    """
    return [(n, tuple(p.shape), str(p.dtype), p.grad is not None) for n, p in model.named_parameters()]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's gathered value (:func:`~gradwatch.check.objective.dtensor.whole`, a
    collective), a plain one's detached copy."""
    with torch.no_grad():
        if is_dtensor(t):
            return whole(t).detach().contiguous()
        return t.detach().clone()


def plain_class(module: nn.Module) -> Type[nn.Module]:
    """The module's own class: the one ``fully_shard`` subclassed (``FSDPLinear`` -> ``Linear``)."""
    cls = type(module)
    fsdp = fsdp_module()
    if fsdp is not None and isinstance(module, fsdp):
        for base in cls.__mro__[1:]:
            if not issubclass(base, fsdp) and issubclass(base, nn.Module):
                return base
    return cls


def _distributed_hook(hook: Any) -> bool:
    """True for a hook that torch.distributed registered (FSDP's pre/post forward, DTensor's input/output)."""
    fn = getattr(hook, "func", hook)
    owner = getattr(fn, "__self__", None)
    fn = getattr(fn, "__func__", fn)
    where = getattr(fn, "__module__", None) or type(fn).__module__
    owner_where = type(owner).__module__ if owner is not None else ""
    return any(isinstance(w, str) and w.startswith("torch.distributed") for w in (where, owner_where))


def kept_hooks(attrs: Dict[str, Any], drop: Callable[[Any], bool]) -> Dict[str, Any]:
    """A module's hook dicts (and the dicts that flag a hook's kind) from its ``__dict__`` ``attrs``, without the hooks
    ``drop`` picks: new dicts, to put in place of the old.

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> _ = lin.register_forward_hook(lambda m, i, o: None, always_call=True)
        >>> kept = kept_hooks(lin.__dict__, lambda hook: True)
        >>> len(kept["_forward_hooks"]), len(kept["_forward_hooks_always_called"])
        (0, 0)
    """
    out: Dict[str, Any] = {}
    dropped: set = set()
    for key in _HOOK_DICTS:
        if key in attrs:
            out[key] = collections.OrderedDict((hid, h) for hid, h in attrs[key].items() if not drop(h))
            dropped.update(hid for hid in attrs[key] if hid not in out[key])
    for key in _HOOK_FLAGS:
        if key in attrs:
            out[key] = collections.OrderedDict((k, v) for k, v in attrs[key].items() if k not in dropped)
    return out


class Replica:
    """A plain, unsharded copy of a (sharded) model in its own dtype, refreshed from it in place.

    Building makes no collective (the parameters are allocated, not filled). :meth:`refresh` gathers
    every parameter and every ``.grad`` with ``DTensor.full_tensor()``: collectives on the model's own
    process group, so every rank must refresh its replica at the same point, for a model of the same
    :func:`layout`. Parameters that are not DTensors are copied as they are; buffers are copied. The replica's
    modules are the model's classes without FSDP; hooks torch.distributed registered are left out,
    other hooks are kept (the check suspends user hooks, as on any model).

    Args:
        model: The live model (sharded or not).

    Example:
        >>> live = nn.Linear(3, 1)
        >>> module = Replica(live).refresh(live)
        >>> module.weight is live.weight, torch.equal(module.weight, live.weight)
        (False, True)
    """

    def __init__(self, model: nn.Module) -> None:
        self.signature = _signature(model)
        memo: Dict[int, Any] = {}
        for _, p in model.named_parameters():
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
        for _, b in model.named_buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=b.device)
        self.module: nn.Module = _copy_module(model, memo)
        self._params = [p for _, p in self.module.named_parameters()]

    def matches(self, model: nn.Module) -> bool:
        """True while the live model has the same parameters and buffers (names, shapes, dtypes, devices)."""
        return _signature(model) == self.signature

    @torch.no_grad()
    def refresh(self, model: nn.Module) -> nn.Module:
        """Gather the live parameters and gradients into the replica (in place); returns the replica module.

        One ``full_tensor()`` per parameter, then one per gradient that exists, in
        ``named_parameters()`` order: the same collectives on every rank when the layouts agree.
        """
        for (_, live), mine in zip(model.named_parameters(), self._params):
            mine.copy_(full_tensor(live))
            mine.requires_grad_(live.requires_grad)
            mine.grad = None if live.grad is None else full_tensor(live.grad)
        self.refresh_rest(model)
        return self.module

    @torch.no_grad()
    def refresh_rest(self, model: nn.Module) -> None:
        """The live buffers (gathered where they are DTensors) and each module's training mode, into the replica."""
        for (_, buf), (_, live_buf) in zip(self.module.named_buffers(), model.named_buffers()):
            if buf is not None and live_buf is not None:
                buf.copy_(full_tensor(live_buf))
        for copied, original in zip(self.module.modules(), model.modules()):
            copied.training = original.training

    def release(self) -> None:
        """Drop the gathered gradients (between checks the replica holds the parameters only)."""
        for p in self._params:
            p.grad = None


def _signature(model: nn.Module) -> Tuple:
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return tuple((n, tuple(t.shape), t.dtype, str(t.device)) for n, t in tensors)


def _copy_module(module: nn.Module, memo: Dict[int, Any]) -> nn.Module:
    """``module`` rebuilt in its plain class: parameters and buffers from ``memo``, children likewise,
    other attributes deep-copied (with ``memo``, so tied tensors and shared submodules stay shared)."""
    if id(module) in memo:
        return memo[id(module)]
    cls = plain_class(module)
    new = cls.__new__(cls)
    memo[id(module)] = new
    state: Dict[str, Any] = kept_hooks(module.__dict__, _distributed_hook)
    for key, value in module.__dict__.items():
        if key.startswith("__composable_api") or key in FSDP_KEYS or key in state:
            continue
        if key == "_modules":
            state[key] = {n: None if c is None else _copy_module(c, memo) for n, c in value.items()}
        elif key in ("_parameters", "_buffers"):
            state[key] = {n: None if t is None else memo[id(t)] for n, t in value.items()}
        else:
            state[key] = _copied(value, memo)
    new.__dict__.update(state)
    return new


def _copied(value: Any, memo: Dict[int, Any]) -> Any:
    """A deep copy of an attribute, or the attribute itself where it cannot be copied.

    What cannot be deep-copied (a process group, a device mesh, a lock, the Lightning trainer that
    holds them) is the machinery around the module, not the state of its math: the replica shares it.
    A failed copy leaves ``memo`` as it was, so no half-copied object is reused.

    Example:
        >>> import threading
        >>> lock = threading.Lock()
        >>> _copied(lock, {}) is lock, _copied([1], {}) == [1]
        (True, True)
    """
    trial = dict(memo)
    try:
        out = copy.deepcopy(value, trial)
    except Exception:  # noqa: BLE001 - any failure of __deepcopy__/__reduce__ means: not copyable, share it
        return value
    memo.update(trial)
    return out


def mixed_precision(model: nn.Module) -> Optional[str]:
    """What FSDP2's ``MixedPrecisionPolicy`` changes in the model's compute, or None when nothing.

    With a ``param_dtype`` (or ``reduce_dtype``) other than the parameters' own, training's forward
    and backward run in another precision than the replica, and its inputs are cast: the training
    part cannot replay them (not supported yet; it says so instead of judging).

    Example:
        >>> mixed_precision(nn.Linear(2, 1)) is None
        True
    """
    if not fsdp_loaded():
        return None
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover
        return None
    for name, module in model.named_modules():
        if not is_fsdp(module):
            continue
        policy = getattr(cast(Any, fully_shard).state(module), "_mp_policy", None)  # no public getter in torch 2.13
        unit = cast(nn.Module, module)
        own = {p.dtype for p in unit.parameters(recurse=False)} or {p.dtype for p in unit.parameters()}
        for field in ("param_dtype", "reduce_dtype"):
            dtype = getattr(policy, field, None)
            if dtype is not None and any(dtype != d for d in own):
                return f"{field}={dtype} on {name or 'the model'}"
    return None


def refuse_unsupported(model: nn.Module) -> None:
    """Raise for a sharded form gradwatch does not check: FSDP1's ``FullyShardedDataParallel`` wrapper.

    Example:
        >>> refuse_unsupported(nn.Linear(2, 1))  # a plain model: fine
    """
    if "torch.distributed.fsdp" not in sys.modules:
        return  # no FSDP1 wrapper exists before its package is imported (importing it takes a second)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return
    found = next((name or "the model" for name, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)), None)
    if found is not None:
        raise ValueError(
            f"{found} is wrapped in FullyShardedDataParallel (FSDP1), which gradwatch does not check: its flat "
            "parameters cannot be gathered one tensor at a time. Shard with torch.distributed.fsdp.fully_shard "
            "(FSDP2) instead, or use DistributedDataParallel"
        )


class LiveForwardInCheck(RuntimeError):
    """The live sharded model ran a forward during a check (``loss_fn`` used a model from its closure)."""


def live_forward_refused(what: str, instead: str, given: str = "a gathered replica"
                         ) -> Callable[[nn.Module, tuple], None]:
    """A forward pre-hook (gradwatch's own: kept when user hooks are suspended) raising :class:`LiveForwardInCheck`
    for a forward of the live ``what`` model, whose hooks would gather (a collective on one rank only).

    Example:
        >>> hook = live_forward_refused("FSDP-sharded", "one from its closure")
        >>> hook(nn.Linear(2, 1), ())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        gradwatch.parallel.sharded.LiveForwardInCheck: loss_fn ran the live FSDP-sharded Linear inside a gradwatch check; ...
    """

    def refuse(module: nn.Module, args: tuple) -> None:
        raise LiveForwardInCheck(
            f"loss_fn ran the live {what} {type(module).__name__} inside a gradwatch check; its forward "
            "all-gathers parameters, a collective the other ranks are not making. Use the model loss_fn is "
            f"given (the check passes {given}), not {instead}"
        )

    refuse._gradwatch_hook = True  # type: ignore[attr-defined]
    return refuse


@contextlib.contextmanager
def live_forward_forbidden(model: nn.Module) -> Iterator[None]:
    """A forward of the live FSDP model (any of its FSDP units) raises for the duration, before it all-gathers.

    Example:
        >>> with live_forward_forbidden(nn.Linear(2, 1)):  # not sharded: nothing to guard
        ...     pass
    """
    handles = []
    if fsdp_loaded():
        refuse = live_forward_refused("FSDP-sharded", "one from its closure")
        for m in model.modules():
            if is_fsdp(m):
                handles.append(m.register_forward_pre_hook(refuse, prepend=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


#: The note every report of a sharded model carries.
REPLICA_NOTE = ("the model is sharded (FSDP2): the check ran on a replica gathered with DTensor.full_tensor() "
                "on every rank, never on the live sharded model")
