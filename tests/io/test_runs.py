"""`gradwatch report` over real logs: one run resumed across folders is one history, appended runs stay
apart (JSONL and event files agree), exit codes CI can trust; `python -m gradwatch`; `validate` lists
every problem of a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gradwatch import GradWatch
from gradwatch.cli import commands as cli

ROOT = Path(__file__).resolve().parents[2]


def _run_main(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def loss_fn(model, batch):
    return model(batch).pow(2).mean()


def train(watch, model, steps, start=0):
    g = torch.Generator().manual_seed(start)
    for step in range(start, start + steps):
        watch.step(torch.randn(8, 3, generator=g), global_step=step)


def small_watch(log_dir, model=None):
    model = model if model is not None else nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    return model, GradWatch(model, loss_fn, every=2, coords=2, directions=1, log_dir=str(log_dir))


# --------------------------------------------------------------------- exit codes

@pytest.mark.parametrize("content", [b"", b"garbage\nmore garbage\n", b'{"a": 1}\n[1, 2]\n'],
                         ids=["empty", "garbage", "foreign-json"])
@pytest.mark.parametrize("flag", [[], ["--fail-on-alerts"]], ids=["plain", "fail-on-alerts"])
def test_report_exits_2_when_nothing_is_readable(capsys, tmp_path, content, flag):
    (tmp_path / "checks.jsonl").write_bytes(content)
    code, out, err = _run_main(capsys, "report", tmp_path, *flag)
    assert code == 2, (out, err)
    assert "nothing readable" in err and "Traceback" not in err


def test_fail_on_alerts_passes_only_when_checks_were_read(capsys, tmp_path):
    _, watch = small_watch(tmp_path)
    watch.close()  # a run record, no check
    code, out, _ = _run_main(capsys, "report", tmp_path)
    assert code == 0 and "no checks recorded" in out
    code, _, err = _run_main(capsys, "report", tmp_path, "--fail-on-alerts")
    assert code == 2 and "holds no check" in err
    model, watch = small_watch(tmp_path / "ok")
    train(watch, model, 3)
    watch.close()
    assert _run_main(capsys, "report", tmp_path / "ok", "--fail-on-alerts")[0] == 0


def test_python_dash_m_gradwatch_version():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "gradwatch", "--version"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("gradwatch "), proc.stderr


def test_validate_lists_every_problem_of_a_file(capsys, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("evry: 5\ncoords: 0\nraise_on: always\ndirections: 2\n")
    code, _, err = _run_main(capsys, "validate", path)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("gradwatch validate: error:")]
    assert len(lines) == 3, err
    for key in ("evry", "coords", "raise_on"):
        assert any(f"{path}: {key}:" in line for line in lines), (key, err)
    code, out, _ = _run_main(capsys, "validate", path, "--format", "json")
    doc = json.loads(out)
    assert code == 2
    assert not doc["valid"]
    assert len(doc["errors"]) == 3
    assert doc["error"] == doc["errors"][0]


# --------------------------------------------------------------------- runs

def test_appended_runs_are_kept_apart_and_both_views_agree(capsys, tmp_path):
    for seed in (0, 1):
        torch.manual_seed(seed)
        model, watch = small_watch(tmp_path)
        train(watch, model, 6)  # checks at 0, 2, 4
        watch.close()
    records = [json.loads(line) for line in (tmp_path / "checks.jsonl").read_text().splitlines()]
    ids = list(dict.fromkeys(r["run_id"] for r in records))
    assert len(ids) == 2 and all(r.get("run_id") for r in records)
    views = {}
    for source in ("jsonl", "events"):
        code, out, err = _run_main(capsys, "report", tmp_path, "--source", source, "--format", "json")
        assert code == 0, err
        doc = json.loads(out)
        views[source] = [(run["run_id"], run["checks"], sorted((t["tensor"], t["checks"]) for t in run["tensors"]))
                         for run in doc["runs"]]
    assert views["jsonl"] == views["events"]
    assert [v[:2] for v in views["jsonl"]] == [(ids[0], 3), (ids[1], 3)]
    code, out, err = _run_main(capsys, "report", tmp_path)
    assert "=== run 1 of 2" in out
    assert "=== run 2 of 2" in out
    assert "holds 2 runs" in err


def test_event_files_of_one_second_are_read_in_the_order_they_were_written(tmp_path):
    """A process's 10th event writer sorts after its 9th (the names differ by that count alone within a second)."""
    from gradwatch.io.runs import event_files

    for count in (10, 9, 11):
        (tmp_path / f"events.out.tfevents.1764145234.host.4242.{count}").write_bytes(b"")
    assert [p.name.rsplit(".", 1)[1] for p in event_files(tmp_path)] == ["9", "10", "11"]


def test_a_run_resumed_in_another_folder_is_one_history(capsys, tmp_path):
    model, first = small_watch(tmp_path / "version_0")
    train(first, model, 6)
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    _, second = small_watch(tmp_path / "version_1", model=model)
    second.load_state_dict(state)
    assert second.run_id == first.run_id
    train(second, model, 6, start=6)  # checks at 6, 8, 10
    second.close()
    for args in ([tmp_path], [tmp_path / "version_0", tmp_path / "version_1"]):
        code, out, err = _run_main(capsys, "report", *args, "--format", "json")
        assert code == 0, err
        doc = json.loads(out)
        assert doc["run_id"] == first.run_id
        assert doc["checks"] == 6
        assert (doc["first_step"], doc["last_step"]) == (0, 10)
        assert {t["checks"] for t in doc["tensors"]} == {6}
    code, out, _ = _run_main(capsys, "report", tmp_path, "--source", "events", "--format", "json")
    assert json.loads(out)["checks"] == 6


def test_lightning_resumed_run_reads_as_one_run(capsys, tmp_path):
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset

    from gradwatch.integrations.lightning import GradWatchCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.lin(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 3, generator=g), torch.randint(0, 2, (64,), generator=g)),
                      batch_size=8)

    def fit(max_steps, ckpt_path=None):
        trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=TensorBoardLogger(str(tmp_path), name="logs"),
                             callbacks=[GradWatchCallback(every=2, coords=2, directions=1)], enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1)
        trainer.fit(Module(), data, ckpt_path=ckpt_path)
        return trainer

    trainer = fit(6)  # checks at 0, 2, 4
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    fit(12, ckpt_path=str(tmp_path / "last.ckpt"))  # version_1: checks at 6, 8, 10
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["version_0", "version_1"]
    code, out, err = _run_main(capsys, "report", tmp_path / "logs", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["checks"] == 6 and (doc["first_step"], doc["last_step"]) == (0, 10)
    code, out, _ = _run_main(capsys, "report", tmp_path / "logs")
    assert "6 checks, steps 0-10" in out
