"""The training part's replay run as the backward part's capture in one process (``gradwatch.watch.parts.replay_capture``).

From the second check on (the first learns whether ``loss_fn`` differentiates inside), a module-form check whose
replay runs without autocast captures the units' inputs in the replay's own forward: one forward of the model a check
fewer. Where the first check's isolated forward met no randomness but dropout, the replay captures with training's
dropout masks too; a replay that draws other random numbers leaves the capture its own forward, for the rest of the
run. A check of the whole objective's form, or one with no piece to capture, runs the replay on its own after it. The
captures share the replay's tensors; one changed in place later in its forward is taken again.

The captured inputs of a Hugging Face attention layer hold the model's ``DynamicCache``. In the replay's forward, with
grad, its keys and values carry a ``grad_fn``, which ``copy.deepcopy`` refuses; kept by reference, the forward went on
appending to it, and the layer's own code ran on 16 keys for 8 (a ``not_checked`` alert). The capture copies such a
cache's tensors detached (:func:`gradwatch.check.modules.localize.copy_opaque`).
"""

from __future__ import annotations

import pytest
import torch
from helpers import watch_run
from torch import nn

from gradwatch.check.modules import module_form
from gradwatch.check.modules.localize import copy_opaque
from gradwatch.watch.parts import replay_capture

transformers = pytest.importorskip("transformers")
from test_moe_hooks import model_loss, padded_batch, tiny_moe  # noqa: E402


@pytest.fixture
def replays(monkeypatch) -> list:
    """Each call of a :class:`~gradwatch.watch.parts.replay_capture.ReplayCapture`: (hooks given, forward usable)."""
    calls: list = []
    call = replay_capture.ReplayCapture.__call__

    def spy(self, pre, post):
        out = call(self, pre, post)
        calls.append((len(pre) + len(post), self.usable))
        return out

    monkeypatch.setattr(replay_capture.ReplayCapture, "__call__", spy)
    return calls


def loop(model: nn.Module, loss_fn, batches, **options):
    """:func:`helpers.watch_run` without pace (a loaded machine's would spread the cycle wider)."""
    return watch_run(loss_fn, model, batches, pace=None, **options)


def test_a_cache_filled_with_grad_is_copied_not_shared():
    cache = transformers.DynamicCache()
    w = torch.ones(3, requires_grad=True)
    keys = torch.randn(1, 2, 4, 3) * w  # a graph's tensor: deepcopy refuses it
    cache.update(keys, keys, 0)
    copied = copy_opaque({"past_key_values": cache})["past_key_values"]
    assert copied is not cache
    cache.update(keys, keys, 0)  # the forward goes on with the live one
    assert (cache.get_seq_length(), copied.get_seq_length()) == (8, 4)
    k = copied.layers[0].keys
    assert k.grad_fn is None
    assert torch.equal(k, keys.detach())
    assert k.data_ptr() != keys.data_ptr()


def test_the_replay_is_the_capture_from_the_second_check_and_a_kv_cache_in_its_inputs_stays_as_captured(replays):
    watch, reports = loop(tiny_moe("qwen2_moe"), model_loss, [padded_batch(s, rows=4, seq=8) for s in range(4)],
                          form="module")
    assert len(replays) == 3 and all(hooks > 0 and usable for hooks, usable in replays), replays
    assert watch.alerts == [], [a.message for a in watch.alerts]
    judged = [r.tensors.get("model.layers.1.self_attn.q_proj.weight") for r in reports]
    assert any(tc is not None and tc.verdict is not None for tc in judged)
    assert all(r.training for r in reports)  # the training verdict at every check, fused or not


def test_the_captures_hooks_and_its_forward_are_let_go_once_their_parts_ran(replays, monkeypatch):
    # The hooks (and what they hold) serve the replay's forward only, the fused forward the backward part only: a check
    # that kept them in its context held them through its later parts (cnn64 and a UNet peaked 12 MB higher).
    from gradwatch.watch.parts.inner import InnerPart

    held, run = [], InnerPart.run

    def spy(self, check):
        held.append((check.hooks, check.fused))
        return run(self, check)

    monkeypatch.setattr(InnerPart, "run", spy)
    loop(tiny_moe("qwen2_moe"), model_loss, [padded_batch(s, rows=4, seq=8) for s in range(4)], form="module")
    assert len(replays) == 3, replays  # the replay was the capture's forward at three checks
    assert held == [(None, None)] * 4


class Dropped(nn.Module):
    """Dropout as a module and as a function (``noise``: a draw that is not dropout besides)."""

    def __init__(self, noise: bool = False) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 2)
        self.noise = noise

    def forward(self, x):
        h = self.drop(torch.tanh(self.a(x)))
        if self.noise and self.training:
            h = h + 0.01 * torch.randn_like(h)
        return self.b(nn.functional.dropout(h, 0.2, self.training))


def test_a_replay_with_dropout_is_the_capture_where_dropout_is_all_the_model_draws(replays):
    torch.manual_seed(0)
    watch, reports = loop(Dropped(), lambda m, b: m(b).pow(2).mean(), [torch.randn(8, 6) for _ in range(4)],
                          form="module")
    assert [usable for _, usable in replays] == [True, True, True]
    assert watch.alerts == [], [a.message for a in watch.alerts]
    assert all(r.training and all(tc.verdict is not None for tc in r.tensors.values()) for r in reports)


def test_a_replay_that_draws_other_random_numbers_leaves_the_capture_its_own_forward(replays):
    torch.manual_seed(0)
    watch, reports = loop(Dropped(noise=True), lambda m, b: m(b).pow(2).mean(), [torch.randn(8, 6) for _ in range(4)],
                          form="module")
    assert [usable for _, usable in replays] == [False]  # tried once (the second check), then not again
    assert watch.alerts == [] and all(r.training and r.tensors for r in reports)
    assert all(tc.verdict is not None for r in reports[1:] for tc in r.tensors.values())


def test_a_check_of_the_whole_objective_runs_the_replay_on_its_own(replays):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    watch, reports = loop(model, lambda m, b: m(b).pow(2).mean(), [torch.randn(8, 6) for _ in range(4)],
                          form="objective")
    assert replays == []
    assert watch.alerts == [] and all(set(r.training) == {n for n, _ in model.named_parameters()} for r in reports)


class Doubled(nn.Module):
    """Own code that doubles its child's output in place (autograd allows it: ``mul_`` needs no saved value)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(6, 16), nn.Linear(16, 2)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        h = self.lin(x)
        h.mul_(2.0)
        return self.out(torch.tanh(h) * self.scale)


def test_a_capture_changed_in_place_later_in_the_replay_is_taken_again(replays, monkeypatch):
    from gradwatch.check.modules import capture

    stale: list = []
    take = capture.capture

    def spy(*args, **kwargs):
        got = take(*args, **kwargs)
        stale.append(got.stale)
        return got

    monkeypatch.setattr(capture, "capture", spy)
    monkeypatch.setattr(module_form, "capture", spy)
    torch.manual_seed(0)
    watch, reports = loop(Doubled(), lambda m, b: m(b).pow(2).mean(), [torch.randn(8, 6) for _ in range(4)],
                          form="module")
    assert len(replays) == 3 and all(usable for _, usable in replays)
    assert stale.count(True) == 3  # each replay's captures: the root's own code saw its child's output doubled
    assert watch.alerts == [], [a.message for a in watch.alerts]
    assert all(r.tensors["scale"].verdict is not None for r in reports)
