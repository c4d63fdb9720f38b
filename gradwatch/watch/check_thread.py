"""A check's own thread: on the CPU, the check's allocations kept out of the heap training allocates from.

glibc's malloc gives each thread an arena of its own (up to a few per core). The check allocates and frees its
float64 copies, replays and captures in between training's steps; in training's arena those frees leave free chunks
of the check's sizes among training's, and training's next forward and backward then spread over that heap: on a
CNN, training's own peak rose once checks ran at every step, even with every freed chunk given back to the system
after each check (``malloc_trim``). Run in a thread of its own, the check allocates from another arena, and training's
peak stays near its own (plus what the first check maps in for good: float64 kernels, imports; docs/costs.md has the
figures). Large tensors (over glibc's mmap threshold) are mapped and unmapped either way.

One persistent thread (OpenMP keeps a team of threads per thread that calls it: a new thread per check would start a
new team each time). The caller's context variables and grad mode go with the call; its exception comes back. Only
in one process with the model on the CPU: a CUDA stream is per thread, and collectives keep to their thread.

Example:
    >>> thread = CheckThread()
    >>> thread.run(lambda: torch.is_grad_enabled())
    True
    >>> thread.close()
"""

from __future__ import annotations

import contextvars
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")


class CheckThread:
    """Runs a check in one persistent worker thread (see the module docstring).

    Example:
        See the module's example.
    """

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in the worker thread, with this thread's context variables and grad mode; returns its result, or
        raises its exception. Called from the worker itself (a check inside a check), ``fn`` runs here.

        An interrupt (Ctrl-C) while the check runs waits for it to end first (it may hold training's parameters
        perturbed), then is raised.
        """
        if threading.current_thread().name.startswith("gradwatch-check"):
            return fn()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradwatch-check")
            pool = self._pool
        context = contextvars.copy_context()
        grad = torch.is_grad_enabled()

        def call() -> T:
            with torch.set_grad_enabled(grad):
                return context.run(fn)

        future: Future = pool.submit(call)
        interrupted: Optional[BaseException] = None
        while True:
            try:
                result = future.result()
                break
            except (KeyboardInterrupt, SystemExit) as exc:  # the check ends first: training's tensors as they were
                interrupted = interrupted or exc
            except BaseException:
                if interrupted is not None:
                    raise interrupted from None
                raise
        if interrupted is not None:
            raise interrupted
        return result

    def close(self) -> None:
        """Stop the worker thread (idempotent)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


__all__ = ["CheckThread"]
