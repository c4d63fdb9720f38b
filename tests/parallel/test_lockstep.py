"""The agreement points of a check whose collectives run inside the user's code (:mod:`gradwatch.parallel.lockstep`).

One process, a coordinator whose ranks always agree: where the points fall (before each functional collective,
none elsewhere) and that a region leaves nothing alive once it ends.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from gradwatch.check.objective.dtensor import functional_collectives
from gradwatch.parallel.lockstep import Lockstep


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
    ops = functional_collectives()
    assert ("_c10d_functional", "all_gather_into_tensor") in ops and ("_c10d_functional_autograd", "all_to_all_single") in ops
    assert not {("_c10d_functional", "wait_tensor"), ("_dtensor", "mesh_get_process_group")} & set(ops)


def test_a_point_comes_before_each_functional_collective_forward_and_backward_and_the_operators_are_put_back(one_rank):
    """DTensor and funcol call each collective through ``torch.ops``: wrapped for the region, each call makes a point
    first; an autograd collective's backward (issued by autograd itself) gets one where its output's gradient
    arrives. Nested regions point at the innermost; once the last closes, ``torch.ops`` holds torch's own operators."""
    import torch.distributed._functional_collectives as funcol

    own = torch.ops._c10d_functional.all_reduce
    outer, inner = Agreeing(), Agreeing()
    x = torch.ones(3, requires_grad=True)
    with Lockstep(outer, nn.Linear(2, 2)):
        y = funcol.all_reduce(x * 2, "sum", one_rank)
        assert outer.calls == 1 and torch.equal(funcol.wait_tensor(y), torch.full((3,), 2.0))
        with Lockstep(inner, nn.Linear(2, 2)):
            z = funcol.all_gather_single_autograd(x * 3, 0, one_rank)
            assert inner.calls == 1 and outer.calls == 1
            funcol.wait_tensor(z).sum().backward()
            assert inner.calls == 2  # before the backward's reduce-scatter
        assert torch.equal(x.grad, torch.full((3,), 3.0))
        assert inner.calls == 3 and outer.calls == 1  # the inner region's last point
        assert torch.ops._c10d_functional.all_reduce is not own
    assert torch.ops._c10d_functional.all_reduce is own and outer.calls == 2
    funcol.wait_tensor(funcol.all_reduce(torch.ones(1), "sum", one_rank))
    assert outer.calls == 2  # no region: no point
