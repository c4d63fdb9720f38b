"""GradWatchCallback in every optimization mode and with every logger, in real Lightning fits on CPU.

Automatic and manual optimization, one and two optimizers: training is bit-identical with
and without the callback and ``global_step`` is unchanged. A check objective that would step
an optimizer is refused and the watch pauses. Records land where each logger looks.
"""

from __future__ import annotations

import csv
import logging
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from gradwatch.integrations.lightning import GradWatchCallback  # noqa: E402
from gradwatch.io.sinks import read_jsonl  # noqa: E402


class Net(pl.LightningModule):
    """Two small blocks; automatic optimization by default."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.enc(x))

    def compute_loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Manual(Net):
    """Manual optimization, one optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.compute_loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)


class TwoOptimizers(Net):
    """Manual optimization, two optimizers stepping one after the other on each batch (GAN style)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_enc, opt_head = self.optimizers()
        for opt in (opt_head, opt_enc):
            self.toggle_optimizer(opt)
            loss = self.compute_loss(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self):
        return (torch.optim.SGD(self.enc.parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(self.head.parameters(), lr=0.01))


def loader(n: int = 96) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)),
                      batch_size=8, shuffle=False)


def fit(module_cls, root, max_steps, callbacks=(), logger=False, **trainer_kwargs):
    pl.seed_everything(0, verbose=False)
    model = module_cls()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=logger, callbacks=list(callbacks),
                         default_root_dir=str(root), log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader())
    return trainer, model, [str(w.message) for w in caught]


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("module_cls, loss_fn, max_steps, checked_steps", [
    (Net, None, 10, [0, 3, 6, 9]),
    (Manual, lambda m, b: m.compute_loss(b), 10, [0, 3, 6, 9]),
    (TwoOptimizers, lambda m, b: m.compute_loss(b), 12, [0, 4, 8]),  # two optimizer steps per batch
], ids=["automatic", "manual", "two-optimizers"])
def test_training_is_bit_identical_and_global_step_unchanged(tmp_path, module_cls, loss_fn, max_steps, checked_steps):
    plain_trainer, plain, _ = fit(module_cls, tmp_path / "plain", max_steps)
    callback = GradWatchCallback(loss_fn, every=3, coords=4, directions=2)
    trainer, watched, _ = fit(module_cls, tmp_path / "watched", max_steps, [callback])
    assert trainer.global_step == plain_trainer.global_step == max_steps
    assert same_weights(plain, watched)
    for a, b in zip(plain_trainer.optimizers, trainer.optimizers):  # momentum / Adam moments too
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]
        assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i] if torch.is_tensor(sa[i][k]))
    watch = callback.watch
    assert watch.paused is None and watch.alerts == []
    assert sorted({r["step"] for h in watch.history.values() for r in h}) == checked_steps
    records, _ = read_jsonl(Path(tmp_path / "watched" / "checks.jsonl"))  # logger=False: default_root_dir
    assert [r["step"] for r in records if r["type"] == "check"] == checked_steps
    checks = [r for r in records if r["type"] == "check"]
    if module_cls is Net:  # automatic optimization: the training verdict ran, and agrees
        assert all(c["training"] and all(t["verdict"] == "excellent" for t in c["training"].values()) for c in checks)
    else:  # manual optimization: the training verdict is off (no hook on the module)
        assert all(c["training"] == {} for c in checks) and not watched._forward_pre_hooks


def test_manual_optimization_without_loss_fn_fails_at_setup_naming_the_fix(tmp_path):
    with pytest.raises(MisconfigurationException) as info:
        fit(Manual, tmp_path, 4, [GradWatchCallback(every=2)])
    text = str(info.value)
    assert "automatic_optimization = False" in text
    assert "loss_fn=" in text
    assert "Manual" in text


def test_an_objective_that_steps_the_optimizer_is_refused_once_and_pauses_the_watch(tmp_path, caplog):
    plain_trainer, plain, _ = fit(Manual, tmp_path / "plain", 12)
    # The runaway: the check objective re-runs a manual training_step (backward + opt.step()).
    callback = GradWatchCallback(lambda m, b: m.training_step(b, 0), every=2, coords=2, directions=1)
    with caplog.at_level(logging.DEBUG, logger="gradwatch"):
        trainer, watched, _ = fit(Manual, tmp_path / "watched", 12, [callback])
    assert trainer.global_step == 12 and same_weights(plain, watched)
    watch = callback.watch
    assert watch.paused is not None and "SGD.zero_grad() (refused)" in watch.paused
    gw = [r for r in caplog.records if r.name == "gradwatch"]
    errors = [r.getMessage() for r in gw if r.levelno >= logging.ERROR]
    # the traceback with cause and fix, and the error alert: both about the one failed check at step 0
    assert len(errors) == 2 and all("step 0" in m and "zero_grad" in m and "loss_fn" in m for m in errors), errors
    assert "Traceback" in errors[0]
    assert [r.getMessage() for r in gw if r.levelno == logging.WARNING and "paused" in r.getMessage()] == [
        r.getMessage() for r in gw if r.levelno == logging.WARNING]
    assert len([r for r in gw if r.levelno == logging.WARNING]) == 1
    assert len(gw) == 3  # no flood: nothing more while paused
    records, _ = read_jsonl(tmp_path / "watched" / "checks.jsonl")
    assert [r["kind"] for r in records if r["type"] == "alert"] == ["error", "paused"]
    assert [r for r in records if r["type"] == "check"] == []


def test_an_objective_that_steps_in_automatic_mode_is_refused(tmp_path):
    def stepping_loss(module, batch):
        module.trainer.optimizers[0].step()  # what a side-effect in training_step could do
        return module.compute_loss(batch)

    plain_trainer, plain, _ = fit(Net, tmp_path / "plain", 6)
    callback = GradWatchCallback(stepping_loss, every=1, coords=2, directions=1)
    trainer, watched, _ = fit(Net, tmp_path / "watched", 6, [callback])
    assert trainer.global_step == 6 and same_weights(plain, watched)
    assert "SGD.step()" in callback.watch.paused


# ---------------------------------------------------------------------------- loggers
def test_csv_logger_gets_gradwatch_columns_and_checks_jsonl_next_to_metrics_csv(tmp_path):
    callback = GradWatchCallback(every=2, coords=2, directions=1)
    trainer, _, caught = fit(Net, tmp_path, 6, [callback], logger=CSVLogger(str(tmp_path), name="csv"))
    log_dir = Path(trainer.logger.log_dir)
    assert (log_dir / "metrics.csv").is_file() and (log_dir / "checks.jsonl").is_file()
    assert not list(log_dir.glob("events.out.tfevents*"))  # no event file in another logger's folder
    with open(log_dir / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert "gradwatch/judged_rel_diff/head.weight" in rows[0] and "train_loss" in rows[0]
    steps = [int(r["step"]) for r in rows if r.get("gradwatch/rel_diff/head.weight")]
    assert steps == [0, 2, 4]
    records, _ = read_jsonl(log_dir / "checks.jsonl")
    assert [r["step"] for r in records if r["type"] == "check"] == [0, 2, 4]
    assert not [m for m in caught if "nothing of the checks" in m]


def test_tensorboard_and_csv_loggers_together(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = GradWatchCallback(every=3, coords=2, directions=1)
    loggers = [CSVLogger(str(tmp_path), name="csv"), TensorBoardLogger(str(tmp_path), name="tb")]
    trainer, _, _ = fit(Net, tmp_path, 6, [callback], logger=loggers)
    csv_dir, tb_dir = Path(loggers[0].log_dir), Path(loggers[1].log_dir)
    assert (csv_dir / "checks.jsonl").is_file()  # trainer.log_dir: the first logger's
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("gradwatch/rel_diff/head.weight")] == [0, 3]  # once, through the writer
    assert "custom_scalars__config__" in acc.Tags()["tensors"]
    with open(csv_dir / "metrics.csv") as fh:
        assert "gradwatch/rel_diff/head.weight" in fh.readline()


def test_logger_false_keeps_records_under_default_root_dir(tmp_path):
    callback = GradWatchCallback(every=2, coords=2, directions=1)
    fit(Net, tmp_path, 4, [callback], logger=False)
    records, _ = read_jsonl(tmp_path / "checks.jsonl")
    assert [r["step"] for r in records if r["type"] == "check"] == [0, 2]


def test_one_warning_when_nothing_can_be_kept(tmp_path):
    callback = GradWatchCallback(every=2, coords=2, directions=1, jsonl=False)
    _, _, caught = fit(Net, tmp_path, 4, [callback], logger=False)
    assert len([m for m in caught if "nothing of the checks will be kept" in m]) == 1
    assert not list(tmp_path.glob("checks.jsonl")) and len(callback.watch.history["head.weight"]) == 2
