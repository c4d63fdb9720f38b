"""GradWatchCallback in real Lightning fits on CPU: steps, logger writer, self.log, checkpoints, options."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from gradwatch.integrations.lightning import GradWatchCallback  # noqa: E402
from gradwatch.io.sinks import read_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


class BuggySigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, grad):
        (s,) = ctx.saved_tensors
        return grad * s * (1 + s)  # should be s * (1 - s)


class Tiny(pl.LightningModule):
    """A small classifier that logs from training_step, reading the trainer as real modules do."""

    def __init__(self, buggy: bool = False) -> None:
        super().__init__()
        self.buggy = buggy
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc1(x)
        h = BuggySigmoid.apply(h) if self.buggy else torch.tanh(h)
        return self.fc2(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        self.log_dict({"lr": self.trainer.optimizers[0].param_groups[0]["lr"], "epoch": float(self.current_epoch)})
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def make_trainer(root, max_steps, callbacks, version=None) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=2,
        logger=TensorBoardLogger(str(root), name="tb", version=version),
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def events(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def event_files(log_dir):
    return [f for f in os.listdir(log_dir) if f.startswith("events.out.tfevents")]


def fit(root, max_steps, callback, *, model=None, ckpt_path=None, version=None):
    pl.seed_everything(0, verbose=False)
    model = model if model is not None else Tiny()
    trainer = make_trainer(root, max_steps, [callback], version=version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer, model, [str(w.message) for w in caught]


# ---------------------------------------------------------------------------- fit, steps, writer, self.log
def test_fit_checks_at_global_steps_through_the_logger_writer(tmp_path):
    callback = GradWatchCallback(every=4, coords=4, directions=2)
    trainer, model, caught = fit(tmp_path, 18, callback)
    assert trainer.global_step == 18
    log_dir = trainer.logger.log_dir
    expected_steps = [0, 4, 8, 12, 16]

    # one event file in the logger's directory, holding both Lightning's and gradwatch's scalars
    assert event_files(log_dir) == event_files(log_dir)[:1] and len(event_files(log_dir)) == 1
    acc = events(log_dir)
    tags = set(acc.Tags()["scalars"])
    assert "train_loss" in tags
    for name in PARAMS:
        for metric in ("rel_diff", "directional_rel_diff", "max_rel_error"):
            assert [e.step for e in acc.Scalars(f"gradwatch/{metric}/{name}")] == expected_steps
    assert [e.step for e in acc.Scalars("gradwatch/alerts/count")] == expected_steps
    assert "custom_scalars__config__" in acc.Tags()["tensors"]

    # checks.jsonl next to the events, with the same numbers at the same steps
    records, warns = read_jsonl(Path(log_dir) / "checks.jsonl")
    assert warns == []
    checks = [r for r in records if r["type"] == "check"]
    assert [r["step"] for r in checks] == expected_steps
    tb = {e.step: e.value for e in acc.Scalars("gradwatch/rel_diff/fc1.weight")}
    assert all(tb[r["step"]] == pytest.approx(r["tensors"]["fc1.weight"]["rel_diff"], rel=1e-6, abs=1e-30)
               for r in checks)

    watch = callback.watch
    assert callback.watch.alerts == []
    assert watch.check_counts == {n: len(expected_steps) for n in PARAMS}
    assert all(r["ok"] for r in checks)

    # the default loss (training_step's) ran its self.log calls on the trainer-less shadow, silenced
    assert not [m for m in caught if "self.log" in m], caught
    assert not any(k.startswith("gradwatch") for k in trainer.callback_metrics)
    assert set(trainer.callback_metrics) >= {"train_loss", "lr"}


def test_shadow_logging_would_warn_without_silencing():
    """Control for the test above: training_step on a deep copy (what the check evaluates) warns."""
    module = Tiny()
    shadow = copy.deepcopy(module)
    with pytest.warns(UserWarning, match="self.log"):
        try:
            shadow.training_step((torch.randn(2, 4), torch.tensor([0, 1])), 0)
        except RuntimeError:  # self.trainer in log_dict: not attached
            pass


def test_custom_loss_fn_and_alerts_reach_on_alert(tmp_path):
    collected = []

    def loss_fn(module, batch):
        x, y = batch
        out = module.training_step(batch, 0)  # logs, reads self.trainer: still fine in a check
        return out + 0.0 * module(x).sum()

    callback = GradWatchCallback(loss_fn, every=3, coords=4, directions=2, on_alert=collected.append)
    trainer, model, caught = fit(tmp_path, 7, callback, model=Tiny(buggy=True))
    assert callback.loss_fn is loss_fn
    assert not [m for m in caught if "self.log" in m], caught
    assert collected and collected == callback.watch.alerts
    assert {n for a in collected if a.kind == "threshold" for n in a.names} >= {"fc1.weight", "fc1.bias"}  # issue 73
    assert all(a.step == 0 for a in collected if a.kind == "threshold")  # wrong from the start, then deduplicated
    # this loss_fn calls the model twice, training once: the training verdict never given, said once (issue 73)
    assert [(a.kind, a.part, a.step) for a in collected if a.kind != "threshold"] == [("not_checked", "training", 6)]
    records, _ = read_jsonl(Path(trainer.logger.log_dir) / "checks.jsonl")
    assert [r["step"] for r in records if r["type"] == "check"] == [0, 3, 6]
    assert len([r for r in records if r["type"] == "alert"]) == len(collected)


def test_plain_loss_fn_variant(tmp_path):
    callback = GradWatchCallback(lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), every=5, tensors_per_check=2)
    fit(tmp_path, 10, callback)
    assert callback.watch.check_counts == {"fc1.weight": 1, "fc1.bias": 1, "fc2.weight": 1, "fc2.bias": 1}
    assert callback.watch.alerts == []


# ---------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_continues_schedule_trends_and_coverage(tmp_path):
    first = GradWatchCallback(every=4, coords=4, directions=2, tensors_per_check=3)
    trainer, model, _ = fit(tmp_path, 10, first, version=0)
    assert sorted({r["step"] for h in first.watch.history.values() for r in h}) == [0, 4, 8]
    assert sorted(first.watch.check_counts.values()) == [2, 2, 2, 3]
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"][first.state_key]
    assert saved["checks"] == 3 and saved["schedule"]["last_check_step"] == 8
    json.dumps(saved, allow_nan=False)  # plain JSON state

    second = GradWatchCallback(every=4, coords=4, directions=2, tensors_per_check=3)
    trainer2, _, _ = fit(tmp_path, 22, second, ckpt_path=str(ckpt), version=1)
    assert trainer2.global_step == 22
    watch = second.watch
    assert watch.state_dict()["checks"] == 6  # 0, 4, 8 then 12, 16, 20: continued, not restarted
    assert watch.schedule.last_check_step == 20
    assert sum(watch.check_counts.values()) == 6 * 3
    assert max(watch.check_counts.values()) - min(watch.check_counts.values()) <= 1  # rotation continued
    steps = sorted({r["step"] for h in watch.history.values() for r in h})
    assert steps == [0, 4, 8, 12, 16, 20]
    records, _ = read_jsonl(Path(trainer2.logger.log_dir) / "checks.jsonl")
    assert [r["step"] for r in records if r["type"] == "check"] == [12, 16, 20]

    # the same callback object reused for another resumed fit also continues
    trainer3, _, _ = fit(tmp_path, 26, second, ckpt_path=str(ckpt), version=2)
    assert second.watch.state_dict()["checks"] == 7  # restored to the checkpoint (3), then 12, 16, 20, 24
    assert second.watch.schedule.last_check_step == 24


def test_two_callbacks_keep_separate_checkpoint_state(tmp_path):
    pl.seed_everything(0, verbose=False)
    first = GradWatchCallback(every=2, coords=2, directions=1, tensors=["fc1.*"])
    second = GradWatchCallback(every=3, coords=2, directions=1, tensors=["fc2.*"])
    assert first.state_key != second.state_key
    trainer = make_trainer(tmp_path, 6, [first, second], version=0)
    trainer.fit(Tiny(), loader())
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    assert sorted(saved[first.state_key]["counts"]) == ["fc1.bias", "fc1.weight"]
    assert sorted(saved[second.state_key]["counts"]) == ["fc2.bias", "fc2.weight"]
    assert saved[first.state_key]["checks"] == 3 and saved[second.state_key]["checks"] == 2  # steps 0,2,4 / 0,3


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"every": -1}, ["every", "-1"]),
        ({"every": 0}, ["every"]),
        ({"evry": 5}, ["evry", "did you mean 'every'"]),
        ({"raise_on": "sometimes"}, ["raise_on"]),
        ({"on_alert": "print"}, ["on_alert"]),
        ({"loss_fn": 3}, ["loss_fn"]),
        ({"config": "/nonexistent/gradwatch.yaml"}, ["/nonexistent/gradwatch.yaml"]),
        ({"config": 3}, ["config: got int", "GradWatchConfig"]),
        ({"every": 5, "schedule": {"every": 50}}, ["schedule.every", "given both flat"]),
        ({"schedule": {"raise_on": "wrong"}}, ["schedule.raise_on", "it is in alerts", "schedule takes every"]),
        ({"fail_at": "maybe"}, ["fail_at: got 'maybe', expected 'wrong' or 'suspicious'"]),
    ],
)
def test_bad_options_raise_misconfiguration_naming_the_option(kwargs, words):
    with pytest.raises(MisconfigurationException) as info:
        GradWatchCallback(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_config_file_and_overrides():
    cb = GradWatchCallback(config=ROOT / "configs" / "low_overhead.yaml", coords=3)
    assert (cb.config.every, cb.config.tensors_per_check, cb.config.coords) == ("auto", 2, 3)


def test_config_file_with_groups_and_grouped_overrides(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("gradwatch:\n  schedule: {every: 4}\n  check:\n    coords: 2\n  alerts: {raise_on: off}\n")
    cb = GradWatchCallback(config=str(path), check={"directions": 1}, budget={"tensors_per_check": 2})
    assert (cb.config.every, cb.config.coords, cb.config.directions, cb.config.tensors_per_check) == (4, 2, 1, 2)
    assert cb.config.raise_on is None


def test_config_is_a_gradwatchconfig_in_a_real_fit(tmp_path):
    from gradwatch.config import GradWatchConfig

    config = GradWatchConfig(every=2, coords=2, directions=1, raise_on="wrong")
    callback = GradWatchCallback(config=config, schedule={"every": 3}, alerts={"drift_window": 2})
    assert callback.config == config.replace(every=3, drift_window=2)
    trainer, _, _ = fit(tmp_path, 7, callback)
    watch = callback.watch
    assert (watch.config.every, watch.config.coords, watch.config.raise_on, watch.config.drift_window) == (3, 2, "wrong", 2)
    assert watch.config.log_dir == trainer.logger.log_dir  # the callback's own settings over the given config
    records, _ = read_jsonl(Path(trainer.logger.log_dir) / "checks.jsonl")
    assert [r["step"] for r in records if r["type"] == "check"] == [0, 3, 6]
    assert records[0]["options"]["every"] == 3 and records[0]["options"]["raise_on"] == "wrong"
    assert watch.alerts == []


# ---------------------------------------------------------------------------- the example
@pytest.mark.slow
def test_lightning_example_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_module.py"), "--buggy", "--steps", "30",
         "--every", "5", "--logdir", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    assert "checks at global steps: [0, 5, 10, 15, 20, 25]" in proc.stdout, proc.stdout
    assert "checks per tensor: {'fc1.weight': 6, 'fc1.bias': 6, 'fc2.weight': 6, 'fc2.bias': 6}" in proc.stdout
    assert "coverage: {'fc1.weight': {'backward': 1.0, 'training': 1.0}" in proc.stdout
    assert "fc1.weight" in proc.stdout.split("alerts", 1)[1]
    [version] = list((tmp_path / "lightning_module").iterdir())
    assert len(event_files(version)) == 1 and (version / "checks.jsonl").is_file()


def test_lightning_example_has_a_docstring():
    import ast

    doc = ast.get_docstring(ast.parse((ROOT / "examples" / "lightning_module.py").read_text()))
    assert doc
    assert "GradWatchCallback" in doc
    assert "TensorBoardLogger" in doc
