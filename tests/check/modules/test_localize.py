"""Module-local checks name the broken module (and custom autograd.Function); correct twins pass."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import check_model
from gradwatch.check.modules.localize import ModuleCheck, check_module, localize
from gradwatch.options import CheckOptions

FACTOR = 1.27


class BuggySigmoidFunction(torch.autograd.Function):
    """Sigmoid whose backward is FACTOR times too large."""

    @staticmethod
    def forward(ctx, x):
        y = torch.sigmoid(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y * (1 - y) * FACTOR


class SigmoidFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.sigmoid(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y * (1 - y)


class BuggySigmoid(nn.Module):
    def forward(self, x):
        return BuggySigmoidFunction.apply(x)


class Sigmoid(nn.Module):
    def forward(self, x):
        return SigmoidFunction.apply(x)


class Encoder(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc = nn.Linear(6, 12)
        self.act = act
        self.norm = nn.LayerNorm(12)

    def forward(self, x):
        return self.norm(self.act(self.fc(x)))


class Net(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.encoder = Encoder(act)
        self.head = nn.Sequential(nn.Linear(12, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))

    def forward(self, x):
        return self.head(self.encoder(x))


def ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def data(n=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def twins():
    torch.manual_seed(0)
    buggy = Net(BuggySigmoid())
    correct = Net(Sigmoid())
    correct.load_state_dict(buggy.state_dict())
    return buggy, correct


def test_check_model_localize_names_the_module_its_type_and_the_function():
    buggy, _ = twins()
    report = check_model(buggy, ce, data(), localize=True)
    assert not report.ok
    failed = [c for c in report.localized if c.failed]
    assert [c.name for c in failed] == ["encoder.act"]
    act = failed[0]
    assert act.type == "BuggySigmoid" and act.functions == ["BuggySigmoidFunction"]
    assert act.failures == ["input"]
    line = act.summary()
    assert line.startswith("`encoder.act` (BuggySigmoid, autograd.Function BuggySigmoidFunction): input gradient wrong")
    assert f"analytic {FACTOR:.2f}x numeric" in line
    text = str(report)
    assert "localized: `encoder.act` (BuggySigmoid" in text and f"{FACTOR:.2f}x" in text
    assert "encoder.act" in report.failure_message()
    d = json.loads(json.dumps(report.to_dict()))
    assert [x["name"] for x in d["localized"] if x["failed"]] == ["encoder.act"]


def test_the_correct_twin_raises_nothing_and_localize_flags_no_module():
    _, correct = twins()
    report = check_model(correct, ce, data(), localize=True)
    assert report.ok and report.localized == []
    checks = localize(correct, ce, data())
    assert checks and not any(c.failed for c in checks)
    names = [c.name for c in checks]
    assert names == ["encoder.fc", "encoder.act", "encoder.norm", "head.0", "head.1", "head.2"]
    assert all(c.evaluations > 0 for c in checks if c.tensors)


def test_localize_alone_checks_parameters_and_inputs_of_each_leaf():
    buggy, _ = twins()
    checks = {c.name: c for c in localize(buggy, ce, data())}
    assert set(checks["encoder.fc"].tensors) == {"input", "weight", "bias"}
    assert set(checks["encoder.act"].tensors) == {"input"}
    assert not checks["encoder.fc"].failed and not checks["head.0"].failed
    assert checks["encoder.act"].failed
    assert all(isinstance(c, ModuleCheck) for c in checks.values())


class DoubledWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, 2.0 * (g * x).sum(0)


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return DoubledWeightGrad.apply(x, self.weight)


def test_a_parameter_gradient_bug_is_named_with_the_parameter_and_the_factor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), Scale(5), nn.Linear(5, 3))
    report = check_model(model, ce, data(), localize=True)
    assert [t.name for t in report.failures] == ["2.weight"]
    bad = [c for c in report.localized if c.failed]
    assert [c.name for c in bad] == ["2"] and bad[0].failures == ["weight"]
    assert "gradient of weight wrong, analytic 2.00x numeric" in bad[0].summary()


class OwnCode(nn.Module):
    """The bug sits in this module's own forward, outside any leaf module."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(BuggySigmoidFunction.apply(self.fc(x)))


def test_a_bug_outside_every_leaf_is_named_at_the_innermost_enclosing_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), OwnCode())
    report = check_model(model, ce, data(), localize=True)
    assert not report.ok
    bad = [c for c in report.localized if c.failed]
    assert [c.name for c in bad] == ["1"]
    assert bad[0].type == "OwnCode" and "BuggySigmoidFunction" in bad[0].functions
    assert not any(c.failed for c in report.localized if c.name in ("0", "1.fc", "1.out"))


def test_localize_leaves_model_buffers_grads_and_rng_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), BuggySigmoid(), nn.Linear(8, 3)).train()
    loss = ce(model, data())
    loss.backward()
    state = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    rng = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    for dtype in ("float64", None):
        checks = localize(model, ce, data(), dtype=dtype)
        assert [c.name for c in checks if c.failed] == ["3"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert torch.equal(torch.get_rng_state(), rng[0]) and np.array_equal(np.random.get_state()[1], rng[1])
    assert random.getstate() == rng[2]
    assert model[2].training and model.training


def test_modules_can_be_chosen_by_name_glob_or_object():
    buggy, _ = twins()
    assert [c.name for c in localize(buggy, ce, data(), modules=["encoder.act"])] == ["encoder.act"]
    assert [c.name for c in localize(buggy, ce, data(), modules=["head.*"])] == ["head.0", "head.1", "head.2"]
    assert [c.name for c in localize(buggy, ce, data(), modules=[buggy.encoder.fc])] == ["encoder.fc"]
    with pytest.raises(ValueError, match="matches no submodule"):
        localize(buggy, ce, data(), modules=["decoder"])


def test_modules_with_tuple_outputs_and_several_inputs_do_not_false_alarm():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(4, 6, batch_first=True)
            self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            h, _ = self.rnn(x)
            a, _ = self.attn(h, h, h, need_weights=False)
            return self.head(a.mean(1))

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(3, 5, 4, generator=g), torch.randint(0, 3, (3,), generator=g))
    checks = {c.name: c for c in localize(Net(), ce, batch)}
    assert not any(c.failed for c in checks.values()), [c.summary() for c in checks.values()]
    assert {"input[0]", "input[1]", "input[2]"} <= set(checks["attn"].tensors)


def test_check_module_can_be_called_directly():
    torch.manual_seed(0)
    act = BuggySigmoid().double()
    res = check_module("act", act, (torch.randn(4, 3, dtype=torch.float64),), {}, CheckOptions())
    assert res.failed and res.failures == ["input"]
    assert res.to_dict()["summary"] == res.summary()


class PaddedBag(nn.Module):
    """An Embedding with padding_idx whose padding row is not zero (loaded weights, or it drifted)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=0)
        with torch.no_grad():
            self.emb.weight[0].normal_()  # the forward reads this row; torch gives it a zero gradient by design
        self.fc = nn.Linear(6, 3)

    def forward(self, ids):
        return self.fc(self.emb(ids).mean(1))


def padded_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (8, 5), generator=g)
    ids[:, 0] = 0
    return ids, torch.randint(0, 3, (8,), generator=g)


@pytest.mark.parametrize("dtype", ["float64", None])
def test_an_embedding_padding_row_is_held_constant_not_judged_wrong(dtype):
    torch.manual_seed(0)
    model = PaddedBag()
    before = model.emb.weight.detach().clone()
    report = check_model(model, ce, padded_batch(), localize=True, dtype=dtype, coords=12, directions=4)
    assert report.ok, str(report)
    assert report.tensors["emb.weight"].verdict is not None and not report.tensors["emb.weight"].failed
    assert any("emb.weight row 0 (padding_idx)" in n for n in report.notes)
    assert not any(c.failed for c in localize(model, ce, padded_batch(), dtype=dtype))
    assert "forward" not in vars(model.emb) and torch.equal(model.emb.weight, before)


def test_a_wrong_embedding_gradient_outside_the_padding_row_is_still_caught():
    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    class Net(PaddedBag):
        def forward(self, ids):
            return self.fc(Doubled.apply(self.emb(ids)).mean(1))

    torch.manual_seed(0)
    report = check_model(Net(), ce, padded_batch(), coords=12, directions=4)
    assert report.tensors["emb.weight"].failed
    assert "2.00x" in report.tensors["emb.weight"].diagnosis


class Float32Norm(nn.Module):
    """A correct RMSNorm that computes its variance in float32 (a float32 island in the float64 shadow)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(d))

    def forward(self, x):
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + 1e-6)).to(x.dtype)


class SoftmaxMissingTerm(torch.autograd.Function):
    """Softmax whose backward lacks ``- sum(y * g)``: a bug in the attention module's own code."""

    @staticmethod
    def forward(ctx, x):
        y = x.softmax(-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return y * g


class Attention(nn.Module):
    def __init__(self, d, buggy):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.buggy = buggy

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / x.shape[-1] ** 0.5
        weights = SoftmaxMissingTerm.apply(scores) if self.buggy else scores.softmax(-1)
        return self.o(weights @ self.v(x))


class Block(nn.Module):
    def __init__(self, d, buggy, norm):
        super().__init__()
        self.norm = norm(d)
        self.attn = Attention(d, buggy)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Stack(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.blocks = nn.Sequential(Block(8, False, norm), Block(8, True, norm))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.blocks(x).mean(1))


def seq_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 5, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def test_a_falsely_failing_leaf_does_not_hide_the_attention_layer_whose_own_code_is_wrong():
    # The float32-island norms fail alone in the float64 shadow (or come out inconclusive, once the
    # check measures precision): either way localization goes on and names the attention module.
    torch.manual_seed(0)
    model = Stack(Float32Norm)
    report = check_model(model, ce, seq_batch(), localize=True, coords=4, directions=2)
    assert not report.ok
    checked = {c.name: c for c in report.localized}
    assert checked["blocks.1.attn"].failed and checked["blocks.1.attn"].type == "Attention"
    assert "SoftmaxMissingTerm" in checked["blocks.1.attn"].functions
    assert not checked["blocks.0.attn"].failed
    for leaf in ("q", "k", "v", "o"):
        assert not checked[f"blocks.1.attn.{leaf}"].failed
    assert "localized: `blocks.1.attn` (Attention, autograd.Function SoftmaxMissingTerm)" in str(report)


class NeedsItsLayer(nn.Module):
    """Correct, but reads a value its enclosing layer hands over for one call: it cannot be replayed alone."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.scale = None

    def forward(self, x):
        scale, self.scale = self.scale, None
        return self.lin(x) * scale


class HandOff(nn.Module):
    def __init__(self, d, buggy):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.inner = NeedsItsLayer(d)
        self.attn = Attention(d, buggy)

    def forward(self, x):
        self.inner.scale = 0.5
        return self.attn(self.inner(self.norm(x)))


def test_an_inconclusive_leaf_does_not_stop_localization_and_the_enclosing_layer_is_named():
    torch.manual_seed(0)
    model = nn.Sequential(HandOff(8, buggy=True), nn.Flatten(), nn.Linear(40, 3))
    report = check_model(model, ce, seq_batch(), localize=True, coords=4, directions=2)
    assert not report.ok
    checked = {c.name: c for c in report.localized}
    assert checked["0.inner"].inconclusive and not checked["0.inner"].failed
    assert [c.name for c in report.localized if c.failed] == ["0.attn"]


def test_a_constant_ratio_is_a_typed_field_of_the_tensor_check():
    buggy, _ = twins()
    act = [c for c in localize(buggy, ce, data()) if c.failed][0]
    assert act.tensors["input"].ratio == pytest.approx(FACTOR, rel=1e-3)
    assert act.to_dict()["tensors"]["input"]["ratio"] == pytest.approx(FACTOR, rel=1e-3)
    report = check_model(buggy, ce, data())
    assert all(t.ratio is None for t in report.tensors.values() if not t.failed)


def test_bert_with_padding_tokens_checks_clean_and_its_padding_row_is_named_as_held():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=24, max_position_embeddings=16, num_labels=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30, (3, 8), generator=g)
    ids[:, -2:] = 0  # padding tokens, attended to (no attention mask)
    labels = torch.randint(0, 2, (3,), generator=g)

    def loss(m, b):
        return F.cross_entropy(m(input_ids=b[0]).logits, b[1])

    report = check_model(model, loss, (ids, labels), tensors=["*word_embeddings*"], coords=8, directions=4)
    assert report.ok, str(report)
    assert any("bert.embeddings.word_embeddings.weight row 0 (padding_idx)" in n for n in report.notes)


def test_an_embedding_bag_skips_its_padding_entries_and_needs_no_held_row():
    class Bag(PaddedBag):
        def __init__(self):
            super().__init__()
            self.emb = nn.EmbeddingBag(10, 6, mode="mean", padding_idx=0)
            with torch.no_grad():
                self.emb.weight[0].normal_()

        def forward(self, ids):
            return self.fc(self.emb(ids))

    torch.manual_seed(0)
    report = check_model(Bag(), ce, padded_batch(), coords=12, directions=4)
    assert report.ok and not any("padding_idx" in n for n in report.notes)


@pytest.mark.parametrize("vocab", [10, 600])  # checked whole; in blocks of rows (the block with row 0 renumbered)
def test_the_module_form_holds_an_embedding_padding_row_constant_too(vocab):
    """The module form checks an Embedding alone on a random cotangent that reaches the padding positions too (the
    loss would mask them): its padding row is held constant there as in the whole objective, not judged WRONG (TRL's
    SFT on a Llama with pad_token_id, checked in modules: analytic -0.20 against numeric -0.71 before)."""
    from gradwatch import GradWatch

    torch.manual_seed(0)
    model = PaddedBag()
    model.emb = nn.Embedding(vocab, 6, padding_idx=0)
    with torch.no_grad():
        model.emb.weight[0].normal_()
    ids, y = padded_batch()
    ids = ids * (vocab // 10)  # ids spread over the whole vocabulary, row 0 at the first position of every sample
    with GradWatch(model, ce, every=1, log_dir=None, form="module") as watch:
        for _ in range(watch.cycle_length or 3):
            model.zero_grad()
            ce(model, (ids, y)).backward()
            watch.step((ids, y))
    assert watch.alerts == [], [a.message for a in watch.alerts]
    assert watch.coverage["emb.weight"]["backward"] > 0
