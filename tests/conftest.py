"""Small shared fixtures: the tutorial's sigmoid autograd Functions, a real 1-rank gloo process group, and every
alert a test raises checked for a headline a person reads at a glance."""

from __future__ import annotations

import gc
import os
import sys

import paths

# Test modules import helpers other test modules define, by the module's name, from any directory of tests.
sys.path.extend(str(d) for d in paths.DIRS if str(d) not in sys.path)

# Subprocesses (torchrun ranks, the CLI) on one OpenMP thread too: two ranks of two spinning threads on a
# 2-core machine beside a second pytest worker only wait for each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.autograd import Function

# Tiny models: one intra-op thread is faster than two on a 2-core machine, and
# keeps timings steady when pytest shares the machine (doctests included).
torch.set_num_threads(1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, Lightning, every test module: over half a million objects) is
    never garbage: frozen out of the collector's way, each full collection costs 0.3 s less (the automatic ones, and the
    ``gc.collect()`` that accelerate runs at every ``Trainer.train()``, DeepSpeed as it partitions, and tests)."""
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Every test module starts on one intra-op thread, whatever an earlier module set (``bench --threads``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: Every :class:`gradwatch.Alert` built in this process by the running test (see :func:`alert_headlines`).
_BUILT_ALERTS: list = []
#: Most characters of an alert's headline (issue 73: read at a glance).
MAX_HEADLINE = 120


def _collect_alerts() -> None:
    """Make every Alert this process builds land in :data:`_BUILT_ALERTS` too (once per process: each xdist worker)."""
    from gradwatch.watch.trend import Alert

    if getattr(Alert.__post_init__, "collects", False):
        return
    built = Alert.__post_init__

    def post_init(self):
        built(self)
        _BUILT_ALERTS.append(self)

    post_init.collects = True
    Alert.__post_init__ = post_init


_collect_alerts()


@pytest.fixture(autouse=True)
def alert_headlines(request):
    """Every alert a test raises has a headline of at most 120 characters on one line, not empty, and its message
    is that headline, ``why: ...`` and ``what to do: ...`` (issue 73, item 3); the test fails at teardown naming the
    alert otherwise. It sees the alerts built in this process (each pytest-xdist worker collects its own): not those
    raised inside the subprocesses a test starts (torchrun or multiprocessing ranks, the CLI run as a command), whose
    alert sites are the same code the in-process tests run. With GRADWATCH_HEADLINES=FILE every headline is appended
    to FILE (length, kind, headline), to measure the longest across the suite."""
    del _BUILT_ALERTS[:]
    yield
    built, _BUILT_ALERTS[:] = list(_BUILT_ALERTS), []
    log = os.environ.get("GRADWATCH_HEADLINES")
    if log and built:
        with open(log, "a", encoding="utf-8") as f:
            f.write("".join(f"{len(a.headline)}\t{a.kind}\t{request.node.nodeid}\t{a.headline}\n" for a in built))
    bad = [a for a in built if not a.headline.strip() or len(a.headline) > MAX_HEADLINE or "\n" in a.headline
           or a.message.split("\n")[0] != a.headline or len(a.message.split("\n")) != 3]
    if bad:
        pytest.fail("alert headlines must be one line of 1 to 120 characters, then why, then what to do: " + "; ".join(
            f"{a.kind} on {a.tensor!r} at step {a.step}: {len(a.headline)} characters: {a.headline!r}" for a in bad[:5]),
            pytrace=False)


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
