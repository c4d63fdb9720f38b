"""GradWatch in a PyTorch Lightning fit: ``GradWatchCallback`` and a ``TensorBoardLogger``.

A small LightningModule (with ``self.log`` calls in ``training_step``, as real
modules have) is trained for a few dozen optimizer steps on synthetic data,
with gradient accumulation. ``GradWatchCallback(every=5)`` checks the
gradients of the loss ``training_step`` returns (``self.log`` is silenced
during checks) at global steps 0, 5, 10, ... and writes through the logger's
own ``SummaryWriter``: the ``gradwatch/...`` scalars land in the same event
file as ``train_loss``, and ``checks.jsonl`` next to it in ``logger.log_dir``.

The activation is a custom ``autograd.Function`` (SiLU). With ``--buggy`` its
backward forgets a term for inputs beyond |x| = 3, and the first layer's
weights are scaled up halfway through, as weights grow during training: the
callback then reports alerts on the first layer. Without it: no alerts.

    python examples/lightning_module.py [--buggy] [--steps 40] [--every 5] [--logdir DIR]

Then ``tensorboard --logdir DIR`` shows the ``gradwatch`` charts (and the
custom-scalars layout) beside the training loss.
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradwatch.integrations.lightning import GradWatchCallback


class SiLU(torch.autograd.Function):
    """``x * sigmoid(x)``; with ``buggy`` the backward drops ``x s (1 - s)`` where ``|x| >= 3``."""

    @staticmethod
    def forward(ctx, x, buggy):
        ctx.save_for_backward(x)
        ctx.buggy = buggy
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        d = s + x * s * (1 - s)
        if ctx.buggy:
            d = torch.where(x.abs() < 3, d, s)
        return grad * d, None


class Classifier(pl.LightningModule):
    def __init__(self, buggy: bool = False, grow_at: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(self.drop(SiLU.apply(self.fc1(x), self.hparams.buggy)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step == self.hparams.grow_at and (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            with torch.no_grad():
                self.fc1.weight.mul_(6.0)  # weights grow: activation inputs cross |x| = 3

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buggy", action="store_true", help="use the activation whose backward is wrong beyond |x| = 3")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--every", type=int, default=5, help="check every N optimizer steps")
    parser.add_argument("--logdir", default=None, help="TensorBoard/JSONL root (default: a temporary directory)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # tiny float64 checks run fastest on one thread
    pl.seed_everything(0, verbose=False)

    x = torch.randn(512, 8)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)

    root = args.logdir or tempfile.mkdtemp(prefix="gradwatch-lightning-")
    logger = TensorBoardLogger(root, name="lightning_module")
    callback = GradWatchCallback(every=args.every, coords=4, directions=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        accumulate_grad_batches=2,
        logger=logger,
        callbacks=[callback],
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Classifier(buggy=args.buggy, grow_at=args.steps // 2 if args.buggy else -1)
    trainer.fit(model, loader)

    watch = callback.watch
    steps = [int(r["step"]) for r in watch.history[next(iter(watch.history))]]
    print(f"log dir: {logger.log_dir}")
    print(f"checks at global steps: {steps}")
    print(f"checks per tensor: {watch.check_counts}")
    print(f"coverage: {watch.coverage}")
    print(f"{len(watch.alerts)} alerts")
    for alert in watch.alerts:
        print(f"  [{alert.kind}] step {alert.step} {', '.join(alert.names)}: {alert.headline}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
