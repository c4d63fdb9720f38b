"""Failures inside gradwatch's own default objective say what of the model or batch caused them (issue 73).

Under the Hugging Face Trainer the user wrote no ``loss_fn``: the callback's default objective is the model's loss (or
the Trainer's ``compute_loss``). Before, a failure there said "the gradient check raised ValueError: ... (in loss_fn)
... make loss_fn work on the watched batch". The Trainer's label smoothing takes the labels out of the model's inputs:
the model returned no loss and no check ran at all. Now that Trainer is checked on its own ``compute_loss``, and a
forward that fails in the check's float64 copy is said in the model's and the batch's terms, naming no internal class.
"""

from __future__ import annotations

import re

import pytest
import torch

from gradwatch.errors import ObjectiveError

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

from gradwatch.integrations.transformers import GradWatchCallback  # noqa: E402
from gradwatch.io.sinks import read_jsonl  # noqa: E402

#: Class names a message a person reads must not show: Python's exceptions and gradwatch's own classes.
INTERNAL = re.compile(r"\b\w*(Error|Exception)\b|\bStub\b|ModuleView|TrainerLoss|ComputeLoss|ObjectiveError")


class Ids(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 50, (n, seq), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


class FloatOnly(BertForSequenceClassification):
    """A model with a kernel of its own that runs in float32 only (as fused attention kernels do)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if self.classifier.weight.dtype == torch.float64:
            raise RuntimeError("fused_softmax: expected scalar type Float but found Double")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)


def bert(cls=BertForSequenceClassification):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=16, num_labels=2)
    model = cls(config)
    model.accepts_loss_kwargs = False
    return model


def train(tmp_path, model, callback, **kwargs):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, use_cpu=True, disable_tqdm=True, seed=0, report_to=[],
                             save_strategy="no", **kwargs)
    Trainer(model=model, args=args, train_dataset=Ids(), callbacks=[callback]).train()


@pytest.mark.slow
def test_a_trainer_with_label_smoothing_is_checked_on_its_own_loss(tmp_path):
    callback = GradWatchCallback(every=2, log_dir=str(tmp_path / "watch"), form="objective", coords=2, directions=1)
    train(tmp_path, bert(), callback, label_smoothing_factor=0.1)
    assert callback.watch.alerts == [], [a.message for a in callback.watch.alerts]  # was: an error at every check
    checks = [r for r in read_jsonl(tmp_path / "watch")[0] if r["type"] == "check"]
    assert len(checks) == 2 and all(c["tensors"] and c["training"] for c in checks)
    assert all(t["verdict"] == "excellent" for c in checks for t in c["training"].values())


@pytest.mark.slow
def test_a_forward_that_fails_in_the_checks_copy_is_said_in_the_models_terms(tmp_path):
    callback = GradWatchCallback(every=2, log_dir=None, form="objective", coords=2, directions=1)
    train(tmp_path, bert(FloatOnly), callback)
    (alert,) = [a for a in callback.watch.alerts if a.kind == "error"]
    headline, why, todo = alert.message.split("\n")
    assert "FloatOnly's forward failed on the watched batch" in headline and len(headline) <= 120
    assert "float64 copy" in why
    assert "input_ids" in why
    assert "expected scalar type Float" in why
    assert "dtype=None" in todo and "loss_fn=" in todo
    assert "make loss_fn work" not in alert.message and not INTERNAL.search(alert.message), alert.message


def test_a_model_that_returns_no_loss_says_the_batch_has_no_labels():
    from gradwatch.integrations.transformers import model_loss

    model = bert()
    with pytest.raises(ObjectiveError) as caught:
        model_loss(model, {"input_ids": torch.ones(2, 4, dtype=torch.long)})
    err = caught.value
    assert "returned no loss" in err.what and "the batch has no labels (keys: input_ids)" in err.why
    assert not INTERNAL.search(str(err))


def test_a_training_step_that_returns_no_loss_is_said_so():
    pl = pytest.importorskip("lightning.pytorch")
    from gradwatch.integrations.lightning import training_step_loss

    class Skips(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return None if batch.sum() < 0 else self.lin(batch).sum()

    with pytest.raises(ObjectiveError) as caught:
        training_step_loss(Skips(), -torch.ones(2, 2))
    assert "training_step returned no loss" in caught.value.what and "None" in caught.value.why
    assert not INTERNAL.search(str(caught.value))
