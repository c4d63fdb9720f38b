"""At real size: language models with their real vocabularies, checked in the module form (benchmarks/real_size.py).

The benchmark's own workers run here, each in a fresh interpreter as the benchmark runs them (the room the
memory budget leaves is measured from the process's own peak, which earlier tests would inflate), at the
smallest number of checks that shows the behaviour; the full figures are the benchmark's, in docs/guides/real-size.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradwatch.cli import commands

ROOT = Path(__file__).resolve().parents[2]
real_size = commands.load_bench(ROOT / "benchmarks" / "real_size.py")

pytestmark = pytest.mark.slow  # subprocesses of the benchmarks


def test_gpt2_with_its_real_vocabulary_a_softmax_bug_in_attention_is_caught_and_named():
    # whole units are spread over the K = 8 checks the LM head's blocks take: caught within K
    row = real_size._spawn("gpt2", "softmax", 8, threads=1)
    assert row["forms"] == ["module"] and row["caught_at_check"] is not None and row["caught_at_check"] < 8, row
    assert row["named"] and all(n.startswith("transformer.h.0.attn") for n in row["named"])
    assert row["alerts_on_other_modules"] == [] and row["training_coverage_zero"] == []
    assert row["unreached_rows"]["transformer.wte.weight"] > 49_000  # 128 tokens reach few of 50,257 rows


def test_lora_gpt2_a_softmax_bug_in_the_frozen_attention_is_caught_through_the_adapters():
    # only the adapters train: the frozen attention code between them and the loss is checked for what it passes back
    # caught within K (at the first check on a quiet machine; under a test suite's load the first check's pieces
    # hold their pace, half of it at least, and reach the first block's attention at the second check or the third);
    # every tensor has had both verdicts within K (a paced cycle spreads the pieces over the next checks)
    row = real_size._spawn("gpt2lora", "softmax", 8, threads=1, covered=True)
    assert row["caught_at_check"] is not None and row["caught_at_check"] < row["cycle_length"], row
    assert row["steps"] <= row["cycle_length"], row
    assert row["named"] == ["base_model.model.transformer.h.0.attn.c_attn:output"], row
    assert row["alerts_on_other_modules"] == [] and row["not_checked"] == [], row
    assert row["backward_coverage_zero"] == [] and row["training_coverage_zero"] == []


@pytest.mark.parametrize("bug", ["none", "softmax"])
def test_nanogpt_with_a_50304_vocabulary(bug):
    # K = 8 checks: every unit and row block once (no pace: a loaded machine's slower step would pace the checks and
    # make K longer; the pace has its own tests)
    row = real_size._spawn("nanogpt", bug, 8, threads=1, options={"pace": None})
    assert row["forms"] == ["module"], row
    if bug == "none":
        assert row["alerts"] == 0 and row["caught_at_check"] is None, row
        assert row["backward_coverage_zero"] == [] and row["training_coverage_zero"] == [], row
    else:
        assert row["caught_at_check"] is not None and row["caught_at_check"] < 8, row
        assert row["alerts_on_other_modules"] == [], row
    assert row["cycle_length"] == 8


LORA_OBJECTIVE = """
import json, resource, sys, torch
sys.path.insert(0, {bench!r})
import real_size as rs
torch.set_num_threads(1); torch.manual_seed(0)
model, loss_fn, make_batch = rs._setup("gpt2lora", "none")
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
def step(watch, i):
    b = make_batch(i); opt.zero_grad(); loss_fn(model, b).backward()
    report = watch.step(b) if watch is not None else None
    opt.step()
    return report
for i in range(2):
    step(None, i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from gradwatch import GradWatch
watch = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None, form="objective")
report = step(watch, 2)
print(json.dumps({{"form": report.form, "alerts": len(watch.alerts),
                  "ratio": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / before}}))
"""


def test_the_whole_objective_of_a_lora_gpt2_holds_one_forwards_activations_per_batched_evaluation():
    # vmapped batches were sized by the perturbed tensor alone: 32 copies of a LoRA adapter, and with them 32
    # forwards' logits over the 50,257-token vocabulary in float64 at once (3.7 GB against 0.5 GB trained)
    import json
    import subprocess
    import sys

    code = LORA_OBJECTIVE.format(bench=str(ROOT / "benchmarks"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["form"] == "objective" and got["alerts"] == 0, got
    assert got["ratio"] < 1.6, got  # 1.2x measured; 7x before


LORA_FORMS = """
import json, sys, torch
sys.path.insert(0, {bench!r})
import real_size as rs
torch.set_num_threads(1); torch.manual_seed(0)
model, loss_fn, make_batch = rs._setup("gpt2lora", "none")
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
from gradwatch import GradWatch
watch = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None, memory_budget=None)  # the whole objective fits
forms, notes = [], []
for i in range(3):
    b = make_batch(i); opt.zero_grad(); loss_fn(model, b).backward()
    report = watch.step(b); opt.step()
    forms.append(report.form); notes += [n for n in report.notes if n.startswith("form:")]
print(json.dumps({{"forms": forms, "notes": notes, "alerts": len(watch.alerts),
                  "coverage": sorted({{v["backward"] for v in watch.coverage.values()}})}}))
"""


def test_auto_moves_a_lora_gpt2_to_the_module_form_once_it_measured_it_cheaper():
    # where the whole objective fits, form="auto" weighs the measured cost: 13.7 s a check of the whole objective
    # against 0.75 s in modules (LoRA GPT-2, vocabulary 50,257), so after one trial every check is in modules
    import json
    import subprocess
    import sys

    code = LORA_FORMS.format(bench=str(ROOT / "benchmarks"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["forms"] == ["objective", "module", "module"], got
    assert "timed against it once" in got["notes"][0] and "against" in got["notes"][-1], got
    assert got["alerts"] == 0 and got["coverage"] == [1.0], got
