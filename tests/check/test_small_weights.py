"""Weights near zero (near-zero init, heavy weight decay): no false alarm on correct ReLU models, where the
base step crosses ReLU kinks that a smaller step cannot resolve; a 1% error in a last layer's weight gradient,
tiny against the objective, still caught by a wider step (``gradwatch.check.probes.reexamine.widen``)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tanh_wrong_in_channel
from torch import nn

from gradwatch import check_model


class _OffLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, 1.01 * (g.t() @ x), g.sum(0)


class OffLinear(nn.Linear):
    def forward(self, x):
        return _OffLinear.apply(x, self.weight, self.bias)


def mlp(scale: float, seed: int, last=nn.Linear) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), last(16, 3)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def check(model: nn.Module):
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(32, 8, generator=gen, dtype=torch.float64), torch.randint(0, 3, (32,), generator=gen))
    return check_model(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch)


@pytest.mark.parametrize("scale", [1e-2, 1e-4, 1e-6])
def test_a_correct_relu_mlp_at_small_weights_raises_no_alarm(scale):
    for seed in range(3):  # before: '2.bias' WRONG for every seed at 1e-4 and 1e-6 (ReLU kinks within the step)
        report = check(mlp(scale, seed))
        assert not [n for n, t in report.tensors.items() if t.failed], (scale, seed, str(report))
        # what the whole objective cannot resolve is judged on its module alone: every tensor gets a verdict
        assert all(t.verdict is not None for t in report.tensors.values()), str(report)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-6])
def test_a_one_percent_error_in_a_last_layer_weight_gradient_is_caught_at_small_weights(scale):
    report = check(mlp(scale, 0, last=OffLinear))
    assert [n for n, t in report.tensors.items() if t.failed] == ["4.weight"], str(report)


def watch_module_form(model: nn.Module, form: str = "module"):
    from gradwatch import GradWatch

    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(32, 8, generator=gen, dtype=torch.float64), torch.randint(0, 3, (32,), generator=gen))

    def loss(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    watch = GradWatch(model, loss, every=1, log_dir=None, form=form, training=False, independence="off")
    loss(model, batch).backward()
    report = watch.step(batch)
    watch.close()
    return report


class OffMiddle(nn.Module):
    def __init__(self, scale: float, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), OffLinear(16, 16), nn.ReLU(), nn.Linear(16, 3)).double()
        with torch.no_grad():
            for p in self.net.parameters():
                p.mul_(scale)

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("scale", [1e-6, 1e-8])
def test_the_module_form_at_small_weights_no_alarm_and_a_middle_layer_bug_caught(scale):
    """Each module alone differences its own outputs: a middle layer's 1% bug is caught where the objective form
    cannot resolve it; a ReLU's input gradient, with entries far smaller than 1, is probed at steps of its own
    size (at steps of 1's size every entry crossed its kink: false alarms on ``3:input``)."""
    for seed in range(2):
        report = watch_module_form(mlp(scale, seed))
        assert not [n for n, t in report.tensors.items() if t.failed], (scale, seed, str(report))
        assert report.tensors["3:input"].verdict is not None
    report = watch_module_form(OffMiddle(scale, 0))
    assert [n for n, t in report.tensors.items() if t.failed] == ["net.2.weight"]


@pytest.mark.parametrize("scale", [1e-4, 1e-6])
def test_check_model_judges_what_the_objective_cannot_resolve_on_its_module(scale):
    """A middle layer's gradient at weights near zero is lost in the whole objective's rounding: the objective
    part says so (below_resolution or flat, never a passing verdict), and check_model judges it on its module
    alone, which catches a 1% error there."""
    from gradwatch.check.model import run_model_check
    from gradwatch.check.objective.terms import Objective
    from gradwatch.options import CheckOptions

    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(32, 8, generator=gen, dtype=torch.float64), torch.randint(0, 3, (32,), generator=gen))
    model = OffMiddle(scale, 0)
    alone = run_model_check(model, Objective(lambda m, b: F.cross_entropy(m(b[0]), b[1])), batch, CheckOptions(),
                            mark_unseen=True)
    middle = alone.tensors["net.2.weight"]
    assert middle.verdict is None and middle.inconclusive_kind.value in ("below_resolution", "flat")
    report = check(model)
    assert [n for n, t in report.tensors.items() if t.failed] == ["net.2.weight"], str(report)
    assert any("judged on their modules alone" in note and "net.2.weight" in note for note in report.notes)
    assert report.verdict_evaluations == report.evaluations  # the module checks' evaluations count to the verdict


def test_a_bias_before_batchnorm_is_judged_on_its_module():
    """The objective does not move at all with a bias before BatchNorm (flat): its own module judges it, and
    the modules after it are not checked for it (flat, nothing downstream can make its gradient wrong unseen)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()
    batch = (torch.randn(20, 8, dtype=torch.float64), torch.randint(0, 3, (20,)))
    report = check_model(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch)
    assert report.ok and all(t.verdict is not None for t in report.tensors.values())
    assert any("judged on their modules alone" in note and "0.bias" in note for note in report.notes)
    assert not [n for n in report.tensors if ":" in n]  # no module's input gradient failed


def test_the_watch_objective_form_judges_what_it_cannot_resolve_on_modules():
    """The watch's objective form at weights near zero: a middle layer's 1% error, lost in the whole objective's
    rounding, is judged on its module alone and caught; every tensor of the correct model gets a verdict."""
    report = watch_module_form(OffMiddle(1e-4, 0), form="objective")
    assert report.form == "objective"
    assert [n for n, t in report.tensors.items() if t.failed] == ["net.2.weight"], str(report)
    correct = watch_module_form(mlp(1e-4, 0), form="objective")
    assert correct.ok and all(t.verdict is not None for t in correct.tensors.values()), str(correct)


class OffTanh(nn.Module):
    """tanh whose input gradient is 1% too large."""

    fn = tanh_wrong_in_channel(slice(None), 1.01)

    def forward(self, x):
        return self.fn.apply(x)


def test_a_wrong_input_gradient_below_resolution_joins_the_report():
    """A parameter-free unit whose backward is 1% off, at weights of 1e-6: the tensors upstream of it that the
    objective cannot resolve send check_model to every module alone, and the unit's input gradient fails there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), OffTanh(), nn.Linear(16, 3)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e-6)
    report = check(model)
    assert "3:input" in [t.name for t in report.failures], str(report)
    assert report.tensors["3:input"].verdict.value in ("suspicious", "wrong")
