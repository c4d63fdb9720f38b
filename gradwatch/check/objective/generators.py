"""Random generators kept outside the global streams, held by the model or the loss.

``preserved_rng`` saves and restores torch's default generator, ``numpy.random``
and ``random``. A model or a loss may also draw from generators of its own: a
``torch.Generator``, ``np.random.default_rng(...)`` (``numpy.random.Generator``),
a ``np.random.RandomState`` or a ``random.Random``. Each evaluation of a check
would advance them, so training would diverge from a run without the watch, and
two evaluations would see different numbers. :class:`HeldGenerators` finds them
where the check can see them, puts each back in its saved state before every
evaluation and restores it after the check.

Where it looks (:func:`find_generators`): attributes of every module of the
model; the closure, defaults and referenced globals of ``loss_fn``, each
regularizer and ``grad_fn`` (and of the functions and bound methods those
reach, three levels deep); attributes of objects and items of lists, tuples and
dicts met on the way (one level deeper). A generator only reachable otherwise
(a global of a module the loss imports, a generator created inside ``forward``
from a global seed counter) is not found.
"""

from __future__ import annotations

import functools
import itertools
import random
import types
from typing import Any, Iterable, List

import numpy as np
import torch
from torch import nn

#: Generator types found; the process-wide default instances are left to ``preserved_rng``.
GENERATOR_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
#: Attributes every ``nn.Module`` has (parameters, hooks, flags): not searched.
_MODULE_KEYS = frozenset(vars(nn.Module()))
_MAX_ITEMS = 64
#: Levels of functions, objects and containers followed from each root.
MAX_DEPTH = 3
#: Most objects looked at outside the model's modules (a loss closing over a trainer reaches many).
MAX_VISITS = 20000


def _is_global(g: Any) -> bool:
    if g is torch.default_generator or g is np.random.mtrand._rand or g is random._inst:
        return True
    if isinstance(g, torch.Generator) and g.device.type != "cpu":
        try:
            return any(g is d for d in torch.cuda.default_generators)
        except Exception:  # noqa: BLE001 - no CUDA: not a default generator
            return False
    return False


def find_generators(roots: Iterable[Any], depth: int = MAX_DEPTH) -> List[Any]:
    """Non-global generators reachable from ``roots`` (models, functions, objects), each once.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> loss = lambda model, batch: float(rng.normal())
        >>> find_generators([loss]) == [rng]
        True
    """
    found: List[Any] = []
    seen = set()
    budget = [MAX_VISITS]

    def visit(obj: Any, depth: int) -> None:
        if obj is None or isinstance(obj, (str, bytes, int, float, complex, bool, torch.Tensor, np.ndarray, type, types.ModuleType)):
            return
        if id(obj) in seen or budget[0] <= 0:
            return
        seen.add(id(obj))
        budget[0] -= 1
        try:
            look_into(obj, depth)
        except Exception:  # noqa: BLE001 - an object that resists inspection holds no generator we can reset
            pass

    def look_into(obj: Any, depth: int) -> None:
        if isinstance(obj, GENERATOR_TYPES):
            if not _is_global(obj):
                found.append(obj)
            return
        if isinstance(obj, nn.Module):
            for m in obj.modules():
                seen.add(id(m))
                attrs = m.__dict__
                for key in attrs.keys() - _MODULE_KEYS:
                    visit(attrs[key], depth)
            return
        if depth <= 0:
            return
        if isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth - 1)
                except ValueError:  # an empty cell
                    pass
            for value in (obj.__defaults__ or ()) + tuple((obj.__kwdefaults__ or {}).values()):
                visit(value, depth - 1)
            for name in _global_names(obj.__code__):
                visit(obj.__globals__.get(name), depth - 1)
        elif isinstance(obj, types.MethodType):
            visit(obj.__self__, depth)
            visit(obj.__func__, depth)
        elif isinstance(obj, functools.partial):
            for value in (obj.func, *obj.args, *obj.keywords.values()):
                visit(value, depth - 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for value in list(itertools.islice(obj, _MAX_ITEMS)):
                visit(value, depth - 1)
        elif isinstance(obj, dict):
            for value in list(itertools.islice(obj.values(), _MAX_ITEMS)):
                visit(value, depth - 1)
        else:
            own = getattr(obj, "__dict__", None)
            if isinstance(own, dict):
                for value in list(itertools.islice(own.values(), _MAX_ITEMS)):
                    visit(value, depth - 1)
            call = getattr(type(obj), "__call__", None)  # noqa: B004 - the class's function object, not callability
            if isinstance(call, types.FunctionType):
                visit(call, depth - 1)

    for root in roots:
        visit(root, depth)
    return found


def _global_names(code: types.CodeType) -> List[str]:
    """Names a code object (and the code nested in it: lambdas, comprehensions) looks up as globals."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return names


def _state(g: Any) -> Any:
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    if isinstance(g, np.random.RandomState):
        return g.get_state()
    return g.getstate()


def _set_state(g: Any, state: Any) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(state)
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    elif isinstance(g, np.random.RandomState):
        g.set_state(state)
    else:
        g.setstate(state)


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


class HeldGenerators:
    """The generators :func:`find_generators` sees, with their states at construction.

    Call :meth:`reset` before each evaluation (same numbers every time) and once after the
    check (the generators continue exactly where training left them).

    Example:
        >>> gen = torch.Generator().manual_seed(0)
        >>> held = HeldGenerators([lambda model, batch: torch.rand(1, generator=gen)])
        >>> a = torch.rand(2, generator=gen); held.reset(); b = torch.rand(2, generator=gen)
        >>> bool(torch.equal(a, b)), len(held)
        (True, 1)
    """

    def __init__(self, roots: Iterable[Any]) -> None:
        self.generators = find_generators(roots)
        self._states = [_state(g) for g in self.generators]

    @classmethod
    def of(cls, generators: Iterable[Any]) -> "HeldGenerators":
        """Hold generators found earlier (no search), with their states now."""
        held = cls.__new__(cls)
        held.generators = list(generators)
        held._states = [_state(g) for g in held.generators]
        return held

    def moved(self) -> bool:
        """True when some generator was drawn from since construction (or the last :meth:`reset`).

        Example:
            >>> gen = torch.Generator().manual_seed(0)
            >>> held = HeldGenerators([lambda: torch.rand(1, generator=gen)])
            >>> _ = torch.rand(1, generator=gen); held.moved()
            True
        """
        return any(not _same_state(_state(g), state) for g, state in zip(self.generators, self._states))

    def reset(self) -> None:
        """Put every generator back in its saved state."""
        for g, state in zip(self.generators, self._states):
            _set_state(g, state)

    def __len__(self) -> int:
        return len(self.generators)
