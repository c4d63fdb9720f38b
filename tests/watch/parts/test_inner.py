"""Objectives that differentiate inside: ``torch.autograd.grad(..., create_graph=True)`` in ``loss_fn``.

WGAN-GP's critic loss, an R1 penalty, a physics-informed heat-equation residual (first and second
derivatives of the output with respect to the inputs) and double backprop (a classifier loss plus
its input-gradient norm), on small tanh MLPs: the watch runs both verdicts on them in the
whole-objective form and in the module form, with no alert on correct models, and ``check_model``
agrees; a 20% error planted in a custom tanh's double backward (its first backward right) is caught
and the tanh named (``1:double_backward``: each leaf module's double backward checked on the inputs the
objective gives it) in all four objectives, in both forms and by ``check_model``.
"""

from __future__ import annotations

import paths
import pytest
import torch
from helpers import make_tanh, watch_run
from torch import nn

from gradwatch import GradWatch, check_model


def mlp(d_in: int, dtype: torch.dtype, act: nn.Module = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, 32), act or nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)).to(dtype)


def wgan_gp(m, b):
    real, fake = b
    eps = torch.rand(real.shape[0], 1, dtype=real.dtype, generator=torch.Generator().manual_seed(0))
    x = (eps * real + (1 - eps) * fake).requires_grad_(True)
    (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    return m(fake).mean() - m(real).mean() + 10 * ((g.norm(dim=1) - 1) ** 2).mean()


def r1(m, b):
    real, fake = b
    real = real.detach().requires_grad_(True)
    out = m(real)
    (g,) = torch.autograd.grad(out.sum(), real, create_graph=True)
    return nn.functional.softplus(m(fake)).mean() + nn.functional.softplus(-out).mean() + 5 * g.pow(2).sum(1).mean()


def heat_residual(m, b):
    xt, _ = b
    xt = xt[:, :2].detach().requires_grad_(True)
    u = m(xt)
    (du,) = torch.autograd.grad(u.sum(), xt, create_graph=True)
    u_x, u_t = du[:, 0], du[:, 1]
    (d2u,) = torch.autograd.grad(u_x.sum(), xt, create_graph=True)
    return (u_t - 0.1 * d2u[:, 0]).pow(2).mean() + u.pow(2).mean()


def double_backprop(m, b):
    x, y = b
    x = x.detach().requires_grad_(True)
    loss = nn.functional.mse_loss(m(x), y[:, :1])
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    return loss + 0.5 * g.pow(2).sum()


OBJECTIVES = {"wgan_gp": (wgan_gp, 8), "r1": (r1, 8), "heat": (heat_residual, 2), "double_backprop": (double_backprop, 8)}


def batches(d_in: int, dtype: torch.dtype, n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, d_in, generator=g).to(dtype), torch.randn(16, d_in, generator=g).to(dtype)) for _ in range(n)]


@pytest.mark.parametrize("form", ["objective", "module"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_correct_models_both_verdicts_no_alert(name, dtype, form):
    loss_fn, d_in = OBJECTIVES[name]
    model = mlp(d_in, dtype)
    watch, reports = watch_run(loss_fn, model, batches(d_in, dtype, 3), form=form)
    said = [("not_checked", "<loss_fn>")] if form == "module" else []  # loss_fn's own code, once: no verdict failed
    assert [(a.kind, a.tensor) for a in watch.alerts] == said
    assert all(r is not None and r.form == form and r.ok for r in reports)
    params = {n for n, _ in model.named_parameters()}
    assert all(set(r.training) == params for r in reports)  # the training verdict on every tensor, every check
    assert watch.objective.differentiates is True
    inner = {f"{i}:double_backward" for i in range(5)}  # every leaf module's double backward, every check
    assert all({n for n in r.tensors if n.endswith(":double_backward")} == inner for r in reports)
    if form == "module":  # its units, checked on captured inputs; loss_fn's own code needs the model: said so
        assert all(v["backward"] == 1.0 for v in watch.coverage.values())
        assert any("differentiates through the model" in note for note in reports[0].notes)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_check_model_runs_and_passes(name):
    loss_fn, d_in = OBJECTIVES[name]
    report = check_model(mlp(d_in, torch.float32), loss_fn, batches(d_in, torch.float32, 1)[0])
    assert report.ok and len(report.tensors) == 6 + 5  # 6 parameters, 5 modules' double backward


class WrongDoubleBackwardTanh(nn.Module):
    """tanh whose double backward is 20% off in ``y`` (its first backward right)."""

    def __init__(self) -> None:
        super().__init__()
        self.tanh = make_tanh(x_error=1.2)

    def forward(self, x):
        return self.tanh(x)


def test_wrong_double_backward_caught_in_the_objective_form():
    model = mlp(8, torch.float32, act=WrongDoubleBackwardTanh())
    watch, _ = watch_run(wgan_gp, model, batches(8, torch.float32, 2))
    named = {a.tensor for a in watch.alerts if a.kind == "threshold"}
    # the objective's gradient check names the layer before the wrong tanh; the inner check names the tanh
    assert named
    assert named <= {"0.weight", "0.bias", "1:double_backward"}
    assert "1:double_backward" in named
    assert not check_model(model, wgan_gp, batches(8, torch.float32, 1)[0]).ok


@pytest.mark.parametrize("form", ["objective", "module"])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_wrong_double_backward_caught_and_named_in_every_objective(name, form):
    """The tanh's double backward 20% off (its first backward right): each module's double backward is checked
    on the inputs the objective gives it, so the tanh is named, in the physics-informed residual too (where the
    wrong second derivative is part of the objective's value and its own gradient check cannot see it)."""
    loss_fn, d_in = OBJECTIVES[name]
    model = mlp(d_in, torch.float32, act=WrongDoubleBackwardTanh())
    watch, reports = watch_run(loss_fn, model, batches(d_in, torch.float32, 2), form=form)
    alerts = [a for a in watch.alerts if a.kind == "threshold" and a.tensor == "1:double_backward"]
    assert alerts
    assert alerts[0].step == 0
    assert "WRONG" in alerts[0].message.upper()
    assert all(n == "1:double_backward" for n in (t.name for t in reports[0].failures) if n.endswith("double_backward"))
    report = check_model(model, loss_fn, batches(d_in, torch.float32, 1)[0])
    assert "1:double_backward" in {t.name for t in report.failures}


def test_the_readme_examples_run_without_alert(tmp_path):
    from docs_text import page, python_blocks

    code = python_blocks(page("guides/derivatives-inside.md"))[0]
    critic = mlp(8, torch.float32)
    ns = {"torch": torch, "GradWatch": GradWatch, "critic": critic, "opt": torch.optim.SGD(critic.parameters(), lr=1e-3)}
    exec(compile(code, "docs/guides/derivatives-inside.md", "exec"), ns)
    ns["watch"].close()
    watch, reports = watch_run(ns["critic_loss"], critic, batches(8, torch.float32, 2))
    assert watch.alerts == [] and all(r.ok and r.training for r in reports)
    u = mlp(2, torch.float32)
    g = torch.Generator().manual_seed(2)
    watch, reports = watch_run(ns["heat_residual"], u, [torch.randn(16, 2, generator=g) for _ in range(2)])
    assert watch.alerts == [] and all(r.ok and r.training for r in reports)


class PlainGAN(nn.Module):
    """WGAN-GP as a plain module: the critic's loss has a gradient penalty; the noise comes with the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.critic = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def critic_loss(self, batch):
        real, z, eps = batch
        fake = self.generator(z).detach()
        x = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (g,) = torch.autograd.grad(self.critic(x).sum(), x, create_graph=True)
        return self.critic(fake).mean() - self.critic(real).mean() + 10 * ((g.norm(dim=1) - 1) ** 2).mean()

    def generator_loss(self, batch):
        return -self.critic(self.generator(batch[1])).mean()


def test_the_readme_plain_gan_loop_gives_each_network_both_verdicts(tmp_path, monkeypatch):
    from docs_text import page

    section = page("guides/derivatives-inside.md")
    code = section.split("in a plain loop, one watch per network", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    gan = PlainGAN()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g), torch.rand(8, 1, generator=g))
            for _ in range(3)]
    ns = {"GradWatch": GradWatch, "gan": gan, "data": data,
          "opt_c": torch.optim.Adam(gan.critic.parameters(), lr=1e-3),
          "opt_g": torch.optim.Adam(gan.generator.parameters(), lr=1e-3)}
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/guides/derivatives-inside.md (plain GAN loop)", "exec"), ns)
    from gradwatch.io.sinks import read_jsonl

    for name, net in (("watch_c", "critic"), ("watch_g", "generator")):
        watch = ns[name]
        watch.close()
        assert watch.alerts == []
        params = {n for n, _ in gan.named_parameters() if n.startswith(net + ".")}
        checks = [r for r in read_jsonl(tmp_path / "runs" / net / "checks.jsonl")[0] if r["type"] == "check"]
        assert checks  # every='auto': the first step is checked, then as the overhead budget allows
        for c in checks:  # both verdicts on the network's own parameters, at every check
            assert {n for n in c["tensors"] if not n.endswith(":double_backward")} == params
            assert set(c["training"]) == params and all(t["verdict"] == "excellent" for t in c["training"].values())


_OVER_BUDGET = """
import sys, json, torch
from torch import nn
from test_inner import wgan_gp, batches, watch_run
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3000), nn.Tanh(), nn.Linear(3000, 3000), nn.Tanh(),
                      nn.Linear(3000, 1))
watch, reports = watch_run(wgan_gp, model, batches(8, torch.float32, 1))
print(json.dumps({"notes": reports[0].notes, "inner": sorted(n for n in reports[0].tensors if n.endswith(":double_backward"))}))
"""


@pytest.mark.slow
def test_a_module_whose_double_backward_check_does_not_fit_memory_budget_is_said_not_checked():
    """A 9M-parameter Linear's float64 copy and check (~430 MB) does not fit the room of a fresh process at the
    default memory_budget: named in a note, not checked; the small modules are (a process of its own: the room
    is its training's own peak, not the test run's)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", _OVER_BUDGET], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": paths.pythonpath()})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert any(n.startswith("4's double backward not checked") and "memory_budget" in n for n in got["notes"])
    assert "4:double_backward" not in got["inner"] and "1:double_backward" in got["inner"]
