"""What a sharded check's pieces cost, and what they run under: the first check's times are not kept (they include
the first call of each code path), and only code of yours runs where a collective is refused.

A piece of a sharded model is checked by one rank alone, so a collective made there would wait for ranks that are
not making it (:func:`gradwatch.check.objective.dtensor.no_collectives` refuses it). That refusing mode sees every
operator of the piece's evaluations; torch's own modules on the view's plain tensors make no collective, so they run
without it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch
from gradwatch.check.modules.module_form import _one_rank
from gradwatch.check.objective.dtensor import checked_alone
from gradwatch.plan.units import Unit


class Mine(nn.Module):  # a module of yours: its forward is your code
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).tanh()


def _view(unit, rows):  # a stand-in for the sharded view: the unit as it is
    return contextlib.nullcontext((unit, 0))


def test_only_code_of_yours_runs_where_collectives_are_refused():
    linear, norm, mine = nn.Linear(3, 3), nn.LayerNorm(3), Mine()
    for module, kind, refused in ((linear, "module", False), (norm, "module", False), (mine, "own", True),
                                  (mine.lin, "module", False), (nn.Sequential(mine), "module", True)):
        unit = Unit("u", module, dict(module.named_parameters()), 1, kind=kind)
        with _one_rank(_view, unit):
            assert checked_alone() is refused, (type(module).__name__, kind)
        with _one_rank(None, unit):  # one process: nothing is refused
            assert not checked_alone()


def test_the_first_checks_piece_times_are_not_kept():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    watch = GradWatch(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), every=1, log_dir=None, form="module")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tables = []
    for _ in range(2):
        batch = (torch.randn(6, 4), torch.randint(0, 3, (6,)))
        opt.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        report = watch.step(batch)
        assert report is not None and report.piece_seconds  # measured at every check
        tables.append(dict(watch.backward.piece_seconds))
        opt.step()
    assert tables[0] == {}  # the first check's: not kept
    assert tables[1] and all(seconds > 0 for seconds, _ in tables[1].values())
    watch.close()


def test_what_the_captures_hold_through_the_replay_is_bounded_by_the_budgets_aim():
    """Shard by shard, the captures ride on the replay's forward (:mod:`gradwatch.watch.parts.replay_capture`) and are held
    through its backward, which peaks about as training did or above: they hold the captures' third of the room at
    most, and never more than half what the budget aims at above training's peak (a quarter of ``memory_budget``)."""
    from gradwatch.plan.memory import AIM
    from gradwatch.watch.parts.replay_capture import held_budget

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    watch = GradWatch(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), every=1, log_dir=None, memory_budget=0.1)
    batch = (torch.randn(6, 4), torch.randint(0, 3, (6,)))
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    assert watch.step(batch) is not None
    ctx = watch.runner.watch
    peak = ctx.memory.training_peak
    assert peak > 0 and held_budget(ctx, None) is None
    assert held_budget(ctx, 10 ** 12) == int(AIM * 0.1 * peak) // 2  # half the aim, under a room far above it
    assert held_budget(ctx, 300) == 100  # the captures' third of a small room
    watch.close()
