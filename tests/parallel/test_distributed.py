"""GradWatch under DistributedDataParallel: 2 gloo ranks on 127.0.0.1, spawned as subprocesses.

The DDP scenarios run in turn in one launch of the 2 ranks (a module fixture;
the scenario where rank 1 dies last), each test reading its own scenario's
results. Every launch has a hard timeout (the parent kills the workers), so a
hang fails the tests instead of blocking the suite. Each worker writes what it
saw to a JSON file that the parent then checks:

- checks run on the unwrapped module: no DDP forward and no gradient
  all-reduce happen inside a check (a forward pre-hook on the DDP wrapper and
  a DDP comm hook count them);
- every rank checks at the same steps, also with ``every="auto"`` when the
  ranks' own timings would disagree;
- each rank checks its own round-robin share of the tensors, and the merged
  report (the same on every rank) holds all of them;
- only rank 0 writes TensorBoard and ``checks.jsonl``;
- an exception in one rank's check becomes an ``error`` alert naming the rank,
  and a rank that dies in its check does not leave the other one waiting:
  it gives up after ``distributed_timeout`` with an alert and trains on.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch.distributed as dist
from helpers import run_launcher, run_two_ranks

from gradwatch.io.sinks import read_jsonl

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]

RUN_TIMEOUT = 90.0
#: The one launch running every DDP scenario in turn (each of them had 90 s as a launch of its own).
DDP_RUNS_TIMEOUT = 240.0
#: The DDP scenarios, in the order one launch of 2 ranks runs them; "die" last: rank 1 exits inside its check.
SCENARIOS = ("error", "auto", "die")

WORKER = textwrap.dedent(
    r'''
    import time
    started = time.monotonic()
    import json, os, sys, datetime, logging, traceback
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank, world, port, out, scenarios = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))

    import gradwatch.check.model
    from gradwatch import GradWatch, GradientDriftError

    startup = time.monotonic() - started  # this process's start-up: part of the "die" scenario's time limit
    state = {"in_check": False, "result": None}
    real_check = gradwatch.check.model.run_model_check

    def spying_check(model, objective, batch, opts, **kw):
        state["result"]["shares"].append(list(kw.get("names") or []))
        state["in_check"] = True
        try:
            return real_check(model, objective, batch, opts, **kw)
        finally:
            state["in_check"] = False

    gradwatch.check.model.run_model_check = spying_check


    def run(scenario, out):
        """One scenario: a fresh model, DDP wrapper, optimizer and watch (its files under ``out``); this rank's results."""
        t_scenario = time.monotonic()
        result = state["result"] = {"rank": rank, "checked_steps": [], "shares": [], "alerts": [], "in_check_collectives": 0,
                                    "allreduces": 0, "ddp_forwards_in_check": 0, "raised_at": None}
        torch.manual_seed(0)  # same initial weights on both ranks (DDP also broadcasts them)
        net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
        model = DDP(net)

        def count_forward(module, args):
            if state["in_check"]:
                result["ddp_forwards_in_check"] += 1

        model.register_forward_pre_hook(count_forward)

        def comm_hook(process_group, bucket):
            result["allreduces"] += 1
            if state["in_check"]:
                result["in_check_collectives"] += 1
            fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0] / world)

        model.register_comm_hook(None, comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        fail_at = {"error": 2, "die": 0}.get(scenario)

        def loss_fn(m, batch):
            checking = not torch.is_grad_enabled() or state["in_check"]
            if checking and rank == 1 and fail_at is not None and step_now[0] == fail_at:
                if scenario == "die":
                    os._exit(7)  # a crash inside the check: no exception, the process is gone
                raise KeyError("'labels' missing on rank 1")
            if checking and scenario == "auto" and rank == 1:
                time.sleep(0.005)  # rank 1's checks are slower: its own auto interval would differ
            return F.cross_entropy(m(batch[0]), batch[1])

        grad_fn = None
        if scenario == "auto":
            def grad_fn(m, batch):  # correct until step 12, then twice the gradient
                params = dict(m.named_parameters())
                grads = torch.autograd.grad(loss_fn(m, batch), list(params.values()))
                factor = 2.0 if step_now[0] >= 12 else 1.0
                return {n: g * factor for n, g in zip(params, grads)}

        options = dict(
            # the whole objective fits memory_budget: the ranks share the tensors (test_ddp_module_form.py: the pieces)
            error=dict(every=2, log_dir=os.path.join(out, f"run{rank}" if rank else "run"), coords=3, directions=1),
            die=dict(every=2, log_dir=os.path.join(out, "run"), coords=3, directions=1, distributed_timeout=3),
            # The schedule's agreement is what this scenario tests, timed on the backward part alone: the training
            # part (a replay and two small collectives per check) has its own DDP test in test_training.py.
            auto=dict(every="auto", overhead_budget=0.2, training=False, dtype=None, log_dir=os.path.join(out, "run"), coords=3,
                      directions=1, raise_on="wrong", tensors_per_check=1),
        )[scenario]
        watch = GradWatch(model, loss_fn, optimizer=opt, grad_fn=grad_fn, **options)
        result["model_is_unwrapped"] = watch.model is net
        result["sink_count"] = len(watch.sinks)

        steps = {"error": 8, "die": 2, "auto": 60}[scenario]
        step_now = [0]
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard
        t0 = time.time()
        for step in range(steps):
            step_now[0] = step
            batch = (torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g))
            opt.zero_grad()
            loss_fn(model, batch).backward()  # DDP all-reduce
            if scenario == "auto":
                time.sleep(0.01)  # a training step of >= 10 ms: the auto gap (check time / step time) stays a few steps
            try:
                report = watch.step(batch)
            except GradientDriftError as err:
                result["raised_at"] = step
                result["checked_steps"].append(step)
                result["alerts"] = [a.to_dict() for a in watch.alerts]
                break
            if report is not None:
                result["checked_steps"].append(step)
                result.setdefault("reports", []).append(sorted(report.tensors))
            result["local_interval"] = watch.schedule.interval()
            result["schedule"] = watch.schedule.explain()  # for a failing assertion's message
            if watch.dist is not None:
                result["agreed_interval"] = watch.dist.interval
            if scenario == "die" and watch.dist is not None and watch.dist.broken:
                break  # rank 1 is gone: no more DDP steps
            opt.step()
        result["seconds"] = time.time() - t0
        result["alerts"] = [a.to_dict() for a in watch.alerts]
        result["broken"] = watch.dist.broken if watch.dist is not None else None
        result["params"] = [p.detach().sum().item() for p in net.parameters()]
        watch.close()
        result["startup"], result["wall"] = startup, time.monotonic() - t_scenario
        return result


    for scenario in scenarios:  # each scenario's results in out/<scenario>/rank<r>.json as soon as it ends
        folder = os.path.join(out, scenario)
        os.makedirs(folder, exist_ok=True)
        try:
            result = run(scenario, folder)
        except Exception:
            result = {"exception": traceback.format_exc()}
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    if "die" not in scenarios:
        dist.destroy_process_group()
    os._exit(0)
    '''
)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """Every scenario of :data:`SCENARIOS` in turn in one launch of 2 ranks: (folder, exit codes, logs); a hang (the
    launch killed after :data:`DDP_RUNS_TIMEOUT`) gives codes None, and the scenarios without results fail by name."""
    out = tmp_path_factory.mktemp("ddp")
    try:
        codes, logs = run_two_ranks(WORKER, out / "worker.py", [str(out), ",".join(SCENARIOS)], DDP_RUNS_TIMEOUT,
                                    "the distributed runs")
    except pytest.fail.Exception as hang:
        return out, None, [str(hang)]
    return out, codes, logs


def run_ranks(launch, scenario: str, die: bool = False) -> tuple:
    """``scenario``'s results in ``launch`` (rank 0's, rank 1's: None where that rank left none), its folder and the
    launch's logs. Both ranks' results must be there and hold no exception, but for rank 1 in "die" (it exits inside its
    check): that the launch ended with exit codes (0, 7) is "die"'s own assertion."""
    out, codes, logs = launch
    folder = out / scenario
    results = [json.loads((folder / f"rank{r}.json").read_text()) if (folder / f"rank{r}.json").exists() else None
               for r in range(2)]
    launched = f"the launch's exit codes {codes}\n" + "\n----\n".join(logs)
    for r, res in enumerate(results):
        if die and r == 1:
            continue
        assert res is not None, f"rank {r} left no results for scenario {scenario!r}; {launched}"
        assert "exception" not in res, f"rank {r} raised in scenario {scenario!r}:\n{res['exception']}\n{launched}"
    return results, folder, logs


NAMES = ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]


def test_ddp_sharded_checks_rank0_writes_and_errors_are_reported(launch):
    (r0, r1), tmp_path, logs = run_ranks(launch, "error")
    for r in (r0, r1):
        assert r["model_is_unwrapped"]
        # No collective inside a check: no DDP forward, no gradient all-reduce while checking.
        assert r["ddp_forwards_in_check"] == 0 and r["in_check_collectives"] == 0
        assert r["allreduces"] >= 8  # the training steps did all-reduce
        assert r["checked_steps"] == [0, 2, 4, 6]  # every=2: the same steps on both ranks
    # Each rank checked its own round-robin share; together, every tensor at every check.
    assert r0["shares"] == [NAMES[0::2]] * 4
    assert r1["shares"] == [NAMES[1::2]] * 4
    # The merged report is the same on both ranks; at step 2 rank 1's share is missing (its loss_fn raised).
    assert r0["reports"] == r1["reports"]
    assert r0["reports"][0] == sorted(NAMES) and r0["reports"][1] == sorted(NAMES[0::2])
    assert r0["reports"][2] == sorted(NAMES)
    for r in (r0, r1):
        errors = [a for a in r["alerts"] if a["kind"] == "error"]
        assert len(errors) == 1 and errors[0]["step"] == 2
        assert "rank 1: KeyError" in errors[0]["message"] and "labels" in errors[0]["message"]
    # Identical training on both ranks (DDP) despite the failed check.
    assert r0["params"] == r1["params"]
    # Only rank 0 writes files.
    assert r0["sink_count"] >= 2 and r1["sink_count"] == 0
    assert not (tmp_path / "run1").exists()
    records, warnings = read_jsonl(tmp_path / "run")
    assert warnings == []
    checks = [rec for rec in records if rec["type"] == "check"]
    assert [c["step"] for c in checks] == [0, 2, 4, 6]
    assert {c["form"] for c in checks} == {"objective"}  # the whole objective fits memory_budget
    assert sorted(checks[0]["tensors"]) == sorted(NAMES)
    assert checks[-1]["check_counts"] == {"0.weight": 4, "0.bias": 3, "1.weight": 4, "1.bias": 3, "3.weight": 4, "3.bias": 3}
    assert any(rec["type"] == "alert" and "rank 1" in rec["message"] for rec in records)
    assert len(list((tmp_path / "run").glob("events.out.tfevents.*"))) == 1


def test_ddp_auto_schedule_is_agreed_and_raise_on_is_consistent(launch):
    (r0, r1), _, logs = run_ranks(launch, "auto")
    assert r0["checked_steps"] == r1["checked_steps"]
    assert len(r0["checked_steps"]) >= 3, (r0["schedule"], r0["checked_steps"])
    assert r0["agreed_interval"] == r1["agreed_interval"]
    # The same decision on both ranks, although rank 1's own timings would have said otherwise.
    assert r1["local_interval"] > r1["agreed_interval"], (r0["schedule"], r1["schedule"])  # rank 1 sleeps in checks
    # tensors_per_check=1 per rank: two tensors per check, one on each rank.
    assert all(len(s) == 1 for s in r0["shares"] + r1["shares"])
    assert all(len(rep) == 2 for rep in r0["reports"])
    # In place (dtype=None) through DDP: still no collective inside a check.
    assert r0["in_check_collectives"] == 0 and r1["in_check_collectives"] == 0
    # The wrong gradient from step 12 raises GradientDriftError on both ranks at the same step.
    assert r0["raised_at"] is not None and r0["raised_at"] == r1["raised_at"] >= 12
    wrong0 = [a for a in r0["alerts"] if a["kind"] == "threshold"]
    wrong1 = [a for a in r1["alerts"] if a["kind"] == "threshold"]
    assert wrong0 and wrong0 == wrong1


def test_ddp_rank_dying_in_check_does_not_hang_the_other(launch):
    (r0, r1), tmp_path, logs = run_ranks(launch, "die", die=True)
    codes = launch[1]
    assert codes == (0, 7), f"exit codes {codes}\n" + "\n----\n".join(logs)
    assert r1 is None  # rank 1 died inside its first check
    assert r0["broken"] and "distributed_timeout" in r0["broken"]
    errors = [a for a in r0["alerts"] if a["kind"] == "error"]
    assert len(errors) == 1 and "gave up" in errors[0]["message"]
    assert r0["checked_steps"] == []
    assert r0["startup"] + r0["wall"] < 60  # rank 0's start-up and this scenario's run
    records, _ = read_jsonl(tmp_path / "run")
    assert any(rec["type"] == "alert" and "gave up" in rec["message"] for rec in records)


LIGHTNING_SCRIPT = textwrap.dedent(
    r'''
    import json, os, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    import gradwatch.check.model
    from gradwatch.integrations.lightning import GradWatchCallback

    SHARES = []
    _real = gradwatch.check.model.run_model_check

    def _spy(model, objective, batch, opts, **kw):  # runs in every rank (top level: re-run on spawn)
        SHARES.append(list(kw.get("names") or []))
        return _real(model, objective, batch, opts, **kw)

    gradwatch.check.model.run_model_check = _spy


    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

        def training_step(self, batch, idx):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)


    class Dump(pl.Callback):
        def __init__(self, watcher, out):
            self.watcher, self.out = watcher, out

        def on_train_end(self, trainer, pl_module):
            watch = self.watcher.watch
            info = {"rank": trainer.global_rank, "shares": SHARES, "distributed": watch.dist is not None,
                    "sinks": len(watch.sinks), "coverage": watch.check_counts, "alerts": len(watch.alerts)}
            with open(os.path.join(self.out, f"lightning_rank{trainer.global_rank}.json"), "w") as f:
                json.dump(info, f)


    if __name__ == "__main__":
        torch.set_num_threads(1)
        out = sys.argv[1]
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(256, 5), torch.randint(0, 3, (256,)))
        watcher = GradWatchCallback(every=2, coords=3, directions=1)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=6,
                             logger=TensorBoardLogger(out, name="tb"), callbacks=[watcher, Dump(watcher, out)],
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(Net(), DataLoader(data, batch_size=16))
    '''
)


def test_lightning_ddp_spawn(tmp_path):
    pytest.importorskip("lightning")
    run_launcher(LIGHTNING_SCRIPT, tmp_path / "fit.py", [str(tmp_path)], RUN_TIMEOUT, "Lightning ddp_spawn fit")
    r0, r1 = (json.loads((tmp_path / f"lightning_rank{r}.json").read_text()) for r in range(2))
    names = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert r0["distributed"] and r1["distributed"]
    assert r0["shares"] == [names[0::2]] * 3 and r1["shares"] == [names[1::2]] * 3
    assert r0["coverage"] == r1["coverage"] == {n: 3 for n in names}
    assert r0["sinks"] >= 2 and r1["sinks"] == 0
    (run,) = (tmp_path / "tb").iterdir()
    records, warnings = read_jsonl(run)
    assert warnings == []
    checks = [r for r in records if r["type"] == "check"]
    assert [c["step"] for c in checks] == [0, 2, 4]
    assert all(sorted(c["tensors"]) == sorted(names) and c["ok"] for c in checks)
    assert len(list(run.glob("events.out.tfevents.*"))) == 1  # gradwatch wrote through the logger's writer


# ---------------------------------------------------------------- in-process pieces


def test_unwrap_and_modes(tmp_path):
    import torch
    from torch import nn

    from gradwatch import GradWatch
    from gradwatch.parallel.coordinator import DistributedCoordinator, unwrap_model

    lin = nn.Linear(2, 1)
    assert unwrap_model(nn.DataParallel(nn.DataParallel(lin))) is lin
    assert DistributedCoordinator.create(lin, "auto") is None
    assert DistributedCoordinator.create(lin, False) is None
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        DistributedCoordinator.create(lin, True)
    with pytest.raises(ValueError, match="distributed: got 'yes'"):
        GradWatch(lin, lambda m, b: m(b).sum(), distributed="yes")
    # A single-rank group (and DataParallel on CPU) keeps the single-process path, on the inner module.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)))
        with GradWatch(ddp, lambda m, b: m(b).pow(2).mean(), every=1, log_dir=None, coords=2) as watch:
            assert watch.dist is None and watch.model is ddp.module
            report = watch.step(torch.randn(5, 3))
            assert report.ok and sorted(report.tensors) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    finally:
        dist.destroy_process_group()


def test_merge_reports_orders_tensors_and_keeps_nonfinite():
    from gradwatch import CheckReport, TensorCheck
    from gradwatch.parallel.coordinator import merge_reports

    def report(names, objective, evaluations):
        return CheckReport(tensors={n: TensorCheck(n, (1,), 0.0, 0.0) for n in names}, objective=objective,
                           terms={"loss": objective}, evaluations=evaluations, seconds=evaluations / 10)

    merged = merge_reports([(1, report(["b", "d"], 2.0, 5)), (0, report(["a", "c"], 1.0, 3))], ["a", "b", "c", "d"], None)
    assert list(merged.tensors) == ["a", "b", "c", "d"]
    assert merged.objective == 1.0
    assert merged.evaluations == 8
    assert merged.seconds == 0.5
    bad = report(["b"], float("nan"), 1)
    bad.nonfinite = True
    merged = merge_reports([(0, report(["a"], 1.0, 1)), (1, bad)], ["a", "b"], None)
    assert merged.nonfinite
    assert merged.objective != merged.objective
    assert not merged.ok


def test_merge_reports_keeps_a_ranks_failing_verdict_whatever_rank_comes_after():
    # ranks judge different rows of one weight (DDP splits the pieces, FSDP2 checks each rank's shard): the merged
    # report keeps the failing one, not the last rank's
    from gradwatch import CheckReport, TensorCheck
    from gradwatch.bands import Verdict
    from gradwatch.parallel.coordinator import merge_reports

    bad = TensorCheck("w", (4, 2), 0.06, 0.2, judged_rel_diff=0.06, verdict=Verdict.WRONG, failed=True)
    ok = TensorCheck("w", (4, 2), 0.0, 0.0, verdict=Verdict.EXCELLENT)
    for ranks in ((bad, ok), (ok, bad)):
        reports = [(r, CheckReport(tensors={"w": t}, objective=1.0, terms={"loss": 1.0})) for r, t in enumerate(ranks)]
        merged = merge_reports(reports, ["w"], None)
        assert merged.tensors["w"] is bad and not merged.ok


def test_coordinator_shares_gathers_and_merges_only():
    """The seam of issue 13: the coordinator neither imports the GradWatch facade nor reaches into it."""
    import ast
    import inspect

    import gradwatch.parallel.coordinator as coordinator
    from gradwatch.parallel.coordinator import DistributedCoordinator

    source = inspect.getsource(coordinator)
    imported = [(node.level, node.module, [a.name for a in node.names])
                for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)]
    assert not [i for i in imported if i[1] in ("gradwatch", "hook") or "GradWatch" in i[2]], imported
    assert "watch._" not in source and "GradWatch" not in [n for n in dir(coordinator)]
    assert not hasattr(DistributedCoordinator, "run")  # the check loop is GradWatch's own
    params = {n for name, fn in inspect.getmembers(DistributedCoordinator, inspect.isfunction)
              for n in inspect.signature(fn).parameters}
    assert "watch" not in params, params
