"""Agreement points through shared memory, for ranks that share one host.

A check's agreement point (:mod:`gradwatch.parallel.lockstep`) is a one-element all-reduce. Over gloo that is a TCP
round trip, and a tensor parallel check makes dozens of them. Ranks on one host (tensor parallel almost always is)
agree instead through a small shared-memory file: each rank writes its value and its point's number into its own slot
and reads the others', far quicker than the round trip (docs/costs.md has the figures).

Layout: a header (a random word that proves every rank opened the same file) and, per rank, on a cache line of its
own, two numbers and two values, one of each per parity of the point number: a rank one point ahead writes the other
parity, so a slow rank still reads the point it waits at (no rank can get two points ahead: the next point waits for
it). A rank writes its value first, then the point's number; a reader that sees the number reads the value. x86-64
keeps stores in order and loads in order, so the shared memory is used there only (elsewhere the points stay gloo's).
A rank that waits past ``timeout`` marks its slot as gone before it raises: a rank that reaches the point later (it
stalled) finds the mark and raises too, where gloo's all-reduce would fail, instead of going on to a collective the
other rank no longer makes.

Each rank also has two data slots of :data:`DATA` bytes (one per parity), after the points: a check's collectives of
CPU tensors over every rank (:mod:`gradwatch.parallel.host_collectives`) put a rank's input in its slot before the
point and read the others' after it. A slot of point ``n`` is written again only for point ``n + 2``, which no rank
reaches before every rank has passed point ``n + 1``, after its reads of point ``n``. The slots are allocated when
the file is made (``posix_fallocate``), so a small ``/dev/shm`` (a container's default) is found there, not by a
signal at a write: the file is then made without them (:attr:`HostPoints.data` 0), and those collectives stay the
process group's.

Example:
    >>> points = HostPoints.open(lambda mine: [mine], rank=0, world=1, timeout=5.0)  # alone: every rank one host
    >>> points.smallest(7), points.smallest(3)
    (7, 3)
    >>> points.put(torch.arange(3.0)), points.smallest(0), points.parts(torch.float32, 3)
    (True, 0, [tensor([0., 1., 2.])])
    >>> points.close()
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import sys
import time
from typing import Any, Callable, List, Optional

import torch

__all__ = ["HostPoints"]

_DIR = "/dev/shm"
_LINE = 8  # words per rank's slot: one 64-byte cache line (no false sharing between ranks)
_HEADER = 8  # words before the first slot (the proof word, the data slots' bytes, then padding to a cache line)
_GONE = 4  # the word of a rank's slot that says it gave up waiting (set once; its coordinator is broken)
_SPIN = 64  # checks before yielding the CPU
_YIELD = 2000  # yields before sleeping (a rank with a core of its own never gets there at a quick point)
#: Bytes of each rank's data slot, one per parity (2**20: a small model's activations fit in one): a bigger collective
#: takes several rounds. What a rank touches of the slots counts in its resident memory.
DATA = 1 << 20


def usable() -> bool:
    """Whether this process can agree through shared memory: Linux on x86-64 (ordered stores and loads) with
    ``/dev/shm``.

    Example:
        >>> isinstance(usable(), bool)
        True
    """
    return sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64") \
        and os.path.isdir(_DIR)


def _size(world: int, data: int) -> int:
    """Bytes of the file: the header, the points' slots, then two data slots of ``data`` bytes per rank."""
    return 8 * (_HEADER + _LINE * world) + 2 * world * data


class HostPoints:
    """Every rank's slot in one shared-memory file; :meth:`smallest` is an agreement point.

    Build it with :meth:`open`, on every rank at the same point (it exchanges twice over ``exchange``).

    Args:
        buffer: The mapped file.
        rank: This process's rank.
        world: The number of ranks.
        timeout: Seconds a point waits for the other ranks.
    """

    def __init__(self, buffer: mmap.mmap, rank: int, world: int, timeout: float) -> None:
        self._buffer = buffer
        self._words = memoryview(buffer).cast("q")
        self.rank = rank
        self.world = world
        self.timeout = timeout
        #: Points made so far (the same count on every rank).
        self.count = 0
        #: Bytes of each data slot (0: the file has none, /dev/shm had no room for them).
        self.data = int(self._words[1])
        self._slots: List[Optional[torch.Tensor]] = [None] * (2 * world)  # byte views, made at first use

    @classmethod
    def open(cls, exchange: Callable[[Any], List[Any]], rank: int, world: int, timeout: float
             ) -> Optional["HostPoints"]:
        """Shared-memory points when every rank can open rank 0's file, else None on every rank.

        Args:
            exchange: ``exchange(mine)`` -> every rank's value by rank (a collective of the caller's group).
            rank: This process's rank.
            world: The number of ranks.
            timeout: Seconds a point waits for the other ranks.
        """
        path, proof = None, secrets.randbits(62)
        if rank == 0 and usable():
            try:
                path = os.path.join(_DIR, f"gradwatch-{os.getpid()}-{secrets.token_hex(8)}")
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    data = DATA
                    try:  # the slots' memory now, where a lack of it is an error and not a SIGBUS at a write
                        os.posix_fallocate(fd, 0, _size(world, data))
                    except OSError:
                        data = 0
                        os.ftruncate(fd, 0)
                        os.ftruncate(fd, _size(world, 0))
                    os.pwrite(fd, proof.to_bytes(8, sys.byteorder, signed=True) + data.to_bytes(8, sys.byteorder), 0)
                finally:
                    os.close(fd)
            except OSError:
                if path is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(path)  # made but not filled: nothing left behind
                path = None
        shared, proof = exchange((path, proof) if rank == 0 else None)[0]  # rank 0's file (None: none) and word
        points = cls._attach(shared, proof, rank, world, timeout) if shared is not None else None
        attached = exchange(points is not None)
        if rank == 0 and shared is not None:
            with contextlib.suppress(OSError):
                os.unlink(shared)  # every rank has it mapped (or gave up): nothing is left behind, even by a crash
        if not all(attached):
            if points is not None:
                points.close()
            return None
        return points

    @classmethod
    def _attach(cls, path: str, proof: int, rank: int, world: int, timeout: float) -> Optional["HostPoints"]:
        """This rank's mapping of rank 0's file, or None when it is not there or not the same (another host)."""
        if not usable():
            return None
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            buffer = mmap.mmap(fd, size) if size in (_size(world, 0), _size(world, DATA)) else None
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if buffer is None:
            return None
        points = cls(buffer, rank, world, timeout)
        if points._words[0] != proof:
            points.close()
            return None
        return points

    def smallest(self, value: int) -> int:
        """An agreement point: return the smallest of every rank's ``value`` at this point, once every rank is here.

        Raises:
            TimeoutError: A rank did not reach the point within ``timeout`` seconds (named).
        """
        self.count += 1
        n = self.count
        parity = n % 2
        words = self._words
        mine = _HEADER + _LINE * self.rank
        words[mine + 2 + parity] = value  # the value first, then the point's number that makes it readable
        words[mine + parity] = n
        least = value
        deadline = None
        for other in range(self.world):
            if other == self.rank:
                continue
            slot = _HEADER + _LINE * other
            tries = 0
            while True:
                if words[slot + _GONE]:  # it waited here past the timeout and left: this rank must not go on alone
                    self._leave()
                    raise TimeoutError(f"rank {other} gave up waiting for this rank at agreement point {n} after "
                                       f"{self.timeout:g}s")
                if words[slot + parity] == n:
                    break
                tries += 1
                if tries < _SPIN:
                    continue
                if deadline is None:
                    deadline = time.monotonic() + self.timeout
                elif time.monotonic() > deadline:
                    self._leave()
                    raise TimeoutError(f"rank {other} did not reach agreement point {n} within {self.timeout:g}s")
                if tries < _YIELD:
                    os.sched_yield()
                else:
                    time.sleep(0.0002)
            least = min(least, words[slot + 2 + parity])
        return least

    def _slot(self, rank: int, parity: int) -> torch.Tensor:
        """``rank``'s data slot of ``parity``, as bytes (a view of the file)."""
        index = 2 * rank + parity
        slot = self._slots[index]
        if slot is None:
            slot = torch.frombuffer(self._buffer, dtype=torch.uint8, count=self.data,
                                    offset=_size(self.world, 0) + index * self.data)
            self._slots[index] = slot
        return slot

    def put(self, tensor: torch.Tensor) -> bool:
        """Copy ``tensor`` (a CPU tensor) into this rank's slot of the next point; False (nothing written) when it does
        not fit. The others read it after that point (:meth:`parts`)."""
        size = tensor.numel() * tensor.element_size()
        if size > self.data or tensor.device.type != "cpu":
            return False
        self._slot(self.rank, (self.count + 1) % 2)[:size].view(tensor.dtype).copy_(tensor.reshape(-1))
        return True

    def parts(self, dtype: torch.dtype, numel: int, start: int = 0) -> List[torch.Tensor]:
        """Every rank's input of the point just made (each :meth:`put` it), by rank: ``numel`` elements of ``dtype``
        from element ``start``, as views of the slots (valid until this rank's next point)."""
        size = torch.empty((), dtype=dtype).element_size()
        return [self._slot(r, self.count % 2)[start * size:(start + numel) * size].view(dtype)
                for r in range(self.world)]

    def _leave(self) -> None:
        """Say in this rank's slot that it gave up (its coordinator is broken): a rank that reaches the point later
        stops there too instead of going on to a collective this rank will not make."""
        self._words[_HEADER + _LINE * self.rank + _GONE] = 1

    def close(self) -> None:
        """Unmap the file (best effort)."""
        self._slots = [None] * len(self._slots)  # the views export the buffer: dropped before it closes
        try:
            self._words.release()
            self._buffer.close()
        except (BufferError, ValueError):  # pragma: no cover - a view still held elsewhere
            pass
