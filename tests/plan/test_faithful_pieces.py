"""Pieces that compute what the model computes: a Linear subclass with its own forward is never sliced.

A row slice re-runs a module's ``forward`` on a smaller weight. For a plain ``nn.Linear`` that is the
same computation; for a subclass with its own forward (a quantized, fused or adapter linear, a kernel
that treats its last partial tile apart) it is another one: the rows of such a module are checked in
place, at its full size, or not at all, and coverage counts only the rows a comparison covered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import paths
import pytest
import torch
import torch.nn.functional as F
from helpers import ScaledAffine
from torch import nn

from gradwatch import GradWatch
from gradwatch.plan.memory import peak_bytes
from gradwatch.plan.units import faithful_rows

TILE = 512  # rows past the last full tile of 512 take the kernel's other path


class TiledLinear(nn.Linear):
    """A Linear whose forward is its own (a custom kernel): slicing its rows would skip the partial tile."""

    def __init__(self, d_in: int, d_out: int, bug: bool = False) -> None:
        super().__init__(d_in, d_out)
        self.bug = bug

    def forward(self, x):
        # with ``bug`` the weight gradient of the rows past the last full tile is 20% off
        return ScaledAffine.apply(x, self.weight, self.bias, (1.0, 1.0, 1.0), slice(TILE, None), 1.2 if self.bug else 1.0)


def model(bug: bool, width: int = 600) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 48), nn.Tanh(), TiledLinear(48, width, bug), nn.Tanh(), nn.Linear(width, 5))


def loss_fn(m, b):
    return F.cross_entropy(m(b[0]), b[1])


def run(m, checks, **options):
    watch = GradWatch(m, loss_fn, every=1, log_dir=None, form="module", **options)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    reports = []
    for _ in range(checks):
        b = (torch.randn(16, 24, generator=gen), torch.randint(0, 5, (16,), generator=gen))
        opt.zero_grad()
        loss_fn(m, b).backward()
        reports.append(watch.step(b))
        opt.step()
    return watch, reports


def test_only_a_library_forward_is_sliced():
    assert faithful_rows(nn.Linear(2, 3)) and faithful_rows(nn.Embedding(4, 2))
    assert not faithful_rows(TiledLinear(2, 3)) and not faithful_rows(nn.Embedding(4, 2, max_norm=1.0))

    class Tagged(nn.Linear):  # a subclass that only adds attributes computes what nn.Linear computes
        tag = "head"

    assert faithful_rows(Tagged(2, 3))


@pytest.mark.parametrize("width", [600, 700])
def test_a_linear_subclass_wrong_in_its_last_rows_is_caught_within_k_checks(width):
    watch, reports = run(model(bug=True, width=width), 4)
    k = watch.cycle_length
    assert k is not None and k <= 4
    wrong = [a for a in watch.alerts if a.kind == "threshold" and a.tensor == "2.weight"]
    assert wrong, [(a.kind, a.tensor) for a in watch.alerts]
    assert wrong[0].step < k
    # its pieces ran at full size, only the block's rows moved
    types = {c.type for r in reports if r is not None for c in r.localized if c.name == "2"}
    assert types and all("(in place)" in t for t in types), types
    assert not [a for a in watch.alerts if a.tensor not in ("2.weight", "2:input", "2:output")], watch.alerts


def test_the_same_subclass_correct_no_alert_and_every_row_covered():
    watch, _ = run(model(bug=False), 4)
    assert not watch.alerts, [(a.kind, a.tensor, a.message[:120]) for a in watch.alerts]
    assert watch.coverage["2.weight"]["backward"] == 1.0


def tight_room() -> dict:
    """A budget that leaves about 1.5 MB: room for the small plain Linear, not for the full-size float64 copy
    (4.6 MB) a block of the subclass checked in place needs (the room is half the budget of this process's peak, and
    moves with it: at 2.3 MB a copy some checks of a CI run had room for it)."""
    budget = 2 * 1.5 * 2**20 / peak_bytes(torch.device("cpu"))
    watch, reports = run(model(bug=False, width=12000), 3, memory_budget=budget)
    return {"notes": [n for r in reports if r is not None for n in r.notes],
            "coverage": {n: v["backward"] for n, v in watch.coverage.items()},
            "not_checked": [a.tensor for a in watch.alerts if a.kind == "not_checked"]}


def test_rows_that_cannot_be_checked_in_place_are_never_counted_as_covered():
    # in a fresh interpreter: the room is measured from the process's own peak, which earlier tests would inflate
    code = "import json, test_faithful_pieces as t; print(json.dumps(t.tight_room()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=paths.ROOT, env={**os.environ, "PYTHONPATH": paths.pythonpath()})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    said = [n for n in got["notes"] if "`2` (TiledLinear rows" in n and "not checked" in n]
    assert said and "its own forward is checked at its full size" in said[0], got["notes"]
    assert got["coverage"]["2.weight"] == 0.0
    assert got["coverage"]["0.weight"] == 1.0  # the small plain Linear before it was checked
    assert "2" in got["not_checked"]


def test_a_piece_the_room_did_not_hold_is_taken_first_by_the_next_check():
    # the room changes from check to check: a block of rows it could not hold is owed to the next check, not left
    # for the next pass of the cycle (K checks later)
    from gradwatch.plan.planner import Planner

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2000))
    batch = torch.randn(4, 8)
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    names = [n for n, _ in model.named_parameters()]
    planner = Planner()
    _, first = planner.module_pieces(model, loss, batch, names, key=("k",))
    head = [p for p in first if p.rows is not None]
    assert head and planner.cycle_length == 8
    planner.owe([str(head[-1]), "not a piece of this check"])
    _, second = planner.module_pieces(model, loss, batch, names, key=("k",))
    assert second[0] == head[-1] and second.count(head[-1]) == 1
    _, third = planner.module_pieces(model, loss, batch, names, key=("k",))
    assert head[-1] not in third  # owed once: paid
    fresh = Planner()
    fresh.module_pieces(model, loss, batch, names, key=("k",))
    assert [p for p in fresh.module_pieces(model, loss, batch, names, key=("k",))[1]] == second[1:]


def test_a_subclass_block_that_fits_only_alone_is_checked_alone():
    # a block of a subclass is checked in place: a float64 copy of its whole weight beside the block's own need;
    # where that fits only without the other units' captures, the block waits to be checked alone
    from gradwatch.check.modules.module_form import _alone
    from gradwatch.plan.units import Unit

    sub, plain = Unit("head", TiledLinear(48, 600)), Unit("head", nn.Linear(48, 600))
    copies = 48 * 600 * 8
    need = 10_000
    assert _alone(sub, (0, 256), need, torch.float64, room=copies, alone=need + copies)
    assert not _alone(sub, (0, 256), need, torch.float64, room=need + copies, alone=need + copies)  # fits now
    assert not _alone(sub, (0, 256), need, torch.float64, room=copies, alone=copies)  # fits nowhere: said over the room
    assert not _alone(plain, (0, 256), need, torch.float64, room=need, alone=10 * need)  # a slice needs no copies
    assert _alone(plain, None, need, torch.float64, room=need - 1, alone=need)  # a whole piece, as before


class FirstRowsLinear(nn.Linear):
    """A Linear whose weight gradient is 20% off in its first 4 output rows."""

    def forward(self, x):
        return ScaledAffine.apply(x, self.weight, self.bias, (1.0, 1.0, 1.0), slice(0, 4), 1.2)


@pytest.mark.parametrize("order", [0, 1])
def test_a_failing_block_is_not_hidden_by_a_later_block_of_the_same_check(order):
    # two blocks of one weight in one check: the report keeps the failing one, whichever comes last
    from gradwatch.check.modules.module_form import run_module_check
    from gradwatch.check.objective.terms import Objective
    from gradwatch.options import CheckOptions
    from gradwatch.plan.cycle import Piece

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), FirstRowsLinear(48, 600))
    batch = (torch.randn(16, 24), torch.randint(0, 600, (16,)))
    pieces = [Piece("2", (0, 200)), Piece("2", (200, 400))][::1 if order == 0 else -1]
    report = run_module_check(m, Objective(loss_fn), batch, CheckOptions(), pieces=pieces, screen=True)
    assert [str(p) for p in pieces] == report.pieces
    assert report.tensors["2.weight"].failed, report.tensors["2.weight"]
    assert sum(c.failed for c in report.localized) == 1
