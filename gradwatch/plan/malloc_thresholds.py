"""glibc's mmap threshold held where training left it, so that a check's frees do not move it.

glibc serves an allocation above its mmap threshold with a mapping of its own, given back to the system when freed,
and one below it from the heap, where a freed block stays counted in the process's RSS until it is reused or trimmed.
The threshold is dynamic: freeing a mapped block raises it to that block's size (up to :data:`HIGHEST`), and the
trim threshold to twice that. A check frees float64 copies, captures and replays larger than anything training frees,
so after the first check training's own mid-sized tensors come from the heap instead of mappings, and its forward and
backward peak higher (``benchmarks/shapes.py``'s ``cnn128``: higher and more variable peaks with the threshold left
dynamic than with it held). Held at the value training reached in its first step, training's median step is the
same; the runs are in docs/costs.md (Stop 82).

:func:`glibc` loads the C library once for this and for :func:`~gradwatch.plan.memory.release_freed`'s
``malloc_trim``. :func:`hold_thresholds` reads the threshold (:func:`mmap_threshold`: the smallest block glibc maps, found by
allocating blocks of growing size and counting the mapped ones) and sets it, with the trim threshold at twice it, as
fixed (``mallopt``), once per process. Elsewhere than glibc on Linux it does nothing.

Example:
    >>> t = mmap_threshold()  # the watch's meter calls hold_thresholds() before the first check allocates
    >>> t is None or LOWEST <= t <= HIGHEST
    True
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional

#: glibc's ``mallopt`` parameters.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc's bounds on the dynamic threshold (its ``DEFAULT_MMAP_THRESHOLD_MIN`` and ``_MAX`` on 64-bit systems).
LOWEST = 128 * 1024
HIGHEST = 32 * 1024 * 1024
#: The probe's step: each block this much bigger than the last (the threshold is found within it).
STEP = 1.05

@functools.lru_cache(maxsize=1)
def glibc() -> Any:
    """glibc, loaded once per process, with ``malloc``, ``free``, ``mallopt`` and, where it has one (2.33 and later),
    ``mallinfo2`` typed; None elsewhere (not Linux, or a C library without ``malloc_trim``).

    Example:
        >>> libc = glibc()
        >>> libc is None or libc is glibc()
        True
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):  # not glibc
        return None
    fields = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                              "uordblks", "fordblks", "keepcost")]
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = type("mallinfo2", (ctypes.Structure,), {"_fields_": fields})
    return libc


def mmap_threshold(libc: Any = None) -> Optional[int]:
    """glibc's mmap threshold now, in bytes (within :data:`STEP`; None where it cannot be read).

    A block that glibc maps raises the threshold to its own size when freed, so the probe goes upward: the first
    mapped block is the threshold, and freeing it moves the threshold by less than a step.

    Example:
        >>> t = mmap_threshold()
        >>> t is None or LOWEST <= t <= HIGHEST
        True
    """
    libc = libc or glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    size = LOWEST
    while size <= HIGHEST:
        before = libc.mallinfo2().hblks
        block = libc.malloc(size)
        if not block:
            return None
        mapped = libc.mallinfo2().hblks > before
        libc.free(block)
        if mapped:
            return size
        size = (int(size * STEP) // 4096 + 1) * 4096
    return HIGHEST


@functools.lru_cache(maxsize=1)
def hold_thresholds() -> Optional[int]:
    """Hold glibc's mmap threshold at its value now, the trim threshold at twice it (see the module docstring), once
    per process; the threshold held (None where nothing was held: not glibc, or a probe that failed).

    Example:
        >>> held = hold_thresholds()
        >>> held is None or hold_thresholds() == held  # once per process: a second call changes nothing
        True
    """
    libc = glibc()
    threshold = mmap_threshold(libc) if libc is not None else None
    if threshold is None:
        return None
    try:
        if libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1:
            libc.mallopt(M_TRIM_THRESHOLD, 2 * threshold)
            return threshold
    except Exception:  # noqa: BLE001 - an allocator setting only
        pass
    return None
