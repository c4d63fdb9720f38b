"""Agreement points through shared memory (:mod:`gradwatch.parallel.host_points`): 2 real processes on one host, one
launch for every case.

Each rank opens the points over a real gloo group (``all_gather_object``), then makes points in step: every rank
gets the smallest value, a rank one point ahead does not overwrite what a slow rank reads, a rank that never arrives
is named after the timeout and a rank arriving after the other gave up stops too; the file is gone from ``/dev/shm``
once every rank has it mapped; a rank that cannot open rank 0's file makes every rank fall back (None).
"""

from __future__ import annotations

import json

import pytest
from helpers import run_two_ranks

from gradwatch.parallel.host_points import usable

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not usable(), reason="shared-memory points: Linux on x86-64 with /dev/shm only")]

SCRIPT = r'''
import json, os, sys, time
import torch.distributed as dist
from gradwatch.parallel.host_points import HostPoints

rank, port, cases = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
results = {}

for case in cases:  # each case opens points of its own, in one launch
    seen = {}

    def exchange(mine):
        out = [None, None]
        dist.all_gather_object(out, mine)
        if case == "elsewhere" and rank == 1 and isinstance(out[0], tuple):
            out[0] = (out[0][0] + "-not-here", out[0][1])  # rank 0's file, as a rank on another host fails to open it
        seen.setdefault("path", out[0][0] if isinstance(out[0], tuple) else None)
        return out

    points = HostPoints.open(exchange, rank, 2, timeout=1.0)
    result = results[case] = {"opened": points is not None}
    dist.barrier()  # rank 0 unlinks the file once open() has heard every rank: looked for after it surely did
    if points is not None:
        result["left_in_dev_shm"] = os.path.exists(seen["path"])
        if case == "values":
            got = []
            for i in range(200):
                if rank == 0 and i % 50 == 0:
                    time.sleep(0.05)  # rank 1 waits here, then runs one point ahead
                got.append(points.smallest(1000 * rank + i if i % 3 else 10 ** 6 - i))
            result["got"] = got
        elif case == "timeout":
            points.smallest(5)
            if rank == 1:
                time.sleep(1.5)  # rank 0 waits past its timeout at the next point and gives up
            start = time.monotonic()
            try:
                points.smallest(6)
                result["second"] = "passed"
            except TimeoutError as exc:
                result["second"] = str(exc)
            result["waited"] = time.monotonic() - start
        points.close()
    dist.barrier()
dist.destroy_process_group()
print("RESULT " + json.dumps(results))
'''

CASES = ("values", "timeout", "elsewhere")


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    """Every case on 2 ranks in one launch: ``{case: (rank 0's result, rank 1's)}``."""
    out = tmp_path_factory.mktemp("points")
    codes, logs = run_two_ranks(SCRIPT, out / "points.py", [",".join(CASES)], timeout=120, what="host points")
    assert codes == (0, 0), logs
    r0, r1 = (json.loads(next(ln for ln in log.splitlines() if ln.startswith("RESULT "))[7:]) for log in logs)
    return {case: (r0[case], r1[case]) for case in CASES}


def test_every_rank_gets_the_smallest_value_of_each_point_and_no_file_is_left(cases):
    r0, r1 = cases["values"]
    want = [i if i % 3 else 10 ** 6 - i for i in range(200)]  # rank 0's values are the smaller
    assert r0["opened"] and r1["opened"]
    assert r0["got"] == want and r1["got"] == want
    assert not r0["left_in_dev_shm"] and not r1["left_in_dev_shm"]  # unlinked once every rank mapped it


def test_a_rank_that_never_arrives_is_named_and_a_rank_arriving_after_the_other_gave_up_stops_too(cases):
    r0, r1 = cases["timeout"]
    assert r0["second"] == "rank 1 did not reach agreement point 2 within 1s", r0
    assert 0.9 < r0["waited"] < 1.5, r0
    assert r1["second"] == "rank 0 gave up waiting for this rank at agreement point 2 after 1s", r1
    assert r1["waited"] < 0.5, r1  # at once: the mark is there when it arrives


def test_a_rank_that_cannot_open_the_file_makes_every_rank_fall_back(cases):
    r0, r1 = cases["elsewhere"]
    assert r0 == {"opened": False} and r1 == {"opened": False}
