"""The wrappers training puts around a model, and the three modules a watch takes from them.

Training often calls a wrapper, not the module the user wrote: DDP and ``DataParallel`` (``.module``),
``torch.compile``'s ``OptimizedModule`` (``._orig_mod``), Lightning Fabric's ``_FabricModule``
(``._forward_module``, which converts the inputs and runs the forward in its precision's context), and
DeepSpeed's engine (``.module``; its ZeRO partitions are read through :mod:`gradwatch.parallel.zero`), and
any nesting of them (Fabric sets up a compiled model as ``_FabricModule(OptimizedModule(model))``).
Accelerate's ``prepare`` gives one of these, or the model itself with a patched ``forward``.
A :class:`Wrapping` takes three modules from the chain:

- ``model``: the user's module, every wrapper taken off. Its parameter names are the ones the user
  wrote (``tensors=`` patterns, reports, ``checks.jsonl``, TensorBoard tags, alerts: ``0.weight``, not
  ``_orig_mod.0.weight`` or ``_forward_module.0.weight``), and the checks' own float64 evaluations run
  it, eager.
- ``entry``: the module training calls, handed to ``loss_fn`` by the training part's replay, so the replay
  computes what training computed (the compiled graph; Fabric's input conversion and autocast). DDP,
  ``DataParallel`` and DeepSpeed's engine are taken off, as they always were: their forward and backward are
  collectives (and the engine's forward keeps ZeRO's counters).
- ``root``: where the recorder of training's forwards sits: the user's module (under Fabric it sees the
  converted inputs and the autocast state the forward ran in), or the outermost compiled module (the code
  a compiled region runs cannot hold gradwatch's hook).

A Fabric module's outputs carry a hook that refuses any backward but ``fabric.backward(loss)`` where the
precision or strategy overrides backward ("bf16-mixed"); :meth:`Wrapping.fabric_backward` lets the
replay's backward (``torch.autograd.grad``, what ``fabric.backward`` runs for Fabric's CPU precisions)
through, as ``fabric.backward`` does.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2))
    >>> w = Wrapping.of(nn.DataParallel(model))
    >>> w.model is model, w.entry is model, w.root is model, w.fabric is None
    (True, True, True, True)
    >>> w.region() is None, w.grad_scaler() is None  # no Fabric: the recorded autocast, no scaler
    (True, True)
    >>> with w.fabric_backward():  # no Fabric: nothing to let through
    ...     pass
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, Callable, ContextManager, Iterator, List, Optional

import torch
from torch import nn

from gradwatch.parallel.zero import ZeroLossScale, ZeroOptimizerGroups, is_engine

#: Wrappers whose forward and backward are collectives: the watch never runs them (nor DeepSpeed's engine).
COLLECTIVE = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def is_collective(module: nn.Module) -> bool:
    """True for a wrapper whose forward and backward are collectives: DDP, ``DataParallel``, DeepSpeed's engine.

    Example:
        >>> is_collective(nn.DataParallel(nn.Linear(2, 1))), is_collective(nn.Linear(2, 1))
        (True, False)
    """
    return isinstance(module, COLLECTIVE) or is_engine(module)


def is_compiled(module: nn.Module) -> bool:
    """True for ``torch.compile(module)``'s wrapper (an ``OptimizedModule``).

    Example:
        >>> is_compiled(nn.Linear(2, 1))
        False
    """
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def is_fabric(module: nn.Module) -> bool:
    """True for Lightning Fabric's ``_FabricModule`` (what ``fabric.setup(model)`` returns), without importing lightning.

    Example:
        >>> is_fabric(nn.Linear(2, 1))
        False
    """
    return (type(module).__name__ == "_FabricModule"
            and isinstance(module.__dict__.get("_modules", {}).get("_forward_module"), nn.Module))


def inside(module: nn.Module) -> Optional[nn.Module]:
    """The module a wrapper wraps (None for a module that is not a known wrapper).

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> inside(nn.DataParallel(lin)) is lin, inside(lin)
        (True, None)
    """
    if is_collective(module) and isinstance(getattr(module, "module", None), nn.Module):
        return module.module  # type: ignore[return-value]
    if is_compiled(module):
        return module._orig_mod  # type: ignore[return-value]
    if is_fabric(module):
        return module._modules["_forward_module"]
    return None


def layers(module: nn.Module) -> List[nn.Module]:
    """The chain of wrappers, outermost first, ending with the user's module.

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> [type(m).__name__ for m in layers(nn.DataParallel(nn.DataParallel(lin)))]
        ['DataParallel', 'DataParallel', 'Linear']
    """
    chain = [module]
    while True:
        nxt = inside(chain[-1])
        if nxt is None or any(nxt is m for m in chain):
            return chain
        chain.append(nxt)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP, DataParallel, ``torch.compile``, Lightning Fabric and DeepSpeed wrappers (any
    depth and nesting); any other module as it is.

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> unwrap_model(lin) is lin, unwrap_model(nn.DataParallel(lin)) is lin
        (True, True)
    """
    return layers(model)[-1]


@dataclasses.dataclass
class Wrapping:
    """The modules a watch takes from the wrappers around a model (see the module docstring).

    Attributes:
        model: The user's module (names, the checks' own evaluations).
        entry: The module training calls, minus DDP/DataParallel (``loss_fn``'s model in the replay).
        root: Where the recorder of training's forwards sits.
        fabric: The Fabric module between ``entry`` and ``model``, or None.
        engine: DeepSpeed's engine around ``model``, or None.
        replicated: DDP wraps the model: every rank holds the same parameters after each step.

    Example:
        See the module's example.
    """

    model: nn.Module
    entry: nn.Module
    root: nn.Module
    fabric: Optional[nn.Module] = None
    engine: Optional[nn.Module] = None
    replicated: bool = False

    @classmethod
    def of(cls, module: nn.Module) -> "Wrapping":
        """The modules of ``module``'s chain of wrappers."""
        chain = layers(module)
        last_collective = max((i for i, m in enumerate(chain) if is_collective(m)), default=-1)
        run = chain[last_collective + 1:]  # what a replay may call: no collective inside
        compiled = [m for m in run if is_compiled(m)]
        fabric = next((m for m in run if is_fabric(m)), None)
        engine = next((m for m in chain if is_engine(m)), None)
        return cls(model=chain[-1], entry=run[0], root=compiled[0] if compiled else chain[-1], fabric=fabric,
                   engine=engine, replicated=any(isinstance(m, nn.parallel.DistributedDataParallel) for m in chain))

    def optimizer(self, optimizer: Any) -> Optional[torch.optim.Optimizer]:
        """The optimizer whose ``param_groups`` name the model's parameters: a ZeRO optimizer's (the one
        ``deepspeed.initialize`` returned, or the torch optimizer handed to it, whose groups ZeRO turned into flat
        partitions) as :class:`~gradwatch.parallel.zero.ZeroOptimizerGroups`; any other as it is."""
        zero = getattr(self.engine, "optimizer", None)
        if zero is not None and optimizer is getattr(zero, "optimizer", None):
            optimizer = zero  # the torch optimizer the user built and handed to deepspeed.initialize
        groups = ZeroOptimizerGroups.of(optimizer) if optimizer is not None else None
        return groups if groups is not None else optimizer

    def region(self) -> Optional[Callable[[], ContextManager[Any]]]:
        """The context training's ``loss_fn`` ran in, when it is not the recorded forward's autocast: under Fabric,
        none (the Fabric module opens its precision's context itself, around the forward only); else None (the
        replay takes the recorded forward's autocast state)."""
        return contextlib.nullcontext if self.fabric is not None else None

    @contextlib.contextmanager
    def fabric_backward(self) -> Iterator[None]:
        """Under Fabric, let a backward through the Fabric module's outputs pass its guard, as ``fabric.backward``
        does (the replay's backward is the one ``fabric.backward`` runs); elsewhere nothing."""
        owner = sys.modules.get(type(self.fabric).__module__) if self.fabric is not None else None
        if owner is None or not hasattr(owner, "_in_fabric_backward"):
            yield
            return
        flags = vars(owner)  # the module's globals: its hook reads the flag there
        before = flags["_in_fabric_backward"]
        flags["_in_fabric_backward"] = True
        try:
            yield
        finally:
            flags["_in_fabric_backward"] = before

    def grad_scaler(self) -> Any:
        """The ``GradScaler`` of Fabric's precision ("16-mixed" on a GPU), DeepSpeed fp16's loss scale
        (:class:`~gradwatch.parallel.zero.ZeroLossScale`), or None."""
        engine: Any = self.engine
        if engine is not None:
            return ZeroLossScale(engine) if engine.fp16_enabled() else None
        strategy = self.fabric.__dict__.get("_strategy") if self.fabric is not None else None
        return getattr(getattr(strategy, "precision", None), "scaler", None)


__all__ = ["COLLECTIVE", "Wrapping", "inside", "is_collective", "is_compiled", "is_fabric", "layers", "unwrap_model"]
