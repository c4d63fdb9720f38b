"""Hugging Face accelerate's gradient accumulation with a watch: the recipe of docs/getting-started/accelerate.md.

``Accelerator(gradient_accumulation_steps=4)`` with ``with accelerator.accumulate(model):`` divides every
micro-batch's loss by 4, also in the last window of an epoch when it holds fewer (accelerate 1.x syncs at the
end of the dataloader and does not change the divisor). With the recipe (``watch.accumulate`` on the steps
that do not sync, ``watch.step`` on the one that does), whole windows are judged on every tensor with no
alert; a partial window is one ``partial_window`` alert naming it, never a WRONG per tensor blaming
missing ``watch.accumulate`` calls; a window whose micro-batches the watch is not handed is one ``unjudged``
warning for the run. The real package, tiny models, in this process.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradwatch import GradWatch

accelerate = pytest.importorskip("accelerate")
Accelerator, GradientAccumulationPlugin = accelerate.Accelerator, accelerate.utils.GradientAccumulationPlugin

K = 4


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def train(batches, *, epochs=1, calls="recipe", plugin=None, after_backward=None, state=None):
    """A user's accelerate loop over ``batches`` micro-batches of 4 samples per epoch; the watch on every step.

    ``calls``: ``"recipe"`` (accumulate, then step on the sync step) or ``"sync_only"`` (step on the sync step only).
    """
    accelerator = (Accelerator(gradient_accumulation_plugin=plugin) if plugin is not None
                   else Accelerator(gradient_accumulation_steps=K))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    names = [n for n, _ in model.named_parameters()]
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * batches, 6, generator=g), torch.randint(0, 3, (4 * batches,), generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=4))
    watch = GradWatch(model, loss_fn, optimizer=opt, every=1, tensorboard=False, jsonl=False, coords=2, directions=1)
    if state is not None:
        watch.load_state_dict(state)
    reports = []
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model, batch))
                if accelerator.sync_gradients:
                    if after_backward is not None:
                        after_backward(model)
                    reports.append(watch.step(batch))
                elif calls == "recipe":
                    watch.accumulate(batch)
                opt.step()
                opt.zero_grad()
    watch.close()
    return watch, reports, names


def test_whole_windows_are_judged_on_every_tensor_with_no_alert():
    watch, reports, names = train(2 * K)
    assert watch.alerts == []
    assert len(reports) == 2
    for r in reports:  # the user's names, every tensor, over the step's 4 micro-batches
        assert sorted(r.training) == sorted(names) and not any(t.failed for t in r.training.values())
        assert r.training_items["counts"] == [[4.0] * K] and r.training_window is None
    assert all(c["backward"] > 0 and c["training"] > 0 for c in watch.coverage.values())
    assert sorted(watch.coverage) == sorted(names)


@pytest.mark.parametrize("batches, epochs, held", [(2 * K + 2, 1, "each of the step's 2 micro-batches is"),
                                                   (2 * K + 1, 2, "the step's one micro-batch is")])
def test_a_partial_window_is_one_alert_naming_it(batches, epochs, held):
    watch, reports, names = train(batches, epochs=epochs)
    n = batches % K
    # One alert per partial window (one per epoch), a warning naming it; no tensor WRONG, no blame on watch.accumulate.
    expected = [("partial_window", "warning", "*", "training")] * epochs
    assert [(a.kind, a.severity, a.tensor, a.part) for a in watch.alerts] == expected
    for alert in watch.alerts:
        assert f"{held} divided by {K}, the full accumulation window, where the step has {n}" in alert.message
        assert f"this step's update is {Fraction(n, K)} the size its objective asks for" in alert.message
        assert "watch.accumulate" not in alert.message and "sync_with_dataloader=False" in alert.message
    partial = [r for r in reports if r.training_window is not None]
    assert len(partial) == epochs and len(reports) == 3 * epochs
    for r in partial:
        assert sorted(r.training) == sorted(names) and not any(t.failed for t in r.training.values())
        assert r.training_window["micro_batches"] == n and r.training_window["window"] == K
        assert r.training_window["scale"] == pytest.approx(n / K, rel=1e-5)
        assert "a partial accumulation window" in r.training_note


def test_windows_kept_whole_across_epochs_raise_nothing():
    # The fix the alert names: accelerate's windows run on into the next epoch, so every window is whole.
    plugin = GradientAccumulationPlugin(num_steps=K, sync_with_dataloader=False)
    watch, reports, _ = train(2 * K + 2, epochs=2, plugin=plugin)
    assert watch.alerts == [] and len(reports) == 5
    assert all(r.training and r.training_items["counts"] == [[4.0] * K] for r in reports)


def test_a_wrong_tensor_on_a_partial_window_still_fails_on_its_own():
    steps = []

    def slip(model):  # at the partial window only, a hook-like edit of one tensor's .grad
        steps.append(1)
        if len(steps) == 3:
            model[2].bias.grad.mul_(3.0)

    watch, reports, _ = train(2 * K + 2, after_backward=slip)
    kinds = sorted((a.kind, a.tensor) for a in watch.alerts)
    assert kinds == [("partial_window", "*"), ("threshold", "2.bias")], [a.message[:150] for a in watch.alerts]
    last = reports[-1]
    assert [n for n, t in last.training.items() if t.failed] == ["2.bias"]
    assert "3.00x" in last.training["2.bias"].diagnosis  # against the step's objective times 2/4


def test_step_on_sync_steps_only_is_one_warning_for_the_run():
    watch, reports, _ = train(3 * K, calls="sync_only")
    assert [(a.kind, a.severity, a.part) for a in watch.alerts] == [("unjudged", "warning", "training")]
    assert "if accelerator.sync_gradients: watch.step(batch) else: watch.accumulate(batch)" in watch.alerts[0].message
    assert len(reports) == 3
    for r in reports:  # each check says why, in its record; the backward verdict goes on
        assert r.training == {}
        assert r.training_note.startswith("skipped: accumulating")
        assert r.tensors


def test_a_resumed_run_keeps_the_window_it_learned():
    """A checkpoint keeps the window: after a resume, a last window of one micro-batch (nothing to read the window
    from but the run's) is named at once, not judged WRONG on every tensor."""
    first, _, _ = train(2 * K)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint file holds it
    assert state["training"] == {"window": K, "warned": False}
    watch, reports, _ = train(1, state=state)
    assert [(a.kind, a.tensor) for a in watch.alerts] == [("partial_window", "*")], [a.message[:150] for a in watch.alerts]
    assert reports[0].training_window["window"] == K and reports[0].training_window["micro_batches"] == 1
