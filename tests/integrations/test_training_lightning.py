"""The training part under a real Lightning ``Trainer``: dropout, gradient accumulation, AMP, a planted slip."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402

from gradwatch import Verdict  # noqa: E402
from gradwatch.integrations.lightning import GradWatchCallback  # noqa: E402


class Net(pl.LightningModule):
    """Dropout, and a training_step that calls submodules (never ``self(x)``), as many modules do."""

    def __init__(self, slip: float = 1.0) -> None:
        super().__init__()
        self.slip = slip
        self.fc1, self.drop, self.fc2 = nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.fc2(self.drop(torch.tanh(self.fc1(x)))), y)
        self.log("train_loss", loss)
        return loss

    def on_after_backward(self):
        if self.slip != 1.0:
            self.fc2.weight.grad.mul_(self.slip)  # a slip on one gradient, after backward

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader():
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(96, 4, generator=g), torch.randint(0, 3, (96,), generator=g))
    return DataLoader(ds, batch_size=8)


def fit(module, tmp_path, **trainer_kw):
    cb = GradWatchCallback(every=2, coords=2, directions=1)
    trainer = pl.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[cb], **trainer_kw)
    trainer.fit(module, loader())
    return cb, None


def training_records(cb):
    return cb.watch.tracker.training_history


@pytest.mark.parametrize("accumulate", [1, 3])
def test_lightning_dropout_and_accumulation_agree(tmp_path, accumulate):
    torch.manual_seed(0)
    cb, _ = fit(Net(), tmp_path, accumulate_grad_batches=accumulate)
    history = training_records(cb)
    assert set(history) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert all(len(h) == 3 for h in history.values())  # steps 0, 2, 4
    assert all(r["verdict"] == "excellent" for h in history.values() for r in h)
    assert cb.watch.alerts == []


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_slip_after_backward_is_caught(tmp_path, accumulate):
    torch.manual_seed(0)
    cb, _ = fit(Net(slip=2.0), tmp_path, accumulate_grad_batches=accumulate)
    alerts = [a for a in cb.watch.alerts if a.part == "training"]
    assert [a.tensor for a in alerts] == ["fc2.weight"]
    if accumulate == 1:  # under accumulation the slip compounds per micro-batch: no longer one constant factor
        assert "2.00x the objective's" in alerts[0].message
    assert all(r["verdict"] == "excellent" for r in training_records(cb)["fc1.weight"])


def test_lightning_bf16_mixed_precision_agrees(tmp_path):
    torch.manual_seed(0)
    cb, _ = fit(Net(), tmp_path, precision="bf16-mixed")
    history = training_records(cb)
    assert all(len(h) == 3 and all(r["verdict"] == Verdict.EXCELLENT.value for r in h) for h in history.values())
    assert cb.watch.alerts == []


def test_lightning_16_mixed_unscales_before_the_check_and_its_scaler_is_replayed(tmp_path):
    """Lightning's "16-mixed" scales the loss with a GradScaler and unscales before on_before_optimizer_step."""
    from lightning.pytorch.plugins import MixedPrecision

    torch.manual_seed(0)
    # Trainer(precision="16-mixed") falls back to bf16 on CPU; the plugin itself runs float16 autocast and a GradScaler.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    cb, _ = fit(Net(), tmp_path, plugins=[plugin])
    assert cb.watch.grad_scaler is not None and cb.watch.grad_scaler.get_scale() > 1  # the loss really was scaled
    history = training_records(cb)
    assert all(len(h) == 3 and all(r["verdict"] == "excellent" and r["rel_diff"] == 0.0 for r in h)
               for h in history.values())  # .grad was unscaled, and the replay gave the same bits
    assert cb.watch.alerts == []


class TokenNet(pl.LightningModule):
    """A token-mean training_step on padded rows of unequal lengths: Lightning divides it by accumulate_grad_batches."""

    def __init__(self) -> None:
        super().__init__()
        from token_batches import TinyLM

        self.lm = TinyLM()

    def training_step(self, batch, batch_idx):
        from token_batches import token_loss

        return token_loss(self.lm, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("even", [False, True])
def test_lightning_accumulation_of_token_means_is_named(tmp_path, even):
    """accumulate_grad_batches=3 on micro-batches of unequal token counts: each micro-batch's mean weighs 1/3, the
    2024 bug, named at the first check; with every row the same length, the same loop is right (no alert)."""
    from token_batches import Rows, collate

    rows = Rows(n=36, longest=3 if even else 24)  # longest=3 with rows of 3 tokens: every micro-batch alike
    cb = GradWatchCallback(every=1, coords=2, directions=1, tensorboard=False)
    trainer = pl.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[cb],
                         accumulate_grad_batches=3)
    trainer.fit(TokenNet(), DataLoader(rows, batch_size=2, collate_fn=collate))
    training = [a for a in cb.watch.alerts if a.part == "training"]
    if even:
        assert cb.watch.alerts == [] and cb.watch.check_counts
        return
    assert training and all(a.step == 0 for a in training)
    assert "training weighs the 3 micro-batches equally, but they hold" in training[0].message
