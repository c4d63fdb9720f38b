"""The forward's unchanged part, reused: a perturbed evaluation recomputes only what comes after the tensor's use.

A probe of one tensor perturbs it alone, so everything the forward computes before it first reads that tensor
is exactly what it computed at the unperturbed point. :class:`PrefixCache` keeps each leaf module call's output
from the first evaluation at the unperturbed point, notes (under a dispatch mode, op by op) where each
parameter is first read, and, while the engine probes a tensor (:meth:`focus`), returns a copy of the kept
output for every leaf call that ended before that tensor's first read instead of running the module. The
order of execution alone decides, not the autograd graph: a ``.detach()``, a ``no_grad`` block or a
checkpoint that hides a dependency from autograd cannot hide it here. The first layer's probes still run
the whole forward; the last layer's run little more than the loss.

A call always runs where replaying it could change a value: it writes to its inputs, draws from torch's
generators (a later call would draw other numbers), returns a view of an input or something not made of
tensors. A model whose evaluation with every other call replayed does not give the unperturbed objective bit
for bit (state outside the modules) runs the whole forward at every evaluation, as without it.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    >>> x = torch.randn(5, 3, dtype=torch.float64)
    >>> cache = PrefixCache(model, dict(model.named_parameters()))
    >>> with cache.installed(), torch.no_grad():
    ...     cache.begin(); y0 = model(x).sum()          # the first evaluation: captured
    ...     cache.captured(); cache.expected = float(y0)
    ...     ok = cache.verify(lambda: float((cache.begin(), model(x).sum())[1]))
    ...     cache.replayed = 0
    ...     cache.focus(model[2].weight); cache.begin(); y1 = model(x).sum()   # replays Linear(3, 4), Tanh
    >>> ok, cache.replayed, bool(y1 == y0)
    (True, 2, True)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, Union

import torch
from torch import nn

from gradwatch.check.objective.dispatch_mode import EagerDispatchMode
from gradwatch.check.probes import kinks
from gradwatch.trees import tensor_leaves

#: Most bytes of leaf outputs kept.
KEEP_BYTES = 256 * 2**20

#: A model whose forward (with grad: the check's analytic one) is quicker than this (seconds) replays nothing
#: (:meth:`PrefixCache.decline`): where a forward takes tens of microseconds, capturing the first evaluation (op by
#: op), verifying the replay and the wrapped calls cost more than the calls replayed save.
REPLAY_MIN_SECONDS = 6e-4

Key = Tuple[int, int]  # (leaf module index, its call number within one evaluation)


def _tensors(out: Any) -> Optional[List[torch.Tensor]]:
    """The tensors an output is made of (a tensor, or a tuple/list of them); None for anything else."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return list(out)
    return None


def _copy(out: Any) -> Any:
    """A copy of a leaf's output (a tensor, or a tuple/list of them), outside any autograd graph."""
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    return type(out)(o.detach().clone() for o in out)


def _storages(args: Any) -> Set[int]:
    return {t.untyped_storage().data_ptr() for t in tensor_leaves(args)}


def _versions(args: Any) -> List[int]:
    return [t._version for t in tensor_leaves(args)]


def _rng_states() -> List[torch.Tensor]:
    """The states of torch's default generators (the CPU one, and the current CUDA device's where CUDA is up)."""
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _same_states(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class _FirstReads(EagerDispatchMode):
    """Counts the ops of one evaluation and notes the first op that reads each watched storage."""

    def __init__(self, storages: Set[int]) -> None:
        super().__init__()
        self.storages = storages
        self.ops = 0
        self.first: Dict[int, int] = {}

    def dispatch(self, func: Any, types: Any, args: Tuple = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kinks.note_reads(self.storages, self.first, self.ops, args, kwargs or {})
        self.ops += 1
        return func(*args, **(kwargs or {}))


class PrefixCache:
    """Leaf-module outputs of the unperturbed point, replayed for the calls that end before the probed tensor's
    first read (see the module's docstring).

    Args:
        model: The model the check evaluates (its float64 copy).
        params: The tensors the engine perturbs, by name.
        keep_bytes: Most bytes of outputs and inputs kept (beyond them, calls run).
    """

    def __init__(self, model: nn.Module, params: Dict[str, torch.Tensor], keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = int(keep_bytes)
        self.leaves = [m for m in model.modules() if next(m.children(), None) is None]
        self.storages = {p.untyped_storage().data_ptr() for p in params.values()}
        self.spans: Dict[Key, Tuple[int, int]] = {}
        self.values: Dict[Key, Any] = {}
        #: The inputs of each call of a leaf holding parameters, from the first evaluation (``(args, kwargs)``).
        self.inputs: Dict[Key, Tuple[Tuple, Dict[str, Any]]] = {}
        self.calls: Dict[int, int] = {}
        self.input_versions: Dict[Key, List[int]] = {}
        self._holds = {i for i, m in enumerate(self.leaves) if next(m.parameters(recurse=False), None) is not None}
        self.entries: Dict[Key, Tuple[int, int]] = {}
        self.counts: Dict[int, int] = {}
        self.phase = "capture"
        self.enabled = True
        self.verified = False
        self.limit: Optional[int] = None
        #: The first op that reads each parameter's storage, from the first evaluation.
        self.first: Dict[int, int] = {}
        #: The objective of the first evaluation (:meth:`verify` compares with it); None until it is known.
        self.expected: Optional[float] = None
        self.replayed = 0
        self.kept_bytes = 0
        #: The record of the forward at the unperturbed point (:mod:`gradwatch.check.probes.kinks`), when taken.
        self.base_record: kinks.Record = []
        self._reads: Optional[Union[_FirstReads, kinks.Recorder]] = None
        self._saved: List[Tuple[nn.Module, Any]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator["PrefixCache"]:
        """Wrap every leaf module's ``forward`` (an instance attribute, removed on exit)."""
        for i, m in enumerate(self.leaves):
            self._saved.append((m, m.__dict__.get("forward")))
            m.forward = self._wrap(i, m.forward)
        try:
            yield self
        finally:
            self._unwrap()
            self.values.clear()
            self.inputs.clear()
            if isinstance(self._reads, _FirstReads):
                self._reads.__exit__(None, None, None)
            self._reads = None

    def _unwrap(self) -> None:
        """Every leaf module's own ``forward`` back."""
        for m, own in self._saved:
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own
        self._saved = []

    def begin(self) -> None:
        """A new evaluation starts: calls are counted from zero again (the first one is captured, its reads
        noted by the kink recorder in effect, else by a dispatch mode of its own)."""
        self.counts = {}
        if self.phase == "capture" and self._reads is None:
            recorder = kinks.active_recorder()
            if recorder is not None and recorder.ops == 0:
                recorder.watch_reads(self.storages)
                self._reads = recorder
            else:
                self._reads = _FirstReads(self.storages)
                self._reads.__enter__()

    def inputs_of(self, module: nn.Module) -> Optional[Tuple[Tuple, Dict[str, Any]]]:
        """The inputs a leaf module holding parameters got at the unperturbed point, where it ran once; else None."""
        index = next((i for i, m in enumerate(self.leaves) if m is module), None)
        if index is None or self.calls.get(index) != 1 or (index, 0) not in self.inputs:
            return None
        args, kwargs = self.inputs[(index, 0)]
        if _versions((args, tuple(kwargs.values()))) != self.input_versions[(index, 0)]:
            return None  # written to since (an in-place op after the call): not what the module got
        return args, kwargs

    def decline(self) -> None:
        """Before the first evaluation: capture nothing, replay nothing, every leaf's own ``forward`` back (a forward
        quicker than :data:`REPLAY_MIN_SECONDS`)."""
        self.phase, self.enabled = "declined", False
        self._unwrap()

    def captured(self) -> None:
        """The first evaluation at the unperturbed point is over: replay from now on (after :meth:`verify`)."""
        if self.phase != "capture":
            return
        self.phase = "ready"
        if self._reads is not None:
            if isinstance(self._reads, _FirstReads):
                self._reads.__exit__(None, None, None)
            self.first = dict(self._reads.first)
            self._reads = None
        else:
            self.enabled = False

    def focus(self, p: Optional[torch.Tensor]) -> None:
        """The tensor the engine perturbs now (None: none, every call runs)."""
        if p is None:
            self.limit = None
            return
        ptr = p.untyped_storage().data_ptr()
        self.limit = self.first.get(ptr, 1 << 62) if ptr in self.storages else None

    def verify(self, evaluate: Callable[[], float]) -> bool:
        """One evaluation with every call that can be replayed replayed must give the first evaluation's objective
        (:attr:`expected`) bit for bit; else off."""
        if not self.enabled or self.phase != "ready" or self.expected is None:
            self.enabled = False
            return False
        limit, self.limit = self.limit, 1 << 62  # a tensor read by nothing: every call can be replayed
        try:
            got = evaluate()
        finally:
            self.limit = limit
        self.verified = got == self.expected
        self.enabled = self.verified
        return self.verified

    def _wrap(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            n = self.counts.get(index, 0)
            self.counts[index] = n + 1
            key = (index, n)
            if self.phase == "capture":
                # (Before the first evaluation's begin(), the analytic forward: nothing of it is kept.)
                return self._capture(key, forward, args, kwargs) if self._reads is not None else forward(*args, **kwargs)
            if self.enabled and self.limit is not None and key in self.values and self.spans[key][1] <= self.limit \
                    and not torch.is_grad_enabled():  # (an objective differentiating inside needs the graph)
                recorder = kinks.active_recorder()
                if recorder is not None and key in self.entries:
                    start, stop = self.entries[key]
                    recorder.replay(self.base_record[start:stop])
                self.replayed += 1
                return _copy(self.values[key])
            return forward(*args, **kwargs)

        return wrapped

    def _capture(self, key: Key, forward: Callable[..., Any], args: Tuple, kwargs: Dict[str, Any]) -> Any:
        """The first evaluation at the unperturbed point: run, and keep what can be replayed."""
        recorder = kinks.active_recorder()
        if recorder is not None:
            self.base_record = recorder.record
        start = recorder.size_entries() if recorder is not None else 0
        reads = self._reads
        first_op = reads.ops if reads is not None else 0
        inputs = (args, tuple(kwargs.values()))
        before, drawn = _versions(inputs), _rng_states()
        self.calls[key[0]] = key[1] + 1
        if key[0] in self._holds:
            size = sum(t.numel() * t.element_size() for t in tensor_leaves(inputs))
            if self.kept_bytes + size <= self.keep_bytes:
                # Held, not copied: kept with their versions, and given out only while nothing wrote to them.
                self.inputs[key] = (args, dict(kwargs))
                self.input_versions[key] = before
                self.kept_bytes += size
        out = forward(*args, **kwargs)
        if reads is None:
            return out
        self.spans[key] = (first_op, reads.ops)
        if recorder is not None:
            self.entries[key] = (start, recorder.size_entries())
        outs = _tensors(out)
        if outs is None or _versions(inputs) != before or not _same_states(drawn, _rng_states()) or \
                {o.untyped_storage().data_ptr() for o in outs} & (_storages(inputs) | self.storages):
            # Not made of tensors, writes to its inputs, draws random numbers (a later call would draw others
            # if it did not run), returns a view of an input, or a checked tensor itself (a module whose forward is
            # `return self.weight` reads it with no op: its kept copy would stand for the perturbed one): it always runs.
            return out
        size = sum(o.numel() * o.element_size() for o in outs)
        if self.kept_bytes + size <= self.keep_bytes:
            self.values[key] = _copy(out)
            self.kept_bytes += size
        return out
