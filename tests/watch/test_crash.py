"""Crash safety: a run killed with SIGKILL keeps every check it completed.

The child process trains with GradWatch checking every step and prints
``CHECKED <step>`` after each completed check. The parent SIGKILLs it while
it is still training (usually in the middle of the next check), then reads
``checks.jsonl`` with :func:`gradwatch.io.sinks.read_jsonl` and the TensorBoard
event file with ``EventAccumulator``: every announced check must be in both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from gradwatch import GradWatch
from gradwatch.io.sinks import LogDirError, read_jsonl

CHILD = textwrap.dedent(
    """
    import sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    from gradwatch import GradWatch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])
    watch = GradWatch(model, loss_fn, every=1, log_dir=sys.argv[1], coords=16, directions=4)
    print("READY", flush=True)
    step = 0
    while True:  # until killed
        batch = (torch.randn(32, 8), torch.randint(0, 3, (32,)))
        opt.zero_grad()
        loss_fn(model, batch).backward()
        if watch.step(batch) is not None:
            print("CHECKED", step, flush=True)
        opt.step()
        step += 1
    """
)

KILL_AFTER = 4
TIMEOUT = 60.0


def _run_and_kill(tmp_path: Path) -> list:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    log_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script), str(log_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    checked = []
    deadline = time.monotonic() + TIMEOUT
    try:
        while len(checked) < KILL_AFTER:
            assert time.monotonic() < deadline, f"child announced only {checked} within {TIMEOUT}s"
            line = proc.stdout.readline()
            assert line, f"child exited early with code {proc.poll()} after {checked}"
            if line.startswith("CHECKED"):
                checked.append(int(line.split()[1]))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return checked


@pytest.mark.slow
def test_sigkill_keeps_every_completed_check(tmp_path):
    checked = _run_and_kill(tmp_path)
    run = tmp_path / "run"

    records, warnings = read_jsonl(run)
    assert all("truncated last line" in w for w in warnings), warnings  # at most a half-written last line
    assert records[0]["type"] == "run"
    steps = [r["step"] for r in records if r["type"] == "check"]
    assert set(checked) <= set(steps), (checked, steps)
    for r in records:
        if r["type"] == "check" and r["step"] in checked:
            assert r["ok"] and set(r["tensors"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(run.glob("events.out.tfevents.*"))
    assert len(events) == 1, events  # one writer per run directory
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("gradwatch/rel_diff/0.weight", "gradwatch/judged_rel_diff/2.bias", "gradwatch/alerts/count"):
        assert tag in tags, tags
        assert set(checked) <= {e.step for e in acc.Scalars(tag)}, tag
    # The same numbers in both files.
    by_step = {r["step"]: r for r in records if r["type"] == "check"}
    for e in acc.Scalars("gradwatch/rel_diff/0.weight"):
        if e.step in checked:
            assert e.value == pytest.approx(by_step[e.step]["tensors"]["0.weight"]["rel_diff"], rel=1e-6, abs=1e-30)


def test_jsonl_records_are_fsynced_one_by_one(tmp_path, monkeypatch):
    """Each record is written, flushed and fsynced before the check returns (no buffering to lose)."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    model = nn.Linear(3, 1)
    fn = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    with GradWatch(model, fn, every=1, log_dir=tmp_path, coords=2, directions=1) as watch:
        after_run = len(synced)
        assert after_run >= 1  # the run record
        for _ in range(3):
            x = torch.randn(4, 3)
            watch.step(x)
            lines = (tmp_path / "checks.jsonl").read_text().splitlines()
            assert lines and lines[-1].startswith('{"type":"check"')
        assert len(synced) == after_run + 3
    assert len(read_jsonl(tmp_path)[0]) == 4


def test_unwritable_log_dir_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = blocker / "run"  # cannot be created even as root
    with pytest.raises(LogDirError, match=r"cannot write .*a_file/run.*writable log_dir") as info:
        GradWatch(nn.Linear(2, 1), lambda m, b: m(b).sum(), log_dir=bad)
    assert isinstance(info.value, OSError)
    # TensorBoard alone (no JSONL) fails just as early.
    with pytest.raises(LogDirError, match=r"TensorBoard.*a_file/run"):
        GradWatch(nn.Linear(2, 1), lambda m, b: m(b).sum(), log_dir=bad, jsonl=False)
    assert blocker.read_text() == "not a directory"
