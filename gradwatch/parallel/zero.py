"""DeepSpeed ZeRO (stages 1, 2 and 3): the engine looked through and its model checked live, with no copy of it;
``form="objective"`` on a plain replica gathered for each check.

``deepspeed.initialize`` returns an engine (a ``DeepSpeedEngine``, an ``nn.Module`` around the user's
module) and a ZeRO optimizer. What a check needs is not where a plain model keeps it:

- the gradients live in ZeRO's partitioned buffers (``.grad`` is None after ``engine.backward``); each rank
  holds a partition of the step's averaged gradient;
- under stage 3 the parameters are empty placeholders (``ds_shape`` is their real shape), each rank
  holding a partition; the forward gathers them through hooks ZeRO registers on every module (and
  ``torch.nn.functional.linear`` is ZeRO's own ``autograd.Function`` from then on).

**Stage 3, piece by piece** (the default; shard by shard, :mod:`gradwatch.parallel.shard_check`): no copy of the
model. The checks' forwards run ``engine.module`` itself, ZeRO's hooks gathering each module's parameters and
releasing them after it, as in training; a rank reaches an agreement point before each of them
(:mod:`gradwatch.parallel.lockstep`). The training part's replay takes ``torch.autograd.grad`` of the step's
objective by a room-bounded set of parameters the ranks agree on (whole-shape gradients; ZeRO's
reduce-scatter hooks run on accumulation only, so never), averages them over the ranks, and each rank
judges its partition against ZeRO's own (:func:`zero_part`, through DeepSpeed's ``safe_get_local_grad``).
The backward part gathers each of its pieces' parameters through ZeRO's own ``GatheredParameters``, the same
gathers in the same order on every rank, keeping only its own pieces'. A check that stops midway (a rank
raised) releases what ZeRO holds gathered (:func:`reset_zero`).

**Stages 1 and 2** (shard by shard too): the parameters are whole on every rank and a forward makes no
collective; the backward part checks the ranks' shares of the pieces on the live model, and the training part
replays as for stage 3, then reads ZeRO's whole gradient of each judged tensor through ``safe_get_full_grad``,
one tensor at a time in the same order on every rank (:func:`whole_grad`).

``form="objective"``: :class:`ZeroReplica` is a plain copy of the user's module (the
same module classes, ZeRO's hooks and attributes left out), refreshed at each check, one parameter at a time in
``named_parameters()`` order on every rank: its value gathered through ZeRO's own
``deepspeed.zero.GatheredParameters`` (stage 3; a no-op for stages 1 and 2), its gradient read through
DeepSpeed's own ``deepspeed.utils.safe_get_full_grad`` (an all-reduce or all-gather of the partitions),
divided by the loss scale under fp16. These are the only collectives of the model's groups in a check, the
same on every rank; both parts of the check then run on the replica with no collective, as on an FSDP2
model's replica (:mod:`gradwatch.parallel.sharded`). ZeRO's state (its partitions, its loss scaler, its
micro-step counters) is only read.

ZeRO's gradients are the step's: ``engine.backward`` divides each micro-batch's loss by
``gradient_accumulation_steps``, and ZeRO averages over the data-parallel ranks. The training part's
replay averages over the ranks too and weighs the micro-batches handed to :meth:`GradWatch.accumulate`
by their share of the step's items, so a check belongs at the accumulation boundary:
``engine.is_gradient_accumulation_boundary()`` between ``engine.backward(loss)`` and ``engine.step()``
(inside the window ZeRO's partitions are not the step's yet: stage 1 and 2 refuse to give them out).

Importing this module does not import ``deepspeed``; a model of a process that never did holds no engine.

Example:
    >>> from torch import nn
    >>> is_engine(nn.Linear(2, 1)), zero_params(nn.Linear(2, 1)), zero3(nn.Linear(2, 1))
    (False, False, False)
    >>> zero_layout(nn.Linear(2, 1))[0]
    ('weight', (1, 2), 'torch.float32', True)
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
from torch import nn

from gradwatch.parallel.sharded import Replica, kept_hooks, live_forward_refused
from gradwatch.trees import whole_numel, whole_shape

#: Attributes ZeRO-3 puts on every module (its bookkeeping and the functions its hooks apply): left out of a replica.
ZERO_MODULE_KEYS = ("_external_params", "_original_parameters", "pre_bwd_fn", "post_bwd_fn", "all_parameters",
                    "ds_external_parameters")


def deepspeed_loaded() -> bool:
    """True once ``deepspeed`` is imported in this process (an engine cannot exist before).

    Example:
        >>> isinstance(deepspeed_loaded(), bool)
        True
    """
    return "deepspeed" in sys.modules


def is_engine(module: Any) -> bool:
    """True for the engine ``deepspeed.initialize`` returns (a ``DeepSpeedEngine`` or a subclass), without importing
    deepspeed.

    Example:
        >>> is_engine(nn.Linear(2, 1))
        False
    """
    return deepspeed_loaded() and isinstance(module, nn.Module) and any(
        c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed.") for c in type(module).__mro__)


def is_partitioned(p: torch.Tensor) -> bool:
    """True for a ZeRO-3 parameter (an empty placeholder; ``ds_shape`` is its shape, ``ds_tensor`` this rank's part).

    Example:
        >>> is_partitioned(torch.ones(2))
        False
    """
    return hasattr(p, "ds_id") and hasattr(p, "ds_shape")


def zero_params(model: nn.Module) -> bool:
    """True when the model's parameters are ZeRO's: partitioned (stage 3) or mapped onto its optimizer's partitions
    (stages 1 and 2, ``_hp_mapping``).

    Example:
        >>> zero_params(nn.Linear(2, 1))
        False
    """
    return deepspeed_loaded() and any(is_partitioned(p) or hasattr(p, "_hp_mapping") for p in model.parameters())


def engine_of(model: nn.Module) -> Optional[nn.Module]:
    """The ``DeepSpeedEngine`` around ``model`` when ``model`` is its ``.module`` (``GradWatch(engine.module)``): found
    in the closure of the forward pre-hook the engine registers on its module; None when there is none.

    Example:
        >>> engine_of(nn.Linear(2, 1)) is None
        True
    """
    if not deepspeed_loaded():
        return None
    for hook in model._forward_pre_hooks.values():
        for cell in getattr(getattr(hook, "__func__", hook), "__closure__", None) or ():
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if is_engine(held) and getattr(held, "module", None) is model:
                return held
    return None


def zero3(model: nn.Module) -> bool:
    """True when some parameter of ``model`` is a ZeRO-3 placeholder (checked piece by piece on the live engine).

    Example:
        >>> zero3(nn.Linear(2, 1))
        False
    """
    return deepspeed_loaded() and any(is_partitioned(p) for p in model.parameters())


def zero_layout(model: nn.Module) -> List[Tuple[str, Tuple[int, ...], str, bool]]:
    """``(name, whole shape, dtype, trainable)`` of every parameter, in the order a refresh gathers them: the ranks
    agree on it before the gather (every rank must make the same collectives).

    Example:
        >>> zero_layout(nn.Linear(2, 1))
        [('weight', (1, 2), 'torch.float32', True), ('bias', (1,), 'torch.float32', True)]
    """
    return [(n, whole_shape(p), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]


def is_deepspeed_hook(hook: Any) -> bool:
    """True for a hook DeepSpeed registered (the engine's forward prologue, ZeRO-3's gathers and releases, its
    NVTX ranges): part of ZeRO's machinery, never a user hook of the model's function.

    Example:
        >>> is_deepspeed_hook(lambda m, i: None)
        False
    """
    fn = getattr(hook, "func", hook)
    fn = getattr(fn, "__func__", fn)
    where = getattr(fn, "__module__", None) or type(fn).__module__
    return isinstance(where, str) and where.split(".")[0] == "deepspeed"


def strip_deepspeed(module: nn.Module) -> None:
    """Take ZeRO's hooks and bookkeeping attributes off every module of ``module`` (a replica's copy of them).

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> _ = lin.register_forward_hook(lambda m, i, o: None)
        >>> strip_deepspeed(lin); len(lin._forward_hooks)  # not DeepSpeed's: kept
        1
    """
    for m in module.modules():
        attrs = m.__dict__
        attrs.update(kept_hooks(attrs, is_deepspeed_hook))
        for key in [k for k in attrs if k in ZERO_MODULE_KEYS or k.startswith("ds_")]:
            del attrs[key]


def loss_scale(engine: Any) -> float:
    """The loss scale ZeRO's gradient partitions carry at the check (fp16's dynamic or static scale), 1 otherwise.

    Example:
        >>> loss_scale(None)
        1.0
    """
    if engine is None or not engine.fp16_enabled():
        return 1.0
    return float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0)


class ZeroLossScale:
    """DeepSpeed fp16's loss scale as the training part's replay reads a ``GradScaler`` (``is_enabled``,
    ``get_scale``, ``scale``): the replay backpropagates the loss times the scale in float16, as
    ``engine.backward`` did, then multiplies by its float32 reciprocal, as ZeRO's step unscales.

    Args:
        engine: The ``DeepSpeedEngine``.

    Example:
        >>> class Engine:  # what the shim reads of an engine
        ...     optimizer = type("Opt", (), {"loss_scale": 1024.0})()
        ...     def fp16_enabled(self): return True
        >>> s = ZeroLossScale(Engine())
        >>> s.is_enabled(), s.get_scale(), float(s.scale(torch.tensor(2.0)))
        (True, 1024.0, 2048.0)
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def is_enabled(self) -> bool:
        return bool(self.engine.fp16_enabled())

    def get_scale(self) -> float:
        return loss_scale(self.engine)

    def scale(self, total: torch.Tensor) -> torch.Tensor:
        return total * self.get_scale()


def at_boundary(engine: Any) -> None:
    """Raise unless the engine is at a gradient accumulation boundary (where ZeRO's gradients are the step's).

    Every rank is at the same micro-step, so every rank raises alike, before any collective.

    Example:
        >>> class Engine:  # what it reads of an engine
        ...     micro_steps = 4
        ...     def is_gradient_accumulation_boundary(self): return False
        ...     def gradient_accumulation_steps(self): return 2
        >>> at_boundary(Engine())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: GradWatch.step() was called at micro-step 1 of DeepSpeed's accumulation window ...
    """
    if engine is None:
        raise ValueError(
            "the model's parameters are DeepSpeed ZeRO's, but gradwatch found no DeepSpeedEngine around it (where "
            "ZeRO's gradients are the step's, and their loss scale): pass the engine deepspeed.initialize returned, "
            "GradWatch(engine, loss_fn, optimizer=optimizer)")
    if engine.is_gradient_accumulation_boundary():
        return
    steps = engine.gradient_accumulation_steps()
    raise ValueError(
        f"GradWatch.step() was called at micro-step {engine.micro_steps % steps + 1} of DeepSpeed's accumulation "
        f"window (gradient_accumulation_steps={steps}), where ZeRO's gradients are not the step's yet: call "
        "watch.accumulate(micro_batch) after each engine.backward(loss), and watch.step(micro_batch) only where "
        "engine.is_gradient_accumulation_boundary() (before engine.step())"
    )


class ZeroReplica(Replica):
    """A plain copy of a ZeRO model, refreshed at each check from ZeRO's partitions (see the module docstring).

    Building makes no collective. :meth:`refresh` gathers every parameter (``GatheredParameters``, stage 3) and
    then every trainable parameter's gradient (``safe_get_full_grad``), in ``named_parameters()`` order: every
    rank must refresh at the same point, for a model of the same :func:`zero_layout`. Under stage 3 a forward of
    the live model raises until :meth:`release` (its all-gathers would be made on one rank only).

    Args:
        model: The user's module (``engine.module``).
        engine: The ``DeepSpeedEngine`` around it (its accumulation boundary, its fp16 loss scale), or None.

    Example:
        >>> live = nn.Linear(3, 1)
        >>> replica = ZeroReplica(live)
        >>> module = replica.refresh(live)  # a plain module: a copy of the values, no gradient
        >>> module is live, torch.equal(module.weight, live.weight), module.weight.grad is None
        (False, True, True)
        >>> replica.release()
    """

    def __init__(self, model: nn.Module, engine: Any = None) -> None:
        super().__init__(model)
        strip_deepspeed(self.module)
        self.engine = engine
        self._guard: Optional[Any] = None

    def params(self) -> List[nn.Parameter]:
        """The replica's parameters, in the order of the live model's ``named_parameters()``."""
        return [p for _, p in self.module.named_parameters()]

    @torch.no_grad()
    def refresh(self, model: nn.Module) -> nn.Module:
        """Gather the live parameters and ZeRO's gradients into the replica (in place); returns the replica module."""
        live = [p for _, p in model.named_parameters()]
        if any(is_partitioned(p) or hasattr(p, "_hp_mapping") for p in live):
            at_boundary(self.engine)  # before any collective: every rank raises alike
        mine = self.params()
        for p, q in zip(live, mine):
            with gathered(p):
                q.data = p.detach().clone()
            q.requires_grad_(p.requires_grad)
        scale = loss_scale(self.engine)
        for p, q in zip(live, mine):
            q.grad = whole_grad(p, q, scale)
        self.refresh_rest(model)
        if any(is_partitioned(p) for p in live):
            self._forbid(model)
        return self.module

    def _forbid(self, model: nn.Module) -> None:
        """Until :meth:`release`, a forward of the live ZeRO-3 model raises before ZeRO's hooks gather."""
        if self._guard is None:
            self._guard = model.register_forward_pre_hook(
                live_forward_refused("ZeRO-3", "the engine or a model from its closure"), prepend=True)

    def release(self) -> None:
        """Drop the gathered gradients and let the live model run again (after each check)."""
        super().release()
        if self._guard is not None:
            self._guard.remove()
            self._guard = None


def gathered(p: torch.Tensor) -> Any:
    """ZeRO's own ``GatheredParameters([p])`` for a ZeRO-3 parameter (read only: no rank modifies it, so nothing is
    broadcast and it is partitioned again on exit, as it was), else nothing.

    Example:
        >>> with gathered(torch.ones(2)):
        ...     pass
    """
    if not is_partitioned(p):
        return contextlib.nullcontext()
    import deepspeed  # type: ignore[import-untyped]  # deepspeed.zero is an attribute of the package, not a module of its own

    return deepspeed.zero.GatheredParameters([p], modifier_rank=None)


def full_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The step's whole gradient of a ZeRO parameter, through DeepSpeed's ``safe_get_full_grad`` (a collective on
    its data-parallel group: every rank calls it for the same parameters in the same order); a plain parameter's
    ``.grad``.

    Example:
        >>> full_grad(torch.ones(2, requires_grad=True)) is None
        True
    """
    if not (is_partitioned(p) or hasattr(p, "_hp_mapping")):
        return p.grad
    from deepspeed.utils import safe_get_full_grad  # type: ignore[import-untyped]

    grad = safe_get_full_grad(p)
    return None if grad is None else grad.detach().clone()


def zero_part(p: torch.Tensor, replayed: torch.Tensor, scale: float = 1.0
              ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """This rank's partition of a ZeRO-3 parameter: ``(its values, ZeRO's gradient partition, the same entries of
    ``replayed``)``, flat, without the padding of the last partition. ZeRO's partition is read through DeepSpeed's
    ``safe_get_local_grad`` (no collective), divided by the fp16 loss ``scale``, in ``replayed``'s dtype.

    A partition is the ``ds_tensor.numel()`` entries of the flattened whole starting at the rank's index in the
    parameter's process group times that count (ZeRO's layout: ``set_fp32_grad_for_param`` reads it so).
    """
    from deepspeed.utils import safe_get_local_grad

    first, end = partition_span(p)
    live = safe_get_local_grad(p) if p.requires_grad else None
    if live is not None:
        live = live.detach().reshape(-1)[:end - first]
        live = _unscaled(live, scale).to(replayed.dtype)
    return cast(Any, p).ds_tensor.detach().reshape(-1)[:end - first], live, replayed.reshape(-1)[first:end]


def whole_grad(p: torch.Tensor, like: torch.Tensor, scale: float = 1.0) -> Optional[torch.Tensor]:
    """The step's whole gradient of a ZeRO-1 or ZeRO-2 parameter (:func:`full_grad`: a collective, every rank for the
    same parameters in the same order), divided by the fp16 loss ``scale``, in ``like``'s dtype and shape.

    Example:
        >>> whole_grad(torch.ones(2, requires_grad=True), torch.zeros(2)) is None  # no gradient yet
        True
    """
    grad = full_grad(p) if p.requires_grad else None
    if grad is None:
        return None
    return _unscaled(grad, scale).to(dtype=like.dtype, device=like.device).reshape(like.shape)


def _unscaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """A gradient ZeRO holds scaled by the fp16 loss ``scale``, divided by it (the tensor itself where it is 1)."""
    return grad / scale if scale != 1.0 else grad


def partition_span(p: torch.Tensor) -> Tuple[int, int]:
    """``(first, end)``: the entries of a ZeRO-3 parameter's flattened whole this rank's partition holds (its
    ``ds_tensor``, whose tail past the whole is padding on the last rank)."""
    import torch.distributed as dist

    size = int(cast(Any, p).ds_tensor.numel())
    first = size * dist.get_rank(group=cast(Any, p).ds_process_group)
    return first, first + max(0, min(size, whole_numel(p) - first))


def _coordinator(engine: Any) -> Any:
    """ZeRO-3's parameter coordinator (None for another engine)."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    return None if offload is None else offload.get_param_coordinator()


def release_leftovers(engine: Any) -> None:
    """After a backward of the live ZeRO-3 model: the parameters of the modules whose post-backward hook never ran
    (the first module's input needs no gradient) released, as ZeRO's own ``backward_epilogue`` does after
    ``engine.backward`` (a ``torch.autograd.grad`` of a check has no epilogue). No collective."""
    coordinator = _coordinator(engine)
    leftovers = getattr(coordinator, "release_backward_leftovers", None)
    if leftovers is not None:
        leftovers()


def reset_zero(model: nn.Module, engine: Any) -> None:
    """After a check stopped midway (a forward or backward cut short by a rank that raised): every parameter ZeRO-3
    holds gathered released, and its coordinator's step state reset, as the next training forward expects."""
    coordinator = _coordinator(engine)
    if coordinator is None:
        return
    release_leftovers(engine)
    coordinator.release_and_reset_all(model)
    coordinator.reset_step()


class ZeroOptimizerGroups(torch.optim.Optimizer):
    """A ZeRO optimizer's param groups over the model's own parameters (what the check objective reads its coupled
    ``weight_decay`` from): ZeRO's inner torch optimizer holds flat partitions instead.

    Its class name is the inner optimizer's, so the notes name it (``AdamW applies decoupled weight decay``).

    Args:
        optimizer: The ZeRO optimizer ``deepspeed.initialize`` returned (``bit16_groups`` for stages 1 and 2,
            ``fp16_groups`` and ``sub_group_to_group_id`` for stage 3).

    Example:
        >>> ZeroOptimizerGroups.of(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)) is None
        True
    """

    def __init__(self, optimizer: Any) -> None:
        inner = optimizer.optimizer
        groups: Dict[int, List[torch.Tensor]] = {}
        if hasattr(optimizer, "bit16_groups"):
            for i, params in enumerate(optimizer.bit16_groups):
                groups.setdefault(i, []).extend(params)
        else:
            ids = getattr(optimizer, "sub_group_to_group_id", {})
            for i, params in enumerate(getattr(optimizer, "fp16_groups", [])):
                groups.setdefault(int(ids.get(i, 0)), []).extend(params)
        decoupled = isinstance(inner, torch.optim.AdamW)
        param_groups = []
        for i, group in enumerate(inner.param_groups):
            if groups.get(i):
                options = {k: v for k, v in group.items() if k != "params"}
                options["decoupled_weight_decay"] = decoupled or bool(group.get("decoupled_weight_decay", False))
                param_groups.append({**options, "params": groups[i]})
        super().__init__(param_groups or [{"params": []}], dict(inner.defaults))
        self.__class__ = _named(type(inner).__name__)

    @classmethod
    def of(cls, optimizer: Any) -> Optional["ZeroOptimizerGroups"]:
        """The groups of a ZeRO optimizer (stages 1, 2 and 3); None for any other optimizer."""
        if not deepspeed_loaded() or not any(c.__module__.startswith("deepspeed.runtime.zero")
                                             for c in type(optimizer).__mro__):
            return None
        if not isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            return None
        return cls(optimizer)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError("ZeroOptimizerGroups only describes a ZeRO optimizer's param groups; it never steps")


@functools.cache
def _named(name: str) -> type:
    """A subclass of :class:`ZeroOptimizerGroups` named like the inner optimizer (one per name)."""
    return type(name, (ZeroOptimizerGroups,), {"__module__": __name__})


__all__ = ["ZERO_MODULE_KEYS", "ZeroLossScale", "ZeroOptimizerGroups", "ZeroReplica", "at_boundary",
           "deepspeed_loaded", "engine_of", "full_grad", "gathered", "is_deepspeed_hook", "is_engine", "is_partitioned",
           "loss_scale", "partition_span", "release_leftovers", "reset_zero", "strip_deepspeed", "whole_grad", "zero3", "zero_layout",
           "zero_params", "zero_part"]
