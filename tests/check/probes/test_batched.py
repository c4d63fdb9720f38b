"""Batched evaluation (torch.vmap): same numbers as the loop, silent fallback where vmap cannot go."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch.check.probes.batched as batched_mod
from gradwatch import GradWatch, check_model
from gradwatch.check.probes.batched import batched_state, reset_batched_state

FALLBACK = "batched evaluation is not available"


@pytest.fixture(autouse=True)
def never_slow(monkeypatch):
    """Batching is given up when it is slower than the loop; timings must not decide these tests."""
    monkeypatch.setattr(batched_mod, "TIME_DECISIONS", False)
    yield
    reset_batched_state()


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Softplus(), nn.Linear(16, 2))


def data(seed=1, n=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g)


def _values(report):
    return {n: (t.numeric, t.dir_numeric, t.analytic, t.dir_analytic, t.noise_floor) for n, t in report.tensors.items()}


def _assert_same_numbers(a, b):
    """Same samples (same seed); numeric values agree within each tensor's noise floor."""
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        ta, tb = a.tensors[name], b.tensors[name]
        assert ta.coords == tb.coords
        floor = max(ta.noise_floor, tb.noise_floor)
        for x, y in zip(ta.numeric + ta.dir_numeric, tb.numeric + tb.dir_numeric):
            assert abs(x - y) <= floor, (name, x, y, floor)
        assert ta.analytic == pytest.approx(tb.analytic, rel=1e-12, abs=1e-15)
        assert ta.dir_analytic == pytest.approx(tb.dir_analytic, rel=1e-9, abs=1e-15)
        assert ta.verdict == tb.verdict


def test_batched_and_loop_give_the_same_numbers_on_an_mlp():
    model, batch = mlp(), data()
    loop = check_model(model, mse, batch, batched=False, seed=3)
    assert batched_state(model)["batches"] == 0
    fast = check_model(model, mse, batch, batched=True, seed=3)
    state = batched_state(model)
    assert state["enabled"] and state["batches"] >= len(fast.tensors), state
    assert loop.ok and fast.ok
    _assert_same_numbers(loop, fast)


def test_samples_lost_in_rounding_are_widened_in_batches_with_the_loops_numbers(monkeypatch):
    """At small weights the last layer's slopes are lost in the objective's rounding at the base step, and each
    such sample is taken again at a wider step (three central differences, ``widen``). On the batched path
    those evaluations go through the batched evaluator too, not one loss call each: same numbers and verdicts
    as the loop, far fewer calls of ``loss_fn``."""
    import gradwatch.check.probes.reexamine as reexamine

    model = mlp(seed=2)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e-3)  # activations near zero: the last layer's gradient is tiny against the objective
    batch = data(seed=4)
    widened = {"loop": 0}
    linear_at = reexamine._linear_at

    def counted(*args, **kwargs):
        widened["loop"] += 1
        return linear_at(*args, **kwargs)

    monkeypatch.setattr(reexamine, "_linear_at", counted)
    calls = {"n": 0}

    def loss(m, b):
        calls["n"] += 1
        return mse(m, b)

    loop = check_model(model, loss, batch, batched=False, seed=7)
    loop_calls, loop_widened = calls["n"], widened["loop"]
    assert loop_widened > 0, "the small weights must put some samples below the rounding (the case under test)"
    calls["n"] = widened["loop"] = 0
    fast = check_model(model, loss, batch, batched=True, seed=7)
    assert batched_state(model)["enabled"]
    assert widened["loop"] == 0  # every widening was evaluated in a batch
    assert calls["n"] * 4 < loop_calls, (calls["n"], loop_calls)
    _assert_same_numbers(loop, fast)


def test_regularizer_terms_are_included_exactly_as_in_the_loop():
    model, batch = mlp(), data()
    opts = dict(seed=5, per_term=True, regularizers={"l2": 1e-2, "l1": 1e-3})
    loop = check_model(model, mse, batch, batched=False, **opts)
    fast = check_model(model, mse, batch, batched=True, **opts)
    assert batched_state(model)["enabled"]
    assert set(fast.term_checks) == {"loss", "l1", "l2"}
    _assert_same_numbers(loop, fast)
    for term in ("loss", "l1", "l2"):
        for name, tl in loop.term_checks[term].items():
            tf = fast.term_checks[term][name]
            floor = max(tl.noise_floor, tf.noise_floor)
            assert all(abs(x - y) <= floor for x, y in zip(tl.numeric + tl.dir_numeric, tf.numeric + tf.dir_numeric))


def test_batchnorm_in_train_mode_is_batched_and_leaves_buffers_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).train()
    before = copy.deepcopy(model.state_dict())
    batch = data()
    loop = check_model(model, mse, batch, batched=False)
    fast = check_model(model, mse, batch, batched=True)
    assert batched_state(model)["enabled"] and batched_state(model)["batches"] > 0
    _assert_same_numbers(loop, fast)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_wrong_gradient_is_caught_on_the_batched_path_too(buggy_sigmoid):
    class Act(nn.Module):
        def forward(self, x):
            return torch.sigmoid(x) * 1.5  # forward fine; the bug is below

    class Scaled(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return torch.tanh(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(output)

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * (1 - y * y) * 2.0  # factor 2 too much

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.fc2(Scaled.apply(self.fc1(x)))

    torch.manual_seed(0)
    model = Net()
    report = check_model(model, mse, data(), batched=True)
    assert batched_state(model)["batches"] > 0
    assert not report.ok and "fc1.weight" in [t.name for t in report.failures]
    assert "2.00x" in report.tensors["fc1.weight"].diagnosis


def test_fallback_for_an_old_style_autograd_function_is_silent_and_logged_once(recwarn, caplog, correct_sigmoid):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.fc2(correct_sigmoid.apply(self.fc1(x)))

    torch.manual_seed(0)
    model, batch = Net(), data()
    with caplog.at_level(logging.DEBUG, logger="gradwatch"):
        reports = [check_model(model, mse, batch, batched=True, seed=s) for s in range(3)]
    assert all(r.ok for r in reports)
    state = batched_state(model)
    assert not state["enabled"] and "setup_context" in state["reason"]
    assert len([r for r in caplog.records if FALLBACK in r.getMessage()]) == 1
    assert len(recwarn) == 0, [str(w.message) for w in recwarn]
    _assert_same_numbers(check_model(model, mse, batch, batched=False, seed=0), reports[0])


def test_fallback_when_vmap_cannot_run_the_model_lstm(recwarn, caplog):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.LSTM(3, 5, batch_first=True), nn.Linear(5, 1)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(4, 5, 3), torch.randn(4, 1))
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        with GradWatch(model, mse, every=1, log_dir=None, coords=2, directions=1) as watch:
            reports = [watch.check(batch) for _ in range(4)]
    assert all(r is not None and r.ok for r in reports)
    assert not batched_state(model)["enabled"]
    assert len([r for r in caplog.records if FALLBACK in r.getMessage()]) <= 1
    assert len(recwarn) == 0, [str(w.message) for w in recwarn]


def test_a_batched_value_that_differs_from_the_loop_means_fallback_not_a_false_alarm(caplog):
    # The loss reads the weight through a reference the batched call cannot swap: batched values
    # would all be the unperturbed loss (numeric gradient 0). The validation catches it.
    model, batch = mlp(), data()
    w = model[0].weight

    def sneaky(m, b):
        x, y = b
        h = torch.tanh(F.linear(x, w.to(x.dtype), m[0].bias))
        return F.mse_loss(m[4](F.softplus(m[2](h))), y)

    with caplog.at_level(logging.INFO, logger="gradwatch"):
        report = check_model(model, sneaky, batch, batched=True, dtype=None)
    assert report.ok, str(report)
    state = batched_state(model)
    assert not state["enabled"] and "differs from a loop evaluation" in state["reason"]
    assert len([r for r in caplog.records if FALLBACK in r.getMessage()]) == 1


def test_batched_decision_is_reported_and_can_be_reset():
    model = mlp()
    assert batched_state(model) == {"enabled": True, "reason": None, "batches": 0, "loop_tensors": {}}
    check_model(model, mse, data(), coords=1, directions=1)
    assert batched_state(model)["batches"] > 0
    reset_batched_state(model)
    assert batched_state(model)["batches"] == 0
    json.dumps(batched_state(model))


def test_slow_batching_goes_back_to_the_loop_per_tensor(monkeypatch, caplog):
    monkeypatch.setattr(batched_mod, "TIME_DECISIONS", True)
    real = batched_mod.BatchedProbe._losses

    def slow(self, p, stacked):
        import time

        time.sleep(0.05)
        return real(self, p, stacked)

    monkeypatch.setattr(batched_mod.BatchedProbe, "_losses", slow)
    model = mlp()
    with caplog.at_level(logging.DEBUG, logger="gradwatch"):
        reports = [check_model(model, mse, data(), seed=s) for s in range(2)]
    assert all(r.ok for r in reports)
    state = batched_state(model)
    # The model's first batch pays vmap's one-time costs and is not timed; every other tensor is.
    assert state["enabled"] and set(state["loop_tensors"]) == set(reports[0].tensors)
    assert all("a batched evaluation took" in why for why in state["loop_tensors"].values())
    assert len([r for r in caplog.records if "one perturbation at a time" in r.getMessage()]) == 1
    calls = state["batches"]
    check_model(model, mse, data(), seed=3)
    assert batched_state(model)["batches"] == calls  # no more batches: every tensor uses the loop


def _counting_backend(runs):
    """A real torch.compile backend that counts how often its compiled graph runs."""

    def backend(gm, example_inputs):
        def run(*args):
            runs["n"] += 1
            return gm.forward(*args)

        return run

    return backend


@pytest.mark.parametrize("dtype,how", [("float64", "wrapper"), (None, "wrapper"), ("float64", "submodule")])
def test_a_compiled_model_keeps_its_compiled_graph_and_grads_after_a_batched_check(caplog, dtype, how):
    torch._dynamo.reset()
    runs = {"n": 0}
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 2))
    if how == "wrapper":
        compiled = torch.compile(model, backend=_counting_backend(runs))
    else:  # an eager model holding a compiled block
        model = compiled = nn.Sequential(torch.compile(model, backend=_counting_backend(runs)), nn.Tanh())
    batch = data()

    def live_step():
        before = runs["n"]
        for p in model.parameters():
            p.grad = None
        mse(compiled, batch).backward()
        return runs["n"] - before, [p.grad.clone() for p in model.parameters()]

    ran, grads = live_step()
    assert ran == 1
    try:
        with caplog.at_level(logging.INFO, logger="gradwatch"):
            for seed in range(2):
                report = check_model(compiled, mse, batch, batched=True, seed=seed, dtype=dtype)
                assert report.ok, str(report)
                assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # .grad untouched
                ran, again = live_step()
                assert ran == 1  # the live model still runs its compiled graph, not eager kernels
                assert all(torch.equal(a, b) for a, b in zip(again, grads))
        state = batched_state(compiled)
        assert not state["enabled"]
        assert "torch.compile" in state["reason"]
        assert state["batches"] == 0
        assert sum(FALLBACK in r.getMessage() for r in caplog.records) == 1
    finally:
        torch._dynamo.reset()


def test_training_a_compiled_model_is_bit_identical_with_and_without_the_watch():
    def run(watched):
        torch._dynamo.reset()
        model = mlp()
        compiled = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        watch = GradWatch(compiled, mse, every=1, tensorboard=False, jsonl=False, coords=2, directions=1) if watched else None
        for seed in range(3):
            batch = data(seed=seed)
            opt.zero_grad()
            mse(compiled, batch).backward()
            if watch is not None:
                assert watch.step(batch).ok
            opt.step()
        torch._dynamo.reset()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))
