"""Trees of tensors as a module is given them: tensors by path, opaque parts (a KV cache, a config) copied, and fresh
inputs for each call of a module, so that every evaluation computes the same function.

Example:
    >>> import torch
    >>> args, kwargs = call_inputs((torch.ones(2),), {"scale": 2.0})
    >>> [path for path, _ in leaves((args, kwargs))], kwargs
    (['[0][0]'], {'scale': 2.0})
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterator, List, Sequence, Set, Tuple

import torch
from torch import nn

from gradwatch.trees import rebuild


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor inside tuples, lists and dicts (:func:`gradwatch.trees.rebuild`)."""
    return rebuild(obj, fn)


def leaves(obj: Any, path: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor, in order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}[{k}]")


def float_outputs(out: Any) -> List[torch.Tensor]:
    """The floating tensors of a module's output, in order."""
    return [t for _, t in leaves(out) if t.is_floating_point()]


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.is_floating_point() else t


def _opaque(obj: Any) -> bool:
    """An input that is not a tensor, a standard container or a plain value (a KV cache, a config)."""
    if isinstance(obj, (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)):
        return False
    if isinstance(obj, (list, tuple)):
        return any(_opaque(v) for v in obj)
    if isinstance(obj, dict):
        return any(_opaque(v) for v in obj.values())
    return True


def call_inputs(args: Any, kwargs: Any) -> Tuple[Any, Any]:
    """Fresh inputs for one call of a module: floating tensors cloned, opaque objects deep-copied.

    A module may work in place on its input (``ReLU(inplace=True)``) or mutate an object it is
    given (a transformers ``Cache`` appends keys and values at every call): each evaluation gets
    its own copies, so every evaluation computes the same function.
    """
    return copy_opaque(map_tensors((args, kwargs), _fresh))


def copy_opaque(obj: Any) -> Any:
    """``obj`` with its opaque parts deep-copied; the tensors in its standard containers stay as they are.

    Objects that cannot be copied are kept as they are.
    """
    if not _opaque(obj):
        return obj
    memo: Dict[int, Any] = {id(t): t for _, t in leaves(obj)}  # deepcopy keeps these tensors
    for t in _recorded(obj):  # (deepcopy refuses a tensor a graph recorded: its values are copied, detached)
        memo.setdefault(id(t), t.detach().clone())
    try:
        return copy.deepcopy(obj, memo)
    except Exception:  # noqa: BLE001 - an object that refuses copying: passed as captured
        return obj


def _recorded(obj: Any, depth: int = 8) -> Iterator[torch.Tensor]:
    """The tensors with a ``grad_fn`` held inside ``obj`` (its attributes, slots and containers, ``depth`` levels
    down, modules left out): a transformers ``Cache`` a forward with grad filled holds its keys and values so.

    Example:
        >>> class Held:
        ...     def __init__(self, t):
        ...         self.layers = [{"keys": t}]
        >>> w = torch.ones(2, requires_grad=True)
        >>> [t.shape for t in _recorded(Held(w * 2))], list(_recorded(Held(w)))
        ([torch.Size([2])], [])
    """
    seen: Set[int] = set()
    todo: List[Tuple[Any, int]] = [(obj, depth)]
    while todo:
        item, left = todo.pop()
        if id(item) in seen or left < 0 or isinstance(item, (nn.Module, str, bytes, int, float, type)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if item.grad_fn is not None:
                yield item
            continue
        if isinstance(item, dict):
            values: Sequence[Any] = list(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            values = list(item)
        else:
            values = list(getattr(item, "__dict__", {}).values())
            values += [getattr(item, s) for s in getattr(type(item), "__slots__", ()) if isinstance(s, str) and hasattr(item, s)]
        todo.extend((v, left - 1) for v in values)
