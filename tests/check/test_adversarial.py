"""The adversarial pass (issue 12): each hostile input is a clear error or handled, and nothing leaks into training."""

from __future__ import annotations

import copy
import logging
import math
import random
import shutil
import types
import warnings
from typing import Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import batch, mlp, mse, sgd_loop
from torch import nn
from torch.nn.utils import prune
from torch.utils.checkpoint import checkpoint

from gradwatch import ConfigError, GradWatch, check_backward, check_model
from gradwatch.check.objective.shadow import Shadow
from gradwatch.io.sinks import read_jsonl


def train(model, watch, loss_fn, batches, lr: float = 0.01):
    """A plain SGD loop; returns what ``watch.step`` returned at each step."""
    return sgd_loop(model, watch, loss_fn, batches, torch.optim.SGD(model.parameters(), lr=lr))


SMALL = dict(every=1, log_dir=None, coords=3, directions=1)


# ---------------------------------------------------------------- 3. sparse embeddings


@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
def test_sparse_embedding_is_checked(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 1))
    batches = [(torch.randint(0, 10, (5, 2)), torch.randn(5, 1)) for _ in range(2)]
    watch = GradWatch(model, mse, dtype=dtype, **SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # SGD takes sparse gradients
    for b in batches:
        opt.zero_grad()
        mse(model, b).backward()
        report = watch.step(b)
        opt.step()
        assert report is not None and report.ok, str(report)
        assert "0.weight" in report.tensors and report.tensors["0.weight"].verdict is not None
    assert watch.alerts == []


# ---------------------------------------------------------------- 5. buffers that follow the batch


class PositionTable(nn.Module):
    """A non-persistent buffer rebuilt whenever the batch size changes (a cache that follows the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("pos", torch.zeros(0), persistent=False)

    def forward(self, x):
        if self.pos.shape[0] != x.shape[0]:
            self.pos = torch.arange(x.shape[0], dtype=x.dtype) / 10
        return self.lin(x) + self.pos[:, None]


@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
def test_non_persistent_buffer_that_changes_shape_with_the_batch(dtype):
    torch.manual_seed(0)
    model = PositionTable()
    watch = GradWatch(model, mse, dtype=dtype, **SMALL)
    for n in (4, 6, 4, 6):
        b = batch(n)
        model.zero_grad()  # (without it .grad sums the steps, and the training part says so)
        mse(model, b).backward()
        report = watch.step(b)
        assert report is not None and report.ok, (n, watch.alerts)
        assert model.pos.shape == (n,)  # the live model keeps the buffer its own forward made
    assert watch.alerts == []


# ---------------------------------------------------------------- 6. loss_fn raising once during a check


def test_loss_fn_raising_once_inside_a_check_is_reported_not_retried():
    calls = []

    def flaky(model, b):
        calls.append(1)
        if len(calls) == 2:  # the 2nd evaluation of the first check (the first one after the analytic pass)
            raise KeyError("flaky data source")
        return mse(model, b)

    model = mlp()
    watch = GradWatch(model, flaky, **SMALL)
    reports = [watch.check(batch()), watch.check(batch())]
    assert reports[0] is None
    assert reports[1] is not None
    assert reports[1].ok
    (alert,) = watch.alerts
    assert alert.kind == "error"
    assert "KeyError" in alert.message
    assert "flaky data source" in alert.message
    assert "(in loss_fn)" in alert.message
    calls.clear()
    calls.append(1)  # the next call is the 2nd: check_model's first evaluation after the analytic pass raises
    with pytest.raises(KeyError, match="flaky data source"):
        check_model(mlp(), flaky, batch(), batched=False)


# ---------------------------------------------------------------- 7. nonsense options and losses


@pytest.mark.parametrize("eps", [1e6, 0.5, math.inf, math.nan])
def test_eps_too_large_or_not_finite_is_refused(eps):
    with pytest.raises(ConfigError, match=rf"eps: got {eps!r}, expected a number > 0 and <= 0.1"):
        GradWatch(mlp(), mse, eps=eps)
    with pytest.raises(ConfigError, match="eps: got"):
        check_model(mlp(), mse, batch(), eps=eps)
    if not 0 < eps < math.inf:  # check_backward's eps is absolute (Chainer's): only non-finite ones are refused
        with pytest.raises(ValueError, match=f"eps must be > 0 and finite, got {eps!r}"):
            check_backward(torch.tanh, np.ones(2), np.ones(2), eps=eps)


def test_empty_tensors_list_is_refused():
    with pytest.raises(ConfigError, match=r"tensors: got \[\], expected a non-empty list .* or null"):
        GradWatch(mlp(), mse, tensors=[])
    with pytest.raises(ConfigError, match=r"tensors: got \[\]"):
        check_model(mlp(), mse, batch(), tensors=[])


@pytest.mark.parametrize("make, dtype", [(lambda out: (out > 0).any(), "bool"),
                                         (lambda out: out.sum() * (1 + 1j), "complex128")], ids=["bool", "complex"])
def test_boolean_or_complex_loss_names_its_dtype(make, dtype):
    with pytest.raises(TypeError, match=f"loss_fn must return a real floating-point scalar tensor, got a {dtype} tensor"):
        check_model(mlp(), lambda m, b: make(m(b[0])), batch())


def test_integer_loss_names_its_dtype():
    def count_loss(model, b):
        return (model(b[0]) > 0).sum()  # an integer count: no gradient

    with pytest.raises(TypeError, match="loss_fn must return a real floating-point scalar tensor, got a int64 tensor"):
        check_model(mlp(), count_loss, batch())
    model = mlp()
    watch = GradWatch(model, count_loss, **SMALL)
    assert watch.check(batch()) is None
    (alert,) = watch.alerts
    assert "int64" in alert.message and "(in loss_fn)" in alert.message


# ---------------------------------------------------------------- 8. watched tensors frozen mid-run


def test_watched_tensors_frozen_mid_run_do_not_stop_training():
    model = mlp()
    watch = GradWatch(model, mse, tensors=["0.*"], **SMALL)
    assert train(model, watch, mse, [batch()])[0].ok
    model[0].requires_grad_(False)  # fine-tuning schedule: the watched layer is frozen
    reports = train(model, watch, mse, [batch(), batch()])  # raise_on is None: training goes on
    assert reports == [None, None]
    (alert,) = watch.alerts  # deduplicated: one alert for the persisting problem
    assert alert.kind == "error"
    assert "tensors: ['0.*'] match no trainable parameter any more" in alert.message
    assert "2.weight" in alert.message and "(in loss_fn)" not in alert.message


def test_partly_frozen_patterns_check_what_still_trains():
    model = mlp()
    watch = GradWatch(model, mse, tensors=["0.*", "2.*"], **SMALL)
    model[0].requires_grad_(False)
    (report,) = train(model, watch, mse, [batch()])
    assert report is not None
    assert report.ok
    assert sorted(report.tensors) == ["2.bias", "2.weight"]


# ---------------------------------------------------------------- 9. who raised


def test_errors_name_the_regularizer_or_grad_fn_that_raised():
    def bad_reg(model):
        raise ValueError("no such layer 'encoder'")

    model = mlp()
    watch = GradWatch(model, mse, regularizers={"sparsity": bad_reg}, **SMALL)
    assert watch.check(batch()) is None
    (alert,) = watch.alerts
    assert "(in regularizer 'sparsity')" in alert.message and "in loss_fn" not in alert.message

    def bad_grad_fn(model, b):
        return {"0.weight": torch.zeros(4, 3)}  # misses tensors

    watch = GradWatch(model, mse, grad_fn=bad_grad_fn, **SMALL)
    assert watch.check(batch()) is None
    (alert,) = watch.alerts
    assert "(in grad_fn)" in alert.message and "grad_fn returned no gradient for" in alert.message


# ---------------------------------------------------------------- 11. log directory deleted mid-run


def test_log_dir_deleted_mid_run_warns_and_keeps_later_records(tmp_path, caplog):
    run = tmp_path / "run"
    model = mlp()
    watch = GradWatch(model, mse, every=1, log_dir=run, coords=2, directions=1, tensorboard=False)
    train(model, watch, mse, [batch()])
    shutil.rmtree(run)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        train(model, watch, mse, [batch(), batch()])
    watch.close()
    assert "checks.jsonl was deleted or moved" in caplog.text and "are lost" in caplog.text
    records, problems = read_jsonl(run)
    assert problems == []
    assert [r["type"] for r in records] == ["run", "check", "check"]
    assert [r["step"] for r in records[1:]] == [1, 2]


# ---------------------------------------------------------------- 10. reentrant checkpointing, spectral_norm


class Checkpointed(nn.Module):
    """The middle layer runs under ``checkpoint(..., use_reentrant=True)``, as memory-saving code does."""

    def __init__(self, act=torch.tanh) -> None:
        super().__init__()
        self.a0, self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 4), nn.Linear(4, 1)
        self.act = act

    def forward(self, x):
        return self.b(checkpoint(lambda h: self.act(self.a(h)), self.a0(x), use_reentrant=True))


@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
@pytest.mark.parametrize("tensors", [None, ["a.*"]], ids=["all", "inside_only"])
def test_reentrant_checkpoint_is_checked_through_backward(dtype, tensors):
    torch.manual_seed(0)
    model = Checkpointed()
    b = batch()
    mse(model, b).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    report = check_model(model, mse, b, dtype=dtype, tensors=tensors, coords=3, directions=1)
    assert report.ok, str(report)
    assert {"a.weight", "a.bias"} <= set(report.tensors)
    assert all(report.tensors[n].judged_rel_diff == 0 for n in ("a.weight", "a.bias"))
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())  # .grad untouched


def test_reentrant_checkpoint_without_inputs_requiring_grad_is_a_true_wrong():
    class RawInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 1)

        def forward(self, x):  # x does not require grad: torch's reentrant checkpoint drops a's gradient
            return self.b(checkpoint(lambda h: torch.tanh(self.a(h)), x, use_reentrant=True))

    torch.manual_seed(0)
    model = RawInput()
    b = batch()
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        mse(model, b).backward()
    assert model.a.weight.grad is None  # training itself gets no gradient for a
    with pytest.warns(UserWarning):
        report = check_model(model, mse, b, coords=3, directions=1)
    assert report.tensors["a.weight"].verdict.value == "wrong"
    assert "analytic gradient is zero" in report.tensors["a.weight"].diagnosis
    assert report.tensors["b.weight"].verdict.value == "excellent"


def test_reentrant_checkpoint_still_finds_a_wrong_backward_inside(buggy_sigmoid):
    torch.manual_seed(0)
    model = Checkpointed(act=buggy_sigmoid.apply)
    report = check_model(model, mse, batch(), tensors=["a.*"], coords=3, directions=1)
    assert not report.ok and report.tensors["a.weight"].failed
    assert "analytic gradient is zero" not in (report.tensors["a.weight"].diagnosis or "")


def spectral_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(6, 5)), nn.Tanh(), nn.Linear(5, 1))
    with torch.no_grad():  # weights far from the ones u, v converged on: the power iteration still moves them
        model[0].parametrizations.weight.original.normal_()
    return model.train()


def test_spectral_norm_in_train_mode_agrees_and_keeps_its_vectors():
    model = spectral_model()
    sn = model[0].parametrizations.weight[0]
    b = (torch.randn(7, 6), torch.randn(7, 1))
    u, v = sn._u.clone(), sn._v.clone()
    for dtype in ("float64", None):
        report = check_model(model, mse, b, dtype=dtype)
        assert report.ok, str(report)
        assert torch.equal(sn._u, u)
        assert torch.equal(sn._v, v)
        assert sn.training


def test_spectral_norm_training_run_raises_no_alert():
    model = spectral_model()
    watch = GradWatch(model, mse, every=1, log_dir=None)
    batches = [(torch.randn(7, 6), torch.randn(7, 1)) for _ in range(4)]
    reports = train(model, watch, mse, batches, lr=0.1)
    assert all(r is not None and r.ok for r in reports), [str(r) for r in reports]
    assert watch.alerts == []


# ---------------------------------------------------------------- 4. complex parameters


class ComplexMul(torch.autograd.Function):
    """``x * w`` for complex tensors; ``conj=False`` forgets the conjugate in w's gradient (a classic bug)."""

    @staticmethod
    def forward(ctx, x, w, conj):
        ctx.save_for_backward(x, w)
        ctx.conj = conj
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w.conj(), g * (x.conj() if ctx.conj else x), None


class ComplexFilter(nn.Module):
    def __init__(self, conj: bool = True) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=torch.complex64))
        self.out = nn.Linear(3, 1)
        self.conj = conj

    def forward(self, z):
        return self.out(ComplexMul.apply(z, self.w, self.conj).abs())


def complex_batch():
    return torch.randn(5, 3, dtype=torch.complex64), torch.randn(5, 1)


@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
def test_complex_parameters_are_checked_as_real_and_imaginary_parts(dtype, recwarn):
    torch.manual_seed(0)
    model = ComplexFilter()
    w = model.w.detach().clone()
    report = check_model(model, mse, complex_batch(), dtype=dtype)
    assert report.ok, str(report)
    assert report.tensors["w"].shape == (3, 2) and report.tensors["w"].verdict is not None
    assert not [str(r.message) for r in recwarn if "imaginary" in str(r.message)]
    assert model.w.dtype == torch.complex64 and torch.equal(model.w, w)
    if dtype is not None:
        assert Shadow(model, torch.float64).module.w.dtype == torch.complex128


def test_complex_gradient_missing_its_conjugate_is_wrong():
    torch.manual_seed(0)
    report = check_model(ComplexFilter(conj=False), mse, complex_batch())
    assert report.tensors["w"].failed and not report.tensors["out.weight"].failed


def test_complex_model_in_a_training_run():
    torch.manual_seed(0)
    model = ComplexFilter()
    watch = GradWatch(model, mse, **SMALL)
    reports = train(model, watch, mse, [complex_batch(), complex_batch()])
    assert all(r is not None and r.ok for r in reports) and watch.alerts == []


# ---------------------------------------------------------------- 1. generators held by the model or the loss


class NoisyNet(nn.Module):
    """Draws from a torch.Generator and a random.Random of its own in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 8), nn.Linear(8, 1)
        self.gen = torch.Generator().manual_seed(1)
        self.py_rng = random.Random(2)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = h + 0.01 * torch.randn(h.shape, generator=self.gen, dtype=h.dtype)
        return self.fc2(h) * (1.0 + 0.01 * self.py_rng.random())


def noisy_run(watch_options):
    torch.manual_seed(0)
    model = NoisyNet()
    np_rng = np.random.default_rng(3)

    def loss_fn(m, b):
        jitter = torch.as_tensor(np_rng.normal(0.0, 0.01, size=b[1].shape), dtype=b[1].dtype)
        return F.mse_loss(m(b[0]), b[1] + jitter)

    watch = GradWatch(model, loss_fn, **watch_options) if watch_options is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reports = []
    for _ in range(4):
        b = (torch.randn(6, 3), torch.randn(6, 1))
        opt.zero_grad()
        loss_fn(model, b).backward()
        if watch is not None:
            reports.append(watch.step(b))
        opt.step()
    state = [p.detach().clone() for p in model.parameters()]
    draws = (torch.rand(3, generator=model.gen), model.py_rng.random(), np_rng.normal())
    return state, draws, reports


@pytest.mark.parametrize("dtype,independence", [("float64", "off"), (None, "off"), ("float64", "batch")],
                         ids=["shadow", "in_place", "independence"])
def test_generators_held_by_model_and_loss_are_not_advanced(dtype, independence):
    plain, plain_draws, _ = noisy_run(None)
    watched, watched_draws, reports = noisy_run(dict(every=1, log_dir=None, coords=3, directions=1, dtype=dtype,
                                                     independence=independence))
    assert all(r is not None and r.ok and not r.nondeterministic for r in reports), [str(r) for r in reports]
    assert all((r.independence is not None) == (independence != "off") for r in reports)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))  # bit-identical training
    assert torch.equal(plain_draws[0], watched_draws[0])
    assert plain_draws[1:] == watched_draws[1:]


def test_check_numpy_leaves_a_generator_of_the_loss_where_it_was():
    from gradwatch import check_numpy

    rng = np.random.default_rng(5)
    w = {"w": np.array([1.0, -2.0, 0.5])}
    before = rng.bit_generator.state
    report = check_numpy(lambda: float((w["w"] ** 2).sum() + 1e-3 * rng.normal()), w, {"w": 2 * w["w"]})
    assert report.ok and not report.nondeterministic, str(report)
    assert rng.bit_generator.state == before


# ---------------------------------------------------------------- 2. hooks and Python side effects


class Counting(nn.Module):
    """Counts its forwards in a plain attribute (a step counter, a warm-up flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("dtype", ["float64", None], ids=["shadow", "in_place"])
def test_hooks_and_counters_of_the_live_model_do_not_run_in_checks(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(Counting(), nn.Linear(1, 1))
    recorded, globally = [], []
    model[0].lin.register_forward_hook(lambda m, args, out: recorded.append(out.shape))
    model[1].register_full_backward_hook(lambda m, gin, gout: recorded.append("backward"))
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: globally.append(type(m)))
    try:
        watch = GradWatch(model, mse, **dict(SMALL, dtype=dtype))
        with pytest.warns(UserWarning, match=r"did not run 3 hook\(s\)"):
            reports = train(model, watch, mse, [batch(), batch()])
        runs_per_step = len(globally) // 2
    finally:
        handle.remove()
    assert all(r is not None and r.ok for r in reports)
    assert model[0].calls == 2  # the training forwards only
    assert recorded.count("backward") == 2 and len(recorded) == 4  # one forward and one backward per step
    assert runs_per_step == 4  # Sequential, Counting, Linear, Linear: once per training forward
    note = reports[0].notes[-1]
    assert "forward hook <lambda> on 0.lin" in note and "backward hook <lambda> on 1" in note
    assert "every module (global)" in note and "move that into forward()" in note
    assert len(model[0].lin._forward_hooks) == 1 and len(model[1]._backward_hooks) == 1  # put back


def test_counters_in_torch_modules_with_a_forward_of_their_own_are_put_back():
    """Torch's own modules are skipped by the attribute guard (their forward changes no plain attribute);
    one whose forward was replaced on the instance is guarded like any other module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    inner = model[0]
    inner.calls = 0

    def counting_forward(self, x):
        self.calls += 1
        return nn.Linear.forward(self, x)

    inner.forward = types.MethodType(counting_forward, inner)  # deep copies bind it to the copy
    model[2].calls = 0  # torch's forward: the guard may skip it, and nothing changes it
    watch = GradWatch(model, mse, **SMALL)
    reports = train(model, watch, mse, [batch(), batch(), batch()])
    assert all(r is not None and r.ok for r in reports), [str(r) for r in reports]
    assert all(r.training for r in reports)  # the replay ran the model (and counted in forward) each step
    assert inner.calls == 3 and model[2].calls == 0  # the training forwards only


def test_torch_hooks_keep_running_in_checks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    prune.random_unstructured(model[0], "weight", amount=0.5)  # a forward pre-hook defined by torch
    report = check_model(model, mse, batch(), dtype=None)  # (a pruned model cannot be deep-copied)
    assert report.ok and not report.notes, str(report)
    assert "0.weight_orig" in report.tensors


class CheckpointedBlocks(nn.Module):
    """Two residual blocks, each under ``torch.utils.checkpoint`` in a plain loop; dropout as a module or, with
    ``functional``, also as ``F.dropout(..., training=self.training)`` inside the checkpoint."""

    def __init__(self, reentrant: bool, functional: bool = False) -> None:
        super().__init__()
        self.reentrant, self.functional, self.checkpointing = reentrant, functional, True
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc1": nn.Linear(8, 16), "fc2": nn.Linear(16, 8),
                                                   "drop": nn.Dropout(0.1)}) for _ in range(2))

    def _block(self, b: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(b["fc1"](x))
        if self.functional:
            h = F.dropout(h, p=0.1, training=self.training)
        return x + b["drop"](b["fc2"](h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            if self.checkpointing:
                h = checkpoint(lambda t, b=b: self._block(b, t), h, use_reentrant=self.reentrant)
            else:
                h = self._block(b, h)
        return self.out(h)


def _watch_checkpointed(model: nn.Module, watched: bool = True) -> Tuple[list, list]:
    def xent(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watch = GradWatch(model, xent, optimizer=opt, every=1, log_dir=None) if watched else None
        for _ in range(2):
            b = (torch.randn(16, 4), torch.randint(0, 3, (16,)))
            opt.zero_grad()
            xent(model, b).backward()
            if watch is not None:
                reports.append(watch.step(b))
            opt.step()
        if watch is not None:
            watch.close()
    return reports, watch.alerts if watch is not None else []


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("functional", [False, True])
def test_a_plain_loops_checkpoint_gets_both_verdicts_no_alert_and_training_bit_identical(reentrant, functional):
    """``torch.utils.checkpoint`` either way, dropout as modules and also ``F.dropout(..., training=self.training)``
    inside the checkpoint. The recomputation in backward runs without the check's dropout-off mode (torch runs it
    outside Python modes): the dropout functions are switched off for the backward's duration too. With
    ``use_reentrant=True`` the training part's replay takes its gradients through ``backward()``."""
    torch.manual_seed(0)
    model = CheckpointedBlocks(reentrant=reentrant, functional=functional)
    plain = copy.deepcopy(model)
    torch.manual_seed(1)
    reports, alerts = _watch_checkpointed(model)
    names = {n for n, _ in model.named_parameters()}
    assert alerts == [], [str(a.message)[:300] for a in alerts]
    for r in reports:
        assert {n for n, t in r.tensors.items() if t.verdict is not None} == names
        assert {n for n, t in r.training.items() if t.verdict is not None} == names
    torch.manual_seed(1)
    _watch_checkpointed(plain, watched=False)
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n


def test_not_yet_reentrant_checkpointing_with_a_post_accumulate_grad_hook_is_an_error_alert():
    """A hook that runs after a gradient is accumulated (an optimizer stepping in backward) would run in the
    replay's ``backward()``: the replay keeps ``autograd.grad``, which torch refuses (docs/guides/leaves-alone.md)."""
    torch.manual_seed(0)
    model = CheckpointedBlocks(reentrant=True)
    calls = []
    model.out.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    reports, alerts = _watch_checkpointed(model)
    assert reports == [None, None] and len(calls) == 2  # training's two backward passes only
    assert alerts
    assert alerts[0].kind == "error"
    assert "incompatible with .grad()" in str(alerts[0].message)


def test_a_model_that_starts_reentrant_checkpointing_later_is_judged_again_from_the_next_check():
    """The replay looks for reentrant checkpoints until it finds none, then stops looking (the walk costs a few
    percent of a small model's replay); a model that starts checkpointing later costs one check (an error alert
    naming torch's refusal), and the next check looks again and judges every tensor."""
    from gradwatch import GradWatch

    torch.manual_seed(0)
    model = CheckpointedBlocks(reentrant=True)
    model.checkpointing = False

    def xent(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = {n for n, _ in model.named_parameters()}
    judged = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GradWatch(model, xent, optimizer=opt, every=1, log_dir=None) as watch:
            for step in range(4):
                model.checkpointing = step >= 2
                b = (torch.randn(16, 4), torch.randint(0, 3, (16,)))
                opt.zero_grad()
                xent(model, b).backward()
                report = watch.step(b)
                judged.append(None if report is None else {n for n, t in report.training.items() if t.verdict is not None})
                opt.step()
    assert judged[0] == judged[1] == names and judged[2] is None and judged[3] == names, judged
    assert [a.step for a in watch.alerts if a.kind == "error"] == [2]
    assert "incompatible with .grad()" in str(watch.alerts[0].message)
