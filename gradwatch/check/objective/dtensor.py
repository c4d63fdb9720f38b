"""Whether a tensor or a model is a DTensor shard (FSDP2, tensor parallel)."""

from __future__ import annotations

from typing import Any

from torch import nn


def is_dtensor(t: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (a sharded or replicated parameter or gradient).

    Example:
        >>> import torch
        >>> is_dtensor(torch.zeros(2))
        False
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` holds an FSDP2 module (``fully_shard``) or a DTensor parameter.

    Such a model cannot be deep-copied, and its forward makes collectives: it is checked only on a
    replica that every rank gathers together (:mod:`gradwatch.watch.sharded`).

    Example:
        >>> is_sharded(nn.Sequential(nn.Linear(2, 2)))
        False
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6 or built without distributed
        return any(is_dtensor(p) for p in model.parameters())
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return True
    return any(is_dtensor(p) for p in model.parameters())
