"""A GAN under Lightning's manual optimization: ``GradWatchCallback(loss_fn={optimizer_index: loss_fn})``.

A WGAN-GP critic (its loss differentiates through the critic: a gradient penalty) and a generator,
each with its own optimizer, stepped one after the other on every batch in a real ``Trainer`` fit.
Each optimizer's parameters get their own watch, checked when that optimizer steps: both verdicts
(backward and training) against their own objective, the critic's modules' double backward too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import make_tanh
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from gradwatch.integrations.lightning import GradWatchCallback  # noqa: E402
from gradwatch.io.sinks import read_jsonl  # noqa: E402


class WrongDoubleBackwardTanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tanh = make_tanh(x_error=1.2)  # the double backward 20% off, the first backward right

    def forward(self, x):
        return self.tanh(x)


class GAN(pl.LightningModule):
    """WGAN-GP: the critic steps first, then the generator (against the critic as it now is)."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.critic = nn.Sequential(nn.Linear(8, 16), WrongDoubleBackwardTanh() if wrong else nn.Tanh(),
                                    nn.Linear(16, 1))

    def critic_loss(self, batch):
        real, z, eps = batch  # the noise comes with the batch
        fake = self.generator(z).detach()
        x = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (g,) = torch.autograd.grad(self.critic(x).sum(), x, create_graph=True)
        return self.critic(fake).mean() - self.critic(real).mean() + 10 * ((g.norm(dim=1) - 1) ** 2).mean()

    def generator_loss(self, batch):
        _, z, _ = batch
        return -self.critic(self.generator(z)).mean()

    def training_step(self, batch, batch_idx):
        opt_g, opt_c = self.optimizers()
        loss_c = self.critic_loss(batch)
        opt_c.zero_grad()
        self.manual_backward(loss_c)
        opt_c.step()
        loss_g = self.generator_loss(batch)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.critic.parameters(), lr=1e-3))


LOSS_FNS = {0: lambda m, b: m.generator_loss(b), 1: lambda m, b: m.critic_loss(b)}


def loader(n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g),
                                    torch.rand(n, 1, generator=g)), batch_size=8)


def fit(root, callbacks=(), wrong=False, steps=4):
    pl.seed_everything(0, verbose=False)
    model = GAN(wrong)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=steps, logger=False,
                         callbacks=list(callbacks), default_root_dir=str(root), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader())
    return trainer, model


def test_both_networks_get_both_verdicts_and_training_is_unchanged(tmp_path):
    _, plain = fit(tmp_path / "plain")
    callback = GradWatchCallback(LOSS_FNS, every=1, coords=4, directions=2)
    _, watched = fit(tmp_path / "watched", [callback])
    for (n, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a, b), n
    assert set(callback.watches) == {0, 1} and callback.watch is callback.watches[0]
    for index, net in ((0, "generator"), (1, "critic")):
        watch = callback.watches[index]
        assert watch.alerts == [] and watch.paused is None
        records, _ = read_jsonl(tmp_path / "watched" / f"optimizer_{index}" / "checks.jsonl")
        checks = [r for r in records if r["type"] == "check"]
        assert len(checks) == 4
        params = {n for n, _ in watched.named_parameters() if n.startswith(net + ".")}
        for c in checks:
            assert {n for n in c["tensors"] if not n.endswith(":double_backward")} == params
            assert set(c["training"]) == params, c["training_note"]
            assert all(t["verdict"] == "excellent" for t in c["training"].values())
    critic = [r for r in read_jsonl(tmp_path / "watched" / "optimizer_1" / "checks.jsonl")[0] if r["type"] == "check"]
    # the critic's loss differentiates through the critic: its modules' double backward, none of the generator's
    assert {n for n in critic[0]["tensors"] if n.endswith(":double_backward")} == {
        "critic.0:double_backward", "critic.1:double_backward", "critic.2:double_backward"}


def test_a_wrong_double_backward_in_the_critic_is_caught_and_named(tmp_path):
    callback = GradWatchCallback(LOSS_FNS, every=1, coords=4, directions=2)
    fit(tmp_path, [callback], wrong=True, steps=2)
    named = {n for a in callback.watches[1].alerts if a.kind == "threshold" for n in a.names}  # one cause's too
    assert "critic.1:double_backward" in named
    assert all(a.kind != "threshold" for a in callback.watches[0].alerts)  # the generator's own gradients are right


def test_bad_optimizer_indices_are_named(tmp_path):
    with pytest.raises(MisconfigurationException, match="loss_fn key 'g' is not an optimizer index"):
        GradWatchCallback({"g": LOSS_FNS[0]})
    with pytest.raises(MisconfigurationException, match=r"loss_fn\[1\] must be callable"):
        GradWatchCallback({1: "critic"})
    with pytest.raises(MisconfigurationException, match="optimizer index 2, but GAN configures 2 optimizers"):
        fit(tmp_path, [GradWatchCallback({2: LOSS_FNS[0]})], steps=1)
