"""Whether a tensor or a model is a DTensor shard (FSDP2, tensor parallel)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, List, Tuple

from torch import nn


def is_dtensor(t: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (a sharded or replicated parameter or gradient).

    Example:
        >>> import torch
        >>> is_dtensor(torch.zeros(2))
        False
    """
    kind = _DTENSOR[0]
    if kind is None:
        if "torch.distributed.tensor" not in sys.modules:
            return False  # no DTensor exists before its package is imported (importing it takes a second)
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch built without distributed
            return False
        kind = _DTENSOR[0] = DTensor  # (an import statement costs more than the test, which runs per tensor)
    return isinstance(t, kind)


#: ``torch.distributed.tensor.DTensor`` once its package is imported (None before).
_DTENSOR: List[Any] = [None]


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` holds an FSDP2 module (``fully_shard``) or a DTensor parameter.

    Such a model cannot be deep-copied, and its forward makes collectives: it is checked only on a
    replica that every rank gathers together (:mod:`gradwatch.watch.sharded`).

    Example:
        >>> is_sharded(nn.Sequential(nn.Linear(2, 2)))
        False
    """
    if "torch.distributed.fsdp" not in sys.modules and "torch.distributed.tensor" not in sys.modules:
        return False  # neither exists before its package is imported (importing them here slows a first check)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6 or built without distributed
        return any(is_dtensor(p) for p in model.parameters())
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return True
    return any(is_dtensor(p) for p in model.parameters())


def whole(t: Any) -> Any:
    """A DTensor's whole value as a plain tensor (``full_tensor()``: a collective unless every placement is
    ``Replicate``); any other value as it is.

    Every rank must call it on the same DTensors in the same order: a ``Shard`` or ``Partial`` placement
    all-gathers or all-reduces over the mesh.

    Example:
        >>> import torch
        >>> whole(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    if not is_dtensor(t):
        return t
    if all(type(p).__name__ == "Replicate" for p in t.placements):
        return t.to_local()  # the same everywhere: no collective
    full = t.full_tensor()
    wait = getattr(full, "wait", None)  # an AsyncCollectiveTensor: its values, as a plain tensor
    if callable(wait) and not is_dtensor(full) and type(full).__name__ == "AsyncCollectiveTensor":
        full = wait()
    return full


class CollectiveInCheck(RuntimeError):
    """A piece checked by one rank made a collective (its own code communicates): the others would wait."""


#: Operator namespaces of torch.distributed's collectives (functional and in place).
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "_dtensor")
#: The functional collectives' operator namespaces (DTensor's redistributions, ``full_tensor()``, funcol), and the ops
#: in them that are no collective of their own (a wait, an autograd wrapper, a lookup) or involve some ranks only (point
#: to point).
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor")
NOT_COLLECTIVE = ("wait_tensor", "_wrap_tensor_autograd", "send", "recv", "isend", "irecv", "batch_p2p_ops",
                  "mesh_get_process_group")


#: The functional collective operators, listed at the first call.
_COLLECTIVES: List[Tuple[str, str]] = []


def functional_collectives() -> List[Tuple[str, str]]:
    """``(namespace, name)`` of every functional collective operator (:mod:`gradwatch.watch.lockstep` makes a point
    before each call of one). They are torch's C++ operators, registered when torch loads: listed once a process
    (reading every operator's name at every check costs too much).

    Example:
        >>> import torch.distributed._functional_collectives  # registers them
        >>> ops = functional_collectives()
        >>> ("_c10d_functional", "all_reduce") in ops, ("_c10d_functional", "wait_tensor") in ops
        (True, False)
    """
    if _COLLECTIVES:
        return list(_COLLECTIVES)
    import torch

    with contextlib.suppress(ImportError):  # what these register in Python, registered before the list is made
        import torch.distributed._functional_collectives  # noqa: F401
        import torch.distributed.tensor  # noqa: F401
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace in FUNCTIONAL_NAMESPACES and name not in NOT_COLLECTIVE:
            found.append((namespace, name))
    _COLLECTIVES.extend(sorted(found))
    return list(_COLLECTIVES)


#: The :func:`no_collectives` regions open now.
_ALONE: List[Any] = []


def checked_alone() -> bool:
    """True inside :func:`no_collectives`: one rank checks alone, so a collective raises instead of waiting (and no
    agreement point may come before it: that too is a collective)."""
    return bool(_ALONE)


def no_collectives() -> Any:
    """A context in which a collective raises :class:`CollectiveInCheck` before it starts.

    A piece of a sharded model is checked by one rank alone; a collective there (a ``full_tensor()`` written
    in a module's ``forward``) would wait for ranks that are not making it. Inside, it raises instead, and
    the piece is reported as not checked.

    Example:
        >>> import torch
        >>> with no_collectives():
        ...     (torch.ones(2) * 2).tolist()
        [2.0, 2.0]
    """
    from gradwatch.check.objective.dispatch_mode import EagerDispatchMode

    class _Refuse(EagerDispatchMode):
        def __enter__(self) -> Any:
            _ALONE.append(self)
            return super().__enter__()

        def __exit__(self, *exc: Any) -> Any:
            _ALONE.remove(self)
            return super().__exit__(*exc)

        def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.namespace in COLLECTIVE_NAMESPACES:
                raise CollectiveInCheck(
                    f"its own code makes a collective ({func.namespace}::{func.__name__}), which one rank cannot make "
                    "alone in a check; parallelize it with torch's plans (parallelize_module) so the collective is in "
                    "their hooks, or use form='objective'")
            return func(*args, **(kwargs or {}))

    return _Refuse()
