"""A unit that cannot be replayed alone is checked another way, or "not checked" with a reason a user acts on.

Issue 73: a not-checked unit gave ``'Stub' object has no attribute 'resnets'`` (a diffusers UNet) or
``ZeroDivisionError: float division by zero`` as its reason. Planted here on a real diffusers ``UNet2DModel``:

- an up block whose own code dispatches on the class of the block it calls (a registry keyed by class): run with
  stubs it raised ``KeyError: <class 'gradwatch.check.modules.stubs.Stub'>``. It is checked whole now (its children
  real, on the same inputs), EXCELLENT, and a wrong backward planted in its own code is still caught there;
- an up block with state of its own (a counter it divides by): its check raised ``ZeroDivisionError: float division
  by zero``. It is "not checked" with a reason in words, and the alert names no internal class.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch, Verdict
from gradwatch.check.modules.localize import ModuleCheck
from gradwatch.check.modules.module_form import run_module_check
from gradwatch.check.modules.replay_failure import why_not_alone
from gradwatch.check.objective.terms import Objective
from gradwatch.options import CheckOptions
from gradwatch.plan.units import plan_units

diffusers = pytest.importorskip("diffusers")

#: Class names a message a person reads must not show: Python's exceptions and the module form's stand-ins.
INTERNAL = re.compile(r"\b\w*(Error|Exception)\b|\bStub\b|ModuleView|OwnCode|gradwatch\.check\.")


class Doubled(torch.autograd.Function):
    """Identity forward, a backward twice the true one: the planted bug."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return 2 * g


def unet(block_kind: str, bad: bool = False) -> Any:
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                  block_out_channels=(16, 32), norm_num_groups=8,
                                  down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                  up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    block = model.up_blocks[0]
    base = type(block)
    resnet = diffusers.models.resnet.ResnetBlock2D

    class Dispatching(base):  # type: ignore[misc, valid-type]
        """Scales by a registry keyed by the class of the block it calls."""

        def forward(self, hidden_states: torch.Tensor, res: Any, temb: Any = None, **kwargs: Any) -> Any:
            hidden_states = hidden_states * {resnet: 1.0}[type(self.resnets[0])]
            if bad:
                hidden_states = Doubled.apply(hidden_states)
            return super().forward(hidden_states, res, temb, **kwargs)

    class Counting(base):  # type: ignore[misc, valid-type]
        """State of its own: it counts its runs and divides by what is left of three."""

        def forward(self, hidden_states: torch.Tensor, res: Any, temb: Any = None, **kwargs: Any) -> Any:
            self.runs = getattr(self, "runs", 0) + 1
            return super().forward(hidden_states * (1.0 / (3 - self.runs)), res, temb, **kwargs)

    block.__class__ = Dispatching if block_kind == "dispatch" else Counting
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(x, torch.tensor([10, 500])).sample, x)

    return model, loss_fn, images


def checked(model: nn.Module, loss_fn: Any, batch: Any, names: Sequence[str]) -> Dict[str, ModuleCheck]:
    units = [u for u in plan_units(model, loss_fn, batch) if u.name in names]
    report = run_module_check(model, Objective(loss_fn), batch, CheckOptions(), units=units)
    return {m.name: m for m in report.localized}


def test_own_code_that_cannot_run_with_stubs_is_checked_whole():
    model, loss_fn, images = unet("dispatch")
    result = checked(model, loss_fn, images, ["up_blocks.0"])["up_blocks.0"]
    assert result.inconclusive is None and result.tensors, result  # was: KeyError: <class '...stubs.Stub'>
    assert all(t.verdict == Verdict.EXCELLENT for t in result.tensors.values())
    assert "whole" in result.type and not INTERNAL.search(result.type), result.type


def test_a_wrong_backward_in_that_own_code_is_caught_whole():
    model, loss_fn, images = unet("dispatch", bad=True)
    result = checked(model, loss_fn, images, ["up_blocks.0"])["up_blocks.0"]
    assert result.failed
    assert result.tensors["input[0]"].verdict == Verdict.WRONG
    assert "Doubled" in result.functions


@pytest.mark.slow
def test_a_forward_with_state_is_not_checked_with_a_reason_in_words():
    model, loss_fn, images = unet("count")
    block = model.up_blocks[0]
    watch = GradWatch(model, loss_fn, every=1, log_dir=None, form="module")
    notes = []
    for _ in range(watch.cycle_length or 8):
        block.runs = 0
        model.zero_grad()
        loss_fn(model, images).backward()
        block.runs = 0
        notes += watch.step(images).notes
    said = [n for n in notes if "`up_blocks.0`" in n and "not checked" in n]
    assert said and "state of its own" in said[0], notes  # was: ZeroDivisionError: float division by zero
    alerts = [a for a in watch.alerts if a.kind == "not_checked" and a.tensor == "up_blocks.0"]
    assert len(alerts) == 1 and not INTERNAL.search(alerts[0].message), alerts
    assert not any(INTERNAL.search(n) for n in said), said


def test_what_a_stub_cannot_answer_is_said_in_words():
    why = why_not_alone(AttributeError("'Stub' object has no attribute 'resnets'"), own=True)
    assert why == "its own code reads `resnets` of a module it calls, which the stand-in for that module cannot answer"
    assert not INTERNAL.search(why_not_alone(ZeroDivisionError("float division by zero"), own=True))
