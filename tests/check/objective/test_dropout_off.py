"""Dropout of every form is off during the backward check, and the report counts what was switched off.

A hand-written model applies dropout as a module, with ``F.dropout``, ``torch.dropout``,
``F.dropout2d``, inside ``scaled_dot_product_attention(dropout_p=...)`` and in
``nn.MultiheadAttention``, and has a layerdrop; a tiny random Bert uses SDPA attention with
dropout. The check objective must equal the model's loss with dropout off (eval mode), the record
must count each form, training stays bit-identical with the watch, and the training part's replay
keeps dropout on (its verdict is EXCELLENT, not a mismatch).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch, Verdict, check_model
from gradwatch.check.objective.functional_dropout import DropoutRecord, FunctionalDropoutOff


class Functional(nn.Module):
    """Every dropout form; ``layerdrop`` skips ``extra`` when ``torch.rand([])`` falls under it."""

    def __init__(self, layerdrop: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.3)
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.2, batch_first=True)
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, 6)
        h = F.dropout(torch.tanh(self.inp(x)), p=0.25, training=self.training)
        h = torch.dropout(h, 0.1, self.training)
        b, s, d = h.shape
        q = h.view(b, s, 2, d // 2).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.4 if self.training else 0.0)
        h = h + a.transpose(1, 2).reshape(b, s, d)
        h = F.dropout2d(h.unsqueeze(-1), 0.2, self.training).squeeze(-1)
        h = self.drop(h)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        if not (self.training and torch.rand([]) < self.layerdrop):
            h = h + torch.tanh(self.extra(h))
        return self.head(h.mean(1))


def ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def data(steps: int = 1, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 5, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(steps)]


def eval_loss(model, batch) -> float:
    """The loss with every dropout off, in float64 (what the check objective must be)."""
    ref = Functional().double()
    ref.load_state_dict(model.state_dict())
    ref.eval()
    with torch.no_grad():
        return float(ce(ref, (batch[0].double(), batch[1])))


def test_the_report_counts_every_dropout_form_switched_off_and_the_objective_has_none():
    torch.manual_seed(0)
    model = Functional().train()
    (batch,) = data()
    report = check_model(model, ce, batch, coords=2, directions=1)
    assert report.ok, str(report)
    rec = report.dropout
    assert isinstance(rec, DropoutRecord)
    assert rec.modules == 1 and rec.probabilities == 1
    assert rec.functional == {"F.dropout": 1, "torch.dropout": 1, "scaled_dot_product_attention(dropout_p)": 1,
                              "F.dropout2d": 1}
    assert rec.stays_on == [] and rec.random_draws == {"torch.rand": 1}
    assert report.objective == pytest.approx(eval_loss(model, batch), rel=1e-12, abs=0)
    assert report.to_dict()["dropout"]["functional"]["F.dropout"] == 1
    assert "4 functional dropout calls" in str(report)
    # nothing of the model changed: flags and probabilities are back
    assert model.drop.training
    assert model.mha.dropout == 0.2
    assert model.training


def test_layerdrop_is_reported_as_staying_on_reseeded():
    torch.manual_seed(0)
    model = Functional(layerdrop=0.5).train()
    report = check_model(model, ce, data()[0], coords=2, directions=1)
    assert not report.nondeterministic and report.ok, str(report)
    assert report.dropout.stays_on == ["layerdrop 0.5 in `Functional`"]
    assert "stays on, reseeded" in str(report) and "layerdrop 0.5" in str(report)


def test_an_eval_mode_model_reports_nothing_switched_off():
    torch.manual_seed(0)
    model = Functional().eval()
    report = check_model(model, ce, data()[0], coords=2, directions=1)
    assert report.dropout.modules == 0 and report.dropout.functional == {}
    assert "dropout off" not in str(report)


def test_the_interception_is_per_thread_and_ends_with_the_check():
    x = torch.ones(1000)
    other = {}

    def in_another_thread():
        other["y"] = F.dropout(x, 0.5, training=True)

    record = DropoutRecord()
    with FunctionalDropoutOff(record):
        t = threading.Thread(target=in_another_thread)
        t.start()
        t.join()
        assert torch.equal(F.dropout(x, 0.5, training=True), x)
    assert (other["y"] == 0).any()  # the other thread's dropout stayed on
    assert (F.dropout(x, 0.5, training=True) == 0).any()  # and this thread's is back on
    assert record.functional == {"F.dropout": 1}


def test_training_with_functional_dropout_is_bit_identical_and_the_replay_keeps_dropout_on():
    def run(watched: bool):
        torch.manual_seed(0)
        model = Functional().train()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        watch = GradWatch(model, ce, every=1, tensorboard=False, jsonl=False, coords=2, directions=1) if watched else None
        reports = []
        for batch in data(3):
            opt.zero_grad()
            ce(model, batch).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            if watch is not None:
                reports.append(watch.step(batch))
                assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
            opt.step()
        return [p.detach().clone() for p in model.parameters()], torch.rand(3), reports

    plain, rng_plain, _ = run(False)
    watched, rng_watched, reports = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    assert torch.equal(rng_plain, rng_watched)
    assert all(r is not None and r.ok and r.training for r in reports)
    assert all(t.verdict is Verdict.EXCELLENT for r in reports for t in r.training.values())
    assert all(r.dropout.functional_calls == 4 for r in reports)


def test_bert_with_sdpa_attention_dropout_checks_with_every_dropout_off():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=24, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.3)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).train()
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(1, 40, (3, 6), generator=g), torch.randint(0, 3, (3,), generator=g))

    def loss(m, b):
        return F.cross_entropy(m(input_ids=b[0]).logits, b[1])

    report = check_model(model, loss, batch, coords=1, directions=1, tensors=["classifier.*", "*layer.1.output.dense.*"])
    assert report.ok, str(report)
    rec = report.dropout
    dropout_modules = sum(1 for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0)
    assert rec.modules == dropout_modules > 0
    assert rec.functional == {"scaled_dot_product_attention(dropout_p)": cfg.num_hidden_layers}
    ref = transformers.BertForSequenceClassification(cfg).double().eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert report.objective == pytest.approx(float(loss(ref, batch)), rel=1e-12, abs=0)
    assert model.training and all(m.training for m in model.modules())


FUNCTIONAL = [
    ("F.dropout", lambda x: F.dropout(x, 0.5, training=True)),
    ("F.dropout1d", lambda x: F.dropout1d(x, 0.5, training=True)),
    ("F.dropout2d", lambda x: F.dropout2d(x.unsqueeze(-1), 0.5, True).squeeze(-1)),
    ("F.dropout3d", lambda x: F.dropout3d(x.unsqueeze(-1).unsqueeze(-1), p=0.5).squeeze(-1).squeeze(-1)),
    ("F.alpha_dropout", lambda x: F.alpha_dropout(x, 0.5, training=True)),
    ("F.feature_alpha_dropout", lambda x: F.feature_alpha_dropout(x, 0.5, True)),
    ("torch.dropout", lambda x: torch.dropout(x, 0.5, True)),
    ("torch.dropout_", lambda x: torch.dropout_(x.clone(), 0.5, train=True)),
    ("torch.alpha_dropout", lambda x: torch.alpha_dropout(x, 0.5, True)),
    ("torch.feature_dropout", lambda x: torch.feature_dropout(x, 0.5, True)),
    ("torch.feature_alpha_dropout", lambda x: torch.feature_alpha_dropout(x, 0.5, True)),
    ("torch.native_dropout", lambda x: torch.native_dropout(x, 0.5, True)[0]),
    ("scaled_dot_product_attention(dropout_p)",
     lambda x: F.scaled_dot_product_attention(x, x, x, None, 0.5) - F.scaled_dot_product_attention(x, x, x) + x),
]


@pytest.mark.parametrize("label,fn", FUNCTIONAL, ids=[f[0] for f in FUNCTIONAL])
def test_each_functional_dropout_form_is_switched_off_and_counted(label, fn):
    x = torch.randn(4, 6, 8, dtype=torch.float64)
    assert not torch.equal(fn(x), x)  # on outside a check
    record = DropoutRecord()
    with FunctionalDropoutOff(record):
        assert torch.equal(fn(x), x)
    assert record.functional == {label: 1}


def test_multi_head_attention_forward_called_functionally_has_its_dropout_off():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, dropout=0.5)
    x = torch.randn(5, 3, 8)

    def call(training):
        return F.multi_head_attention_forward(
            x, x, x, 8, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.5,
            mha.out_proj.weight, mha.out_proj.bias, training=training, need_weights=False)[0]

    reference = call(False)
    record = DropoutRecord()
    with FunctionalDropoutOff(record):
        assert torch.equal(call(True), reference)
    assert record.functional == {"F.multi_head_attention_forward(dropout_p)": 1}


def test_the_interception_ends_after_the_first_forward_when_nothing_functional_drops():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()  # its F.dropout call runs with training off
    record = DropoutRecord()
    mode = FunctionalDropoutOff(record)
    with mode:
        model[1].eval()
        model(torch.randn(2, 4))
        record.settle()
        assert not mode.active
        assert (F.dropout(torch.ones(1000), 0.5, training=True) == 0).any()
    record = DropoutRecord()
    mode = FunctionalDropoutOff(record)
    with mode:
        F.dropout(torch.ones(3), 0.5, training=True)
        record.settle()
        assert mode.active and torch.equal(F.dropout(torch.ones(3), 0.5, training=True), torch.ones(3))
    assert record.functional == {"F.dropout": 1}  # counted in the first forward only


def test_a_speech_model_with_layerdrop_in_its_config_reports_it_as_staying_on():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Wav2Vec2Config(
        vocab_size=10, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        conv_dim=(8, 8), conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, layerdrop=0.5, num_labels=2, hidden_dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1, feat_proj_dropout=0.1, mask_time_prob=0.0, classifier_proj_size=8)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForSequenceClassification(cfg).train()
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, 400, generator=g), torch.tensor([0, 1]))

    def loss(m, b):
        return F.cross_entropy(m(input_values=b[0]).logits, b[1])

    report = check_model(model, loss, batch, coords=1, directions=1, tensors=["classifier.*"])
    assert report.ok and not report.nondeterministic, str(report)
    rec = report.dropout
    assert rec.stays_on == ["layerdrop 0.5 (config.layerdrop of `Wav2Vec2ForSequenceClassification`)"]
    assert rec.random_draws == {"torch.rand": cfg.num_hidden_layers}  # one layerdrop draw per layer, reseeded
    assert rec.modules > 0
