"""check_model's detection first (screen=True, the default): one probe per tensor settles a correct one;
a disagreeing probe is traced to the one wrong entry (pinpoint); anything unsettled gets the full sample."""

import pytest
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
        assert t.verdict.value == "excellent"
        assert not t.coords
        assert len(t.dir_analytic) == 1
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
    assert bias.verdict.value == "excellent"
    assert len(bias.dir_analytic) == 1
    assert not bias.coords


def test_wrong_factor_on_whole_tensor_still_fails_with_full_sample():
    model, batch = _model()
    model[2].idx, model[2].factor = (slice(None), slice(None)), 1.2  # every entry 20% too large
    report = check_model(model, _ce, batch)
    assert [t.name for t in report.failures] == ["2.weight"]
    failure = report.failures[0]
    assert failure.verdict.value == "wrong" and failure.coords  # judged on the full sample
    assert abs(failure.ratio - 1.2) < 1e-3


def _two_tensor_objective(wrong: float = 1.2, raise_after_verdict: bool = False):
    """J = sum(sin(a)) + sum(b**3)/3 with a's gradient ``wrong`` times too large; the engine's inputs."""
    from gradwatch.bands import Verdict
    from gradwatch.check.probes.lines import EngineSettings, Evaluator

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(40, dtype=torch.float64, generator=gen)
    b = torch.randn(30, dtype=torch.float64, generator=gen)
    state = {"after": False}

    def evaluate():
        if state["after"] and raise_after_verdict:
            raise RuntimeError("the loss raised during the diagnosis")
        return {"loss": float(torch.sin(a).sum() + (b ** 3).sum() / 3)}

    targets = [("a", "a", a, {"total": wrong * torch.cos(a)}), ("b", "b", b, {"total": b ** 2})]
    settings = EngineSettings(coords=8, directions=4, eps=None, bands=(1e-7, 1e-4, 1e-2), fail_at=Verdict.SUSPICIOUS,
                              detect_kinks=True, eval_eps=2.2e-16, magnitude=1.0, screen=True)
    return targets, Evaluator(evaluate), settings, state


def test_every_verdict_comes_before_the_failing_tensors_full_samples():
    from gradwatch.check.probes.engine import check_tensors

    targets, evaluator, settings, _ = _two_tensor_objective()
    at_verdict = []
    judged = list(check_tensors(targets, evaluator, settings, seed=0,
                                on_verdict=lambda: at_verdict.append(evaluator.count)))
    # two at the base point and one probe per tensor: the disagreeing probe's own one-sided slopes rule out a kink
    assert at_verdict == [2 + 2 * 2]
    assert [j.key for j in judged] == ["b", "a"]  # the failing tensor's full sample comes last
    b, a = judged[0].check, judged[1].check
    assert not b.failed
    assert not b.coords
    assert len(b.dir_analytic) == 1
    assert a.failed
    assert a.verdict.value == "wrong"
    assert len(a.coords) == 8  # diagnosed on the full sample
    assert abs(a.ratio - 1.2) < 1e-3 and "1.20x" in a.diagnosis
    assert evaluator.count > 2 * at_verdict[0]


def test_a_failing_verdict_survives_a_raise_during_its_diagnosis():
    from gradwatch.check.probes.engine import check_tensors

    targets, evaluator, settings, state = _two_tensor_objective(raise_after_verdict=True)
    got = []
    with pytest.raises(RuntimeError, match="during the diagnosis"):
        for j in check_tensors(targets, evaluator, settings, seed=0, on_verdict=lambda: state.update(after=True)):
            got.append(j)
    assert [j.key for j in got] == ["b", "a"]
    assert got[1].check.failed
    assert got[1].check.verdict.value == "wrong"
    assert len(got[1].check.dir_analytic) == 1


def test_check_model_reports_the_time_to_its_verdict(monkeypatch):
    from gradwatch.check import model as model_module

    model, batch = _model()
    model[2].idx, model[2].factor = (slice(None), slice(None)), 1.2
    monkeypatch.setattr(model_module, "REPLAY_MIN_SECONDS", 0.0)  # the prefix replayed, whatever the forward's time
    report = check_model(model, _ce, batch)
    assert list(report.tensors) == [n for n, _ in model.named_parameters()]  # model order, failing ones included
    assert 0 < report.verdict_seconds < report.seconds and report.localize_seconds > 0
    assert report.to_dict()["verdict_seconds"] == report.verdict_seconds
    # the analytic pass, two at the base point (the first, captured, and the one verifying the prefix replay), one
    # probe per tensor: what a correct model's verdict costs
    assert report.verdict_evaluations == 1 + 2 + 2 * len(report.tensors) < report.evaluations
    monkeypatch.setattr(model_module, "REPLAY_MIN_SECONDS", float("inf"))  # declined: no replay to verify
    assert check_model(model, _ce, batch).verdict_evaluations == 1 + 1 + 2 * len(report.tensors)
    model[2].idx = None
    correct = check_model(model, _ce, batch)
    assert correct.ok
    assert correct.localize_seconds == 0
    assert 0 < correct.verdict_seconds <= correct.seconds
    assert correct.verdict_evaluations == correct.evaluations


def test_a_kink_crossed_by_the_probe_is_not_taken_for_a_wrong_gradient():
    """J = sum(relu(a - c)) with c just beside a: the probe crosses kinks on one side. Its central difference
    disagrees with the (correct) gradient, but its one-sided slopes differ too: no failing verdict on the probe
    alone; the smaller steps tell the kink and the tensor passes."""
    from gradwatch.bands import Verdict
    from gradwatch.check.probes.engine import check_tensors
    from gradwatch.check.probes.lines import EngineSettings, Evaluator

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(20, dtype=torch.float64, generator=gen)
    c = a.clone()
    c[:5] += 1e-6 * torch.tensor([1.0, -1.0, 2.0, -0.5, 1.5], dtype=torch.float64)  # kinks within the step

    def evaluate():
        return {"loss": float(torch.relu(a - c).sum() + (a ** 2).sum())}

    targets = [("a", "a", a, {"total": ((a - c) > 0).double() + 2 * a})]
    settings = EngineSettings(coords=8, directions=4, eps=1e-5, bands=(1e-7, 1e-4, 1e-2), fail_at=Verdict.SUSPICIOUS,
                              detect_kinks=True, eval_eps=2.2e-16, magnitude=1.0, screen=True)
    evaluator = Evaluator(evaluate)
    at_verdict = []
    (judged,) = check_tensors(targets, evaluator, settings, seed=0,
                              on_verdict=lambda: at_verdict.append(evaluator.count))
    assert not judged.check.failed, judged.check
    assert at_verdict[0] > 2 + 2  # the probe was re-examined at smaller steps before any verdict
