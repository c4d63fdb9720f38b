"""The replayed gradients averaged over the ranks (:meth:`DistributedCoordinator.average`), on a real 1-rank gloo group.

Small tensors of one dtype travel together in one all-reduce (:func:`buckets`), each copied back to its own place:
with one rank the mean is each tensor itself, whatever its shape, strides, dtype or bucket, and ``in_place`` keeps
the replay's own tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradwatch.parallel import coordinator as distributed
from gradwatch.parallel.coordinator import DistributedCoordinator


@pytest.fixture
def coordinator(one_rank):
    coord = DistributedCoordinator(timeout=30.0)
    yield coord
    coord.close()


def test_tensors_averaged_in_buckets_come_back_each_in_its_place(coordinator, monkeypatch):
    monkeypatch.setattr(distributed, "BUCKET", 70)  # several buckets from these sizes
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(5, 6, generator=g), "b": torch.randn(6, generator=g),
               "t": torch.randn(6, 5, generator=g).t(),  # not contiguous
               "d": torch.randn(3, dtype=torch.float64, generator=g), "h": torch.randn(4, generator=g).half(),
               "big": torch.randn(100, generator=g), "e": torch.randn(2, 2, generator=g)}
    calls = []
    reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: calls.append(t.numel()) or reduce(t, **kw))
    want = {n: t.clone() for n, t in tensors.items()}
    out = coordinator.average(tensors)
    assert list(out) == list(tensors)
    for n, t in out.items():
        assert t.dtype == want[n].dtype and t.shape == want[n].shape and torch.equal(t, want[n]), n
    assert calls == [30 + 6 + 30, 3, 4, 100, 4]  # w, b, t together; d (float64); h (to float32); big alone; e
    same = coordinator.average(tensors, in_place=True)
    assert all(torch.equal(same[n], want[n]) for n in want)
    assert same["b"].data_ptr() == tensors["b"].data_ptr()  # averaged where it is (float32 on the CPU)
