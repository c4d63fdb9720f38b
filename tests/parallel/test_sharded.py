"""GradWatch on a model sharded with FSDP2 (``fully_shard``): 2 gloo ranks on 127.0.0.1, CPU.

One pair of worker processes runs every scenario in turn (each with its own model and
watch), under a hard timeout (the parent kills the workers), so a hang fails the test
instead of blocking the suite and an abort inside gloo shows as an exit code. Each rank
writes what it saw to a JSON file that the tests then read.

Shard by shard (the default, :mod:`gradwatch.parallel.shard_check`):

- ``correct``: default check options on a correct model with dropout: no error, no alert,
  every parameter checked by the ranks that hold its rows, the training part judged on the
  shards, and the parameters after training bit-identical to a run without the watch;
- ``planted``: a custom ``autograd.Function`` with a wrong backward: its module named, in the
  same record on both ranks;
- ``transformer``: a pre-norm transformer with hand-written attention, each block sharded, a
  softmax backward 10% off in block 1: the alert names block 1's attention, nothing else; the
  correct one trains bit-identical to a run without the watch (the root's own parameters too);
- ``lockstep``: the same transformer; one rank's check raises where the other is in FSDP2's collectives
  (``loss_fn`` before the model, the model's forward midway, after the capture's forward, a custom
  backward in the replay), or stalls: an error record naming that rank on both, checks go on, the slow
  rank named, training bit-identical to a run without the watch;
- ``mixed``: a bfloat16 ``MixedPrecisionPolicy``: both parts judged (the replay runs in it);
- ``nan``: rank 1's batch holds a NaN at step 2: no hang, the same ``nonfinite`` record on both
  ranks, checks go on, and the parameters are bit for bit those of a run without the watch.

On a gathered replica (``form="objective"``, :mod:`gradwatch.parallel.sharded`):

- ``replica``: the planted bug caught and diagnosed, each rank checking its own tensors;
- ``inplace``: ``dtype=None`` (before this, one rank aborted inside gloo): checks run;
- ``errors``: ``loss_fn`` raises on rank 1 only; at another check it calls the live
  sharded model from its closure on rank 0 only; at a third, rank 1 has no ``.grad`` for
  one tensor (the ranks would gather different tensors): each time an error record on
  every rank, no hang, and training completes bit-identical to a run without the watch.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch.distributed as dist
from helpers import run_two_ranks

from gradwatch.io.sinks import read_jsonl

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
    pytest.skip("needs torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

RUN_TIMEOUT = 120.0
SCENARIOS = ("correct", "planted", "transformer", "lockstep", "mixed", "nan", "replica", "inplace", "errors")

WORKER = textwrap.dedent(
    r'''
    import datetime, json, os, sys, time
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    scenarios = sys.argv[4].split(",")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))

    from gradwatch import GradWatch
    from helpers import Act  # tests/helpers.py: tanh, or with wrong=True its planted WrongTanh
    from helpers import WrongSoftmax  # softmax whose backward is 10% too large


    def build(wrong=False, mixed=False):
        torch.manual_seed(0)  # the same initial weights on both ranks
        net = nn.Sequential(nn.Linear(6, 16), Act(wrong), nn.Dropout(0.2), nn.Linear(16, 16), nn.Tanh(),
                            nn.Linear(16, 3))  # 3 rows: uneven shards over 2 ranks
        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) if mixed else {}
        for i in (0, 3, 5):
            fully_shard(net[i], **kw)
        fully_shard(net, **kw)
        return net


    NAMES = ["0.weight", "0.bias", "3.weight", "3.bias", "5.weight", "5.bias"]
    state = {"step": -1, "net": None, "raise_on_rank": None, "closure_on_rank": None, "hide_grad_on_rank": None,
             "nan_on_rank": None}


    def loss_fn(m, batch):
        if m is not state["net"]:  # a check: gradwatch passes its gathered replica
            if state["raise_on_rank"] == (rank, state["step"]):
                raise KeyError("'labels' missing on rank 1")
            if state["closure_on_rank"] == (rank, state["step"]):
                m = state["net"]  # the live sharded model from the closure: its forward would all-gather
        return F.cross_entropy(m(batch[0]), batch[1])


    class Attention(nn.Module):  # q k^T, causal mask, softmax, v: all in this module's own forward
        def __init__(self, d, heads, wrong):
            super().__init__()
            self.qkv, self.out, self.heads, self.wrong = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, wrong

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            s = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            a = WrongSoftmax.apply(s) if self.wrong else torch.softmax(s, -1)
            return self.out((a @ v).transpose(1, 2).reshape(b, t, d))


    class Block(nn.Module):
        def __init__(self, d, wrong):
            super().__init__()
            self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, 2, wrong), nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))


    class LM(nn.Module):
        def __init__(self, vocab=50, d=16, wrong_block=None):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList([Block(d, i == wrong_block) for i in range(2)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, ids):
            x = self.emb(ids)
            for i, block in enumerate(self.blocks):
                if i == 1 and due("mid"):  # after block 0's all-gather, before block 1's
                    raise RuntimeError(f"block 1 cannot run on rank {rank}")
                x = block(x)
            return self.head(self.ln(x))


    def build_lm(wrong):
        torch.manual_seed(0)
        net = LM(wrong_block=1 if wrong else None)
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        return net


    faults = {"checking": False, "calls": 0, "step": -1, "at": {}}  # (rank, step) -> (call of loss_fn, what)


    def due(what):  # this rank meets fault ``what`` now: inside the check, at the planned call of loss_fn
        planned = faults["at"].get((rank, faults["step"]))
        return faults["checking"] and planned == (faults["calls"], what)


    class FailsBackward(torch.autograd.Function):  # identity whose backward raises (a custom backward's bug)
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError(f"the custom backward failed on rank {rank}")


    def lm_loss(m, batch):
        faults["calls"] += faults["checking"]
        if due("before"):
            raise KeyError(f"'labels' missing on rank {rank}")
        if due("stall"):
            time.sleep(2.5)
        logits = m(batch[:, :-1])
        if due("backward"):  # the replay's backward fails on this rank only, before any reduce-scatter
            logits = FailsBackward.apply(logits)
        if due("after"):
            raise ValueError(f"the loss could not be computed on rank {rank}")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


    def train_lm(steps, watch_options, wrong):
        net = build_lm(wrong)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        watch = GradWatch(net, lm_loss, optimizer=opt, **watch_options) if watch_options is not None else None
        g = torch.Generator().manual_seed(100 + rank)
        checks = []
        for step in range(steps):
            faults["step"] = step
            batch = torch.randint(0, 50, (4, 9), generator=g)
            opt.zero_grad()
            lm_loss(net, batch).backward()
            if watch is not None:
                faults["checking"], faults["calls"] = True, 0
                report = watch.step(batch)
                faults["checking"] = False
                if report is not None:
                    checks.append({"step": step, "ok": report.ok, "pieces": report.pieces, "notes": report.notes,
                                   "training": {n: t.verdict.value if t.verdict else None
                                                for n, t in report.training.items()}})
            opt.step()
        params = {n: p.to_local().detach().clone() for n, p in net.named_parameters()}
        if watch is None:
            return params
        res = {"checks": checks, "alerts": [a.to_dict() for a in watch.alerts], "coverage": watch.coverage,
               "modules_checked": watch.modules_checked, "params": params}
        watch.close()
        return res


    def train(steps, watch_options=None, wrong=False, mixed=False):
        net = build(wrong, mixed)
        state["net"] = net
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        watch = GradWatch(net, loss_fn, optimizer=opt, **watch_options) if watch_options is not None else None
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard
        torch.manual_seed(1234)  # dropout masks: the same stream with and without the watch
        checks = []
        for step in range(steps):
            state["step"] = step
            batch = (torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g))
            if state["nan_on_rank"] == (rank, step):
                batch[0][0, 0] = float("nan")
            opt.zero_grad()
            loss_fn(net, batch).backward()
            if watch is not None:
                hidden = None
                if state["hide_grad_on_rank"] == (rank, step):  # this rank's 5.bias has no .grad at the check
                    hidden, net[5].bias.grad = net[5].bias.grad, None
                report = watch.step(batch)
                if hidden is not None:
                    net[5].bias.grad = hidden
                if report is not None:
                    checks.append({
                        "step": step, "ok": report.ok, "notes": report.notes, "training_note": report.training_note,
                        "backward": {n: [t.verdict.value if t.verdict else None, t.rel_diff, t.diagnosis]
                                     for n, t in report.tensors.items()},
                        "training": {n: [t.verdict.value if t.verdict else None, t.rel_diff]
                                     for n, t in report.training.items()},
                    })
            opt.step()
        params = {n: p.to_local().detach().clone() for n, p in net.named_parameters()}
        result = {"checks": checks}
        if watch is not None:
            result["alerts"] = [a.to_dict() for a in watch.alerts]
            result["sinks"] = len(watch.sinks)
            watch.close()
        return params, result


    def same(a, b):  # bit for bit (NaN included)
        return {n: bool(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32))) for n in a}


    results = {}
    for scenario in scenarios:
        t0 = time.perf_counter()
        run_dir = os.path.join(out, scenario)
        if scenario == "correct":  # default check options
            plain, _ = train(4)
            watched, res = train(4, dict(every=1, log_dir=run_dir))
            res["bit_identical"] = same(plain, watched)
        elif scenario == "planted":
            _, res = train(2, dict(every=1, log_dir=run_dir), wrong=True)
        elif scenario == "transformer":
            plain = train_lm(2, None, wrong=False)
            res = {"correct": train_lm(2, dict(every=1, log_dir=None), wrong=False),
                   "wrong": train_lm(2, dict(every=1, log_dir=None), wrong=True)}
            # emb, ln and head are the root's own parameters: the replay's backward must not touch their .grad
            res["bit_identical"] = same(plain, res["correct"].pop("params"))
            res["wrong"].pop("params")
        elif scenario == "lockstep":  # one rank's check raises where the others are in FSDP2's collectives
            plain = train_lm(7, None, wrong=False)
            faults["at"] = {(1, 1): (1, "before"), (0, 2): (1, "mid"), (1, 3): (2, "after"), (1, 4): (1, "stall"),
                            (0, 5): (1, "backward")}
            res = train_lm(7, dict(every=1, log_dir=run_dir), wrong=False)
            faults["at"] = {}
            res["bit_identical"] = same(plain, res.pop("params"))
        elif scenario == "replica":
            _, res = train(2, dict(every=1, log_dir=run_dir, coords=4, directions=1, form="objective"), wrong=True)
        elif scenario == "inplace":
            _, res = train(3, dict(every=1, log_dir=run_dir, coords=4, directions=1, dtype=None, form="objective"))
            try:  # its ranks must gather it together: distributed=False is refused at once
                GradWatch(build(), loss_fn, distributed=False)
            except ValueError as err:
                res["refused"] = str(err)
        elif scenario == "errors":
            plain, _ = train(10)
            state["raise_on_rank"], state["closure_on_rank"], state["hide_grad_on_rank"] = (1, 2), (0, 4), (1, 8)
            watched, res = train(10, dict(every=2, log_dir=run_dir, coords=4, directions=1, form="objective"))
            state["raise_on_rank"] = state["closure_on_rank"] = state["hide_grad_on_rank"] = None
            res["bit_identical"] = same(plain, watched)
        elif scenario == "nan":
            state["nan_on_rank"] = (1, 2)
            plain, _ = train(4)
            watched, res = train(4, dict(every=1, log_dir=run_dir))
            state["nan_on_rank"] = None
            res["bit_identical"] = same(plain, watched)
        elif scenario == "mixed":
            _, res = train(2, dict(every=1, log_dir=run_dir, coords=4, directions=1), mixed=True)
        res["seconds"] = time.perf_counter() - t0
        results[scenario] = res
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    '''
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run every scenario on 2 ranks once; (rank 0's results, rank 1's results, the output folder)."""
    out = tmp_path_factory.mktemp("fsdp")
    codes, logs = run_two_ranks(WORKER, out / "worker.py", [str(out), ",".join(SCENARIOS)], RUN_TIMEOUT, "the FSDP2 run")
    # Every rank exits 0: no abort inside gloo (SIGABRT is -6), no exception out of the watch.
    assert codes == (0, 0), f"exit codes {codes}\n" + "\n----\n".join(logs)
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in range(2))
    return r0, r1, out


NAMES = ["0.weight", "0.bias", "3.weight", "3.bias", "5.weight", "5.bias"]


def test_correct_fsdp2_model_checked_shard_by_shard_no_alert_and_training_bit_identical(ranks):
    r0, r1, out = ranks
    for r in (r0["correct"], r1["correct"]):
        assert r["alerts"] == []
        assert [c["step"] for c in r["checks"]] == [0, 1, 2, 3]
        for c in r["checks"]:
            assert c["ok"], c
            # every parameter, its rows checked on the rank that holds them, and every module's input gradient
            assert set(NAMES) | {"0:input", "1:input", "3:input", "5:input"} <= set(c["backward"])
            assert all(v[0] in ("excellent", "acceptable") for v in c["backward"].values()), c["backward"]
            assert sorted(c["training"]) == sorted(NAMES)  # each rank judged its shard of .grad
            assert all(v[0] in ("excellent", "acceptable") for v in c["training"].values()), c["training"]
            assert any("checked shard by shard" in n for n in c["notes"])
            assert not any("replica" in n for n in c["notes"])
        # Training left exactly as it would have been: every local shard bit-identical.
        assert r["bit_identical"] == {n: True for n in NAMES}
    assert r0["correct"]["checks"] == r1["correct"]["checks"]  # one merged record, the same on both ranks
    assert r0["correct"]["sinks"] >= 2 and r1["correct"]["sinks"] == 0  # only rank 0 writes
    records, warnings = read_jsonl(out / "correct")
    assert warnings == []
    assert [rec["step"] for rec in records if rec["type"] == "check"] == [0, 1, 2, 3]


def test_planted_wrong_backward_is_named_by_its_module_shard_by_shard(ranks):
    r0, r1, _ = ranks
    for r in (r0["planted"], r1["planted"]):
        for c in r["checks"]:
            assert not c["ok"]
            assert c["backward"]["1:input"][0] == "wrong"  # the planted tanh, module 1
            assert all(c["backward"][n][0] in ("excellent", "acceptable") for n in NAMES), c["backward"]
            assert all(v[0] in ("excellent", "acceptable") for v in c["training"].values()), c["training"]
        wrong = {a["tensor"] for a in r["alerts"] if a["kind"] == "threshold" and a["part"] == "backward"}
        assert wrong == {"1:input"}, r["alerts"]
    assert r0["planted"]["checks"] == r1["planted"]["checks"]
    assert r0["planted"]["alerts"] == r1["planted"]["alerts"]


def test_sharded_transformer_softmax_bug_named_in_its_block(ranks):
    r0, r1, _ = ranks
    for r in (r0["transformer"], r1["transformer"]):
        correct, wrong = r["correct"], r["wrong"]
        assert correct["alerts"] == [] and all(c["ok"] for c in correct["checks"])
        assert all(v in ("excellent", "acceptable") for c in correct["checks"] for v in c["training"].values())
        # the rows of the embedding and the LM head are split between the ranks, each checking its own
        pieces = [p for c in correct["checks"] for p in c["pieces"]]
        assert any(p.startswith("head[") for p in pieces) and any(p.startswith("emb[") for p in pieces)
        assert correct["coverage"]["blocks.1.attn.qkv.weight"]["backward"] == 1.0
        assert correct["modules_checked"].get("blocks.1.attn", 0) >= 1  # the attention's own code
        named = {a["tensor"] for a in wrong["alerts"] if a["kind"] == "threshold"}
        assert named and all(n.startswith("blocks.1.attn") for n in named), wrong["alerts"]
        # Training exactly as without the watch, the root's own parameters (emb, ln, head) included.
        assert set(r["bit_identical"]) >= {"emb.weight", "head.weight", "ln.bias"}
        assert all(r["bit_identical"].values()), r["bit_identical"]
    assert r0["transformer"]["wrong"] == r1["transformer"]["wrong"]  # one merged record on both ranks


def test_a_rank_raising_inside_the_sharded_forward_is_a_record_on_every_rank_and_training_goes_on(ranks):
    r0, r1, out = ranks  # both ranks exited 0 within the timeout (the fixture asserts it): no hang, no abort
    for r in (r0["lockstep"], r1["lockstep"]):
        errors = [a for a in r["alerts"] if a["kind"] == "error"]
        assert [a["step"] for a in errors] == [1, 2, 3, 5], r["alerts"]
        # named by the rank that raised, where it raised: in the replay before the model was called, in the
        # middle of the model's forward (block 0 gathered, block 1 not), after the capture's forward
        assert "rank 1: KeyError" in errors[0]["message"] and "labels" in errors[0]["message"]
        assert "rank 0: RuntimeError: block 1 cannot run on rank 0" in errors[1]["message"]
        assert "rank 1: ValueError: the loss could not be computed on rank 1" in errors[2]["message"]
        # in the replay's backward: the other rank stopped before its next collective, not in the reduce-scatter
        assert "rank 0: RuntimeError: the custom backward failed on rank 0" in errors[3]["message"]
        assert not any("rank 0" in a["message"] for a in (errors[0], errors[2]))  # the stopped rank adds nothing
        assert [c["step"] for c in r["checks"]] == [0, 4, 6]  # checks go on after each failed one
        assert all(c["ok"] for c in r["checks"])
        stalled = r["checks"][1]["notes"]
        assert any(n.startswith("rank 1 ran slow in this check") for n in stalled), stalled
        assert r["bit_identical"] and all(r["bit_identical"].values()), r["bit_identical"]
    assert r0["lockstep"]["alerts"] == r1["lockstep"]["alerts"]
    records, _ = read_jsonl(out / "lockstep")
    assert [rec["step"] for rec in records if rec["type"] == "check"] == [0, 4, 6]


def test_dtype_none_under_fsdp2_runs_without_crashing_a_rank(ranks):
    r0, r1, _ = ranks  # both ranks exited 0 (the fixture asserts it)
    for r in (r0["inplace"], r1["inplace"]):
        assert r["alerts"] == []
        assert [c["step"] for c in r["checks"]] == [0, 1, 2]
        for c in r["checks"]:
            assert c["ok"] and list(c["backward"]) == NAMES, c
            assert all(v[0] in ("excellent", "acceptable") for v in c["training"].values()), c["training"]
        assert r["refused"].startswith("distributed=False, but FSDPSequential is sharded")


def test_a_check_failing_on_one_rank_is_an_error_record_on_every_rank(ranks):
    r0, r1, out = ranks
    for r in (r0["errors"], r1["errors"]):
        errors = [a for a in r["alerts"] if a["kind"] == "error"]
        assert [a["step"] for a in errors] == [2, 4, 8], errors  # (a check completes at 6: alerts are per streak)
        assert "rank 1: KeyError" in errors[0]["message"] and "labels" in errors[0]["message"]
        # rank 0's loss_fn called the live sharded model: refused before its all-gather, named as such
        assert "rank 0: LiveForwardInCheck" in errors[1]["message"] and "closure" in errors[1]["message"]
        # rank 1 had no .grad for 5.bias: the ranks would gather different tensors, so none does
        assert "ranks 0, 1: DistributedCheckError: the ranks disagree on the parameters to gather" in errors[2]["message"]
        assert "('5.bias', (3,), 'torch.float32', True) on rank 0, ('5.bias', (3,), 'torch.float32', False) on rank 1" \
            in errors[2]["message"]
        assert [c["step"] for c in r["checks"]] == [0, 2, 4, 6]
        assert r["checks"][3]["ok"] and list(r["checks"][3]["backward"]) == NAMES
        step2, step4 = r["checks"][1], r["checks"][2]
        assert list(step2["backward"]) == NAMES[0::2]  # rank 0's share still judged at step 2
        assert list(step4["backward"]) == NAMES[1::2]  # and rank 1's at step 4
        assert "replay failed on another rank" in step2["training_note"]
        # Training went on to the end, bit-identical to a run without the watch.
        assert r["bit_identical"] == {n: True for n in NAMES}
    assert r0["errors"]["alerts"] == r1["errors"]["alerts"]
    records, _ = read_jsonl(out / "errors")
    assert sum(rec["type"] == "alert" and "rank 1: KeyError" in rec["message"] for rec in records) == 1


def test_mixed_precision_policy_both_parts_judged_shard_by_shard(ranks):
    r0, r1, _ = ranks
    for r in (r0["mixed"], r1["mixed"]):
        assert r["alerts"] == [] and [c["step"] for c in r["checks"]] == [0, 1]
        for c in r["checks"]:
            assert c["ok"] and set(NAMES) <= set(c["backward"])
            # the replay runs in the policy's bfloat16, as training did: its shards agree with .grad
            assert sorted(c["training"]) == sorted(NAMES)
            assert all(v[0] in ("excellent", "acceptable") for v in c["training"].values()), c["training"]


def test_nan_on_one_rank_is_a_record_on_every_rank_without_hang(ranks):
    r0, r1, _ = ranks  # both ranks exited 0 within the timeout (the fixture asserts it)
    for r in (r0["nan"], r1["nan"]):
        assert [c["step"] for c in r["checks"]] == [0, 1, 2, 3]
        nonfinite = [a for a in r["alerts"] if a["kind"] == "nonfinite"]
        # from step 2 on the parameters hold NaN (SGD applied the NaN gradient, as without the watch)
        assert nonfinite and min(a["step"] for a in nonfinite) == 2, r["alerts"]
        assert not [a for a in r["alerts"] if a["kind"] in ("threshold", "error")], r["alerts"]
        assert r["bit_identical"] == {n: True for n in NAMES}
    assert r0["nan"]["alerts"] == r1["nan"]["alerts"]


def test_replica_form_catches_and_diagnoses_the_planted_bug(ranks):
    r0, r1, _ = ranks
    for r in (r0["replica"], r1["replica"]):
        for c in r["checks"]:
            assert not c["ok"]
            # The first layer's tensors feed the wrong tanh backward; the layers after it are right.
            assert c["backward"]["0.weight"][0] == "wrong" and c["backward"]["0.bias"][0] == "wrong"
            assert all(c["backward"][n][0] in ("excellent", "acceptable") for n in NAMES[2:]), c["backward"]
            assert all(v[0] in ("excellent", "acceptable") for v in c["training"].values()), c["training"]
            assert "averaged over 2 ranks" in c["training_note"]
            assert any("replica" in n for n in c["notes"])
        wrong = {a["tensor"] for a in r["alerts"] if a["kind"] == "threshold" and a["part"] == "backward"}
        assert wrong == {"0.weight", "0.bias"}, r["alerts"]
    # 0.weight was checked on rank 0 and 0.bias on rank 1: both ranks hold both, in the same record.
    assert r0["replica"]["checks"] == r1["replica"]["checks"]


# ---------------------------------------------------------------- in-process pieces (one rank)


def test_replica_is_plain_full_and_keeps_ties_and_user_hooks(one_rank):
    import torch
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    from gradwatch.parallel.sharded import (
        LiveForwardInCheck,
        Replica,
        is_sharded,
        layout,
        live_forward_forbidden,
    )

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.BatchNorm1d(4))
    seen = []
    net[2].register_forward_hook(lambda m, i, o: seen.append(1))  # a user hook: kept (the check suspends it)
    fully_shard(net[0])
    fully_shard(net)
    assert is_sharded(net)
    assert isinstance(net[0].weight, DTensor)
    assert isinstance(net, FSDPModule)
    net(torch.randn(5, 3)).sum().backward()
    replica = Replica(net)
    module = replica.refresh(net)
    assert type(module) is nn.Sequential and type(module[0]) is nn.Linear  # FSDP's classes left out
    assert not any(isinstance(m, FSDPModule) for m in module.modules())
    assert not any(k.startswith("__composable_api") for m in module.modules() for k in vars(m))
    for (n, live), (_, mine) in zip(net.named_parameters(), module.named_parameters()):
        assert type(mine) is nn.Parameter and not isinstance(mine, DTensor)
        assert torch.equal(mine, live.full_tensor()) and torch.equal(mine.grad, live.grad.full_tensor()), n
    assert torch.equal(module[3].running_mean, net[3].running_mean)
    assert [h for h in module[2]._forward_hooks.values()] == [h for h in net[2]._forward_hooks.values()]
    assert not module._forward_pre_hooks and not module[0]._forward_pre_hooks  # FSDP's pre/post forward hooks
    assert layout(net) == [(n, tuple(p.shape), str(p.dtype), True) for n, p in net.named_parameters()]
    out = module(torch.randn(5, 3))  # a plain forward: no collective
    assert out.shape == (5, 4) and seen == [1, 1]
    replica.release()
    assert all(p.grad is None for p in module.parameters())
    # During a check, the live sharded model refuses to run (before FSDP's all-gather), the replica runs.
    with live_forward_forbidden(net):
        with pytest.raises(LiveForwardInCheck, match="the model loss_fn is given"):
            net(torch.randn(5, 3))
        module(torch.randn(5, 3))
    net(torch.randn(5, 3))  # and runs again afterwards


def test_tied_parameters_stay_tied_in_the_replica(one_rank):
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from gradwatch.parallel.sharded import Replica

    emb = nn.Embedding(6, 4)
    head = nn.Linear(4, 6, bias=False)
    head.weight = emb.weight
    net = nn.Sequential(emb, head)
    fully_shard(net)
    module = Replica(net).refresh(net)
    assert module[0].weight is module[1].weight
    assert torch.equal(module[0].weight, net[0].weight.full_tensor())


def test_sharded_models_refused_where_they_cannot_be_checked(one_rank):
    import torch
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    import gradwatch
    from gradwatch import GradWatch

    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    fully_shard(net)

    def loss_fn(m, b):
        return m(b).pow(2).mean()

    with pytest.raises(ValueError, match="check_model cannot check FSDPSequential: it is sharded"):
        gradwatch.check_model(net, loss_fn, torch.randn(4, 3))
    # One rank: nothing to coordinate; shard by shard (one shard holds everything), or on the replica.
    for form, checked in (("auto", {"0.bias", "0.weight", "0:input", "2.bias", "2.weight", "2:input"}),
                          ("objective", {"0.bias", "0.weight", "2.bias", "2.weight"})):
        with GradWatch(net, loss_fn, every=1, log_dir=None, coords=2, directions=1, form=form) as watch:
            assert watch.dist is None
            net.zero_grad()
            batch = torch.randn(4, 3)
            loss_fn(net, batch).backward()
            report = watch.step(batch)
            assert report.ok and checked <= set(report.tensors), (form, sorted(report.tensors))
            assert all(t.verdict.value == "excellent" for t in report.training.values()), report.training
            assert sorted(report.training) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # FSDP1 needs an accelerator to be built; the refusal looks at the wrapper's class only.
    wrapped = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapped)
    wrapped.inner = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="FullyShardedDataParallel \\(FSDP1\\), which gradwatch does not check"):
        GradWatch(nn.Sequential(wrapped), loss_fn)


def test_fsdp_over_one_rank_makes_no_agreement_point(one_rank):
    """A 1x2 ``dp x tp`` mesh shards FSDP2 over one rank: its all-gathers and reduce-scatters wait for no other rank,
    so a check's region puts no point around them (on the 20.8M 1x2 model of ``benchmarks/parallel.py``, 68 points
    a check before, 47 since: the tensor parallel collectives' alone)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from gradwatch.parallel.lockstep import Lockstep
    from gradwatch.parallel.sharded import fsdp_communicates

    class Agreeing:
        calls = 0

        def agree(self, ok, value=None):
            Agreeing.calls += 1
            return True, value

    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    fully_shard(net[0])
    fully_shard(net)
    assert not fsdp_communicates(net[0]) and not fsdp_communicates(net)
    assert fsdp_communicates(nn.Linear(2, 2))  # not FSDP2: nothing says it does not
    with Lockstep(Agreeing(), net) as step:
        net(torch.randn(5, 3)).sum().backward()
    assert (Agreeing.calls, step.points) == (1, 1)  # the region's last point only
