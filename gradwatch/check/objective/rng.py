"""Random number generators held still: the same draws at every evaluation, the user's state restored after."""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any, ContextManager, Iterator

import numpy as np
import torch

_RNG_GUARD = threading.local()


def preserved_rng() -> ContextManager[None]:
    """Restore torch (CPU, CUDA), numpy and ``random`` RNG states on exit.

    Nested uses cost nothing: the outermost one restores every generator when it exits (a check
    wraps both of its parts in one, as reading and writing numpy's state alone costs ~0.2 ms).

    Example:
        >>> with preserved_rng():
        ...     _ = torch.rand(3)
    """
    if getattr(_RNG_GUARD, "depth", 0):
        return contextlib.nullcontext()  # inside the outermost one, which restores everything
    return _outermost_rng()


@contextlib.contextmanager
def _outermost_rng() -> Iterator[None]:
    _RNG_GUARD.depth = 1
    try:
        with _restoring_rng():
            yield
    finally:
        _RNG_GUARD.depth = 0


@contextlib.contextmanager
def _restoring_rng() -> Iterator[None]:
    torch_state = torch.get_rng_state()
    cuda_states = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_states = torch.cuda.get_rng_state_all()
    np_state = np.random.get_state()
    py_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        np.random.set_state(np_state)
        random.setstate(py_state)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every initialized CUDA device), numpy and ``random``.

    Used inside :func:`preserved_rng`. CUDA generators are seeded only once
    CUDA is initialized (a model on the GPU initializes it): seeding them
    lazily would queue a callback with a stack trace on every evaluation.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    np.random.seed(seed % (2**32))
    random.seed(seed)


class Reseeder:
    """:func:`seed_everything` for every evaluation of a check, at a third of its cost.

    The generator states right after seeding are captured once and put back on
    each call (``torch.set_rng_state`` and ``random.setstate`` are cheaper than
    re-seeding; numpy's ``seed`` is cheaper than its ``set_state``). Generators held by the
    model or the loss (:class:`~gradwatch.check.objective.generators.HeldGenerators`, ``held``) are put back in
    their saved state on each call. ``random``
    and ``numpy.random`` are reseeded only if one of the first :attr:`WATCH`
    evaluations drew from them (most objectives use torch's generator alone).

    Example:
        >>> with preserved_rng():
        ...     reseed = Reseeder(3)
        ...     a = torch.rand(2); reseed(); b = torch.rand(2)
        >>> bool((a == b).all())
        True
    """

    #: Evaluations watched for use of ``random`` and ``numpy.random`` before an unused one stops being reseeded.
    WATCH = 2

    def __init__(self, seed: int, held: Any = None) -> None:
        self.seed = int(seed)
        self._held = held if held else None  # HeldGenerators: reset before every evaluation too
        seed_everything(self.seed)
        self._torch = torch.get_rng_state()
        self._py = random.getstate()
        self._np = np.random.get_state()
        self._calls = 0
        self._used_py = False
        self._used_np = False

    def __call__(self) -> None:
        torch.set_rng_state(self._torch)
        if self._held is not None:
            self._held.reset()
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(self.seed)
        if 0 < self._calls <= self.WATCH:
            self._watch()
        undecided = self._calls < self.WATCH  # before the last watched evaluation, reseed everything
        self._calls += 1
        if undecided or self._used_np:
            np.random.seed(self.seed % (2**32))
        if undecided or self._used_py:
            random.setstate(self._py)

    def _watch(self) -> None:
        """After one of the first evaluations: did it draw from ``random`` or ``numpy.random``?

        Checking costs more than reseeding, so only the first :attr:`WATCH` evaluations are
        watched. A generator none of them drew from is not reseeded again (its state is still
        the seeded one); one they drew from is reseeded before every evaluation. torch's own
        generator is cheap to reset and always is.
        """
        self._used_py = self._used_py or random.getstate() != self._py
        self._used_np = self._used_np or not _same_np_state(np.random.get_state(), self._np)


def _same_np_state(a: Any, b: Any) -> bool:
    return a[0] == b[0] and a[2:] == b[2:] and bool(np.array_equal(a[1], b[1]))
