"""MKL's buffers given back after a check: the float64 products a check computes leave MKL's allocator holding more.

MKL's fast memory manager keeps the work buffers of its products (one set per thread and shape class) for the next
call, outside glibc's heap, so ``malloc_trim`` does not reach them. A check's float64 products (its numerical
derivatives, the module form's float64 copies) add buffers training's float32 products never asked for, and they
stayed counted in the process's RSS from the first check on (``benchmarks/shapes.py``'s ``encoder_long``: part of
the watched run's excess peak, docs/costs.md Stop 88). :func:`free_mkl_buffers` calls MKL's ``mkl_free_buffers``
(``mkl_serv_free_buffers`` in the MKL that torch's own wheels link in): it frees the buffers no product is using,
and training's next product takes the few it needs again. A check calls it once, as it ends
(``release_freed(mkl=True)``), not between its pieces, whose products would take them again each time. Where torch
has no MKL (another BLAS, another platform), it does nothing.

Example:
    >>> free_mkl_buffers() in (True, False)
    True
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

#: The names MKL's ``mkl_free_buffers`` goes by: its public one, and the one inside torch's statically linked MKL.
NAMES = ("mkl_free_buffers", "mkl_serv_free_buffers")


@functools.lru_cache(maxsize=1)
def _function() -> Optional[Callable[[], Any]]:
    """MKL's ``mkl_free_buffers``, looked up once: in the process's loaded libraries, then in torch's CPU library."""
    try:
        import ctypes

        import torch

        if not torch.backends.mkl.is_available():
            return None
        places = [None, os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")]
        for place in places:
            if place is not None and not os.path.exists(place):
                continue
            lib = ctypes.CDLL(place)
            for name in NAMES:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype, fn.argtypes = None, []
                    return fn
    except Exception:  # noqa: BLE001 - an optimization only: no MKL, no ctypes, another platform
        return None
    return None


def free_mkl_buffers() -> bool:
    """Give back the buffers MKL's allocator holds unused; True where MKL was found (and called).

    Example:
        >>> isinstance(free_mkl_buffers(), bool)
        True
    """
    fn = _function()
    if fn is None:
        return False
    try:
        fn()
    except Exception:  # noqa: BLE001 - an optimization only
        return False
    return True


__all__ = ["NAMES", "free_mkl_buffers"]
