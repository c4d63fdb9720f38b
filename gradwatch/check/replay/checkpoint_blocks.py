"""The training part's replay with the model's repeated blocks checkpointed, where its activations would not fit.

The replay is a forward and backward of training's batch run while training's ``.grad`` is held: at the start of
its backward the process holds training's activations and a whole gradient more than training's own peak did
(training's forward ran with no ``.grad``): on a transformer, a gradient the size of the model on top of its
activations, above training's peak (``docs/costs.md``). Checkpointing the model's repeated blocks
(a transformer's layers: the modules of the outermost ``ModuleList`` or ``Sequential`` whose members are two or
more modules of one class holding parameters) keeps only their inputs through the forward, and recomputes each
block's activations when its backward comes, as ``torch.utils.checkpoint`` with ``use_reentrant=False`` and
``preserve_rng_state=True`` does: the same operations on the same inputs, with the same random draws (dropout's
masks), so the same values and the same gradients, bit for bit, for one more forward of the blocks.

A block is called as it is, without a checkpoint, where its call carries an object that is not a tensor or a plain
value (the recompute would run it on that object again). A Hugging Face key-value cache is the exception: the block
is given none, as Hugging Face's own gradient checkpointing does (the recompute would update it a second time);
training's forward filled a cache its loss never read. Without it GPT-2's attention multiplies its keys as they are
instead of the cache's contiguous copy of them, which changes the gradients in their last bits (well within
float32's training tolerance, ``gradwatch.check.judging.training_judge``); everywhere else the gradients are
training's, bit for bit.

Example:
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 1))
    >>> [type(b).__name__ for b in repeated_blocks(model)]
    ['Linear', 'Linear']
    >>> x = torch.randn(3, 4)
    >>> plain = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    >>> with checkpointed(model):
    ...     again = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    >>> all(torch.equal(a, b) for a, b in zip(plain, again))
    True
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradwatch.check.objective.guards import instance_forwards

_PLAIN = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def repeated_blocks(root: nn.Module) -> List[nn.Module]:
    """The members of the outermost ``ModuleList`` / ``Sequential`` containers whose members are two or more modules
    of one class holding parameters (a container inside a found one is not looked into)."""
    found: List[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            members = list(child.children()) if isinstance(child, (nn.ModuleList, nn.Sequential)) else []
            if (len(members) >= 2 and len({type(m) for m in members}) == 1
                    and all(any(True for _ in m.parameters()) for m in members)):
                found.extend(members)
            else:
                walk(child)

    walk(root)
    return found


def _plain(obj: Any) -> bool:
    """Only tensors and plain values, in tuples, lists and dicts."""
    if isinstance(obj, (list, tuple)):
        return all(_plain(v) for v in obj)
    if isinstance(obj, dict):
        return all(_plain(v) for v in obj.values())
    return isinstance(obj, _PLAIN)


def _hf_cache(obj: Any) -> bool:
    """A Hugging Face ``Cache`` (looked up only where transformers is imported already)."""
    module = sys.modules.get("transformers.cache_utils")
    cls = getattr(module, "Cache", None)
    return cls is not None and isinstance(obj, cls)


def _checkpointing(forward: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        args = tuple(None if _hf_cache(a) else a for a in args)
        kwargs = {k: None if _hf_cache(v) else v for k, v in kwargs.items()}
        if not _plain((args, kwargs)):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return call


@contextlib.contextmanager
def checkpointed(root: nn.Module, count: Optional[int] = None) -> Iterator[int]:
    """For the duration, each of ``root``'s repeated blocks (:func:`repeated_blocks`; with ``count``, the first
    ``count`` of them) runs its forward under a non-reentrant checkpoint; yields how many blocks. Each block's own
    ``forward`` is put back on exit."""
    blocks = repeated_blocks(root)[:count]
    with instance_forwards((block, _checkpointing(block.forward)) for block in blocks):
        yield len(blocks)


def checkpointing(root: nn.Module, evaluate: Callable[[nn.Module, Any], Any], count: Optional[int] = None
                  ) -> Callable[[nn.Module, Any], Any]:
    """``evaluate(model, batch)`` run with ``root``'s repeated blocks (the first ``count``) checkpointed
    (:func:`checkpointed`).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> checkpointing(model, lambda m, b: m(b).sum())(model, torch.ones(1, 2)).grad_fn is not None
        True
    """
    def run(model: nn.Module, batch: Any) -> Any:
        with checkpointed(root, count):
            return evaluate(model, batch)

    return run


def replay_excess(held: int, replayed: int, room: int, activations: int) -> int:
    """Bytes by which training's ``held`` gradient and the ``replayed`` ones exceed what the ``room`` leaves above
    training's ``activations`` (0 or less: the replay fits as it is).

    Example:
        >>> replay_excess(10, 5, 100, 90), replay_excess(10, 5, 100, 50)
        (5, -35)
    """
    return held + replayed - (room - activations)


def blocks_needed(held: int, replayed: int, room: int, activations: int, count: int) -> int:
    """How many of ``count`` repeated blocks a replay checkpoints: as many as keep training's ``held`` gradient and the
    ``replayed`` ones within what the ``room`` leaves above training's ``activations``, each block counted at its
    share of those activations (and of ``held``, which training's forward did not hold), with half as many again for
    what lives outside the blocks (the logits); 0 where they fit.

    Example:
        >>> mb = 2**20
        >>> blocks_needed(472 * mb, 250 * mb, 1450 * mb, 1200 * mb, 12)  # GPT-2 small, as measured at one check
        6
        >>> blocks_needed(13 * mb, 13 * mb, 137 * mb, 102 * mb, 2)  # GPT-2 3.3M: they fit
        0
    """
    excess = replay_excess(held, replayed, room, activations)
    if excess <= 0 or count <= 0:
        return 0
    return min(count, math.ceil(1.5 * excess * count / max(activations + held, 1)))


#: What a replay's forward and backward hold at most beside what the process holds now, per byte a counted forward
#: saved (:class:`~gradwatch.check.modules.activations.Saved`): those bytes, as many again for the gradients its
#: backward makes of them, and as many again for what a count does not see (dropout's masks, temporaries).
COUNTED_FACTOR = 3


def counted_excess(held: int, replayed: int, room: int, activations: int, counted: Optional[int] = None) -> int:
    """:func:`replay_excess`, bounded where a forward's saved bytes were ``counted``: the replay then holds at most
    :data:`COUNTED_FACTOR` times them and its ``replayed`` gradients beside what the process holds now. Training's
    peak is not always its backward's: on a transformer at a small batch it can be its optimizer's step (Adam's
    temporaries), far above what the replay's activations count.

    Example:
        >>> counted_excess(100, 10, 100, 80), counted_excess(100, 10, 100, 80, counted=20)
        (90, -30)
    """
    excess = replay_excess(held, replayed, room, activations)
    return excess if counted is None else min(excess, COUNTED_FACTOR * counted + replayed - room)


def block_counts(root: nn.Module, own: Mapping[str, int]) -> List[int]:
    """The bytes a counted forward saved inside each of ``root``'s repeated blocks, in the blocks' order (``own``: the
    bytes by module of :class:`~gradwatch.check.modules.activations.Saved`): one walk of the module tree, the same
    for every check of a batch shape.

    Example:
        >>> model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
        >>> block_counts(model, {"0.0": 10, "0.1": 30, "1": 60})
        [10, 30]
    """
    names = {id(m): n for n, m in root.named_modules()}
    out = []
    for block in repeated_blocks(root):
        name = names.get(id(block))
        out.append(0 if name is None else sum(b for n, b in own.items() if n == name or n.startswith(name + ".")))
    return out


def block_savings(counts: Sequence[int], total: int, activations: int) -> List[int]:
    """What checkpointing each repeated block saves a replay: its share of what a counted forward saved for its
    backward (``counts``: :func:`block_counts`, of ``total``), times training's measured ``activations``. The share is
    counted, the size measured: the counted forward runs without dropout's masks, and training's peak holds
    temporaries a count of saved tensors does not see. A frozen block saves nothing (no gradient goes through it),
    and where the logits dominate (a big vocabulary on a small model) the blocks save little: far less than an even
    share of the activations and the held gradient would say.

    Example:
        >>> block_savings([10, 30], 100, 1000)
        [100, 300]
    """
    return [activations * inside // max(total, 1) for inside in counts]


def blocks_for(excess: int, savings: Sequence[int]) -> int:
    """How many of the first blocks a replay checkpoints to save ``excess`` bytes, each saving its ``savings``: all
    of them where together they save less (0 where nothing exceeds).

    Example:
        >>> blocks_for(25, [10, 10, 10]), blocks_for(0, [10]), blocks_for(99, [10, 10])
        (3, 0, 2)
    """
    if excess <= 0:
        return 0
    saved = 0
    for i, bytes_ in enumerate(savings):
        saved += bytes_
        if saved >= excess:
            return i + 1
    return len(savings)


def outside_cap(savings: Sequence[int], held: int, room: int, activations: int, counted: Optional[int] = None
                ) -> Optional[int]:
    """Where even every block checkpointed (each saving its ``savings``) leaves training's ``held`` gradient over what
    the ``room`` leaves above its ``activations`` (an MoE model's logits on a big vocabulary dwarf its blocks'
    activations): the most the replayed gradients of the parameters outside the blocks may take together, what the
    blocks leave; else None. Those of the head come at the start of the replay's backward, beside the logits' own
    gradients; a block's come as its recomputed backward runs, after the head's are freed. ``counted``: a forward's
    saved bytes (:func:`counted_excess`).

    Example:
        >>> outside_cap([10, 10], 50, 100, 80)  # 50 held over the 20 left: the blocks save 20
        0
        >>> outside_cap([10, 10], 50, 100, 60), outside_cap([10, 10], 5, 200, 10) is None
        (10, True)
    """
    left = sum(savings) - counted_excess(held, 0, room, activations, counted)
    return None if left >= room else max(0, left)
