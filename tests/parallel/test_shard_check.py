"""What ``form="objective"`` checks, checked shard by shard (FSDP2) and under DDP: 2 gloo ranks on 127.0.0.1, CPU.

One pair of worker processes runs every scenario in turn under a hard timeout (the pattern of
``tests/parallel/test_sharded.py``); each rank writes what it saw to a JSON file that the tests read.

- **terms that read the parameters directly**: a regularizer inside ``loss_fn`` (an L2 over every
  parameter and an L1 on one weight, made whole with ``full_tensor()`` under FSDP2), ``regularizers=``,
  coupled weight decay: checked with the model's outputs held fixed, entries ``"<tensor>:terms"`` (one per
  rank's rows when sharded); a square whose backward forgets its 2 is caught in both ranks' rows;
  the correct ones give no alert, and training is bit-identical to a run without the watch;
- **double backward**: a gradient penalty (``autograd.grad(create_graph=True)`` in ``loss_fn``) gets a
  ``"<module>:double_backward"`` verdict for every leaf, shard by shard too; a tanh whose double backward
  is 1.3x off is named;
- **independence**: every rank's batch checked (under FSDP2 by both ranks together on the live model);
  a module that mixes the batch only in the batch rank 1 holds is caught and said to be rank 1's;
- **weights below resolution under DDP**: judged on their modules, so a 1% error in a last layer's
  weight gradient at weights of 1e-6 is caught.
"""

from __future__ import annotations

import textwrap

import pytest
import torch.distributed as dist
from helpers import two_rank_results

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
    pytest.skip("needs torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

RUN_TIMEOUT = 150.0
SCENARIOS = ("fsdp:reg_ok", "fsdp:reg_bad", "fsdp:regopt_bad", "fsdp:sgd_wd", "fsdp:penalty_bad", "fsdp:indep_ok",
             "fsdp:indep_bad", "ddp:reg_ok", "ddp:reg_bad", "ddp:sgd_wd", "ddp:adam_wd", "ddp:penalty_bad",
             "ddp:indep_ok", "ddp:indep_bad", "ddp:small_wrong")

WORKER = textwrap.dedent(
    r'''
    import datetime, os, sys, time
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    scenarios = sys.argv[4].split(",")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))

    from gradwatch import GradWatch
    from helpers import make_tanh, save_rank_results


    class WrongSquare(torch.autograd.Function):  # p ** 2 whose backward forgets the 2
        @staticmethod
        def forward(ctx, p):
            ctx.save_for_backward(p)
            return p * p

        @staticmethod
        def backward(ctx, g):
            (p,) = ctx.saved_tensors
            return g * p


    class OffLinear(torch.autograd.Function):  # a weight gradient 1% too large
        @staticmethod
        def forward(ctx, x, w, b):
            ctx.save_for_backward(x, w)
            return F.linear(x, w, b)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w, 1.01 * (g.t() @ x), g.sum(0)


    class Off(nn.Linear):
        def forward(self, x):
            return OffLinear.apply(x, self.weight, self.bias)


    class MixesSixes(nn.Module):  # subtracts the mean over the batch (a leak) only from a batch of 6 samples
        def forward(self, x):
            return x - x.mean(0, keepdim=True) if x.shape[0] == 6 else x - x.mean(1, keepdim=True)


    class Tanh(nn.Module):  # tanh whose double backward is 1.3x off (or right)
        def __init__(self, error):
            super().__init__()
            self.f = make_tanh(x_error=error)

        def forward(self, x):
            return self.f(x)


    def build(kind, mix=False, scale=1.0, off=False, penalty_error=None):
        torch.manual_seed(0)
        layers = [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16),
                  Tanh(penalty_error) if penalty_error else nn.Tanh(), (Off if off else nn.Linear)(16, 3)]
        if mix:
            layers.insert(2, MixesSixes())
        net = nn.Sequential(*layers)
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(scale)
        if kind == "ddp":
            return net, DDP(net)
        keep = penalty_error is not None  # a gradient penalty under FSDP2 needs the unsharded parameters kept
        for m in net:
            if isinstance(m, nn.Linear):
                fully_shard(m, reshard_after_forward=not keep)
        fully_shard(net, reshard_after_forward=not keep)
        if keep:
            net.set_reshard_after_backward(False)
        return net, net


    def whole(x):  # a sum over sharded parameters is a partial DTensor: made whole, as training needs it
        return x.full_tensor() if hasattr(x, "full_tensor") else x


    def first(m):
        return getattr(m.module if isinstance(m, DDP) else m, "0")


    def ce(m, b):
        return F.cross_entropy(m(b[0]), b[1])


    def reg_ok(m, b):
        return (ce(m, b) + 1e-3 * whole(sum(p.pow(2).sum() for p in m.parameters()))
                + 1e-2 * whole(first(m).weight.abs().sum()))


    def reg_bad(m, b):
        return ce(m, b) + 1e-1 * whole(WrongSquare.apply(first(m).weight).sum())


    def penalty(m, b):
        x = b[0].clone().requires_grad_(True)
        loss = F.cross_entropy(m(x), b[1])
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        return loss + 0.1 * gx.pow(2).sum()


    def run(kind, loss_fn, steps=2, train_fn=None, opt=(torch.optim.SGD, {}), build_kw=None, sizes=(8, 8),
            watched=True, **options):
        net, model = build(kind, **(build_kw or {}))
        optimizer = opt[0](model.parameters(), lr=0.05, **opt[1])
        watch = GradWatch(model, loss_fn, optimizer=optimizer, every=1, log_dir=None, **options) if watched else None
        g = torch.Generator().manual_seed(100 + rank)
        n = sizes[rank]
        checks = []
        for step in range(steps):
            batch = (torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
            optimizer.zero_grad()
            (train_fn or loss_fn)(model, batch).backward()
            report = watch.step(batch) if watch is not None else None
            if report is not None:
                checks.append({
                    "tensors": {k: [t.verdict.value if t.verdict else None, t.failed] for k, t in report.tensors.items()},
                    "training": {k: t.verdict.value if t.verdict else None for k, t in report.training.items()},
                    "terms": sorted(report.terms), "notes": report.notes,
                    "independence": None if report.independence is None else report.independence.to_dict(),
                })
            optimizer.step()
        params = {k: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for k, p in net.named_parameters()}
        if watch is None:
            return params
        res = {"checks": checks, "alerts": [[a.kind, a.tensor, a.message, a.names] for a in watch.alerts]}
        watch.close()
        return res, params


    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)


    SCENARIO = {
        "reg_ok": lambda k: dict(loss_fn=reg_ok, steps=3, form="module" if k == "ddp" else "auto"),
        "reg_bad": lambda k: dict(loss_fn=reg_bad, form="module" if k == "ddp" else "auto"),
        "regopt_bad": lambda k: dict(loss_fn=ce, train_fn=reg_bad,
                                     regularizers=[lambda m: 1e-1 * whole(WrongSquare.apply(first(m).weight).sum())]),
        "sgd_wd": lambda k: dict(loss_fn=ce, opt=(torch.optim.SGD, dict(weight_decay=0.01))),
        "adam_wd": lambda k: dict(loss_fn=ce, opt=(torch.optim.Adam, dict(weight_decay=0.01)), form="module"),
        "penalty_bad": lambda k: dict(loss_fn=penalty, build_kw=dict(penalty_error=1.3)),
        "indep_ok": lambda k: dict(loss_fn=ce, steps=3, build_kw=dict(mix=True), sizes=(8, 7), independence="batch",
                                   training=False),
        "indep_bad": lambda k: dict(loss_fn=ce, build_kw=dict(mix=True), sizes=(8, 6), independence="batch",
                                    training=False),
        "small_wrong": lambda k: dict(loss_fn=ce, build_kw=dict(scale=1e-6, off=True)),
    }

    results = {}
    for scenario in scenarios:
        t0 = time.perf_counter()
        kind, name = scenario.split(":")
        kw = SCENARIO[name](kind)
        res, params = run(kind, **kw)
        if name in ("reg_ok", "indep_ok"):
            res["bit_identical"] = same(run(kind, **kw, watched=False), params)
        res["seconds"] = time.perf_counter() - t0
        results[scenario] = res
    save_rank_results(out, rank, results)
    dist.destroy_process_group()
    '''
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every scenario on 2 ranks once: (rank 0's results, rank 1's)."""
    return two_rank_results(WORKER, tmp_path_factory.mktemp("shard_complete"), SCENARIOS, RUN_TIMEOUT,
                            "the shard-by-shard run")


def _alerted(res, kind="threshold"):
    """The tensors ``kind`` alerts named: one cause's alert names each tensor it explains (issue 73)."""
    return {n for a in res["alerts"] if a[0] == kind for n in a[3]}


NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
ROWS = {"0": ("[0:8]", "[8:16]"), "2": ("[0:8]", "[8:16]"), "4": ("[0:2]", "[2:3]")}


def test_a_correct_regularizer_in_loss_fn_is_checked_without_alert_and_training_is_untouched(ranks):
    for r in ranks:
        for kind, names in (("fsdp", {f"{n}{rows}:terms" for n in NAMES for rows in ROWS[n[0]]}),
                            ("ddp", {f"{n}:terms" for n in NAMES})):
            res = r[f"{kind}:reg_ok"]
            assert res["alerts"] == [], res["alerts"]
            for c in res["checks"]:
                terms = {k: v for k, v in c["tensors"].items() if k.endswith(":terms")}
                assert set(terms) == names, sorted(terms)  # every rank's rows of every parameter it reads
                assert all(v[0] in ("excellent", "acceptable") for v in terms.values()), terms
                assert all(v in ("excellent", "acceptable") for v in c["training"].values()), c["training"]
            assert res["bit_identical"], kind
    assert ranks[0]["fsdp:reg_ok"]["checks"] == ranks[1]["fsdp:reg_ok"]["checks"]


def test_a_wrong_regularizer_backward_is_caught_shard_by_shard_and_under_ddp(ranks):
    for r in ranks:
        assert _alerted(r["fsdp:reg_bad"]) == {"0.weight[0:8]:terms", "0.weight[8:16]:terms"}, r["fsdp:reg_bad"]["alerts"]
        assert _alerted(r["fsdp:regopt_bad"]) == {"0.weight[0:8]:terms", "0.weight[8:16]:terms"}
        assert "analytic is 0.50x numeric" in r["fsdp:reg_bad"]["alerts"][0][2]
        assert _alerted(r["ddp:reg_bad"]) == {"0.weight:terms"}, r["ddp:reg_bad"]["alerts"]
        assert r["fsdp:regopt_bad"]["checks"][0]["terms"] == ["loss", "reg0"]


def test_coupled_weight_decay_is_in_the_objective_and_gives_no_false_alert(ranks):
    for r in ranks:
        for key in ("fsdp:sgd_wd", "ddp:sgd_wd", "ddp:adam_wd"):
            res = r[key]
            assert res["alerts"] == [], (key, res["alerts"])
            assert all("weight_decay" in c["terms"] for c in res["checks"]), key
        shard = r["fsdp:sgd_wd"]["checks"][0]
        assert {f"{n}{rows}:terms" for n in NAMES for rows in ROWS[n[0]]} <= set(shard["tensors"])
        assert any("(loss_fn, weight_decay)" in n for n in shard["notes"])


def test_a_gradient_penalty_gets_a_double_backward_verdict_and_a_wrong_one_is_named(ranks):
    for r in ranks:
        for kind in ("fsdp", "ddp"):
            res = r[f"{kind}:penalty_bad"]
            for c in res["checks"]:
                double = {k: v for k, v in c["tensors"].items() if k.endswith(":double_backward")}
                assert set(double) == {f"{i}:double_backward" for i in range(5)}, (kind, sorted(double))
                assert double["3:double_backward"][0] == "wrong"
                assert all(v[0] in ("excellent", "acceptable") for k, v in double.items() if k[0] != "3"), double
            assert _alerted(res) == {"3:double_backward"}, (kind, res["alerts"])
    assert ranks[0]["fsdp:penalty_bad"]["checks"] == ranks[1]["fsdp:penalty_bad"]["checks"]


def test_independence_checks_every_ranks_batch(ranks):
    for r in ranks:
        for kind in ("fsdp", "ddp"):
            clean, leak = r[f"{kind}:indep_ok"], r[f"{kind}:indep_bad"]
            assert _alerted(clean, "independence") == set() and clean["bit_identical"], kind
            for c in clean["checks"]:
                assert c["independence"]["ok"] and "checked on the batches of ranks 0, 1" in c["independence"]["notes"]
            # the leak is in rank 1's batch only (6 samples): found there, named by module and rank
            assert _alerted(leak, "independence") == {"2"}, (kind, leak["alerts"])
            for c in leak["checks"]:
                assert not c["independence"]["ok"]
                assert "batch independence broken on the batch of rank 1" in c["independence"]["notes"]


def test_a_small_error_at_weights_below_resolution_is_caught_under_ddp(ranks):
    for r in ranks:
        res = r["ddp:small_wrong"]
        assert _alerted(res) == {"4.weight"}, res["alerts"]
        assert any("judged on their modules alone" in n for c in res["checks"] for n in c["notes"])
