"""What a forward of the model holds for its backward, counted, not guessed.

The objective form evaluates the whole objective on a float64 copy: its analytic pass holds what autograd saves
for the backward of one forward (the activations), in float64. Training's process peak does not tell that figure
apart (it holds the optimizer's state, an evaluation pass, an earlier model), and the parameters' bytes say
nothing of it where activations dominate (a big vocabulary, long sequences, big batches, a frozen base under
adapters). So it is counted: one isolated forward of the live model with grad (dropout off, BatchNorm's running
stats and every generator untouched, as the backward part evaluates it), on the batch's first samples, with
autograd's saved-tensor hooks adding up the distinct storages it saves (the parameters' own excluded), scaled
to the whole batch. No backward runs; the graph is dropped at once.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2))
    >>> counted = saved_bytes(model, lambda m, b: m(b).pow(2).mean(), torch.ones(32, 8))
    >>> counted.per_sample > 0 and counted.total == 32 * counted.per_sample
    True
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Dict, List, Optional, Set

import torch
from torch import nn

from gradwatch.check.modules.batch_cut import batch_dims, sub_batch
from gradwatch.check.objective.generators import HeldGenerators
from gradwatch.check.objective.rng import Reseeder
from gradwatch.plan.units import isolated
from gradwatch.trees import tensor_leaves

#: Samples of the batch the counting forward runs on (two: a train-mode BatchNorm needs more than one value per
#: channel); the count is scaled to the whole batch. A batch of at most :data:`WHOLE` samples is counted whole (its
#: forward costs little, and ``loss_fn`` sees the very batch it was given).
SAMPLES = 2
WHOLE = 8


@dataclasses.dataclass(frozen=True)
class Saved:
    """What one forward saves for its backward.

    Attributes:
        total: Bytes for the whole batch, in the model's own dtypes.
        per_sample: Bytes per sample of the batch.
        samples: Samples of the batch.
        dtype_bytes: The widest floating element size among the saved tensors (4 for float32).
        ratios: Per module (qualified name), what the ops of its own code saved (not its children's) per byte of
            its first call's floating inputs.
        own: Per module (qualified name), the bytes the ops of its own code saved (not its children's), for the whole
            batch; what ``loss_fn`` computes outside every module is in ``total`` only.

    Example:
        >>> Saved(800, 100, 8, 4).scaled(8)
        1600
    """

    total: int
    per_sample: int
    samples: int
    dtype_bytes: int
    ratios: Dict[str, float] = dataclasses.field(default_factory=dict)
    own: Dict[str, int] = dataclasses.field(default_factory=dict)

    def scaled(self, element_size: Optional[int], samples: Optional[int] = None) -> int:
        """Bytes of ``samples`` samples (default: the whole batch) once every floating tensor is ``element_size`` bytes
        an entry (float64: 8; None: the model's own).

        Example:
            >>> Saved(800, 100, 8, 4).scaled(None, 1)
            100
        """
        n = self.samples if samples is None else samples
        return self.per_sample * n * (element_size or self.dtype_bytes) // max(1, self.dtype_bytes)


class SavedCounter(torch.autograd.graph.saved_tensors_hooks):
    """A context: adds up the distinct storages autograd saves for backward inside it, except ``exclude``'s.

    Example:
        >>> w = torch.ones(3, requires_grad=True)
        >>> counter = SavedCounter({w.untyped_storage().data_ptr()})
        >>> with counter:
        ...     _ = (w * torch.ones(3)).tanh()
        >>> counter.bytes  # the ones multiplied by w (w itself excluded) and the tanh's result
        24
    """

    def __init__(self, exclude: Set[int]) -> None:
        super().__init__(self._pack, _unpack)
        self.exclude = set(exclude)
        self.widest = 0
        self._seen: Dict[int, int] = {}  # storage -> the most bytes a saved view of it spans
        #: The modules running now, innermost last (set by the counting forward's hooks): what is saved is theirs.
        self.stack: List[str] = []
        #: Bytes saved by each module's own ops (the innermost module running when they were saved).
        self.by_module: Dict[str, int] = {}
        #: Bytes of each module's first call's floating inputs.
        self.inputs: Dict[str, int] = {}

    @property
    def bytes(self) -> int:
        """Bytes saved: per storage, the largest view of it saved (a slice of the batch is not the whole batch)."""
        return sum(self._seen.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.exclude:
                span = min(int(storage.nbytes()), t.numel() * t.element_size())
                grown = span - self._seen.get(ptr, 0)
                if grown > 0:
                    self._seen[ptr] = span
                    if self.stack:
                        self.by_module[self.stack[-1]] = self.by_module.get(self.stack[-1], 0) + grown
                if t.is_floating_point():
                    self.widest = max(self.widest, t.element_size())
        except Exception:  # noqa: BLE001 - a tensor subclass without a storage: not counted
            pass
        # Detached: a tensor saved by the node that made it (a softmax's result) and returned as is would hold that
        # node through its own grad_fn, a cycle through C++ that Python's collector cannot see: the counting forward's
        # whole graph (GPT-2's logits and their log-softmax, at batch 4 x 128) stayed held for the rest of the run
        return t.detach()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _held(model: nn.Module) -> Set[int]:
    """The storages of the model's parameters and buffers (saved by reference: no activation)."""
    return {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}


def saved_bytes(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any, seed: int = 0,
                samples: int = SAMPLES, held: Optional[HeldGenerators] = None) -> Saved:
    """What ``loss_fn(model, batch)`` saves for its backward, counted on the first ``samples`` samples of ``batch``
    (the whole batch where it has at most :data:`WHOLE`, or where the cut raises) and scaled to the whole batch.
    Raises what ``loss_fn`` raised on it. ``held``: generators the model or ``loss_fn`` hold, put back after.

    Example:
        >>> lin = nn.Linear(4, 3)
        >>> saved_bytes(lin, lambda m, b: m(b).sum(), torch.ones(10, 4)).total  # the input (10 x 4 floats)
        160
    """
    size, _ = batch_dims(batch)
    keep = size if size <= WHOLE else min(size, max(1, samples))
    exclude = _held(model)
    part = sub_batch(batch, keep)[0] if keep < size else batch
    try:
        try:
            counter = _count(model, loss_fn, part, seed, exclude)
        except Exception:  # noqa: BLE001 - the cut batch does not suit loss_fn: the whole batch once
            if keep == size:
                raise
            keep = size
            counter = _count(model, loss_fn, batch, seed, exclude)
    finally:
        if held is not None:
            held.reset()
    per = -(-counter.bytes // keep)
    ratios = {n: b / counter.inputs[n] for n, b in counter.by_module.items() if counter.inputs.get(n)}
    own = {n: -(-b * size // keep) for n, b in counter.by_module.items()}
    return Saved(total=per * size, per_sample=per, samples=size, dtype_bytes=counter.widest or 4, ratios=ratios,
                 own=own)


def _count(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any, seed: int,
           exclude: Set[int]) -> SavedCounter:
    counter = SavedCounter(exclude)
    handles = []
    with isolated(model), torch.enable_grad(), counter:  # (inside: isolated suspends the hooks it finds)
        try:
            for name, module in model.named_modules():
                handles.append(module.register_forward_pre_hook(_enter(counter, name), with_kwargs=True))
                handles.append(module.register_forward_hook(_leave(counter, name), always_call=True))
            Reseeder(seed)()
            out = loss_fn(model, batch)
            del out  # the graph goes with it: no backward runs
        finally:
            for h in handles:
                h.remove()
    return counter


def _enter(counter: SavedCounter, name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        counter.stack.append(name)
        if name not in counter.inputs:
            counter.inputs[name] = sum(t.numel() * t.element_size() for t in tensor_leaves((args, kwargs))
                                       if t.is_floating_point())
    return hook


def _leave(counter: SavedCounter, name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, out: Any) -> None:
        while counter.stack and counter.stack.pop() != name:  # a forward that raised inside left frames behind
            pass
    return hook


__all__ = ["SAMPLES", "WHOLE", "Saved", "SavedCounter", "saved_bytes"]
