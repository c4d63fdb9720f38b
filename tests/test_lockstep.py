"""The agreement points of a check whose collectives run inside the user's code (:mod:`gradwatch.watch.lockstep`).

One process, a coordinator whose ranks always agree: where the points fall (before each functional collective,
none elsewhere) and that a region leaves nothing alive once it ends.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from gradwatch.check.objective.dtensor import makes_collective
from gradwatch.watch.lockstep import Lockstep


class Agreeing:
    """A coordinator of one rank: every point agrees; counts them."""

    def __init__(self) -> None:
        self.calls = 0

    def agree(self, ok, value=None):
        self.calls += 1
        return True, value


def test_a_region_is_freed_when_it_ends_with_the_gradients_it_held():
    """A region holds the plain parameters' gradients while it runs; once it ends nothing keeps it (or them) alive,
    without waiting for the cycle collector (before, 31 MB a check stayed alive on a tensor parallel model)."""
    model = nn.Linear(64, 64)
    model(torch.ones(2, 64)).sum().backward()
    grad = weakref.ref(model.weight.grad)
    gc.disable()
    try:
        with Lockstep(Agreeing(), model) as step:
            (torch.ones(3) * 2).sum()
        region = weakref.ref(step)
        model.weight.grad = None  # training's next zero_grad
        del step
        assert region() is None and grad() is None
    finally:
        gc.enable()


def test_points_fall_before_functional_collectives_only():
    coord = Agreeing()
    with Lockstep(coord, nn.Linear(2, 2)):
        (torch.ones(4) @ torch.ones(4)).item()  # plain ops: no point
    assert coord.calls == 1  # the region's last point only
    assert makes_collective(torch.ops._c10d_functional.all_gather_into_tensor.default)
    assert not makes_collective(torch.ops._c10d_functional.wait_tensor.default)
    assert not makes_collective(torch.ops.aten.add.Tensor)
