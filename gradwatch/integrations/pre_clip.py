"""``.grad`` as backprop left it, held through a check without a second copy of every gradient.

A Hugging Face ``Trainer`` clips ``.grad`` in place between its backward and ``on_pre_optimizer_step``, where the check
runs; the check judges the gradient backprop made, so the callback copies ``.grad`` as the backward ends. Held through
the check beside the clipped tensors, those copies are a second whole gradient, on top of the replay's: on a model whose
vocabulary dwarfs its blocks that copy alone is more than the room a check has above training's peak.

One clip scales every tensor by one factor (``clip_grad_norm_``'s ``g.mul_(coef)``). Where multiplying each
copy by one factor gives the clipped tensor bit for bit (checked, a chunk at a time), :class:`PreClip` puts the copy's
values in the clipped tensor itself (its storage taken where both own theirs whole, else copied) and lets the copy
go; after the check the same multiplication gives back the clipped bits in the very tensor the optimizer steps with.
A tensor the factor does not reproduce (no clipping by one factor, a non-finite gradient, a DTensor) keeps its copy,
as before.

Example:
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> w.grad = torch.tensor([3.0, -1.5, 0.25])
    >>> held = PreClip([(w, w.grad.clone())])
    >>> clipped = w.grad.mul_(torch.tensor(0.3))  # the Trainer's clip, in place
    >>> held.fold()
    1
    >>> w.grad is clipped, w.grad.tolist()  # the backward's values, in the tensor the optimizer holds
    (True, [3.0, -1.5, 0.25])
    >>> held.restore()
    >>> w.grad.tolist() == (torch.tensor([3.0, -1.5, 0.25]) * torch.tensor(0.3)).tolist()
    True
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from gradwatch.check.judging.training_judge import same_bits

#: Elements compared at a time (the product's temporary is at most this many).
CHUNK = 1 << 20
#: The candidate factors tried: the ratio at the largest element, and this many neighbours each side.
NEIGHBOURS = 3
#: Integer views of the floating dtypes by element size (bit-for-bit comparison: -0.0 is not 0.0); none of 1 byte:
#: a float8 product has no CPU kernel (``training_judge``'s map, which compares only, has one).
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def reproduces(pre: torch.Tensor, clipped: torch.Tensor, factor: torch.Tensor) -> bool:
    """Whether ``pre * factor`` is ``clipped`` bit for bit (a chunk at a time).

    Example:
        >>> a = torch.tensor([1.0, 3.0])
        >>> reproduces(a, a * torch.tensor(0.7), torch.tensor(0.7)), reproduces(a, a * 0.7 + 1e-6, torch.tensor(0.7))
        (True, False)
    """
    if (type(pre) is not torch.Tensor or type(clipped) is not torch.Tensor  # (a DTensor's shards: not folded)
            or pre.shape != clipped.shape or pre.dtype != clipped.dtype or pre.device != clipped.device
            or not pre.is_floating_point() or pre.layout != torch.strided or clipped.layout != torch.strided
            or pre.element_size() not in _BITS):
        return False
    bits = _BITS[pre.element_size()]
    f = factor.to(pre.device)
    buffer = torch.empty(min(CHUNK, pre.numel()), dtype=pre.dtype, device=pre.device)  # one product, reused
    for a, b in zip(pre.detach().reshape(-1).split(CHUNK), clipped.detach().reshape(-1).split(CHUNK)):
        product = torch.mul(a, f, out=buffer[:a.numel()])
        if not same_bits(product.view(bits), b.view(bits)):  # (integer views: strict on every device)
            return False
    return True


def candidates(pre: torch.Tensor, clipped: torch.Tensor) -> List[torch.Tensor]:
    """Factors that may scale ``pre`` into ``clipped``, nearest first: the ratio at ``pre``'s largest element and its
    :data:`NEIGHBOURS` each side, in float32 and in the gradient's own dtype (torch's clip makes its factor from a norm
    in that dtype); empty where that element is zero or not finite.

    Example:
        >>> float(candidates(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 2.0]))[0])
        0.5
    """
    flat, out = pre.detach().reshape(-1), clipped.detach().reshape(-1)
    if flat.numel() == 0 or not flat.is_floating_point():
        return []
    i = int(flat.abs().argmax())
    a, b = float(flat[i]), float(out[i])
    if a == 0.0 or not math.isfinite(a) or not math.isfinite(b):
        return []
    ratio = b / a
    found = []
    for dtype in dict.fromkeys((torch.float32, pre.dtype)):
        nearest = torch.tensor(ratio, dtype=dtype)
        up = down = nearest
        found.append(nearest)
        for _ in range(NEIGHBOURS):
            up = torch.nextafter(up, torch.tensor(math.inf, dtype=dtype))
            down = torch.nextafter(down, torch.tensor(-math.inf, dtype=dtype))
            found += [up, down]
    return sorted(found, key=lambda c: abs(float(c) - ratio))


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` owns its storage whole, contiguous (not a view into a bucket or a flat buffer)."""
    return (t._base is None and t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _take(grad: torch.Tensor, copy: torch.Tensor) -> None:
    """``copy``'s values into ``grad``, the same tensor object: its storage taken where both own theirs whole (no pass
    over the values), else copied (a view into DDP's bucket keeps its storage)."""
    with torch.no_grad():
        if _whole(grad) and _whole(copy):
            try:
                grad.set_(copy.untyped_storage(), 0, copy.shape, copy.stride())
                return
            except RuntimeError:  # a tensor made by .detach() or .data refuses set_
                pass
        grad.copy_(copy)


class PreClip:
    """The step's ``.grad`` before the Trainer's clip, held as copies until :meth:`fold` folds them into the clipped
    tensors (see the module docstring).

    Args:
        pairs: Each parameter and its ``.grad`` copied as the backward ended.

    Attributes:
        pairs: Each parameter and the tensor holding its backward's values (after :meth:`fold`, the clipped tensor
            itself where folded).
        factor: The factor the clip scaled by (None until :meth:`fold` found one).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> w.grad = torch.tensor([1.0, 2.0])
        >>> held = PreClip([(w, w.grad.clone())])
        >>> held.fold(), held.factor  # nothing clipped: the copy was the same bits
        (1, tensor(1.))
    """

    def __init__(self, pairs: Sequence[Tuple[nn.Parameter, torch.Tensor]]) -> None:
        self.pairs: List[Tuple[nn.Parameter, torch.Tensor]] = list(pairs)
        self.factor: Optional[torch.Tensor] = None
        self._folded: List[torch.Tensor] = []

    def fold(self) -> int:
        """Write each copy the clip's factor reproduces into the clipped ``.grad`` and let the copy go; the count
        folded."""
        clipped = {id(p): p.grad for p, _ in self.pairs}
        live = [(pre, g) for p, pre in self.pairs for g in (clipped[id(p)],) if g is not None]
        if not live:
            return 0
        pre, now = max(live, key=lambda t: t[0].numel())
        head = (pre.detach().reshape(-1)[:CHUNK], now.detach().reshape(-1)[:CHUNK])  # a first chunk sifts the candidates
        self.factor = next((c for c in candidates(pre, now) if reproduces(*head, c) and reproduces(pre, now, c)), None)
        if self.factor is None:
            return 0
        pairs = []
        for p, copy in self.pairs:
            grad = clipped[id(p)]
            if grad is not None and (grad is now or reproduces(copy, grad, self.factor)):  # (now: reproduced above)
                _take(grad, copy)
                self._folded.append(grad)
                copy = grad
            pairs.append((p, copy))
        self.pairs = pairs
        return len(self._folded)

    def restore(self) -> None:
        """The clipped bits back in the tensors :meth:`fold` wrote into (once)."""
        folded, self._folded = self._folded, []
        if self.factor is not None:
            with torch.no_grad():
                for grad in folded:
                    grad.mul_(self.factor.to(grad.device))


__all__ = ["PreClip", "candidates", "reproduces"]
