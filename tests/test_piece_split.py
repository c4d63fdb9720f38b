"""The ranks' split of a check's pieces, balanced by what each piece's check took (``gradwatch.plan.shards.assign``).

- every piece goes to exactly one rank (a held unit's rows to the ranks that hold them), whatever the costs;
- with no cost known (the first check) the split is the round-robin of before;
- the dearest whole pieces go to the least loaded rank, the rows each rank holds counted first, so an attention's
  own code and a LayerNorm no longer land on the same rank because they are next to each other in the plan;
- the costs are learned from what a check measured (``CheckReport.piece_seconds``), per row for row blocks.
The 2-rank DDP test (``tests/test_ddp_module_form.py``) checks that every rank holds the same costs.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from gradwatch import GradWatch
from gradwatch.plan.costs import PieceCosts
from gradwatch.plan.cycle import Piece
from gradwatch.plan.shards import assign


def _plan(rng: random.Random):
    units = [f"u{i}" for i in range(rng.randint(1, 9))]
    held = {u: rng.randint(1, 600) for u in units if rng.random() < 0.4}
    pieces = []
    for u in units:
        if u in held and rng.random() < 0.5:
            lo = rng.randint(0, held[u] - 1)
            pieces.append(Piece(u, (lo, rng.randint(lo + 1, held[u]))))
        else:
            pieces.append(Piece(u))
    return pieces, held


def test_every_piece_and_every_held_row_goes_to_exactly_one_rank_whatever_the_costs():
    rng = random.Random(0)
    for _ in range(300):
        pieces, held = _plan(rng)
        world = rng.randint(1, 4)
        table = {p.unit: rng.choice([0.0, 0.01, 1.0, 7.5]) for p in pieces}
        for cost in (None, lambda p, table=table: table[p.unit] * (1 if p.rows is None else p.rows[1] - p.rows[0])):
            split = [assign(pieces, held, r, world, cost=cost) for r in range(world)]
            whole = sorted(str(p) for mine in split for p, _ in mine if p.unit not in held)
            assert whole == sorted(str(p) for p in pieces if p.unit not in held)
            for piece in (p for p in pieces if p.unit in held):
                lo, hi = piece.rows or (0, held[piece.unit])
                got = sorted(p.rows for mine in split for p, _ in mine if p.unit == piece.unit)
                covered = [r for a, b in got for r in range(a, b)]
                assert covered == list(range(lo, hi)), (piece, got)


def test_with_no_cost_known_the_split_is_round_robin_in_plan_order():
    pieces = [Piece(n) for n in "abcde"]
    costs = PieceCosts()  # nothing measured: every piece costs the same
    assert [str(p) for p, _ in assign(pieces, {}, 0, 2, cost=costs)] == ["a", "c", "e"]
    assert [str(p) for p, _ in assign(pieces, {}, 1, 2, cost=costs)] == ["b", "d"]
    assert assign(pieces, {}, 1, 2, cost=costs) == assign(pieces, {}, 1, 2)


def test_the_dearest_pieces_are_spread_and_the_held_rows_counted():
    # an attention's own code next to its block's in the plan: round-robin puts both on rank 0
    pieces = [Piece("attn"), Piece("ln"), Piece("block"), Piece("ln2"), Piece("fc", (0, 512))]
    held = {"fc": 512}
    seconds = {"attn": 1.2, "block": 0.9, "ln": 0.05, "ln2": 0.05, "fc": 0.001}
    cost = lambda p: seconds[p.unit] * (1 if p.rows is None else p.rows[1] - p.rows[0])  # noqa: E731
    robin = [[str(p) for p, _ in assign(pieces, held, r, 2)] for r in range(2)]
    assert robin == [["attn", "block", "fc[0:256]"], ["ln", "ln2", "fc[256:512]"]]
    split = [[str(p) for p, _ in assign(pieces, held, r, 2, cost=cost)] for r in range(2)]
    assert split == [["attn", "fc[0:256]"], ["ln", "block", "ln2", "fc[256:512]"]]
    # rows held on rank 1 only weigh there: the attention goes to rank 0, the LayerNorm then to rank 1
    only1 = [[str(p) for p, _ in assign([Piece("attn"), Piece("ln"), Piece("fc", (300, 512))], held, r, 2,
                                        cost=cost)] for r in range(2)]
    assert only1 == [["attn"], ["ln", "fc[300:512]"]]


def test_costs_are_learned_per_unit_and_per_row_an_unknown_unit_costs_the_typical_piece():
    costs = PieceCosts()
    costs.record([("attn", None, 0.4), ("head", (0, 200), 0.2)])
    assert costs(Piece("attn")) == 0.4 and abs(costs(Piece("head", (200, 300))) - 0.1) < 1e-12
    assert abs(costs(Piece("ln")) - 0.3) < 1e-12  # never measured: the mean of the last check's pieces
    costs.record([("attn", None, 0.2)])
    assert abs(costs(Piece("attn")) - 0.3) < 1e-12  # an exponential mean: half the newest


def test_a_watch_records_what_each_piece_took_in_the_module_form():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 300), nn.Tanh(), nn.Linear(300, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = GradWatch(model, lambda m, b: m(b).square().mean(), optimizer=opt, every=1, form="module", log_dir=None)
    x = torch.randn(8, 6)
    opt.zero_grad()
    model(x).square().mean().backward()
    report = watch.step(x)
    assert report.form == "module" and report.pieces
    assert [str(Piece(u, r)) for u, r, _ in report.piece_seconds] == report.pieces
    assert all(s > 0 for _, _, s in report.piece_seconds)
    watch.close()
    for unit, rows, seconds in report.piece_seconds:  # what the next check's split weighs
        per = 1 if rows is None else rows[1] - rows[0]
        assert abs(watch.planner.costs(Piece(unit, (0, 1) if rows else None)) * per - seconds) < 1e-9
