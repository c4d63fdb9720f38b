"""Tensors inside nested batches and outputs: find them by path, rebuild the structure around new ones; and a
parameter's whole shape where the tensor itself is a placeholder (DeepSpeed ZeRO-3)."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, Mapping, Tuple

import torch


def named_leaves(obj: Any, path: Tuple[Any, ...] = ()) -> Iterator[Tuple[Tuple[Any, ...], torch.Tensor]]:
    """Every tensor inside tuples, lists and dicts (``ModelOutput`` too), in order, with its path of keys and indices.

    Example:
        >>> [p for p, _ in named_leaves({"x": torch.ones(1), "y": (torch.ones(1), 3)})]
        [('x',), ('y', 0)]
    """
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from named_leaves(v, path + (i,))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from named_leaves(v, path + (k,))


def tensor_leaves(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside tuples, lists and dicts (``ModelOutput`` too), in order.

    Example:
        >>> [t.item() for t in tensor_leaves((torch.tensor(1), {"a": [torch.tensor(2)]}))]
        [1, 2]
    """
    for _, t in named_leaves(obj):
        yield t


def rebuild(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn`` applied to each tensor, keeping every container's type (named tuples,
    ``OrderedDict``, Hugging Face ``ModelOutput``).

    Example:
        >>> rebuild({"a": (torch.ones(1), 2)}, lambda t: t * 3)
        {'a': (tensor([3.]), 2)}
    """
    return rebuild_at(obj, lambda _path, t: fn(t))


def rebuild_at(obj: Any, fn: Callable[[Tuple[Any, ...], torch.Tensor], Any], path: Tuple[Any, ...] = ()) -> Any:
    """:func:`rebuild` with ``fn(path, tensor)``: each tensor's path of keys and indices (as :func:`named_leaves`).

    Example:
        >>> rebuild_at({"a": torch.ones(1), "b": torch.ones(1)}, lambda p, t: t * 2 if p == ("b",) else t)
        {'a': tensor([1.]), 'b': tensor([2.])}
    """
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(rebuild_at(v, fn, path + (i,)) for i, v in enumerate(obj)))
    if isinstance(obj, (list, tuple)):
        return type(obj)(rebuild_at(v, fn, path + (i,)) for i, v in enumerate(obj))
    if isinstance(obj, Mapping):
        items = {k: rebuild_at(v, fn, path + (k,)) for k, v in obj.items()}
        kind: Any = type(obj)
        try:
            return kind(**items) if kind not in (dict, OrderedDict) else kind(items)
        except TypeError:  # a mapping type that takes no keywords
            return dict(items)
    return obj


def whole_shape(p: torch.Tensor) -> Tuple[int, ...]:
    """A parameter's whole shape: a DeepSpeed ZeRO-3 placeholder's ``ds_shape`` (the tensor itself is empty, its
    values partitioned over the ranks), any other tensor's own shape.

    Example:
        >>> whole_shape(torch.ones(3, 2))
        (3, 2)
    """
    shape = getattr(p, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(p.shape)


def whole_numel(p: torch.Tensor) -> int:
    """Entries of a parameter's whole shape (:func:`whole_shape`).

    Example:
        >>> whole_numel(torch.ones(3, 2))
        6
    """
    shape = getattr(p, "ds_shape", None)
    return math.prod(shape) if shape is not None else int(p.numel())


def param_names(model: torch.nn.Module, remove_duplicate: bool = True) -> Dict[int, str]:
    """``{id(parameter): name}`` for a model's parameters (a tied parameter under its first name, or its last name
    where ``remove_duplicate`` is False, as ``named_parameters`` walks them).

    Example:
        >>> lin = torch.nn.Linear(2, 1)
        >>> sorted(param_names(lin).values())
        ['bias', 'weight']
    """
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=remove_duplicate)}


def dense(g: torch.Tensor) -> torch.Tensor:
    """A gradient as a strided tensor, detached (``Embedding(sparse=True)`` and ``grad_fn`` may give sparse ones).

    Example:
        >>> dense(torch.ones(2).to_sparse()).layout
        torch.strided
    """
    if g.layout != torch.strided:
        return g.detach().to_dense()
    return g.detach() if g.requires_grad else g  # autograd.grad's results need no detach (one less view)


def real_view(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real view ``(..., 2)`` (real, imaginary); others as they are. Perturbed in place, the
    view perturbs ``t``.

    Example:
        >>> real_view(torch.tensor([1 + 2j])).tolist()
        [[1.0, 2.0]]
    """
    return torch.view_as_real(t) if t.is_complex() else t
