"""A gradient as a few thousand numbers: the same random coordinates of each tensor, every time.

The training part compares whole gradients; explaining *how* a gradient was put together (which
weights the step's micro-batches and ranks got, :mod:`gradwatch.check.replay.cut`) needs the gradient of
each micro-batch at once, which would cost a copy of the gradients per micro-batch. A
:class:`Sketch` keeps, of each, the same ``size`` coordinates (an equal share of each tensor,
drawn once from a seed), so that linear relations between gradients hold between their sketches:
a least-squares fit over the sketches finds the weights training applied, at a few kilobytes per
micro-batch. The same seed gives the same coordinates on every rank.

Example:
    >>> g = {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(3)}
    >>> sk = Sketch({n: t.shape for n, t in g.items()}, size=6, seed=0)
    >>> bool(torch.equal(sk(g) * 2, sk({n: 2 * t for n, t in g.items()})))
    True
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Tuple

import torch

#: Coordinates a sketch keeps by default (over every tensor together).
SKETCH_SIZE = 4096


class Sketch:
    """The same random coordinates of each of several tensors, as one float64 CPU vector.

    Args:
        shapes: ``{name: shape}`` of the tensors (a gradient sketched later must have these).
        size: Coordinates in all, shared equally between the tensors (a small tensor gives all it has).
        seed: Draws the coordinates (the same on every rank for the same seed and shapes).
    """

    def __init__(self, shapes: Mapping[str, Tuple[int, ...]], size: int = SKETCH_SIZE, seed: int = 0) -> None:
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        gen = torch.Generator().manual_seed(int(seed) & 0x7FFFFFFF)
        per = max(1, math.ceil(size / max(1, len(self.shapes))))
        self.index: Dict[str, torch.Tensor] = {}
        for n, shape in self.shapes.items():
            numel = math.prod(shape)
            if numel == 0:
                continue
            # Drawn with replacement (a repeat costs nothing but a coordinate): a permutation of a big tensor's
            # entries would cost more than the check's comparison of it.
            self.index[n] = (torch.arange(numel) if numel <= per
                             else torch.randint(numel, (per,), generator=gen).unique())
        self._on: Dict[Tuple[str, torch.device], torch.Tensor] = {}

    @property
    def size(self) -> int:
        """Coordinates kept in all."""
        return sum(int(i.numel()) for i in self.index.values())

    def matches(self, grads: Mapping[str, torch.Tensor]) -> bool:
        """True when ``grads`` holds the tensors this sketch was drawn for, with their shapes."""
        return set(grads) == set(self.shapes) and all(tuple(grads[n].shape) == self.shapes[n] for n in grads)

    def __call__(self, grads: Mapping[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """The sketch of ``grads`` (``{name: tensor}`` of the shapes given), times ``scale``, in float64 on the CPU."""
        parts = []
        for n, idx in self.index.items():
            g = grads[n].detach()
            if g.layout != torch.strided:
                g = g.to_dense()
            if g.is_complex():
                g = torch.view_as_real(g)[..., 0]
            key = (n, g.device)
            on = self._on.get(key)
            if on is None:
                on = self._on[key] = idx.to(g.device)
            parts.append(g.reshape(-1).index_select(0, on).to("cpu", torch.float64))
        out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
        return out * scale if scale != 1.0 else out
