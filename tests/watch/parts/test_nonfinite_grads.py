"""A non-finite ``.grad`` is an alert of its own kind, whatever the replay says (issue 73).

A regression on log counts with a count of 0 in one micro-batch: ``log(0)`` makes that micro-batch's loss and the
step's ``.grad`` infinite. The replay reproduces the same bits, so every training verdict is EXCELLENT; the backward
part checks the last micro-batch, which is finite. Before, nothing was said; now one ``nonfinite`` alert of the
training part names the tensors, once for the episode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradwatch import GradWatch, Verdict
from gradwatch.watch.parts._nonfinite_grads import NonfiniteGrads

transformers = pytest.importorskip("transformers")


def tiny_regressor() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=1,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def loss_fn(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Mean squared error on log counts: a count of 0 is log(0)."""
    pred = model(input_ids=batch["input_ids"]).logits.squeeze(-1)
    return F.mse_loss(pred, torch.log(batch["count"]))


def micro_batch(g: torch.Generator, zero: bool) -> dict:
    count = torch.randint(1, 20, (4,), generator=g).float()
    if zero:
        count[2] = 0.0
    return {"input_ids": torch.randint(1, 40, (4, 8), generator=g), "count": count}


def test_an_infinite_grad_from_log_0_in_one_micro_batch_is_alerted_whatever_the_replay_says():
    model = tiny_regressor()
    watch = GradWatch(model, loss_fn, every=1, log_dir=None, form="objective", coords=2, directions=1)
    g = torch.Generator().manual_seed(1)
    reports = []
    for step in range(4):
        model.zero_grad()
        for k in range(2):
            batch = micro_batch(g, zero=step in (1, 2) and k == 0)  # steps 1 and 2: one episode
            loss = loss_fn(model, batch)
            (loss / 2).backward()
            watch.accumulate(batch, loss=loss)
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        assert finite == (step not in (1, 2))
        reports.append(watch.step())
    # the replay agrees with training's infinite .grad, bit for bit: the verdict cannot say it
    assert reports[1].training and all(t.verdict == Verdict.EXCELLENT for t in reports[1].training.values())
    alerts = [a for a in watch.alerts if a.kind == "nonfinite"]
    assert [(a.step, a.part, a.severity) for a in alerts] == [(1, "training", "error")], \
        [(a.step, a.kind, a.message) for a in watch.alerts]
    alert = alerts[0]
    assert alert.count > 1 and "classifier.weight" in alert.tensors
    headline, why, todo = alert.message.split("\n")
    assert len(headline) <= 120
    assert "NaN or inf" in headline
    assert "log of 0" in why
    assert todo.startswith("what to do")
    assert any("NaN or inf entries" in n for n in reports[2].notes) and not any("NaN or inf" in n for n in reports[3].notes)


def test_a_grad_scaler_overflow_is_a_note_not_an_alert():
    grads = NonfiniteGrads()
    assert grads.look({"w": torch.tensor([float("inf")])}, scaled=True) == ["w"]
    assert grads.alerts(0) == [] and "GradScaler" in (grads.note() or "")


def test_a_float16_autocast_step_that_overflows_is_a_note_not_an_alert():
    """A float16 autocast step with an inf .grad: the GradScaler running it (a Trainer's, not handed to the watch)
    skips that step and lowers its scale; said in the record, no alert."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)

    def loss_fn(m: torch.nn.Module, batch: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return F.mse_loss(m(batch["x"]).squeeze(-1).float(), torch.log(batch["count"]))

    watch = GradWatch(model, loss_fn, every=1, log_dir=None, form="objective", coords=2, directions=1)
    batch = {"x": torch.rand(4, 4), "count": torch.tensor([1.0, 0.0, 2.0, 3.0])}
    loss_fn(model, batch).backward()
    assert not torch.isfinite(model.weight.grad).all()
    report = watch.step(batch)
    assert any("GradScaler" in n for n in report.notes), report.notes
    assert not [a for a in watch.alerts if a.kind == "nonfinite" and a.part == "training"], watch.alerts
