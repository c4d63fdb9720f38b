"""A paced cycle: where one check of every unit takes more than a few training steps, the units are spread over the
next checks (K grows, up to 8), every tensor still judged within K and a planted bug still caught within K."""

from __future__ import annotations

import torch
from helpers import WrongTanh
from torch import nn
from torch.nn import functional as F

from gradwatch import GradWatch
from gradwatch.plan.cycle import CHECKS_PER_PASS


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


def _run(bug: bool, checks: int):
    model = _deep(bug)
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(256, 128, generator=gen), torch.randint(0, 2, (256,), generator=gen))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    reports = []
    with GradWatch(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), every=1, log_dir=None, form="module") as watch:
        for _ in range(checks):
            opt.zero_grad()
            loss = F.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            reports.append(watch.step(batch, loss=loss))
            opt.step()
            if bug and watch.alerts:
                break
        return watch, reports


def test_a_check_slower_than_its_pace_spreads_the_units_over_the_next_checks_each_judged_within_k():
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
