"""DDP's replicas compared across 2 gloo ranks at each check (issue 74, item 3): one 64-bit hash per tensor, sent with
each rank's share of the check. A rank that edits its replica after the step is one alert naming it; a correct run,
none; training bit-identical to the unwatched run on every rank."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch.distributed as dist
from helpers import run_two_ranks

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]

WORKER = textwrap.dedent(
    r'''
    import datetime, json, os, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    from gradwatch import GradWatch

    results = {}
    for name in ("correct", "edited", "unwatched"):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss_fn = lambda m, b: F.mse_loss(m(b[0]), b[1])
        watch = None if name == "unwatched" else GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None)
        g = torch.Generator().manual_seed(rank)
        for step in range(4):
            b = (torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g))
            opt.zero_grad()
            loss_fn(model, b).backward()
            if watch is not None:
                watch.step(b)
            opt.step()
            if name == "edited" and rank == 1 and step == 1:
                with torch.no_grad():
                    model.module[2].bias.add_(1e-3)  # one replica edited after the step
        results[name] = {"alerts": [] if watch is None else [(a.kind, a.step, a.message) for a in watch.alerts],
                         "weights": [p.detach().flatten().tolist() for p in model.parameters()]}
        if watch is not None:
            watch.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    '''
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_replicas")
    codes, logs = run_two_ranks(WORKER, out / "worker.py", [str(out)], 150.0, "DDP replicas")
    assert codes == (0, 0), "\n".join(log[-3000:] for log in logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_correct_ddp_run_is_clean_and_bit_identical_to_the_unwatched_one(ranks):
    for r in ranks:
        assert r["correct"]["alerts"] == [], r["correct"]["alerts"]
        assert r["correct"]["weights"] == r["unwatched"]["weights"]


def test_a_rank_that_edits_its_replica_after_the_step_is_named_at_the_next_check(ranks):
    for r in ranks:  # every rank says it alike
        replica = [a for a in r["edited"]["alerts"] if a[0] == "replica"]
        assert len(replica) == 1 and replica[0][1] == 2, r["edited"]["alerts"]
        assert "(2.bias) differs bit for bit on rank 1 from the other ranks" in replica[0][2], replica[0][2]
