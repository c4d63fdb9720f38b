"""A probe replays the leaf calls that end before its tensor's first read, and changes no verdict doing so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import check_model
from gradwatch.check import model as model_module
from gradwatch.check.probes import prefix as prefix_module


@pytest.fixture
def caches(monkeypatch):
    """Every PrefixCache a check makes; ``off[0] = True`` makes them stay off. The models here are tiny: their
    forwards replay however quick they are (``REPLAY_MIN_SECONDS`` 0)."""
    made, off = [], [False]
    monkeypatch.setattr(model_module, "REPLAY_MIN_SECONDS", 0.0)
    original = prefix_module.PrefixCache.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.enabled = not off[0]
        made.append(self)

    monkeypatch.setattr(prefix_module.PrefixCache, "__init__", init)
    return made, off


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def data(d_in=6, d_out=2, n=16):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(n, d_in, generator=gen), torch.randn(n, d_out, generator=gen)


def test_replayed_prefixes_give_the_same_slopes_bit_for_bit(caches):
    made, off = caches
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    with_replay = check_model(model, mse, data(), seed=1)
    assert made[-1].verified and made[-1].replayed > 0
    off[0] = True
    without = check_model(model, mse, data(), seed=1)
    assert made[-1].replayed == 0
    assert with_replay.ok and without.ok
    for name, t in with_replay.tensors.items():
        u = without.tensors[name]
        assert t.numeric == u.numeric and t.dir_numeric == u.dir_numeric, name


def test_a_forward_too_quick_to_gain_is_neither_captured_nor_replayed_and_gives_the_same_slopes(caches, monkeypatch):
    made, _ = caches
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    check_model(model, mse, data(), seed=1)  # (the first call keeps its detection directions for the next ones)
    replayed = check_model(model, mse, data(), seed=1)
    assert made[-1].verified and made[-1].replayed > 0
    monkeypatch.setattr(model_module, "REPLAY_MIN_SECONDS", float("inf"))  # every forward is quicker
    declined = check_model(model, mse, data(), seed=1)
    cache = made[-1]
    assert (cache.phase, cache.enabled, cache.replayed, cache.first) == ("declined", False, 0, {})
    assert all("forward" not in m.__dict__ for m in model.modules())  # unwrapped before the first evaluation
    assert declined.evaluations < replayed.evaluations  # none to verify a replay
    assert replayed.ok and declined.ok
    for name, t in replayed.tensors.items():  # (a captured forward runs op by op under a dispatch mode: last bits)
        u = declined.tensors[name]
        assert t.verdict == u.verdict
        assert len(t.numeric) == len(u.numeric)
        assert len(t.dir_numeric) == len(u.dir_numeric)
        assert t.numeric + t.dir_numeric == pytest.approx(u.numeric + u.dir_numeric, rel=1e-7, abs=1e-12), name


def test_a_detached_activation_is_still_a_wrong_gradient(caches):
    """The order of execution decides what is replayed, not the autograd graph a .detach() cuts."""
    made, _ = caches

    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)).detach())

    torch.manual_seed(0)
    report = check_model(Detached(), mse, data(), seed=0)
    assert made[-1].verified
    assert report.tensors["a.weight"].failed and report.tensors["a.bias"].failed, str(report)
    assert not report.tensors["b.weight"].failed


def test_a_parameter_read_before_its_module_runs_is_followed(caches):
    """A leaf reading another module's weight through an unregistered reference is not replayed for it."""
    made, _ = caches

    class Reader(nn.Module):
        def __init__(self, other: nn.Module) -> None:
            super().__init__()
            self.__dict__["other"] = other  # not a submodule: ownership does not say it reads other.weight

        def forward(self, x):
            return x * self.other.weight.mean()

    torch.manual_seed(0)
    last = nn.Linear(6, 2)
    model = nn.Sequential(Reader(last), nn.Tanh(), last)
    report = check_model(model, mse, data(), seed=0)
    assert made[-1].verified
    assert report.ok, str(report)


def test_a_module_drawing_random_numbers_always_runs(caches):
    """Replaying the first noise module would hand its draws to the second one, for the middle layer's probes."""
    made, _ = caches

    class Noise(nn.Module):
        def forward(self, x):
            return x + 1e-3 * torch.randn_like(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Noise(), nn.Linear(8, 8), Noise(), nn.Tanh(), nn.Linear(8, 2))
    with_replay = check_model(model, mse, data(), seed=0)
    cache = made[-1]
    assert cache.verified and cache.replayed > 0
    made.clear()
    caches[1][0] = True
    without = check_model(model, mse, data(), seed=0)
    assert with_replay.ok and without.ok
    for name, t in with_replay.tensors.items():  # the same objective along every probe
        assert t.numeric == without.tensors[name].numeric and t.dir_numeric == without.tensors[name].dir_numeric


def test_a_module_returning_its_own_parameter_always_runs(caches):
    """``forward`` returning ``self.weight`` reads it with no op: replaying its kept output would stand the unperturbed
    parameter for the perturbed one (the numeric slope 0: a correct model's WRONG)."""

    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(2))

        def forward(self):
            return self.weight

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.table = nn.Linear(6, 2), Table()

        def forward(self, x):
            offset = self.table()
            return torch.tanh(self.fc(x) + 2 * offset)

    torch.manual_seed(0)
    report = check_model(Net(), mse, data())
    assert report.ok, str(report)
    made, _ = caches
    assert made[-1].verified and made[-1].replayed > 0  # the rest is still replayed
