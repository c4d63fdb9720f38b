"""A ``TorchDispatchMode`` that leaves ``torch._dynamo`` unimported until something compiles.

torch wraps every ``TorchDispatchMode`` subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``, and that wrapper
imports ``torch._dynamo`` (and with it ``torch._inductor``: about 290 modules) at its first call, so that no compile
traces into the mode's frames. A check's modes (the kinks' recorder, the prefix's first reads) run in every process
that is watched, compiled or not: at the first check that import took a large share of a small process's data,
held for good (``docs/costs.md``). Nothing compiles where ``torch._dynamo`` was never imported, so until it is, the mode's dispatch
runs as it is; once it is, through torch's wrapper, as before.

Example:
    >>> import sys, torch
    >>> class Count(EagerDispatchMode):
    ...     ops = 0
    ...     def dispatch(self, func, types, args=(), kwargs=None):
    ...         Count.ops += 1
    ...         return func(*args, **(kwargs or {}))
    >>> with Count():
    ...     _ = torch.ones(2) + 1
    >>> Count.ops >= 1
    True
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class EagerDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose subclasses implement :meth:`dispatch` (not ``__torch_dispatch__``): see the module."""

    _disabled: Optional[Callable[..., Any]] = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # torch's wrapping, which imports torch._dynamo: done here once it is loaded
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "torch._dynamo" not in sys.modules:  # nothing can be compiling
            return self.dispatch(func, types, args, kwargs)
        cls = type(self)
        if cls._disabled is None:
            cls._disabled = torch._disable_dynamo(cls.dispatch, recursive=True)
        return cls._disabled(self, func, types, args, kwargs)

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """What the mode does with each operator (``__torch_dispatch__``'s arguments)."""
        raise NotImplementedError


__all__ = ["EagerDispatchMode"]
