"""check_model leaves the live model and every RNG stream bit-identical (shadow and in-place modes)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import check_model


class Net(nn.Module):
    """BatchNorm (train), dropout (train), an eval-mode branch, and a loss that draws random numbers."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.frozen_bn = nn.BatchNorm1d(16)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        h = F.adaptive_avg_pool2d(h, 2).flatten(1)
        h = self.frozen_bn(self.drop(h))
        return self.fc(h)


def loss_fn(model, batch):
    x, y = batch
    noise = 1e-3 * torch.randn(x.shape[0], 3)  # randomness inside the objective: seeded per evaluation
    return F.cross_entropy(model(x) + noise, y)


def make():
    torch.manual_seed(0)
    model = Net().train()
    model.frozen_bn.eval()  # a mixed train/eval model
    with torch.no_grad():  # non-trivial running stats
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
        model.bn.num_batches_tracked.fill_(7)
        model.frozen_bn.running_mean.uniform_(-1, 1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    model.conv.bias.grad = None  # one parameter without .grad
    batch = (torch.randn(4, 2, 5, 5), torch.randint(0, 3, (4,)))
    return model, batch


def snapshot(model):
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "dtypes": {k: v.dtype for k, v in model.state_dict().items()},
        "grads": {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "dropout_p": model.drop.p,
    }


def assert_same(before, after):
    assert before["state"].keys() == after["state"].keys()
    for k in before["state"]:
        assert before["dtypes"][k] == after["dtypes"][k], k
        assert torch.equal(before["state"][k], after["state"][k]), k
    for n, g in before["grads"].items():
        if g is None:
            assert after["grads"][n] is None, n
        else:
            assert after["grads"][n] is not None and torch.equal(g, after["grads"][n]), n
    assert before["requires_grad"] == after["requires_grad"]
    assert before["training"] == after["training"]
    assert before["dropout_p"] == after["dropout_p"]


def rng_draws():
    return torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)]


def set_rngs(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.mark.parametrize("dtype", [torch.float64, None], ids=["shadow_float64", "in_place"])
def test_live_model_and_rngs_bit_identical(dtype):
    model, batch = make()
    batch_before = tuple(t.clone() for t in batch)
    before = snapshot(model)

    set_rngs(123)
    expected = rng_draws()
    set_rngs(123)
    report = check_model(model, loss_fn, batch, dtype=dtype)
    got = rng_draws()

    assert report.tensors, "the check ran"
    assert not report.nondeterministic  # the random noise in loss_fn is reseeded per evaluation
    assert report.evaluations > 10
    assert torch.equal(expected[0], got[0])
    assert np.array_equal(expected[1], got[1])
    assert expected[2] == got[2]
    assert_same(before, snapshot(model))
    assert all(torch.equal(a, b) for a, b in zip(batch_before, batch))
    # the BatchNorm in train mode had running stats that an unguarded forward would have changed
    model(batch[0])
    assert not torch.equal(before["state"]["bn.running_mean"], model.bn.running_mean)


def test_in_place_check_of_float64_model_passes_and_restores():
    model, batch = make()
    model.double()
    for p in model.parameters():
        p.grad = None
    before = snapshot(model)
    report = check_model(model, loss_fn, (batch[0].double(), batch[1]), dtype=None)
    assert report.ok, str(report)
    assert_same(before, snapshot(model))


def test_repeated_checks_give_identical_reports():
    model, batch = make()
    # The loop path: the very same evaluations, the very same numbers.
    a = check_model(model, loss_fn, batch, batched=False)
    b = check_model(model, loss_fn, batch, batched=False)
    for name in a.tensors:
        assert a.tensors[name].analytic == b.tensors[name].analytic
        assert a.tensors[name].numeric == b.tensors[name].numeric
    assert a.objective == b.objective
    # The default path picks batched or loop evaluation per tensor by timing, so a loaded machine may
    # take the other path the second time: the same analytic side, numeric values equal up to rounding.
    # (Without detection first: which tensors one probe settles depends on the path's rounding.)
    c = check_model(model, loss_fn, batch, screen=False)
    d = check_model(model, loss_fn, batch, screen=False)
    a = check_model(model, loss_fn, batch, batched=False, screen=False)
    for name in c.tensors:
        assert c.tensors[name].analytic == d.tensors[name].analytic == a.tensors[name].analytic
        assert np.allclose(c.tensors[name].numeric, d.tensors[name].numeric, rtol=1e-7, atol=1e-10)
    # Detection first on a fixed path: the same verdicts and numbers every time.
    e = check_model(model, loss_fn, batch, batched=True)
    f = check_model(model, loss_fn, batch, batched=True)
    for name in e.tensors:
        assert e.tensors[name].analytic == f.tensors[name].analytic
        assert e.tensors[name].numeric == f.tensors[name].numeric
    assert c.objective == d.objective == a.objective


# ------------------------------------------------------------ the training part's isolation of the live model


class Stateful(nn.Module):
    """A forward that counts, flags, replaces a buffer and adds an attribute: what a replay must undo."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(3, 3))
        self.register_buffer("cache", torch.zeros(3))
        self.calls = 0
        self.warm = False
        self.note = None

    def forward(self, x):
        self.calls += 1
        self.warm = True
        self.note = "ran"
        self.cache = torch.ones(3)  # a buffer replaced by another tensor
        self.extra = 7  # an attribute the forward adds: left as it is (only what existed is put back)
        return self.lin(x)


def test_live_isolation_runs_a_forward_and_leaves_the_model_as_it_was():
    from gradwatch.check.objective.guards import LiveIsolation

    torch.manual_seed(0)
    model = Stateful()
    cache, u = model.cache, model.lin.parametrizations.weight[0]._u.clone()
    seen = []
    model.lin.register_forward_hook(lambda m, i, o: seen.append("module"))
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append("global"))
    weight = model.lin.parametrizations.weight.original
    weight.register_hook(lambda g: seen.append("tensor") or g * 3)
    try:
        with LiveIsolation(list(model.modules()), [weight]):
            assert not model.lin.parametrizations.weight[0].training  # the power iteration is off
            model(torch.randn(2, 3)).sum().backward()
        assert seen == []  # no user hook ran: module, global or tensor
        assert (model.calls, model.warm, model.note, model.extra) == (0, False, None, 7)
        assert model.cache is cache and torch.equal(model.cache, torch.zeros(3))
        assert torch.equal(model.lin.parametrizations.weight[0]._u, u) and model.lin.parametrizations.weight[0].training
        model(torch.randn(2, 3)).sum().backward()  # every hook is back, in its place
        assert seen.count("module") == 1
        assert seen.count("tensor") == 1
        assert "global" in seen
        assert model.calls == 1 and len(model.lin._forward_hooks) == 1
    finally:
        handle.remove()


def test_scalar_grad_is_autograd_grad_bit_for_bit_and_defers_to_it_for_subclasses():
    from gradwatch.check.replay.reference import scalar_grad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    unused = nn.Parameter(torch.ones(2))
    x = torch.randn(5, 4)
    inputs = (*model.parameters(), unused)
    fast = scalar_grad(model(x).pow(2).mean(), inputs)
    ref = torch.autograd.grad(model(x).pow(2).mean(), inputs, allow_unused=True)
    assert fast[-1] is None and ref[-1] is None
    assert all(torch.equal(a, b) for a, b in zip(fast[:-1], ref[:-1]))
    assert all(p.grad is None for p in inputs)  # .grad is not written

    class Logged(torch.Tensor):  # a __torch_function__ override: autograd.grad's own path, which dispatches to it
        calls: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.autograd.grad:
                cls.calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    w = torch.tensor([1.0, 2.0]).as_subclass(Logged).requires_grad_()
    (g,) = scalar_grad((w * w).sum(), (w,))
    assert Logged.calls and torch.equal(g.as_subclass(torch.Tensor), torch.tensor([2.0, 4.0]))
