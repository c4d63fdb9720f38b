"""check_model's fixed costs on small models (benchmarks/small_models.py): the float64 copy kept between checks of
one model while it is still faithful, a detection probe settled at a wider step where only its floor kept it from
settling, and no import of torch.distributed's packages to learn that a model holds none of their tensors."""

import subprocess
import sys

import pytest
import torch
from helpers import WrongSilu
from torch import nn

from gradwatch import check_model
from gradwatch.check.objective import shadow as shadows
from gradwatch.check.probes import reexamine


class _Scaled(torch.autograd.Function):
    """``x @ w.T + b`` whose weight gradient is ``factor`` times the true one."""

    @staticmethod
    def forward(ctx, x, w, b, factor):
        ctx.save_for_backward(x, w)
        ctx.factor = factor
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, ctx.factor * (g.t() @ x), g.sum(0), None


class ScaledLinear(nn.Linear):
    def __init__(self, n_in: int, n_out: int, factor: float = 1.0) -> None:
        super().__init__(n_in, n_out)
        self.factor = factor

    def forward(self, x):
        return _Scaled.apply(x, self.weight, self.bias, self.factor)


class Net(nn.Module):
    """A small MLP whose activation can carry a planted wrong backward (``bug``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)
        self.act, self.wrong = nn.Tanh(), WrongSilu()
        self.bug = False

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(self.wrong(h) if self.bug else self.act(h))


def _ce(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _batch(n_in: int = 6, classes: int = 3):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, n_in, generator=gen), torch.randint(0, classes, (8,), generator=gen)


def _kept(model):
    entry = shadows._KEPT.get(id(model))
    return entry[1] if entry is not None else None


def test_the_copy_is_kept_for_the_next_check_of_an_unchanged_model():
    torch.manual_seed(0)
    model, batch = Net(), _batch()
    assert check_model(model, _ce, batch).ok
    first = _kept(model)
    assert first is not None
    with torch.no_grad():
        model.fc1.weight.mul_(1.5)  # parameters are refreshed into the kept copy, not copied again
    assert check_model(model, _ce, batch).ok
    assert _kept(model) is first


def test_a_changed_attribute_makes_a_new_copy_and_a_planted_bug_is_still_caught():
    torch.manual_seed(0)
    model, batch = Net(), _batch()
    assert check_model(model, _ce, batch).ok
    first = _kept(model)
    model.bug = True  # a plain attribute the copy took: the kept copy would still run the correct activation
    report = check_model(model, _ce, batch)
    assert not report.ok and _kept(model) is not first
    model.bug = False
    assert check_model(model, _ce, batch).ok


def test_hooks_and_containers_changed_in_place_are_seen():
    torch.manual_seed(0)
    model, batch = Net(), _batch()
    model.scales = [1.0, 2.0]  # a list: compared by its contents
    check_model(model, _ce, batch)
    first = _kept(model)
    model.scales.append(3.0)
    check_model(model, _ce, batch)
    second = _kept(model)
    assert second is not first
    handle = model.fc2.register_forward_pre_hook(lambda m, args: None)
    try:
        with pytest.warns(UserWarning, match="hook"):
            check_model(model, _ce, batch)
    finally:
        handle.remove()
    assert _kept(model) is not second


def test_objects_it_cannot_compare_and_big_models_are_never_kept(monkeypatch):
    torch.manual_seed(0)
    model, batch = Net(), _batch()
    model.config = type("Config", (), {"scale": 1.0})()  # an object: its changes would go unseen
    assert shadows.fingerprint(model) is None
    check_model(model, _ce, batch)
    assert _kept(model) is None
    monkeypatch.setattr(shadows, "KEEP_SHADOW_BYTES", 16)
    other = Net()
    check_model(other, _ce, batch)
    assert _kept(other) is None


def test_the_kept_copy_never_keeps_the_model_alive():
    import gc
    import weakref

    torch.manual_seed(0)
    model = Net()
    check_model(model, _ce, _batch())
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def _tanh_mlp(factor: float = 1.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), ScaledLinear(64, 64, factor), nn.Tanh(), nn.Linear(64, 4))
    return model, _batch(8, 4)


def test_a_probe_whose_floor_alone_kept_it_unsettled_settles_at_a_wider_step(monkeypatch):
    # A step of 1e-7 puts the detection probes' floors between the settling bound and IMPRECISE (as a random
    # direction's small slope does on a tensor of a million entries at the default step).
    settled = []
    original = reexamine.settle_wider

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        settled.append(out is not None)
        return out

    monkeypatch.setattr(reexamine, "settle_wider", spy)
    model, batch = _tanh_mlp()
    report = check_model(model, _ce, batch, eps=1e-7)
    assert report.ok
    assert settled
    assert all(settled)
    # the analytic pass, two at the base point, two per tensor, and four for each tensor settled wider
    assert report.evaluations <= 3 + 2 * len(report.tensors) + 4 * len(settled) + 2


@pytest.mark.parametrize("factor", [1.01, 1.001])
def test_a_wrong_gradient_does_not_settle_at_the_wider_step(factor):
    model, batch = _tanh_mlp(factor)
    report = check_model(model, _ce, batch, eps=1e-7)
    assert not report.ok
    assert [t.name for t in report.failures] == ["2.weight"]


@pytest.mark.slow  # a fresh Python process (torch imported anew)
def test_checking_a_plain_model_imports_no_distributed_package():
    code = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from gradwatch import check_model\n"
        "m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))\n"
        "assert check_model(m, lambda m, b: m(b).square().mean(), torch.randn(5, 3)).ok\n"
        "print(sorted(k for k in sys.modules if k.startswith(('torch.distributed.fsdp', 'torch.distributed.tensor'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_detection_directions_are_drawn_once_per_seed_and_only_read(monkeypatch):
    torch.manual_seed(0)
    model, batch = Net(), _batch()
    reexamine._DRAWN.clear()
    monkeypatch.setattr(reexamine, "_drawn_bytes", 0)  # (what earlier tests' checks kept counts in it)
    first = check_model(model, _ce, batch, seed=3)
    kept = dict(reexamine._DRAWN)
    values = {k: d.clone() for k, d in kept.items()}
    assert first.ok
    assert kept
    assert all(d.numel() <= reexamine._DRAWN_ENTRIES for d in kept.values())
    assert check_model(model, _ce, batch, seed=3).ok
    assert all(reexamine._DRAWN[k] is d and torch.equal(d, values[k]) for k, d in kept.items())  # reused, unchanged
    check_model(model, _ce, batch, seed=4)  # another seed: other directions
    assert len(reexamine._DRAWN) == 2 * len(kept)
