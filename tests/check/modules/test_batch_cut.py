"""A piece over the room on the whole batch, checked on a cut of it: costed as the piece is (its rows' share of the
parameters stays whatever the cut), and no forward run for a cut that cannot fit."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from gradwatch.check.judging.report import CheckReport
from gradwatch.check.modules.batch_cut import forward_cut, forward_transient
from gradwatch.check.modules.capture import capture
from gradwatch.check.modules.module_form import Sharded, run_module_check
from gradwatch.check.modules.piece_cuts import cut_samples
from gradwatch.check.objective.terms import Objective
from gradwatch.options import CheckOptions
from gradwatch.plan.cycle import Piece
from gradwatch.plan.units import Unit, plan_units


def xent(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def _wide_batch(n: int = 2048):
    g = torch.Generator().manual_seed(2)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _check_rows(room: int):
    """Rows 0:100 of the middle Linear (64 -> 200) checked on a batch of 2,048 samples in ``room`` bytes: the
    report, and the batch size of each forward the check ran."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 200), nn.Tanh(), nn.Linear(200, 3))
    calls = []

    def counted(m, b):
        calls.append(b[0].shape[0])
        return xent(m, b)

    report = run_module_check(model, Objective(counted), _wide_batch(), CheckOptions(seed=0),
                              pieces=[Piece("2", (0, 100))], room=room)
    return report, calls


def test_a_row_piece_over_the_room_on_the_whole_batch_is_checked_on_fewer_samples_costed_by_its_rows():
    """Rows 0:100 of a Linear whose whole float64 copy (624 KB) is over the room (500 KB): on the whole batch of
    2,048 samples the piece needs about 6 MB, mostly inputs and outputs; its rows' share of the parameters (312 KB)
    fits, so a forward on its first samples does: the first cut sized by the estimate, a second by what the first
    measured. (The cut used to be costed with every row of the Linear: no cut fitted, up to four forwards ran for
    nothing and the piece went unchecked; on the 20.8M model of benchmarks/parallel.py, 3.3 s of a 5.4 s check.)"""
    report, calls = _check_rows(500_000)
    w = report.tensors["2.weight"]
    assert w.shape == (100, 64)
    assert w.verdict is not None
    assert not w.failed
    note = next(n for n in report.notes if "`2` (Linear) checked on" in n)
    kept = int(note.split("checked on ")[1].split(" of the batch's")[0])
    assert 1 <= kept < 2048 and "2048 samples" in note
    assert calls[:2] == [2048, 2048]
    assert calls[-1] == kept
    assert len(calls) <= 4  # at most two cuts tried


def test_no_forward_on_a_cut_batch_when_the_pieces_parameters_alone_fill_the_room():
    report, calls = _check_rows(200_000)  # its rows' copies alone: 312 KB
    assert "2.weight" not in report.tensors and report.unfit == ["2[0:100]"]
    said = next(n for n in report.notes if "not checked, over the room" in n)
    # the room this piece had (what the captures beside it left), not only the check's whole room
    assert re.search(r"`2` \(Linear\) rows 0:100 needs about [\d.]+ [KMG]?B with [\d.]+ [KMG]?B left to it", said), said
    assert set(calls) == {2048}  # the whole batch only: no cut of it was tried


def test_a_sharded_cut_keeps_the_rows_share_of_the_parameters_in_its_cost():
    """The sharded path cuts what the one forward captured (no other forward may run): a row piece's cost after the
    cut is its rows' parameter copies plus the cut's share of the rest, sized to fit; none fits where those copies
    alone fill the room. (It used to scale the parameters' copies with the cut too: a piece said to fit did not.)"""
    lin = nn.Linear(64, 200)
    unit = Unit("fc", lin, dict(lin.named_parameters()))
    x = torch.randn(2048, 64)
    rows, params = (0, 100), 100 * 65 * 48  # 312,000 bytes whatever the cut
    need = params + 5_000_000
    (args, _), _, cost, what, _ = cut_samples(unit, ((x,), {}), {}, set(), need, 500_000, rows)
    kept = args[0].shape[0]
    assert 1 <= kept < 2048 and what.startswith(f"{kept} of the batch's 2048 samples")
    assert cost == params + 5_000_000 * kept // 2048 and cost <= 500_000
    assert cut_samples(unit, ((x,), {}), {}, set(), need, 300_000, rows) is None  # the rows' copies alone: 312 KB


def test_the_loss_codes_piece_is_costed_with_its_own_intermediates():
    """``loss_fn``'s own code holds intermediates the size of the model's output it is checked on (a log-softmax
    over the vocabulary and its gradient): the piece is costed at twice the bytes a module's parameter entry costs
    (at one sample of 128 x 8,000 logits the check added 118 MB to the process and was costed 49 MB before), so a
    room that held it at the old rate cuts it now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(500, 16), nn.Linear(16, 500))
    batch = torch.randint(0, 500, (4, 33))

    def lm(m, b):
        logits = m(b[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

    entries = 4 * 32 * 500
    whole = run_module_check(model, Objective(lm), batch, CheckOptions(seed=0), pieces=[Piece("<loss_fn>")])
    assert whole.memory["estimate_bytes"] >= 96 * entries
    room = 60 * entries  # the whole batch at the module rate (48 bytes an entry), not at the loss code's
    report = run_module_check(model, Objective(lm), batch, CheckOptions(seed=0), pieces=[Piece("<loss_fn>")], room=room)
    assert report.ok and "<model>:output" in report.tensors
    assert report.memory["estimate_bytes"] <= room
    # cut: captured again on a window of the batch's samples that fits it (one forward, not one per cut tried)
    assert any(n.startswith("module form: 1 unit(s) captured and checked on sample") for n in report.notes), report.notes


def test_a_sharded_linear_too_big_both_ways_is_checked_on_rows_of_one_sample():
    """On a sharded model no other forward may run: a Linear's row block whose inputs alone fill half the room, and
    whose rows' share of the parameters alone fills the room, is checked on a block of rows of one captured sample
    (it was left unchecked: a ``not_checked`` alert on a correct model, in a tight room)."""
    from gradwatch.parallel.shard_check import ShardView

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 3))
    g = torch.Generator().manual_seed(3)
    batch = torch.randn(256, 64, generator=g), torch.randint(0, 3, (256,), generator=g)
    report = run_module_check(model, Objective(xent), batch, CheckOptions(seed=0), pieces=[Piece("0", (0, 256))],
                              room=600_000, sharded=Sharded(ShardView(model, {}, {})))
    assert report.ok and not report.unfit, report.notes
    assert "0.weight" in report.tensors and "0.bias" in report.tensors
    note = next(n for n in report.notes if "checked on output rows" in n)
    assert "on 1 of the batch's 256 samples (cut from the forward's capture)" in note, note
    assert not any("not checked" in n for n in report.notes), report.notes


def test_a_forward_over_its_share_of_the_room_runs_on_the_share_of_the_samples_the_ranks_agree_on():
    """Shard by shard, what a forward holds beyond its captures (its output and the loss over it, sized from the output an
    earlier forward gave) decides how many samples this check's forwards run on: all where it fits the captures'
    share, else that share's fraction of them, at least one, the smallest fraction of the ranks' (``agree``: the
    agreement point, here one rank's own value, or a smaller one another rank gave)."""
    net = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))
    ids = torch.zeros(8, 5, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids.clone()}
    lm = lambda m, b: F.cross_entropy(m(b["input_ids"]).flatten(0, 1), b["labels"].flatten())  # noqa: E731
    units = [u for u in plan_units(net, lm, batch) if u.name == "0"]
    got = capture(net, lm, batch, units, seed=0)
    assert got.model_bytes == 8 * 5 * 50 * 4  # the logits, as the forward to the loss made them
    forward = forward_transient(got.model_bytes / 40, batch)
    assert forward == 3 * 8 * 5 * 50 * 4
    report = CheckReport(tensors={})
    assert forward_cut(batch, forward, forward, lambda v: v, report) is batch and report.notes == []  # it fits
    part = forward_cut(batch, forward, forward // 4, lambda v: v, report)  # a quarter of it fits: 2 of the 8 samples
    assert part["input_ids"].shape == part["labels"].shape == (2, 5)
    assert report.notes == ["module form: this check's forwards ran on the first 2 of the batch's 8 samples (a forward "
                            "of the whole batch holds about 0.0 MB beyond its captures, over their share of the room, "
                            "0.0 MB)"]
    another = forward_cut(batch, forward, forward, lambda v: min(v, 100), CheckReport(tensors={}))  # another rank's tenth
    assert another["input_ids"].shape == (1, 5)  # the smallest fraction, at least one sample

