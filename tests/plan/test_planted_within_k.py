"""Planted bugs caught within the cycle K, and every trained tensor given both verdicts within K, where the watch cuts
its work to fit beside training (``GradWatch(every=1)`` in a plain loop, a small ``memory_budget``): a convolution whose
input gradient is wrong on its last row (the check on windows of one sample's positions), a wrong activation inside a
diffusers UNet's resnet block, and the frozen base layer of a LoRA adapter whose backward to its input is wrong (a
unit with no trainable parameter: its input gradient checked all the same). And a paced cycle planned again puts the
units never checked first, so that every unit is checked within the K it ends with, counted from the first check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable, List, Tuple

import paths
import pytest
import torch
from helpers import WrongSilu
from torch import nn
from torch.nn import functional as F

from gradwatch import GradWatch
from gradwatch.check.judging.report import CheckReport
from gradwatch.plan.planner import Planner


def _train(model: nn.Module, loss_fn: Callable, batch: Any, most: int, planted: bool = True, **options: Any
           ) -> Tuple[GradWatch, List[CheckReport], int]:
    """Up to ``most`` steps of SGD, each checked; stops after K + 1 checks (K as it stands then), once a ``planted``
    bug is caught. Returns the watch, the reports and the number of the first check (1, 2, ...) that raised a
    threshold alert (0: none did)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    reports: List[CheckReport] = []
    caught = 0
    watch = GradWatch(model, loss_fn, every=1, log_dir=None, **options)
    for _ in range(most):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        reports.append(watch.step(batch, loss=loss))
        opt.step()
        if not caught and any(a.kind == "threshold" for a in watch.alerts):
            caught = len(reports)
        if (caught or not planted) and len(reports) > (watch.cycle_length or 1):
            break
    watch.close()
    return watch, reports, caught


def _both_verdicts(watch: GradWatch, model: nn.Module) -> List[str]:
    """The trained tensors without both verdicts yet."""
    cov = watch.coverage
    return [n for n, p in model.named_parameters() if p.requires_grad
            and not (cov.get(n, {}).get("backward", 0) > 0 and cov.get(n, {}).get("training", 0) > 0)]


# --------------------------------------------------------------------------- a convolution wrong on its last row


class _LastRowConv(torch.autograd.Function):
    """A 3x3 convolution (padding 1) whose input gradient is 1.5x on the last row of whatever input it is given."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return F.conv2d(x, w, b, padding=1)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = torch.nn.grad.conv2d_input(x.shape, w, g, padding=1).clone()
        gx[:, :, -1, :] *= 1.5
        return gx, torch.nn.grad.conv2d_weight(x, w.shape, g, padding=1), g.sum((0, 2, 3))


class _Conv(nn.Conv2d):
    def forward(self, x):
        return _LastRowConv.apply(x, self.weight, self.bias)


def _conv_on_windows() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), _Conv(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 3, 64, 64, generator=gen), torch.randint(0, 10, (4,), generator=gen))
    watch, reports, caught = _train(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch, 10,
                                    memory_budget=0.0005)
    notes = [n for r in reports for n in r.notes]
    assert any("`2` (_Conv) checked on" in n and "window at" in n for n in notes), notes  # a window of positions
    assert 0 < caught <= watch.cycle_length, (caught, watch.cycle_length, [a.message[:120] for a in watch.alerts])
    assert "2:input" in {n for a in watch.alerts for n in a.names}, [(a.tensor, a.message[:80]) for a in watch.alerts]
    assert _both_verdicts(watch, model) == []


# --------------------------------------------------------------------------- a UNet's resnet block


def _unet_resnet() -> None:
    import diffusers

    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                  block_out_channels=(16, 32), norm_num_groups=8,
                                  down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                  up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    model.up_blocks[1].resnets[1].nonlinearity = WrongSilu()
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:  # the DDPM loss: it draws its own noise
        noise = torch.randn_like(x)
        t = torch.randint(0, 1000, (x.shape[0],))
        alpha = torch.cos(t.float() / 1000 * 1.5707963).view(-1, 1, 1, 1)
        return F.mse_loss(m(alpha * x + (1 - alpha ** 2).sqrt() * noise, t).sample, noise)

    watch, reports, caught = _train(model, loss_fn, images, 10, memory_budget=0.01)
    assert all(r.form == "module" for r in reports)
    notes = [n for r in reports for n in r.notes]
    assert any("captured and checked on sample" in n for n in notes), notes  # a window of the batch's samples
    assert 0 < caught <= watch.cycle_length, (caught, watch.cycle_length)
    assert "up_blocks.1.resnets.1.nonlinearity:input" in {n for a in watch.alerts for n in a.names}, \
        [(a.tensor, a.message[:80]) for a in watch.alerts]
    assert _both_verdicts(watch, model) == []


def _fresh(case: str) -> None:
    """``case`` run in a fresh process: its room is what its own training's peak leaves (in a test worker the peak is
    earlier tests', and the windows these cases are about never engage)."""
    run = subprocess.run([sys.executable, "-c", f"import test_planted_within_k as t; t.{case}()"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": paths.pythonpath()}, cwd=paths.ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.slow
def test_a_convolution_wrong_on_its_last_row_is_caught_on_windows_within_k():
    _fresh("_conv_on_windows")


@pytest.mark.slow
def test_a_wrong_activation_in_a_unet_resnet_block_is_caught_within_k_every_tensor_judged():
    pytest.importorskip("diffusers")
    _fresh("_unet_resnet")


# --------------------------------------------------------------------------- a LoRA adapter's frozen base layer


class _WrongInputGrad(torch.autograd.Function):
    """transformers' ``Conv1D`` (``x @ W + b``) whose gradient to its input is 1.5x (its weight frozen)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(w)
        return (x.reshape(-1, x.shape[-1]) @ w + b).view(*x.shape[:-1], w.shape[-1])

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return 1.5 * (g @ w.t()), None, None


def _lora_gpt2(bug: bool) -> Tuple[nn.Module, Callable, torch.Tensor]:
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=64, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = peft.get_peft_model(GPT2LMHeadModel(cfg), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"],
                                                                      lora_dropout=0.0))
    if bug:
        base = model.get_submodule("base_model.model.transformer.h.1.attn.c_attn.base_layer")

        class WrongBase(type(base)):  # type: ignore[misc]
            def forward(self, x):
                return _WrongInputGrad.apply(x, self.weight, self.bias)

        base.__class__ = WrongBase
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, lambda m, b: m(input_ids=b, labels=b).loss, ids


BASE = "base_model.model.transformer.h.1.attn.c_attn.base_layer"


def test_a_lora_base_layer_with_a_wrong_input_gradient_is_caught_on_its_own_unit_within_k():
    model, loss_fn, ids = _lora_gpt2(True)
    # the module form, its captures cut to the samples that fit: the base layer has no trainable parameter, and
    # the adapters' wrapper stands a stub for it, so only its own unit sees its backward (before: 0 alerts)
    # (up to 12 checks: alone K is 1 and the first check catches it; under a loaded suite a step takes over
    # PACED_STEP_SECONDS, the pace spreads the units over K = 8, and 6 checks did not reach the base layer's unit)
    watch, reports, caught = _train(model, loss_fn, ids, 12, form="module", memory_budget=0.002)
    assert 0 < caught <= watch.cycle_length, (caught, watch.cycle_length)
    assert f"{BASE}:input" in {n for a in watch.alerts for n in a.names}, [(a.tensor, a.message[:80]) for a in watch.alerts]
    assert _both_verdicts(watch, model) == []


def test_a_lora_base_layer_is_checked_for_its_input_gradient_only_and_agrees():
    model, loss_fn, ids = _lora_gpt2(False)
    watch, reports, _ = _train(model, loss_fn, ids, 10, False, form="module", memory_budget=0.002)
    pieces = {p for r in reports for p in r.pieces}
    assert BASE in pieces and BASE.replace("h.1", "h.0") in pieces, sorted(pieces)
    judged = {n for r in reports for n in r.tensors}
    assert f"{BASE}:input" in judged and f"{BASE}.weight" not in judged  # its frozen weight is not perturbed
    assert watch.alerts == [], [a.message[:120] for a in watch.alerts]


# --------------------------------------------------------------------------- a paced cycle planned again


def test_a_paced_cycle_planned_again_checks_the_units_never_checked_first():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(16)])
    names = [n for n, _ in model.named_parameters()]
    planner = Planner()
    units: set = set()
    checks = 0
    for done in [4, 3, 3, 3, 3, 3, 3, 3, 3]:  # each check's time holds this many of the pieces handed to it
        checks += 1
        pieces = [str(p) for p in planner.module_pieces(model, lambda m, b: m(b).sum(), torch.randn(1, 2), names,
                                                        key=("k",))[1]]
        report = CheckReport(tensors={}, form="module", pieces=pieces[:done], later=pieces[done:])
        planner.record(report)
        planner.pace(report.later)
        units.update(pieces[:done])
        if len(units) == 17:  # 16 Linears and loss_fn's own code
            break
    # planned again after the first check (4 a check) and the second (3 a check: K = 6): every unit within that K
    assert planner.cycle_length == 6
    assert checks <= planner.cycle_length, (checks, sorted(units))
