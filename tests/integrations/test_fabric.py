"""GradWatch on a Lightning Fabric module, at every precision Fabric offers on the CPU, through ``fabric.backward``.

Real Fabric (``accelerator="cpu", devices=1``), a tiny model with dropout (the replay must draw the same masks)
and a custom ``autograd.Function``, SGD with weight decay (coupled into the objective). At each precision:
no alert, both verdicts on every tensor, names as the user wrote them (no ``_forward_module.``), the training
verdict judged in the precision training computed in, and a planted backward bug (1.5x) named. No mocks.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric import wrappers as fabric_wrappers  # noqa: E402

from gradwatch import GradWatch  # noqa: E402
from gradwatch.parallel.wrappers import Wrapping  # noqa: E402

#: Every precision Fabric runs on the CPU ("16-mixed" falls back to "bf16-mixed" there), with the dtype the
#: training part must say training computed in.
PRECISIONS = {"32-true": "float32", "64-true": "float64", "bf16-mixed": "bfloat16", "bf16-true": "bfloat16",
              "16-true": "float16"}
NAMES = ["0.weight", "0.bias", "3.weight", "3.bias"]


class Square(torch.autograd.Function):
    """x**2 with a hand-written backward, ``factor`` times the true one (1.0: correct)."""

    factor = 1.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 * x * Square.factor


class Sq(nn.Module):
    def forward(self, x):
        return Square.apply(x)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


def setup(precision, seed=0, weight_decay=0.01):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Fabric's notes on the CPU precision it picked
        fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    model = nn.Sequential(nn.Linear(4, 8), Sq(), nn.Dropout(0.2), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=weight_decay)
    fmodel, fopt = fabric.setup(model, opt)
    return fabric, model, fmodel, fopt


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def train(fabric, fmodel, fopt, watch, data, after_backward=None):
    reports = []
    for batch in data:
        fopt.zero_grad()
        loss = loss_fn(fmodel, batch)
        fabric.backward(loss)
        if after_backward is not None:
            after_backward()
        reports.append(watch.step(batch, loss=loss) if watch is not None else None)
        fopt.step()
    return reports


@pytest.fixture(autouse=True)
def correct_square():
    Square.factor = 1.0
    yield
    Square.factor = 1.0


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_both_verdicts_on_every_tensor_under_the_users_names_at_each_precision(precision, tmp_path):
    fabric, model, fmodel, fopt = setup(precision)
    watch = GradWatch(fmodel, loss_fn, optimizer=fopt, every=1, log_dir=tmp_path, tensorboard=False)
    assert watch.model is model and watch.context.wrapping.entry is fmodel  # checked eager, replayed as trained
    reports = train(fabric, fmodel, fopt, watch, batches(3))
    watch.close()
    assert watch.alerts == [] and watch.paused is None
    for report in reports:
        assert report is not None and report.ok, str(report)
        assert list(report.tensors) == NAMES and list(report.training) == NAMES
        assert all(t.verdict is not None and not t.failed for t in report.tensors.values())
        assert all(t.verdict is not None and not t.failed for t in report.training.values()), report.training_note
        assert {t.dtype for t in report.training.values()} == {PRECISIONS[precision]}
        assert "replayed from the forward RNG state" in report.training_note  # dropout's masks, verified
    assert watch.coverage["0.weight"] == {"backward": 1.0, "training": 1.0}
    text = (tmp_path / "checks.jsonl").read_text()
    assert "_forward_module" not in text and '"3.weight"' in text


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_a_planted_backward_bug_is_named_at_each_precision(precision):
    fabric, model, fmodel, fopt = setup(precision, weight_decay=0.0)  # the wrong factor alone in the objective
    Square.factor = 1.5  # the custom Function's backward is 1.5x the derivative of its forward
    watch = GradWatch(fmodel, loss_fn, optimizer=fopt, every=1, tensorboard=False, jsonl=False)
    (report,) = train(fabric, fmodel, fopt, watch, batches(1))
    for name in ("0.weight", "0.bias"):  # below the Function: its backward scales their gradients
        check = report.tensors[name]
        assert check.failed and "1.50x" in check.diagnosis, str(report)
    assert not report.tensors["3.weight"].failed and not report.tensors["3.bias"].failed
    # Training applied the gradient its (wrong) backward gives: the training verdict holds.
    assert list(report.training) == NAMES and not any(t.failed for t in report.training.values())
    assert {n for a in watch.alerts for n in a.names} == {"0.weight", "0.bias"}  # one cause's alert (issue 73)


def test_a_gradient_training_changes_after_fabric_backward_is_named_by_the_training_verdict():
    fabric, model, fmodel, fopt = setup("bf16-mixed")
    watch = GradWatch(fmodel, loss_fn, optimizer=fopt, every=1, tensorboard=False, jsonl=False)

    def slip():
        model[3].weight.grad.mul_(1.5)

    (report,) = train(fabric, fmodel, fopt, watch, batches(1), after_backward=slip)
    assert report.training["3.weight"].failed and "1.50x" in report.training["3.weight"].diagnosis
    assert not any(report.training[n].failed for n in NAMES if n != "3.weight")
    assert [a.tensor for a in watch.alerts] == ["3.weight"]


def test_tensor_patterns_use_the_users_names():
    fabric, model, fmodel, fopt = setup("bf16-mixed")
    watch = GradWatch(fmodel, loss_fn, every=1, tensors=["3.*"], tensorboard=False, jsonl=False)
    (report,) = train(fabric, fmodel, fopt, watch, batches(1))
    assert list(report.tensors) == ["3.weight", "3.bias"] and list(report.training) == ["3.weight", "3.bias"]
    with pytest.raises(ValueError, match="matches no trainable parameter"):
        GradWatch(fmodel, loss_fn, tensors=["_forward_module.*"], tensorboard=False, jsonl=False)


def test_training_is_bit_identical_and_fabrics_guard_stays_in_place():
    def run(watched):
        fabric, model, fmodel, fopt = setup("bf16-mixed")
        watch = GradWatch(fmodel, loss_fn, optimizer=fopt, every=1, tensorboard=False, jsonl=False) if watched else None
        train(fabric, fmodel, fopt, watch, batches(3))
        state = [p.detach().clone() for p in model.parameters()], torch.get_rng_state()
        if watch is not None:
            assert fabric_wrappers._in_fabric_backward is False
            with pytest.raises(RuntimeError, match="fabric.backward"):  # loss.backward() is still refused
                loss_fn(fmodel, batches(1)[0]).backward()
        return state

    (a, rng_a), (b, rng_b) = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(rng_a, rng_b)


def test_the_wrapping_of_a_fabric_module():
    fabric, model, fmodel, fopt = setup("bf16-mixed")
    w = Wrapping.of(fmodel)
    assert (w.model, w.entry, w.root, w.fabric) == (model, fmodel, model, fmodel)
    assert w.region() is not None and w.grad_scaler() is None  # bf16 has no GradScaler
    with w.fabric_backward():
        assert fabric_wrappers._in_fabric_backward is True
    assert fabric_wrappers._in_fabric_backward is False
    assert json.dumps(sorted(n for n, _ in w.model.named_parameters())) == json.dumps(sorted(NAMES))


def test_the_inner_module_given_instead_says_why_the_training_part_is_not_judged():
    fabric, model, fmodel, fopt = setup("bf16-mixed")
    watch = GradWatch(fmodel.module, loss_fn, every=1, tensorboard=False, jsonl=False)  # not what training calls
    (report,) = train(fabric, fmodel, fopt, watch, batches(1))
    assert list(report.tensors) == NAMES and report.ok  # the backward verdict does not depend on it
    assert report.training == {} and "give GradWatch the module training calls" in report.training_note
