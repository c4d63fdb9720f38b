"""Kinks seen from the forward: a probe that crosses a ReLU/max-pool/clamp kink is judged only where it crosses none.

At small weights nearly every first-layer pre-activation sits within one step of its kink; a probe of the first
layer's bias crossed many at once and the "smooth disagreement" rule called a correct backward WRONG (issue:
a one-hidden-layer ReLU MLP, width 64-128, batch 64-128, every parameter times 1e-4).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch, check_model
from gradwatch.check.probes.kinks import Recorder, compare, record

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from small_weights import OffLinear  # noqa: E402


def ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def one_hidden(width: int, scale: float, seed: int, bug: str = "none") -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential((OffLinear if bug == "first" else nn.Linear)(16, width), nn.ReLU(),
                          (OffLinear if bug == "last" else nn.Linear)(width, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def data(batch: int, seed: int):
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.randn(batch, 16, generator=gen), torch.randint(0, 5, (batch,), generator=gen)


# The cases the issue found failing before (false WRONG / SUSPICIOUS on 0.bias and 0.weight).
FAILED_BEFORE = [(1e-4, 64, 64, 1), (1e-4, 64, 64, 2), (1e-4, 128, 128, 0), (1e-4, 128, 128, 2), (1e-3, 128, 128, 0),
                 (1e-3, 64, 64, 3)]


@pytest.mark.parametrize("scale,width,batch,seed", FAILED_BEFORE)
def test_a_correct_relu_network_at_small_weights_has_no_false_alarm(scale, width, batch, seed):
    torch.manual_seed(seed)  # the draw of the reproduction: model, then data, from one seed
    model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    batch_ = (torch.randn(batch, 16), torch.randint(0, 5, (batch,)))
    report = check_model(model, ce, batch_, seed=seed)
    assert not report.failures, str(report)
    # the probes that crossed kinks are counted, from the forward
    assert report.kinks == sum(t.kinks for t in report.tensors.values())


@pytest.mark.parametrize("bug,planted", [("first", "0.weight"), ("last", "2.weight")])
@pytest.mark.parametrize("scale", [1e-4, 1e-6])
def test_planted_one_percent_bugs_are_still_caught_at_small_weights(bug, planted, scale):
    model = one_hidden(64, scale, 0, bug)
    report = check_model(model, ce, data(64, 0), seed=0)
    assert planted in {t.name for t in report.failures}, str(report)


@pytest.mark.parametrize("form", ["objective", "module"])
def test_the_watch_forms_have_no_false_alarm_and_catch_the_bug(form):
    for bug in ("none", "first"):
        model = one_hidden(128, 1e-4, 2, bug)
        batch = data(128, 2)
        watch = GradWatch(model, ce, every=1, log_dir=None, form=form, training=False, independence="off", seed=2)
        ce(model, batch).backward()
        report = watch.step(batch)
        watch.close()
        failing = {n for n, t in report.tensors.items() if t.failed}
        if bug == "none":
            assert not failing, str(report)
        else:
            assert "0.weight" in failing, str(report)


def test_a_probe_crossing_relu_kinks_is_counted():
    """The issue's 0.bias WRONG case: its disagreeing probes crossed kinks, and the steps that cross none are lost
    in the objective's rounding: the tensor is judged on its module alone (no kink there), and passes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e-4)
    report = check_model(model, ce, (torch.randn(128, 16), torch.randint(0, 5, (128,))), seed=0)
    assert not report.failures, str(report)
    alone = next(n for n in report.notes if "judged on their modules alone" in n)
    assert "0.bias" in alone and report.tensors["0.bias"].verdict is not None, str(report)


def test_the_record_reads_inputs_before_an_in_place_op_and_pool_indices():
    x = torch.tensor([[-1.0, 2.0, 0.5, -0.25]], dtype=torch.float64)
    got = record(lambda: torch.relu_(x.clone()))
    assert got is not None
    assert got[0][0] == "m"
    assert got[0][1].tolist() == [-1.0, 2.0, 0.5, -0.25]
    image = torch.arange(16.0, dtype=torch.float64).reshape(1, 1, 4, 4)
    a = record(lambda: F.max_pool2d(image, 2))
    flipped = image.clone()
    flipped[0, 0, 0, 0] = 100.0  # the top-left window's argmax moves
    b = record(lambda: F.max_pool2d(flipped, 2))
    assert a is not None
    assert b is not None
    assert a[0][0] == "l"
    crossing = compare(a, b)
    assert crossing.count == 1 and crossing.fraction < 1.0
    assert compare(a, a).count == 0


def test_margins_say_where_along_the_step_a_kink_was_crossed():
    x = torch.tensor([0.3, -2.0, 1.0], dtype=torch.float64)
    base = record(lambda: F.hardtanh(x))
    moved = record(lambda: F.hardtanh(x - torch.tensor([0.6, 0.0, 0.0], dtype=torch.float64)))
    crossing = compare(base, moved)  # 0.3 -> -0.3 crosses 0? no: hardtanh's kinks are at -1 and 1
    assert crossing.count == 0
    moved = record(lambda: F.hardtanh(x + torch.tensor([1.4, 0.0, 0.0], dtype=torch.float64)))
    crossing = compare(base, moved)  # 0.3 -> 1.7 crosses 1 at half the step
    assert crossing.count == 1 and abs(crossing.fraction - 0.5) < 1e-6


def test_a_recorder_that_cannot_read_an_op_gives_up_rather_than_guess():
    with Recorder() as rec:
        torch.clamp(torch.ones(3), min=torch.zeros(3, dtype=torch.long))  # an integer bound: no margin to read
    assert not rec.failed and rec.record == []
