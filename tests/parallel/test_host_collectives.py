"""A check's collectives through shared memory (:mod:`gradwatch.parallel.host_collectives`): 2 real processes.

Inside a real :class:`~gradwatch.parallel.lockstep.Lockstep` region over a real coordinator (gloo, one host), torch's
functional collectives and the ``torch.distributed`` functions FSDP2 calls give the same bits as gloo's outside it,
with no gloo collective made (read back from torch's profiler) and one agreement point a slot's worth (a tensor over
a slot takes two), an autograd collective's too. Outside the region, the functions are torch's again. The
coordinator's average of replayed gradients goes through the same memory, with gloo's bits, and its gathers of
objects (one rank's 2 MB, the other's a few bytes).
"""

from __future__ import annotations

import json

import pytest
from helpers import run_two_ranks

from gradwatch.parallel.host_points import usable

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not usable(), reason="shared-memory points: Linux on x86-64 with /dev/shm only")]

SCRIPT = r'''
import json, sys
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.profiler import ProfilerActivity, profile
from gradwatch.parallel.coordinator import DistributedCoordinator
from gradwatch.parallel.host_points import DATA
from gradwatch.parallel.lockstep import Lockstep

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
world = dist.group.WORLD
wrapped = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}


def call(function, x, shape, **kwargs):  # a torch.distributed function, as FSDP2 calls it (by keyword)
    out = torch.empty(shape)
    work = function(out, x, **kwargs)
    if kwargs.get("async_op"):
        work.wait()
    return out

gen = torch.Generator().manual_seed(10 + rank)
cases = {
    "sum": (torch.randn(64, 256, generator=gen), lambda x: funcol.all_reduce(x, "sum", world)),
    "max": (torch.randn(7, 3, generator=gen), lambda x: funcol.all_reduce(x, "max", world)),
    "min int": (torch.randint(-50, 50, (5, 4), generator=gen), lambda x: funcol.all_reduce(x, "min", world)),
    "sum bf16": (torch.randn(33, 5, generator=gen).bfloat16(), lambda x: funcol.all_reduce(x, "sum", world)),
    "gather": (torch.randn(3, 5, 2, generator=gen), lambda x: funcol.all_gather_tensor(x, 0, world)),
    "scatter": (torch.randn(6, 4, generator=gen), lambda x: funcol.reduce_scatter_tensor(x, "sum", 0, world)),
    "strided": (torch.randn(8, 6, generator=gen).t(), lambda x: funcol.all_reduce(x, "sum", world)),
    "over a slot": (torch.randn(DATA // 4 + 1, generator=gen), lambda x: funcol.all_reduce(x, "sum", world)),
    "scatter over a slot": (torch.randn(2, DATA // 4 + 3, generator=gen),
                            lambda x: funcol.reduce_scatter_tensor(x, "sum", 0, world)),
    "autograd": (torch.randn(4, 3, generator=gen), lambda x: funcol.all_gather_tensor_autograd(x, 0, world)),
    "gather single": (torch.randn(12, generator=gen), lambda x: call(dist.all_gather_single, x, 24, async_op=True)),
    "gather into": (torch.randn(5, 2, generator=gen), lambda x: call(dist.all_gather_into_tensor, x, (10, 2))),
    "scatter single": (torch.randn(10, generator=gen), lambda x: call(dist.reduce_scatter_single, x, 5, async_op=True)),
    "scatter avg": (torch.randn(8, 3, generator=gen), lambda x: call(dist.reduce_scatter_tensor, x, (4, 3),
                                                                      op=dist.ReduceOp.AVG)),
}
outside = {k: funcol.wait_tensor(f(x.clone())) for k, (x, f) in cases.items()}  # gloo's
coord = DistributedCoordinator(timeout=30.0)
coord.agree(True)  # the first point opens the shared memory
result = {"host": coord.host() is not None, "cases": {}}
for k, (x, f) in cases.items():
    with Lockstep(coord, nn.Linear(2, 2)) as step:
        before = step.points
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = funcol.wait_tensor(f(x.clone()))
        gloo = sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::"))
        result["cases"][k] = {"same": got.dtype == outside[k].dtype and torch.equal(got, outside[k]),
                              "shape": list(got.shape), "gloo": gloo, "points": step.points - before}
result["put back"] = all(getattr(dist, n) is f for n, f in wrapped.items())
grads = {"w": torch.randn(300, 7, generator=gen), "b": torch.randn(5, generator=gen).double(),
         "big": torch.randn(DATA // 4 * 3, generator=gen)}  # the replayed gradients averaged under DDP and ZeRO
wanted = {}
for k, g in grads.items():
    total = g.clone()
    dist.all_reduce(total)
    wanted[k] = total / 2
with profile(activities=[ProfilerActivity.CPU]) as prof:
    averaged = coord.average({k: g.clone() for k, g in grads.items()})
result["average"] = {"same": all(torch.equal(averaged[k], wanted[k]) for k in grads),
                     "gloo": sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::"))}
with profile(activities=[ProfilerActivity.CPU]) as prof:  # the coordinator's gathers: pickles of any length
    lengths = [len(v) for v in coord.everyone("x" * (3 + 2_000_000 * rank), "a test's strings")]
result["everyone"] = {"lengths": lengths, "gloo": sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::"))}
coord.close()
print("RESULT " + json.dumps(result))
'''


def test_functional_collectives_in_a_check_are_gloos_bits_through_shared_memory(tmp_path):
    codes, logs = run_two_ranks(SCRIPT, tmp_path / "collectives.py", [], timeout=120, what="host collectives")
    assert codes == (0, 0), logs
    for log in logs:
        got = json.loads(next(ln for ln in log.splitlines() if ln.startswith("RESULT "))[7:])
        assert got["host"], got
        cases = got["cases"]
        assert all(c["same"] for c in cases.values()), cases
        assert cases["gather"]["shape"] == [6, 5, 2] and cases["scatter"]["shape"] == [3, 4], cases
        assert all(c["gloo"] == 0 for c in cases.values()), cases  # in the slots, not gloo's
        assert cases["over a slot"]["points"] == 2, cases
        assert cases["scatter over a slot"]["points"] == 3, cases  # a round carries half a slot for each rank
        assert all(c["points"] == 1 for k, c in cases.items() if "over a slot" not in k), cases
        assert got["put back"], got
        assert got["average"] == {"same": True, "gloo": 0}, got  # the coordinator's average, through the slots too
        assert got["everyone"] == {"lengths": [3, 2_000_003], "gloo": 0}, got  # and its gathers
