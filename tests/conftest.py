"""Small shared fixtures: the tutorial's sigmoid autograd Functions, a real 1-rank gloo process group."""

from __future__ import annotations

import os

# Subprocesses (torchrun ranks, the CLI) on one OpenMP thread too: two ranks of two spinning threads on a
# 2-core machine beside a second pytest worker only wait for each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.autograd import Function

# Tiny models: one intra-op thread is faster than two on a 2-core machine, and
# keeps timings steady when pytest shares the machine (doctests included).
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Every test module starts on one intra-op thread, whatever an earlier module set (``bench --threads``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_rank(tmp_path):
    """A real gloo process group of one rank, this process (its group); destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class BuggySigmoid(Function):
    """The tutorial's sigmoid whose backward uses ``s * (1 + s)`` instead of ``s * (1 - s)``."""

    @staticmethod
    def forward(ctx, input):
        output = 1.0 / (1.0 + torch.exp(-input))
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        grad_sigmoid = output * (1.0 + output)  # the tutorial's bug
        return grad_sigmoid * grad_output


class CorrectSigmoid(Function):
    """The tutorial's fixed sigmoid."""

    @staticmethod
    def forward(ctx, input):
        output = 1.0 / (1.0 + torch.exp(-input))
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        grad_sigmoid = output * (1.0 - output)
        return grad_sigmoid * grad_output


@pytest.fixture
def buggy_sigmoid():
    return BuggySigmoid


@pytest.fixture
def correct_sigmoid():
    return CorrectSigmoid
