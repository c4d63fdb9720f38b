"""Surrogate gradients by design: straight-through quantizers, fake quantization and spikes are not bugs.

The objective is cut at each surrogate module (gradwatch.check.objective.surrogate): what is upstream is checked
against the gradient the surrogate's backward gives, what is downstream on its output; a real bug on
either side is still caught and named."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import check_model


class Quantizer(nn.Module):
    """VQ-VAE's straight-through vector quantizer."""

    def __init__(self, codes: int = 16, dim: int = 4) -> None:
        super().__init__()
        self.code = nn.Parameter(torch.randn(codes, dim))

    def forward(self, z):
        idx = torch.cdist(z, self.code).argmin(-1)
        zq = self.code[idx]
        return z + (zq - z).detach()


class Off(torch.autograd.Function):
    """A Linear whose input gradient (``which=0``) or weight gradient (``which=1``) is 20% too large."""

    @staticmethod
    def forward(ctx, x, w, b, which):
        ctx.save_for_backward(x, w)
        ctx.which = which
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        grads = [g @ w, g.t() @ x, g.sum(0)]
        grads[ctx.which] = 1.2 * grads[ctx.which]
        return (*grads, None)


class OffInput(nn.Linear):
    def forward(self, x):
        return Off.apply(x, self.weight, self.bias, 0)


class OffWeight(nn.Linear):
    def forward(self, x):
        return Off.apply(x, self.weight, self.bias, 1)


class VQ(nn.Module):
    def __init__(self, bug: str = "none") -> None:
        super().__init__()
        self.enc = (OffWeight if bug == "enc" else nn.Linear)(6, 4)
        self.quant = Quantizer()
        self.mid = (OffInput if bug == "mid" else nn.Linear)(4, 8)
        self.dec = nn.Linear(8, 6)

    def forward(self, x):
        return self.dec(torch.tanh(self.mid(self.quant(self.enc(x)))))


class Spike(torch.autograd.Function):
    """A Heaviside spike whose backward is a sigmoid's derivative (a surrogate)."""

    @staticmethod
    def forward(ctx, v):
        ctx.save_for_backward(v)
        return (v > 0).to(v.dtype)

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        s = torch.sigmoid(4 * v)
        return g * 4 * s * (1 - s)


class SpikeLayer(nn.Module):
    def forward(self, v):
        return Spike.apply(v)


def loss(m, x):
    return F.mse_loss(m(x), x)


def failing(report):
    return sorted(n for n, t in report.tensors.items() if t.failed)


@pytest.fixture
def x():
    return torch.randn(32, 6, generator=torch.Generator().manual_seed(0))


def test_an_undeclared_straight_through_quantizer_is_wrong_and_a_declared_one_is_cut(x):
    torch.manual_seed(0)
    model = VQ()
    undeclared = check_model(model, loss, x)
    assert "enc.weight" in failing(undeclared)  # its gradient is not the derivative
    assert "surrogates=[...]" in undeclared.tensors["enc.weight"].diagnosis  # the option is named
    report = check_model(model, loss, x, surrogates=["quant"])
    assert failing(report) == [] and report.surrogates == ["quant"]
    assert "quant.code" not in report.tensors and "enc.weight" in report.tensors
    assert any("surrogate, by design: quant" in n and "quant.code not checked" in n for n in report.notes)
    assert check_model(model, loss, x, surrogates=[Quantizer]).surrogates == ["quant"]  # by class too
    assert check_model(model, loss, x, surrogates=["Quantizer"]).surrogates == ["quant"]  # and by class name


def test_a_bug_beside_a_declared_surrogate_is_caught_and_named(x):
    torch.manual_seed(0)
    upstream = check_model(VQ("enc"), loss, x, surrogates=["quant"])
    assert failing(upstream) == ["enc.weight"]  # checked against the gradient the quantizer's backward gives
    torch.manual_seed(0)
    downstream = check_model(VQ("mid"), loss, x, surrogates=["quant"])
    # mid's input gradient, 20% off, arrives at the quantizer's output (and would pass into enc's unseen)
    assert failing(downstream) == ["quant:output"]


def test_torch_fake_quantize_needs_no_declaration(x):
    from torch.ao.quantization import FakeQuantize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), FakeQuantize(), nn.Tanh(), nn.Linear(8, 6))
    model(x)  # the observer sets the scale
    report = check_model(model, loss, x)
    assert report.surrogates == ["1"] and failing(report) == []


def test_a_spiking_layer_with_a_surrogate_derivative(x):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), SpikeLayer(), nn.Linear(8, 6))
    assert failing(check_model(model, loss, x))  # the spike's derivative is 0 almost everywhere
    report = check_model(model, loss, x, surrogates=[SpikeLayer])
    assert failing(report) == [] and set(report.tensors) == {"0.weight", "0.bias", "2.weight", "2.bias", "1:output"}


def test_a_surrogate_that_matches_nothing_is_refused(x):
    with pytest.raises(ValueError, match=r"surrogates: \['quantizer'\] match no module of VQ"):
        check_model(VQ(), loss, x, surrogates=["quantizer"])


def _watch(model, form, checks=4, **options):
    from gradwatch import GradWatch

    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = GradWatch(model, loss, optimizer=opt, every=1, log_dir=None, form=form, **options)
    gen = torch.Generator().manual_seed(0)
    reports = []
    for _ in range(checks):
        x = torch.randn(32, 6, generator=gen)
        opt.zero_grad()
        loss(model, x).backward()
        reports.append(watch.step(x))
        opt.step()
    alerts = list(watch.alerts)
    watch.close()
    return alerts, reports


@pytest.mark.parametrize("form", ["objective", "module"])
def test_the_watch_on_a_declared_quantizer_and_an_undeclared_fake_quantize_raises_nothing(form):
    from torch.ao.quantization import FakeQuantize

    torch.manual_seed(0)
    alerts, reports = _watch(VQ(), form, surrogates=["quant"])
    assert alerts == [] and all(r.surrogates == ["quant"] for r in reports)
    assert any("surrogate, by design: quant" in n for n in reports[0].notes)
    torch.manual_seed(0)
    # its moving-average observer moves the scale in every training forward: the replay starts it where training did
    alerts, reports = _watch(nn.Sequential(nn.Linear(6, 8), FakeQuantize(), nn.Tanh(), nn.Linear(8, 6)), form)
    assert alerts == []
    assert reports[-1].surrogates == ["1"]
    assert reports[-1].training


@pytest.mark.parametrize("form", ["objective", "module"])
def test_an_undeclared_straight_through_is_one_alert_naming_its_module_and_the_option(form):
    torch.manual_seed(0)
    alerts, reports = _watch(VQ(), form, checks=6)
    assert len(alerts) == 1, [a.message for a in alerts]
    (alert,) = alerts
    assert alert.kind == "surrogate"
    assert alert.tensor == "quant"
    assert alert.step == 0
    assert "surrogates=['quant']" in alert.message and "quant.code" in alert.message
    # the verdicts are still recorded at every check: nothing is hidden from the records
    assert all(not r.ok for r in reports)


@pytest.mark.parametrize("form", ["objective", "module"])
def test_a_bug_beside_an_undeclared_straight_through_still_alerts(form):
    torch.manual_seed(0)
    model = VQ()
    model.dec = OffWeight(8, 6)
    alerts, _ = _watch(model, form, checks=2)
    kinds = {(a.kind, a.tensor) for a in alerts}
    assert ("surrogate", "quant") in kinds
    assert ("threshold", "dec.weight") in kinds, kinds


@pytest.mark.parametrize("form", ["objective", "module"])
def test_the_watch_names_a_bug_beside_a_declared_surrogate(form):
    torch.manual_seed(0)
    alerts, _ = _watch(VQ("mid"), form, checks=1, surrogates=["quant"])
    assert {a.tensor for a in alerts} == {"quant:output" if form == "objective" else "mid:input"}


def test_an_in_place_op_after_a_declared_surrogate_does_not_change_what_is_held(x):
    torch.manual_seed(0)
    class Halve(nn.Module):
        def forward(self, s):
            return s.mul_(0.5)  # in place, on the held output itself

    model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(SpikeLayer(), Halve()), nn.Linear(8, 6))
    report = check_model(model, loss, x, surrogates=[SpikeLayer])
    assert failing(report) == []
    assert report.surrogates == ["1.0"]
    assert not report.nondeterministic
    assert all(t.verdict is not None for t in report.tensors.values())  # judged, not inconclusive


def test_gradwatch_report_names_the_surrogate_parameters_and_why(tmp_path, capsys):
    from gradwatch import GradWatch
    from gradwatch.cli import commands as cli

    torch.manual_seed(0)
    model = VQ()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = GradWatch(model, loss, optimizer=opt, every=1, log_dir=tmp_path, tensorboard=False, surrogates=["quant"])
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(0))
    opt.zero_grad()
    loss(model, x).backward()
    watch.step(x)
    watch.close()
    cli.main(["report", str(tmp_path)])
    out = capsys.readouterr().out
    assert "quant.code not checked by the backward part (surrogate, by design)" in out
