"""GradWatch on tensor parallel, sequence parallel and 2-D (FSDP2 over TP) models: 2 gloo ranks on CPU.

The models are parallelized with torch's own ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput``), as torchtitan does, and watched as a new user would:
``GradWatch(model, loss_fn, optimizer=opt, every=1)``, ``watch.step(batch)`` after backward. One pair of worker
processes runs every scenario in turn under a hard timeout; each rank writes what it saw to a JSON file.

- ``mlp``, ``attn``, ``sp``, ``2d21``, ``2d12``: a correct model over 4 checks at ``every=1``: no alert, every
  parameter with a backward and a training verdict, the parameters after training bit-identical to a run
  without the watch; then the same model with a GELU whose backward is 20% too large (the MLP), and with an
  attention softmax whose backward is 10% too large (the others): each alerted, naming its module.
- ``terms``: the TP attention block with ``tensors_per_check=4`` (K > 1 checks): ``loss_fn`` reads no parameter
  directly, so the forward that looks for such terms runs at the first check of each pass of K checks only.
- ``ckpt``, ``ckpt2d21``: a 2-block TP transformer (and the same under FSDP2 on a 2x1 mesh) in a room too small for
  the replay beside ``.grad``: the replay checkpoints its blocks (as many on each rank), the training verdicts
  stand, training is bit-identical.
- ``vocab``: the TP attention block under GPT-2's 50,257-token head, at batch 4 x 16: a forward to the loss holds
  far more than the captures' share of the room, so a check's forwards that run to the logits run on the batch's
  first sample, the same on both ranks; the correct model gives no alert and trains bit-identically, the wrong softmax is alerted.
- ``dropout``: the TP transformer with dropout on its embedding: the replay draws training's masks, so its forward is
  not the capture's (which runs its own, dropout off); no alert, training bit-identical.
- ``lockstep``: the TP transformer; one rank's check raises before the model, midway in its forward, after
  it, in a custom backward of the replay, or stalls: an error record naming that rank on both ranks, the run
  goes on and ends normally, and training is bit-identical to a run without the watch on every rank.
"""

from __future__ import annotations

import textwrap

import pytest
import torch.distributed as dist
from helpers import two_rank_results

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]
pytest.importorskip("torch.distributed.tensor.parallel")

RUN_TIMEOUT = 240.0
SHAPES = ("mlp", "attn", "sp", "2d21", "2d12")
# ckpt first: its room, from the process peak, is its own
SCENARIOS = ("ckpt", "ckpt2d21") + SHAPES + ("dropout", "gathers", "lockstep", "terms", "vocab")

WORKER = textwrap.dedent(
    r'''
    import datetime, os, sys, time, warnings
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    scenarios = sys.argv[4].split(",")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    from gradwatch import GradWatch
    from gradwatch.plan.cycle import Piece
    from gradwatch.plan.shards import assign
    from gradwatch.plan.units import plan_units
    from gradwatch.parallel.shard_check import held_rows, replicas, reshard, settled, settled_pairs
    from helpers import WrongSoftmax, save_rank_results  # tests/helpers.py: softmax whose backward is 10% too large

    faults = {"checking": False, "calls": 0, "step": -1, "at": {}}  # (rank, step) -> (call of loss_fn, what)


    def due(what):  # this rank meets fault ``what`` now: inside the check, at the planned call of loss_fn
        return faults["checking"] and faults["at"].get((rank, faults["step"])) == (faults["calls"], what)


    class WrongGelu(torch.autograd.Function):  # backward 20% too large
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return F.gelu(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                (d,) = torch.autograd.grad(F.gelu(x), x, g)
            return 1.2 * d


    class FailsBackward(torch.autograd.Function):  # identity whose backward raises (a custom backward's bug)
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError(f"the custom backward failed on rank {rank}")


    class Gelu(nn.Module):
        def __init__(self, wrong):
            super().__init__()
            self.wrong = wrong

        def forward(self, x):
            return WrongGelu.apply(x) if self.wrong else F.gelu(x)


    class Attention(nn.Module):  # q, k, v column-parallel (this rank's heads), o row-parallel
        def __init__(self, d, heads, wrong):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.head_dim, self.wrong = d // heads, wrong

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
            s = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            a = WrongSoftmax.apply(s) if self.wrong else torch.softmax(s, -1)
            return self.o((a @ v).transpose(1, 2).reshape(b, t, -1))


    class Block(nn.Module):
        def __init__(self, d, wrong):
            super().__init__()
            self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, 4, wrong), nn.LayerNorm(d)
            self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), Gelu(False), nn.Linear(4 * d, d)

        def forward(self, x):
            recomputed["n"] += torch._C._current_graph_task_id() >= 0  # a forward inside a backward: a recompute
            if due("mid"):  # inside the model's forward, after the embedding, before the block's collectives
                raise RuntimeError(f"the block cannot run on rank {rank}")
            x = x + self.attn(self.ln1(x))
            return x + self.fc2(self.act(self.fc1(self.ln2(x))))


    class LM(nn.Module):
        def __init__(self, wrong, vocab=40, d=16, dropout=0.0):
            super().__init__()
            self.emb, self.block, self.ln, self.head = nn.Embedding(vocab, d), Block(d, wrong), nn.LayerNorm(d), nn.Linear(d, vocab)
            self.drop = nn.Dropout(dropout)

        def forward(self, ids):
            return self.head(self.ln(self.block(self.drop(self.emb(ids)))))


    class LM2(nn.Module):  # two blocks: what the replay may checkpoint
        def __init__(self, wrong, vocab=40, d=16):
            super().__init__()
            self.emb, self.ln, self.head = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, vocab)
            self.blocks = nn.ModuleList(Block(d, wrong) for _ in range(2))

        def forward(self, ids):
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))


    recomputed = {"n": 0}
    VOCAB = 50257  # GPT-2's
    TP = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
          "attn.o": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    SP = {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
          "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
          "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
          "attn.o": RowwiseParallel(output_layouts=Shard(1)),
          "fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel(output_layouts=Shard(1))}


    class Gathers(nn.Module):  # its own forward makes a collective (a full_tensor() written by hand)
        def forward(self, x):
            return DTensor.from_local(x, mesh, [Shard(0)]).full_tensor()[: x.shape[0]] * 1.0


    class SPLM(LM):  # the block and the final norm see this rank's half of the sequence (torchtitan's plan): the
        # embedding row-parallel with its output sharded by sequence. (It was a plain embedding whose output each rank
        # cut to its half with .chunk(): each replica got the gradient of its half only, and the replicas drifted
        # apart at the first step; gradwatch's replica verdict found it.)
        pass


    def build(shape, wrong):
        global mesh
        torch.manual_seed(0)  # the same initial weights on both ranks
        if shape.startswith("mlp"):
            mesh = init_device_mesh("cpu", (2,))
            net = nn.Sequential(nn.Linear(8, 32), Gelu(wrong), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
            if shape == "mlp-gathers":
                net.append(Gathers())
            parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            return net
        if shape.startswith("ckpt"):
            mesh2 = None
            if shape == "ckpt":
                mesh = init_device_mesh("cpu", (2,))
            else:  # FSDP2 over TP on a 2x1 mesh: FSDP2 shards the blocks, gathered again for their recomputed forward
                mesh2 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
                mesh = mesh2["tp"]
            net = LM2(wrong, vocab=2000, d=128)  # its gradients well above what a check leaves held (the room's noise)
            for block in net.blocks:
                parallelize_module(block, mesh, TP)
                if mesh2 is not None:
                    fully_shard(block, mesh=mesh2["dp"])
            if mesh2 is not None:
                fully_shard(net, mesh=mesh2["dp"])
            return net
        if shape.startswith("2d"):
            mesh2 = init_device_mesh("cpu", (2, 1) if shape == "2d21" else (1, 2), mesh_dim_names=("dp", "tp"))
            mesh = mesh2["tp"]
        else:
            mesh = init_device_mesh("cpu", (2,))
        extra = {"vocab": VOCAB} if shape == "vocab" else {"dropout": 0.1} if shape == "dropout" else {}
        net = (SPLM if shape == "sp" else LM)(wrong, **extra)
        parallelize_module(net.block, mesh, SP if shape == "sp" else TP)
        if shape == "sp":  # the final norm on the sequence shards, the head gathering them
            parallelize_module(net, mesh, {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                                           "ln": SequenceParallel(),
                                           "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
        if shape.startswith("2d"):
            fully_shard(net.block, mesh=mesh2["dp"])
            fully_shard(net, mesh=mesh2["dp"])
        return net


    def loss_fn(m, batch):
        faults["calls"] += faults["checking"]
        if due("before"):
            raise KeyError(f"'labels' missing on rank {rank}")
        if due("stall"):
            time.sleep(2.5)
        if isinstance(batch, tuple):
            return F.cross_entropy(m(batch[0]), batch[1])
        logits = m(batch[:, :-1])
        if due("backward"):  # the replay's backward fails on this rank only
            logits = FailsBackward.apply(logits)
        if due("after"):
            raise ValueError(f"the loss could not be computed on rank {rank}")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


    def train(shape, steps, options=None, wrong=False):
        net = build(shape, wrong)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        watch = GradWatch(net, loss_fn, optimizer=opt, **options) if options is not None else None
        g = torch.Generator().manual_seed(100 if not shape.endswith("2d21") else 100 + rank)  # TP ranks share a batch
        losses, checks = [], []
        for step in range(steps):
            faults["step"] = step
            if shape.startswith("mlp"):
                batch = (torch.randn(12, 8, generator=g), torch.randint(0, 4, (12,), generator=g))
            elif shape == "vocab":
                batch = torch.randint(0, VOCAB, (4, 17), generator=g)
            else:
                batch = torch.randint(0, 40, (3, 9), generator=g)
            opt.zero_grad()
            loss = loss_fn(net, batch)
            loss.backward()
            losses.append(loss.item())
            if watch is not None:
                faults["checking"], faults["calls"] = True, 0
                report = watch.step(batch)
                faults["checking"] = False
                if report is not None:
                    checks.append({"step": step, "ok": report.ok, "notes": report.notes, "k": report.steps_to_full,
                                   "pieces": list(report.pieces), "calls": faults["calls"]})
            opt.step()
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in net.named_parameters()}
        res = {"losses": losses}
        if shape == "sp":  # the norms' .grad is Partial(sum): judged once reduced over the mesh
            g = net.block.ln1.weight.grad
            reduced = settled(g, None)
            res["partial"] = [str(pl) for pl in g.placements]
            res["settled"] = bool(torch.equal(reduced, g.full_tensor())) and not torch.equal(reduced, g.to_local())
            # every norm's, reduced together: the same bits as one at a time, live and replayed alike
            norms = [p.grad for n, p in net.named_parameters() if ".ln" in n or n.startswith("ln")]
            together = settled_pairs([(q, q.to_local() * 2) for q in norms])
            res["pairs"] = (len(norms), all(torch.equal(live, settled(q, None)) and torch.equal(rep, 2 * settled(q, None))
                                            for q, (live, rep) in zip(norms, together)))
        if watch is not None and shape.startswith("2d"):  # who checks which rows (every rank: an exchange)
            units = plan_units(net, loss_fn, batch)
            reshard(net)  # its forward left the root's parameters gathered
            held = replicas(held_rows(units))
            pieces = [Piece(u, (r, r + 4)) for u in ("emb", "head", "block.fc1") for r in range(0, 40, 4)]
            res["held"] = {n: list(h) for n, h in held.items()}
            res["mine"] = [str(p) for p, _ in assign(pieces, held, rank, 2)]
        if watch is not None:
            res.update(checks=checks, alerts=[a.to_dict() for a in watch.alerts], coverage=watch.coverage,
                       names=[n for n, _ in net.named_parameters()],
                       piece_seconds={u: list(c) for u, c in watch.backward.piece_seconds.items()})
            watch.close()
        return params, res


    def same(a, b):  # bit for bit
        return all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


    results = {}
    for scenario in scenarios:
        t0 = time.perf_counter()
        if scenario in ("mlp", "attn", "sp", "2d21", "2d12"):
            plain, base = train(scenario, 4)
            watched, res = train(scenario, 4, dict(every=1, log_dir=None))
            res["bit_identical"] = same(plain, watched) and base["losses"] == res["losses"]
            _, res["wrong"] = train(scenario, 2, dict(every=1, log_dir=None), wrong=True)
        elif scenario == "dropout":  # the replay draws training's masks: the capture runs a forward of its own
            plain, base = train(scenario, 4)
            watched, res = train(scenario, 4, dict(every=1, log_dir=None))
            res["bit_identical"] = same(plain, watched) and base["losses"] == res["losses"]
        elif scenario == "gathers":
            plain, base = train("mlp-gathers", 3)
            watched, res = train("mlp-gathers", 3, dict(every=1, log_dir=None))
            res["bit_identical"] = same(plain, watched) and base["losses"] == res["losses"]
        elif scenario == "vocab":  # a forward to the loss far over the captures' share of the room
            plain, base = train(scenario, 8)  # K = 8 checks: the head's and the embedding's 50,257 rows
            watched, res = train(scenario, 8, dict(every=1, log_dir=None))
            res["bit_identical"] = same(plain, watched) and base["losses"] == res["losses"]
            _, res["wrong"] = train(scenario, 3, dict(every=1, log_dir=None), wrong=True)
        elif scenario == "terms":  # K > 1 checks: whole units spread over the checks
            _, res = train("attn", 6, dict(every=1, log_dir=None, tensors_per_check=4))
        elif scenario.startswith("ckpt"):  # a room too small for the replay beside .grad: its blocks checkpointed
            plain, base = train(scenario, 4)
            recomputed["n"] = 0
            watched, res = train(scenario, 4, dict(every=1, log_dir=None, memory_budget=1e-6))
            res["recomputed"] = recomputed["n"]
            res["bit_identical"] = same(plain, watched) and base["losses"] == res["losses"]
        elif scenario == "lockstep":
            plain, base = train("attn", 7)
            faults["at"] = {(1, 1): (1, "before"), (0, 2): (1, "mid"), (1, 3): (1, "after"), (1, 4): (1, "stall"),
                            (0, 5): (1, "backward")}
            watched, res = train("attn", 7, dict(every=1, log_dir=None))
            faults["at"] = {}
            res["bit_identical"] = same(plain, watched) and base["losses"] == res["losses"]
        res["seconds"] = time.perf_counter() - t0
        results[scenario] = res
    save_rank_results(out, rank, results)
    dist.destroy_process_group()
    '''
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run every scenario on 2 ranks once: (rank 0's results, rank 1's results)."""
    return two_rank_results(WORKER, tmp_path_factory.mktemp("tp"), SCENARIOS, RUN_TIMEOUT, "the tensor parallel run")


@pytest.mark.parametrize("shape", SHAPES)
def test_correct_parallel_model_fully_checked_no_alert_training_bit_identical(ranks, shape):
    for r in ranks:
        res = r[shape]
        assert res["alerts"] == [], res["alerts"]
        assert len(res["checks"]) == 4
        for name in res["names"]:
            cov = res["coverage"][name]
            assert cov["backward"] > 0 and cov["training"] > 0, (name, cov)
        assert res["bit_identical"]
        assert not any("not checked" in n for c in res["checks"] for n in c["notes"]), res["checks"][0]["notes"]


@pytest.mark.parametrize("shape", SHAPES + ("terms",))
def test_whole_pieces_shared_by_measured_cost_are_each_checked_once(ranks, shape):
    """After the first check the whole pieces go out by what the merged report measured: the same table on every rank,
    so every piece of a check is checked by exactly one rank (none twice, none lost) and every tensor is covered."""
    tables = [r[shape]["piece_seconds"] for r in ranks]
    assert tables[0] and tables[0] == tables[1]
    assert all(seconds > 0 for seconds, _ in tables[0].values()), tables[0]
    for check in ranks[0][shape]["checks"]:
        assert len(check["pieces"]) == len(set(check["pieces"])), check["pieces"]
    for r in ranks:
        assert all(c["backward"] > 0 and c["training"] > 0 for c in r[shape]["coverage"].values())


@pytest.mark.parametrize("shape", ["2d21", "2d12"])
def test_2d_mesh_rows_held_by_several_ranks_are_checked_by_one_of_them(ranks, shape):
    mine = [set(r[shape]["mine"]) for r in ranks]
    assert not mine[0] & mine[1], mine[0] & mine[1]  # no piece checked twice
    assert mine[0] | mine[1] == {f"{u}[{r}:{r + 4}]" for u in ("emb", "head", "block.fc1") for r in range(0, 40, 4)}
    if shape == "2d12":  # FSDP2 on a mesh of 1: both tensor parallel ranks hold every row of emb and head, in turns
        assert [r[shape]["held"]["emb"][3:] for r in ranks] == [[0, 2], [1, 2]]
        assert [r[shape]["held"]["block.fc1"][1:] for r in ranks] == [[0, 2, 0, 1], [1, 2, 0, 1]]  # its TP shards
        assert [len([p for p in m if p.startswith("emb")]) for m in mine] == [5, 5]


@pytest.mark.parametrize("shape", SHAPES)
def test_planted_backward_errors_named_by_module(ranks, shape):
    where = "1" if shape == "mlp" else "block.attn"  # the GELU of the MLP, the attention's own softmax
    for r in ranks:
        alerts = r[shape]["wrong"]["alerts"]
        assert alerts, f"{shape}: no alert"
        # a parameter's module, a unit's input's unit, or the module one cause's alert names (issue 73)
        named = {a["tensor"] if a.get("count") else a["tensor"].split(":")[0].rsplit(".", 1)[0]
                 if ":" not in a["tensor"] else a["tensor"].split(":")[0] for a in alerts if a["kind"] != "error"}
        assert any(n == where or n.startswith(where + ".") for n in named), (shape, named)
        assert all(n == where or n.startswith(where) or n.startswith("0") or n.startswith("block")
                   for n in named), named


def test_the_replay_is_the_capture_unless_it_draws_random_numbers(ranks):
    """The replay's forward is the capture's (one call of loss_fn less a check); with dropout on it draws training's
    masks, so the capture runs a forward of its own: one call more on each rank, and still no alert. Which rank checks
    the pieces that call loss_fn follows the seconds each piece measured, so the calls are summed over the ranks."""
    def calls(shape):
        return [sum(c) for c in zip(*([c["calls"] for c in r[shape]["checks"]] for r in ranks))]

    plain, drawn = calls("attn"), calls("dropout")
    assert drawn[1:] == [n + len(ranks) for n in plain[1:]], (plain, drawn)
    for r in ranks:
        res = r["dropout"]
        assert res["alerts"] == []
        assert res["bit_identical"]
        assert all(c["ok"] for c in res["checks"])
        assert all(c["backward"] > 0 and c["training"] > 0 for c in res["coverage"].values()), res["coverage"]


def test_sequence_parallel_partial_gradients_are_judged_reduced(ranks):
    for r in ranks:
        assert r["sp"]["partial"] == ["P(sum)"]  # str() of Partial(sum)
        assert r["sp"]["settled"]  # the reduced gradient (the sum over the ranks), not this rank's part
        assert r["sp"]["pairs"] == [6, True]  # ln1, ln2 and the final ln: weight and bias, in one reduction each


def test_own_code_making_a_collective_is_not_checked_and_never_waits(ranks):
    for r in ranks:  # checked by one rank alone, its all-gather would wait for the other: refused before it starts
        res = r["gathers"]
        said = [a for a in res["alerts"] if a["kind"] == "not_checked"]
        assert [a["tensor"] for a in said] == ["5"], res["alerts"]
        assert "makes a collective" in said[0]["message"] and "parallelize_module" in said[0]["message"]
        # its forward hands rank 1 rank 0's rows: the last Linear (a plain replica) gets no gradient on rank 1, and
        # the replicas drift apart at the first step (a true finding about this model, said once)
        replica = [a for a in res["alerts"] if a["kind"] == "replica"]
        assert len(replica) == 1 and "4.weight, 4.bias)" in replica[0]["message"], res["alerts"]
        assert not [a for a in res["alerts"] if a["kind"] not in ("not_checked", "replica")], res["alerts"]
        assert res["bit_identical"]


def test_a_rank_failing_inside_a_tp_check_stops_every_rank_at_the_same_point(ranks):
    for r in ranks:  # both ranks exited 0 within the timeout (the fixture asserts it): no hang, no abort
        res = r["lockstep"]
        errors = [a for a in res["alerts"] if a["kind"] == "error"]
        assert [a["step"] for a in errors] == [1, 2, 3, 5], res["alerts"]
        # named by the rank that raised, where it raised: before the model, midway in its forward (the
        # embedding run, the block's collectives not), after it, in the replay's custom backward
        assert "rank 1: KeyError" in errors[0]["message"] and "labels" in errors[0]["message"]
        assert "rank 0: RuntimeError: the block cannot run on rank 0" in errors[1]["message"]
        assert "rank 1: ValueError: the loss could not be computed on rank 1" in errors[2]["message"]
        assert "rank 0: RuntimeError: the custom backward failed on rank 0" in errors[3]["message"]
        assert not any("rank 0" in a["message"] for a in (errors[0], errors[2]))  # the stopped rank adds nothing
        # checks go on after each failed one; at step 3 rank 1 raised after the model in the replay's forward, which
        # is the capture's too: the point before the replay's backward stops rank 0 there
        assert [c["step"] for c in res["checks"]] == [0, 4, 6]
        assert all(c["ok"] for c in res["checks"])
        assert any(n.startswith("rank 1 ran slow in this check") for n in res["checks"][1]["notes"])
        assert res["bit_identical"], "training altered by a failing check"
    assert ranks[0]["lockstep"]["alerts"] == ranks[1]["lockstep"]["alerts"]


def test_terms_no_parameter_is_read_by_directly_are_looked_for_once_a_pass(ranks):
    """loss_fn reads no parameter directly (no regularizer, no weight decay): the forward that looks for such terms runs
    at the first check, then at the first check of each pass of K checks only, on both ranks alike."""
    def said(r):
        return [[n for n in c["notes"] if n.startswith("terms that read the parameters directly")] for c in r["terms"]["checks"]]

    assert said(ranks[0]) == said(ranks[1])
    checks = ranks[0]["terms"]["checks"]
    k = checks[0]["k"] or checks[-1]["k"]
    assert k is not None and 1 < k < len(checks), [c["k"] for c in checks]
    for i, notes in enumerate(said(ranks[0])):
        if i % k == 0:
            assert notes == [], (i, notes)  # a pass's first check looks
        else:
            looked = i - i % k  # the pass's first check (0-based) found none; the next pass's looks again
            assert notes == [f"terms that read the parameters directly: loss_fn read none at check {looked + 1}; looked "
                             f"for again at check {looked + k + 1} (once a pass of K = {k} checks)"], (i, notes)
    assert ranks[0]["terms"]["alerts"] == []


@pytest.mark.parametrize("scenario", ["ckpt", "ckpt2d21"])
def test_a_tight_room_replays_tp_blocks_checkpointed_alike_on_every_rank_and_training_is_untouched(ranks, scenario):
    """Tensor parallel, and FSDP2 over it (the 2x1 mesh: each block's recomputed forward on its gathered parameters)."""
    assert ranks[0][scenario]["recomputed"] > 0  # the replay's backward ran the blocks' forward again
    assert ranks[0][scenario]["recomputed"] == ranks[1][scenario]["recomputed"]  # the same blocks on both ranks
    for r in ranks:
        res = r[scenario]
        assert res["bit_identical"]
        assert [a for a in res["alerts"] if a["kind"] != "not_checked"] == [], res["alerts"]
        assert all(res["coverage"][n]["training"] > 0 for n in res["names"]), res["coverage"]


def test_a_forward_over_its_share_of_the_room_runs_on_the_first_samples_alike_on_every_rank(ranks):
    """GPT-2's vocabulary: the logits and the loss over them (about 39 MB beyond the captures at batch 4 x 16) do not fit
    the captures' share of the room, so the forwards of a check that runs them to the logits (the root's or loss_fn's
    own code checked by a rank) run on the batch's first sample, the same on both ranks (their collectives paired);
    the others stop before the head, on the whole batch. The checks still judge every parameter, a correct model
    gives no alert and trains bit-identically (every parameter judged both ways within its K = 8 checks), and the
    attention's wrong softmax is still alerted, named by module."""
    for r in ranks:
        res = r["vocab"]
        assert res["bit_identical"]
        assert res["alerts"] == [], res["alerts"]
        assert [n for n in res["names"] if not (res["coverage"][n]["backward"] > 0 and res["coverage"][n]["training"] > 0)
                ] == [], res["coverage"]  # within the K = 8 checks
        assert any(a["tensor"].startswith("block.attn") for a in res["wrong"]["alerts"]), res["wrong"]["alerts"]
    for run in ("correct", "wrong"):
        checks = [r["vocab"]["checks"] if run == "correct" else r["vocab"]["wrong"]["checks"] for r in ranks]
        assert len(checks[0]) == len(checks[1]) == (8 if run == "correct" else 3)
        ends = 0
        for c0, c1 in zip(*checks):
            # the forwards run to the logits where either rank checks the root's or loss_fn's own code in this check
            to_the_end = bool({"", "<loss_fn>"} & set(c0["pieces"] + c1["pieces"]))
            ends += to_the_end
            for c in (c0, c1):
                cut = [n for n in c["notes"] if "forwards ran on the first" in n]
                assert cut == (["module form: this check's forwards ran on the first 1 of the batch's 4 samples" +
                                cut[0].split("samples", 1)[1]] if to_the_end else []), (run, c["notes"])
        assert ends >= 1, run
