"""A paced cycle: where one check of every unit takes more than a few training steps, the units are spread over the
next checks (K grows, up to 8), every tensor still judged within K and a planted bug still caught within K."""

from __future__ import annotations

import math

import torch
from helpers import WrongTanh
from torch import nn
from torch.nn import functional as F

from gradwatch import GradWatch
from gradwatch.plan import planner
from gradwatch.plan.cycle import CHECKS_PER_PASS, PACE_SHARE


class _Tanh(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug

    def forward(self, x):
        return WrongTanh.apply(x) if self.bug else torch.tanh(x)


def _deep(bug: bool) -> nn.Module:
    """40 layers of 128 on a batch of 256: a training step of tens of milliseconds, a check of every unit (80 pieces)
    of about a second."""
    torch.manual_seed(0)
    layers = []
    for i in range(40):
        layers += [nn.Linear(128, 128), _Tanh(bug and i == 39)]
    return nn.Sequential(*layers, nn.Linear(128, 2))


def _run(bug: bool, checks: int, **options):
    model = _deep(bug)
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(256, 128, generator=gen), torch.randint(0, 2, (256,), generator=gen))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    reports = []
    with GradWatch(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), every=1, log_dir=None, form="module",
                   **options) as watch:
        for _ in range(checks):
            opt.zero_grad()
            loss = F.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            reports.append(watch.step(batch, loss=loss))
            opt.step()
            if bug and watch.alerts:
                break
        return watch, reports


def test_a_check_slower_than_its_pace_spreads_the_units_over_the_next_checks_each_judged_within_k(monkeypatch):
    # The model's step (its replay, at the first check) is 10-30 ms: about PACED_STEP_SECONDS, under which a step is
    # too short to pace by (a quiet machine left the first check unpaced). No floor here: the pace is taken.
    monkeypatch.setattr(planner, "PACED_STEP_SECONDS", 0.0)
    watch, reports = _run(False, CHECKS_PER_PASS + 1)
    first = reports[0]
    assert first.later, "the first check's pieces all fitted its pace: the model is too small to show it"
    assert any("left to the next checks" in n for n in first.notes), first.notes
    k = watch.cycle_length
    assert 1 < k <= CHECKS_PER_PASS
    # each later check takes about a K-th of the units; within K checks of the new plan every tensor has both verdicts
    assert all(v["backward"] > 0 and v["training"] > 0 for v in watch.coverage.values()), watch.coverage
    assert len(reports[-1].pieces) < len(first.pieces) + len(first.later)
    assert watch.alerts == [], [a.message for a in watch.alerts]


def test_a_bug_in_the_last_unit_is_caught_within_k_checks_of_a_paced_cycle():
    watch, reports = _run(True, 2 * CHECKS_PER_PASS)
    assert watch.alerts, "not caught"
    assert len(reports) <= CHECKS_PER_PASS + 1
    assert any(a.tensor.startswith("79") for a in watch.alerts), [(a.tensor, a.message[:80]) for a in watch.alerts]


def _sliced_planner(**options):
    """A planner of 16 small units, ``loss_fn`` and a head of 4,096 rows (16 slices of 256): a pass of 33 pieces,
    K = 8."""
    from gradwatch.plan.planner import Planner

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(16)], nn.Linear(4, 4096))
    planner = Planner(**options)
    names = [n for n, _ in model.named_parameters()]

    def plan():
        return planner.module_pieces(model, lambda m, b: m(b).sum(), torch.randn(2, 4), names, key=("k",),
                                     room=1 << 30)[1]
    return planner, plan


def test_a_sliced_cycle_whose_check_held_half_its_turn_gets_a_longer_k_and_every_piece_still_comes():
    planner, plan = _sliced_planner()
    pieces = plan()
    units = [str(p) for p in pieces]
    assert planner.cycle_length == CHECKS_PER_PASS and any("[" in u for u in units), units
    # the pace is set: a step of 0.5 s, half the check's 1 s already spent on its planning
    assert planner.pace_seconds(0.5, spent=0.5) == 0.5
    assert len(units) == 5  # 3 whole units and 2 slices: a K-th of the pass
    line = planner.pace(units[2:])  # the pieces held 2 of them in half the pace
    assert line is not None and "within K = 11 checks" in line, line
    k = planner.cycle_length
    # 2 pieces in half the pace: 4 a check with the whole pace, 3 of them planned (PACE_SHARE): 33 / 3 -> K = 11
    assert k == math.ceil(33 / math.floor(PACE_SHARE * 4)) == 11
    first_next = [str(p) for p in plan()]
    assert first_next[:len(units) - 2] == units[2:], "the pieces left are not owed first"
    # within the new K checks (after the owed ones), every slice of the head and every small unit is handed once
    seen = set(first_next)
    for _ in range(k):
        seen |= {str(p) for p in plan()}
    head = [p for p in seen if p.startswith("16[")]
    assert len(head) == 16 and {str(i) for i in range(16)} <= seen, sorted(seen)


def test_a_sliced_cycle_keeps_its_k_while_less_than_half_a_turn_is_owed():
    planner, plan = _sliced_planner()
    units = [str(p) for p in plan()]
    planner.pace_seconds(0.5)
    assert planner.pace(units[-1:]) is None  # one piece of 5 late: owed, K kept
    assert planner.cycle_length == CHECKS_PER_PASS
    assert [str(p) for p in plan()][0] == units[-1]


def test_the_pace_option_is_the_steps_a_checks_pieces_may_take_and_null_is_no_pace():
    for pace, seconds in ((2.0, 1.0), (4.0, 2.0), (None, None)):
        planner, plan = _sliced_planner(pace=pace)
        plan()
        assert planner.pace_seconds(0.5) == seconds, (pace, planner.pace_seconds(0.5))


def test_with_no_pace_a_check_slower_than_two_steps_holds_every_unit_of_its_turn():
    watch, reports = _run(False, 1, pace=None)
    first = reports[0]
    assert not first.later and not any("left to the next checks" in n for n in first.notes), first.notes
    assert watch.cycle_length == 1
    assert all(v["backward"] > 0 for v in watch.coverage.values()), watch.coverage
