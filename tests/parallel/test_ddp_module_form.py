"""The module form under DDP: 2 gloo ranks split the planner's pieces of each check, as rank 0 decided.

Each rank holds the whole model; rank 0 measures the room ``memory_budget`` leaves and decides the
form and the training part's tensors for all. In the module form each rank checks its round-robin
share of the check's pieces (no piece twice, none left out), the reports merge into one, the
coverage is the same on both ranks, a correct model gives no alert, and a wrong backward planted in
one layer is named. The per-rank memory figures are in ``benchmarks/ddp_memory.py``.
"""

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
    import gradwatch.check.modules.module_form as modular
    from gradwatch import GradWatch

    from helpers import Act  # tanh, or one whose backward is wrong (tests/ is on the workers' path)

    pieces = []
    real = modular.run_module_check
    def spy(*args, **kw):
        pieces.append([str(p) for p in kw["pieces"]])
        return real(*args, **kw)
    modular.run_module_check = spy  # the backward part calls it through the module (gradwatch.watch.parts.backward)

    results = {}
    for name in ("correct", "bug"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 600), Act(), nn.Linear(600, 32), Act(wrong=name == "bug"), nn.Linear(32, 1))
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = lambda m, b: F.mse_loss(m(b[0]), b[1])
        watch = GradWatch(model, loss_fn, optimizer=opt, every=1, form="module", log_dir=None)
        g = torch.Generator().manual_seed(rank)
        pieces.clear()
        forms, merged = [], []
        for step in range(4):
            b = (torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
            opt.zero_grad()
            loss_fn(model, b).backward()
            report = watch.step(b)
            forms.append(report.form)
            merged.append(sorted(report.pieces))
            opt.step()
        results[name] = {"forms": forms, "mine": [list(p) for p in pieces], "merged": merged,
                         "cycle": watch.cycle_length, "coverage": watch.coverage,
                         "alerts": [(a.kind, a.tensor) for a in watch.alerts]}
        watch.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    '''
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_module")
    codes, logs = run_two_ranks(WORKER, out / "worker.py", [str(out)], 150.0, "DDP module form")
    assert codes == (0, 0), "\n".join(log[-3000:] for log in logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_ranks_split_each_checks_pieces(ranks):
    r0, r1 = ranks[0]["correct"], ranks[1]["correct"]
    assert r0["forms"] == r1["forms"] == ["module"] * 4
    for mine0, mine1, merged in zip(r0["mine"], r1["mine"], r0["merged"]):
        assert mine0
        assert mine1
        assert not set(mine0) & set(mine1)  # each rank its own pieces, none twice
        assert sorted(mine0 + mine1) == merged  # together: the check's pieces
    assert r0["merged"] == r1["merged"] and r0["coverage"] == r1["coverage"]


def test_correct_model_covered_without_alert(ranks):
    r0 = ranks[0]["correct"]
    assert r0["alerts"] == []
    assert r0["cycle"] == 3  # the first Linear's 600 rows: 3 slices of 200, within K = 3 checks
    assert all(v["backward"] == 1.0 and v["training"] == 1.0 for v in r0["coverage"].values())


def test_planted_wrong_backward_is_named(ranks):
    alerts = ranks[0]["bug"]["alerts"]
    assert alerts == ranks[1]["bug"]["alerts"]
    named = {tensor for kind, tensor in alerts if kind == "threshold"}
    assert any(n.startswith("3") for n in named)  # the wrong tanh, checked as its own unit
    assert not any(n.startswith("4.") for n in named)  # after it: right
