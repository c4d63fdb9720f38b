"""At real size: language models with their real vocabularies, checked in the module form (benchmarks/real_size.py).

The benchmark's own workers run here, each in a fresh interpreter as the benchmark runs them (the room the
memory budget leaves is measured from the process's own peak, which earlier tests would inflate), at the
smallest number of checks that shows the behaviour; the full figures are the benchmark's, in docs/guides/real-size.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradwatch.cli import commands

ROOT = Path(__file__).resolve().parents[1]
real_size = commands.load_bench(ROOT / "benchmarks" / "real_size.py")

pytestmark = pytest.mark.slow  # subprocesses of the benchmarks


def test_gpt2_with_its_real_vocabulary_a_softmax_bug_in_attention_is_caught_and_named():
    row = real_size._spawn("gpt2", "softmax", 2, threads=1)
    assert row["forms"] == ["module"] and row["caught_at_check"] == 0, row
    assert row["named"] and all(n.startswith("transformer.h.0.attn") for n in row["named"])
    assert row["alerts_on_other_modules"] == []
    assert row["backward_coverage_zero"] == [] and row["training_coverage_zero"] == []
    assert row["unreached_rows"]["transformer.wte.weight"] > 49_000  # 128 tokens reach few of 50,257 rows


def test_lora_gpt2_a_softmax_bug_in_the_frozen_attention_is_caught_through_the_adapters():
    # only the adapters train: the frozen attention code between them and the loss is checked for what it passes back
    row = real_size._spawn("gpt2lora", "softmax", 1, threads=1)
    assert row["caught_at_check"] == 0, row
    assert row["named"] == ["base_model.model.transformer.h.0.attn.c_attn:output"], row
    assert row["alerts_on_other_modules"] == [] and row["not_checked"] == [], row
    assert row["backward_coverage_zero"] == [] and row["training_coverage_zero"] == []


@pytest.mark.parametrize("bug", ["none", "softmax"])
def test_nanogpt_with_a_50304_vocabulary(bug):
    row = real_size._spawn("nanogpt", bug, 2, threads=1)
    assert row["forms"] == ["module"], row
    if bug == "none":
        assert row["alerts"] == 0 and row["caught_at_check"] is None, row
    else:
        assert row["caught_at_check"] == 0 and row["alerts_on_other_modules"] == [], row
    assert row["cycle_length"] == 8 and row["backward_coverage_zero"] == []
