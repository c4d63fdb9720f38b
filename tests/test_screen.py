"""check_model's detection first (screen=True, the default): one probe per tensor settles a correct one;
a disagreeing probe is traced to the one wrong entry (pinpoint); anything unsettled gets the full sample."""

import torch
from torch import nn

from gradwatch import check_model


class _OffLinear(torch.autograd.Function):
    """x @ w.T + b whose weight gradient is ``factor`` times too large at one entry ``idx`` (None: correct)."""

    @staticmethod
    def forward(ctx, x, w, b, idx, factor):
        ctx.save_for_backward(x, w)
        ctx.idx, ctx.factor = idx, factor
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = g.t() @ x
        if ctx.idx is not None:
            gw = gw.clone()
            gw[ctx.idx] *= ctx.factor
        return g @ w, gw, g.sum(0), None, None


class OffLinear(nn.Linear):
    def __init__(self, n_in: int, n_out: int, idx=None, factor: float = 1.01) -> None:
        super().__init__(n_in, n_out)
        self.idx, self.factor = idx, factor

    def forward(self, x):
        return _OffLinear.apply(x, self.weight, self.bias, self.idx, self.factor)


def _model(idx=None, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), OffLinear(256, 128, idx), nn.Tanh(), nn.Linear(128, 5))
    batch = (torch.randn(32, 16), torch.randint(0, 5, (32,)))
    return model, batch


def _ce(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_correct_model_settled_by_one_probe_per_tensor():
    model, batch = _model()
    report = check_model(model, _ce, batch)
    assert report.ok
    # the analytic pass, two at the base point, two per tensor: nothing else
    assert report.evaluations == 1 + 2 + 2 * len(report.tensors)
    for t in report.tensors.values():
        assert t.verdict.value == "excellent" and not t.coords and len(t.dir_analytic) == 1
    full = check_model(model, _ce, batch, screen=False)
    assert full.ok and full.evaluations > 4 * report.evaluations


def _typical_entry(model, batch):
    """An entry of ``2.weight`` whose gradient is about twice the root-mean-square: 1% of it is an error
    torch's slow gradcheck resolves (its atol is 1e-5), yet it is no largest-|grad| coordinate."""
    _ce(model, batch).backward()
    g = model[2].weight.grad
    target = 2 * g.pow(2).mean().sqrt()
    flat = int((g.abs() - target).abs().argmin())
    model.zero_grad()
    return divmod(flat, g.shape[1])


def test_one_wrong_entry_is_traced_and_named():
    model, batch = _model()
    model[2].idx = _typical_entry(model, batch)
    full = check_model(model, _ce, batch, screen=False)
    assert full.ok, "the full sample's coordinates do not hit one entry of 32768: the reason for pinpoint"
    report = check_model(model, _ce, batch)
    assert not report.ok
    (failure,) = report.failures
    assert failure.name == "2.weight" and model[2].idx in failure.coords


def test_zero_gradient_tensor_settled_flat():
    # a bias before BatchNorm: the objective does not depend on it at all
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    batch = (torch.randn(20, 8), torch.randint(0, 3, (20,)))
    report = check_model(model, _ce, batch)
    assert report.ok
    bias = report.tensors["0.bias"]
    assert bias.verdict.value == "excellent" and len(bias.dir_analytic) == 1 and not bias.coords


def test_wrong_factor_on_whole_tensor_still_fails_with_full_sample():
    model, batch = _model()
    model[2].idx, model[2].factor = (slice(None), slice(None)), 1.2  # every entry 20% too large
    report = check_model(model, _ce, batch)
    assert [t.name for t in report.failures] == ["2.weight"]
    failure = report.failures[0]
    assert failure.verdict.value == "wrong" and failure.coords  # judged on the full sample
    assert abs(failure.ratio - 1.2) < 1e-3
