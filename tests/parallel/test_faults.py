"""Faults during a shard-by-shard check (FSDP2, 2 gloo ranks): the benchmark's own runs (benchmarks/faults.py).

Each run starts 2 fresh processes that train a small sharded transformer without, then with, the watch;
one rank meets the fault at the check of step 2. The faults that raise inside the check are tested in
tests/parallel/test_sharded.py (``lockstep``); here the ones that need processes of their own: a rank killed, a rank
stalled past ``distributed_timeout``, NaN logits on one rank, a custom backward raising in the replay. The
20-run campaign is the benchmark's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from gradwatch.cli import commands

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")]
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
    pytest.skip("needs torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
faults = commands.load_bench(ROOT / "benchmarks" / "faults.py")


def test_a_rank_killed_in_a_check_ends_the_job_with_the_records_written_and_no_hang():
    out = faults.run("killed", 1, at=2, timeout=4.0, pg_timeout=20.0)
    assert not out["hung"] and out["codes"] == [0, -9], out  # the survivor's worker ended on its own
    assert "closed" in out["training_error"][0], out  # training's next collective raised: the job ends
    assert out["checks_written"] == [0, 1]  # the checks before the fault, fsynced
    assert out["identical"], out  # every step before the fault as without the watch
    assert any(s.startswith("error:") and "gave up" in s for s in out["said"]), out["said"]  # rank 0 waited for 1


def test_a_rank_stalled_past_distributed_timeout_stops_the_checks_and_training_goes_on():
    out = faults.run("stall-long", 0, at=2, timeout=4.0, pg_timeout=20.0)
    assert not out["hung"] and out["codes"] == [0, 0] and out["training_error"] == [None, None], out
    assert out["identical"], out  # every step, to the end, bit for bit
    assert out["checks_written"] == [0, 1]
    assert any("distributed_timeout" in s and "gave up" in s for s in out["said"]), out["said"]


def test_nan_logits_on_one_rank_are_a_nonfinite_record():
    out = faults.run("nan", 1, at=2, timeout=4.0, pg_timeout=20.0)
    assert not out["hung"] and out["codes"] == [0, 0] and out["identical"], out
    assert out["checks_written"] == [0, 1, 2, 3, 4]
    assert any(s.startswith("nonfinite:") and "(step 2)" in s.split("\n")[0] for s in out["said"]), out["said"]


def test_a_custom_backward_raising_in_the_replay_that_is_the_capture_leaves_training_bit_identical():
    """FSDP2's replay is the capture's forward (gradwatch/watch/parts/replay_capture.py): a backward that raised midway left
    gradients on unsharded parameters, which the check's region clears where it ends; resharding before that (as
    after a capture that raised) lost them to training's next reduce-scatter, and training's next steps differed."""
    out = faults.run("raise-backward", 0, at=2, timeout=4.0, pg_timeout=20.0)
    assert not out["hung"] and out["codes"] == [0, 0] and out["training_error"] == [None, None], out
    assert out["identical"], out  # every step, to the end, bit for bit
    assert out["checks_written"] == [0, 1, 3, 4]
    assert any(s.startswith("error:") and "custom backward raised" in s for s in out["said"]), out["said"]
