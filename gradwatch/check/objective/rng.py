"""Random number generators held still: the same draws at every evaluation, the user's state restored after."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import random
import sys
import threading
from typing import Any, Callable, ContextManager, Iterator, Optional, Tuple

import numpy as np
import torch

_RNG_GUARD = threading.local()


def preserved_rng() -> ContextManager[None]:
    """Restore torch (CPU, CUDA), numpy and ``random`` RNG states on exit.

    Nested uses cost nothing: the outermost one restores every generator when it exits (a check
    wraps both of its parts in one, as reading and writing numpy's state alone is slow).

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
        self._torch, self._py, self._np = _seeded_states(self.seed)
        self._np_raw = _np_raw()  # numpy's generator as seeding left it, read raw (None: read by get_state)
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
        if not self._used_np:
            raw = _np_raw() if self._np_raw is not None else None
            self._used_np = raw != self._np_raw if raw is not None else not _same_np_state(np.random.get_state(), self._np)


def _np_raw() -> Optional[bytes]:
    """The key and position of numpy's global generator as raw bytes, through its bit generator's ctypes interface
    (``state_address``): far cheaper than ``np.random.get_state()``, which copies the key entry by entry.

    Enough to tell a freshly seeded generator from one an evaluation drew from (any draw moves the position or
    regenerates the key; a Gaussian kept for the next draw is drawn from the key first). The reader is checked once
    against ``get_state``; where it disagrees or the generator is not an MT19937, None: callers use ``get_state``.

    Example:
        >>> np.random.seed(1); a = _np_raw(); _ = np.random.rand(); b = _np_raw(); np.random.seed(1)
        >>> a is None or (a != b and a == _np_raw())
        True
    """
    reader = _np_reader()
    return reader() if reader is not None else None


@functools.lru_cache(maxsize=1)
def _np_reader() -> Optional[Callable[[], bytes]]:
    """Reads the key and position of the MT19937 generator behind numpy's global ``RandomState``, found once per
    process to read what ``get_state`` says (None where it does not or cannot)."""
    try:
        bits = np.random.mtrand._rand._bit_generator
        if type(bits) is not np.random.MT19937:
            return None
        address = int(bits.ctypes.state_address)
        state: Any = np.random.get_state()  # the legacy tuple: (name, key, position, has_gauss, gauss)
        expected = np.asarray(state[1], dtype=np.uint32).tobytes() + int(state[2]).to_bytes(4, sys.byteorder, signed=True)
        size = len(expected)

        def read() -> bytes:
            _ = bits  # (held: the state lives as long as its bit generator)
            return ctypes.string_at(address, size)

        return read if read() == expected else None
    except Exception:  # noqa: BLE001 - no ctypes interface, another layout: get_state it is
        return None


#: The generators' states right after :func:`seed_everything` of a seed (torch's CPU one, ``random``'s, numpy's), for
#: the last :data:`SEEDED_KEPT` seeds: unit tests check with one seed again and again, and reading numpy's state alone
#: costs more than seeding every generator.
_SEEDED: "collections.OrderedDict[int, Tuple[torch.Tensor, Any, Any]]" = collections.OrderedDict()
SEEDED_KEPT = 8
_SEEDED_LOCK = threading.Lock()


def _seeded_states(seed: int) -> Tuple[torch.Tensor, Any, Any]:
    """:func:`seed_everything` of ``seed``, and the states it leaves (torch's CPU generator, ``random``, numpy).

    A seed met before is put back from its kept states (the same states: seeding is a function of the seed alone),
    and numpy seeded again (cheaper than setting its state).

    Example:
        >>> a = _seeded_states(5); x = torch.rand(2)
        >>> b = _seeded_states(5); bool((torch.rand(2) == x).all()), bool((a[0] == b[0]).all())
        (True, True)
    """
    with _SEEDED_LOCK:
        kept = _SEEDED.get(seed)
    if kept is None:
        seed_everything(seed)
        kept = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        with _SEEDED_LOCK:
            _SEEDED[seed] = kept
            while len(_SEEDED) > SEEDED_KEPT:
                _SEEDED.popitem(last=False)
        return kept
    torch.set_rng_state(kept[0])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    np.random.seed(seed % (2**32))
    random.setstate(kept[1])
    return kept


def _same_np_state(a: Any, b: Any) -> bool:
    return a[0] == b[0] and a[2:] == b[2:] and bool(np.array_equal(a[1], b[1]))
