"""How a DTensor parameter's rows are held (:func:`gradwatch.parallel.shard_check.held_by`), on a real 1-rank gloo mesh.

The answer is kept per parameter with the layout it was read from: asked again, the same parameter gives the same
answer without reading its shard; a parameter whose layout differs from the one kept is read again, and so is a new
parameter.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradwatch.parallel import shard_check
from gradwatch.parallel.shard_check import held_by


@pytest.fixture
def mesh(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def test_a_parameters_holding_is_kept_with_its_layout_and_read_again_when_the_layout_changes(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    p = nn.Parameter(distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)]))
    assert held_by(p) == (0, 1)
    reads = []
    original = shard_check._held_by
    shard_check._held_by = lambda *a: reads.append(a) or original(*a)
    try:
        assert held_by(p) == (0, 1) and reads == []  # kept: the shard is not read again
        q = nn.Parameter(distribute_tensor(torch.ones(6, 4), mesh, [Replicate()]))
        assert held_by(q) is None and len(reads) == 1  # another parameter: read
        assert held_by(p) == (0, 1) and len(reads) == 1
        shard_check._HELD[id(p)] = (shard_check._HELD[id(p)][0], ("another layout",), (0, 1))  # as if resharded
        assert held_by(p) == (0, 1) and len(reads) == 2  # its layout differs from the one kept: read again
        assert held_by(torch.ones(6, 4)) is None and len(reads) == 2  # a plain tensor: held by no split
    finally:
        shard_check._held_by = original
