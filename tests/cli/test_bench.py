"""gradwatch bench --quick: runs end to end, writes the five sections, catches every planted bug.

The benchmark is ``benchmarks/bench.py`` (outside the package); ``gradwatch bench`` finds it in a source
checkout and says where to get it otherwise.

No test here asserts a time: the figures are ratios from one run on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gradwatch.cli import commands

ROOT = Path(__file__).resolve().parents[2]
bench = commands.load_bench(ROOT / "benchmarks" / "bench.py")

pytestmark = pytest.mark.slow  # subprocesses of the benchmarks

SECTIONS = ("time_to_verdict", "detection", "efficiency", "training_overhead", "scaling")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(out), "--steps", "20", "--repeats", "2", "--time-cap", "0.3"])
    assert bench.run(args) == 0
    return json.loads(out.read_text())


def test_the_json_has_the_five_sections_for_every_model(result):
    for section in SECTIONS:
        assert result[section], section
    models = set(bench.MODEL_NAMES)
    assert {r["model"] for r in result["time_to_verdict"]} == models
    assert {r["tool"] for r in result["time_to_verdict"]} == {"gradwatch", "gradcheck-fast", "gradcheck-slow"}
    assert {(e["model"], e["requested"]) for e in result["efficiency"]} == {(m, p) for m in models for p in ("loop", "batched")}
    assert {o["model"] for o in result["training_overhead"]} == models
    assert len({s["n_params"] for s in result["scaling"]}) == 3
    assert result["meta"]["quick"] is True and "targets" in result


def test_gradwatch_catches_every_planted_bug_and_names_the_module(result):
    rows = [d for d in result["detection"] if d["tool"] == "gradwatch"]
    assert len(rows) == len(bench.MODEL_NAMES)
    for d in rows:
        assert d["caught"] is True, d
        assert d["module_named"] and d["planted_module"] in d["named_modules"], d
        assert any(d["planted_module"] in line and d["planted_function"] in line for line in d["localized"]), d
        assert d["named_tensors"], d


def test_no_false_alarm_on_the_correct_twins(result):
    for d in result["detection"]:
        if d["tool"] == "gradwatch":
            assert d["false_alarm"] is False, d
    assert result["targets"]["no_false_alarm"] is True


def test_quick_labels_full_size_targets_as_not_applicable(result, capsys):
    for key in bench.FULL_SIZE_TARGETS:
        assert result["targets"][key] == "n/a (full size only)", key
    print(bench.format_result(result))
    out = capsys.readouterr().out
    assert "overhead_at_most_1.02=n/a (full size only)" in out and "=False" not in out.split("targets:")[1]


def test_figures_are_consistent(result):
    for r in result["time_to_verdict"]:
        if r["status"] == "timeout":
            assert r["seconds"] is None and r["evaluations_needed"] == 2 * r["n_params"]
        else:
            assert r["seconds"] > 0 and r["evaluations"] > 0
    for e in result["efficiency"]:
        assert e["evaluations"] > 0
        assert e["efficiency"] > 0
        assert e["ok"] is True
    for o in result["training_overhead"]:
        assert o["checks"] >= 1 and o["median_ratio"] > 0


def test_unknown_models_are_a_usage_error(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--models", "resnet"])) == 2
    assert "unknown model" in capsys.readouterr().err


def test_the_cli_registers_bench():
    parser = commands.build_parser(with_bench=True)
    args = parser.parse_args(["bench", "--quick", "--models", "mlp", "--time-cap", "3"])
    assert args.quick
    assert args.models == "mlp"
    assert args.time_cap == 3.0


def test_memory_section_side_by_side_and_the_module_form_catches_every_bug(result):
    rows = result["memory"]
    assert len(rows) == 1  # 4M parameters with --quick
    for r in rows:
        assert r["plain"]["watch"] is False and r["watched"]["watch"] is True, r
        assert r["watched"]["checks"] == 3 and r["ratio"] == r["watched"]["peak_bytes"] / r["plain"]["peak_bytes"]
        assert r["watched"]["forms"] == ["module"] * 3, r["watched"]  # the budget chose the module form
        # Peak RSS of the watched loop within 1.1x of the same loop without the watch (one subprocess each).
        assert r["ratio"] <= 1.1, (r["watched"]["peak_bytes"] >> 20, r["plain"]["peak_bytes"] >> 20, r["watched"]["notes"])
    module = result["module_form"]
    assert {(r["model"], r["bug"]) for r in module} == {(m, b) for m in bench.MODEL_NAMES for b in (True, False)}
    assert all(r["form"] == "module" for r in module)
    assert result["targets"]["module_form_catches_and_names_every_bug"] is True
    assert result["targets"]["module_form_no_false_alarm"] is True
    assert "6. peak memory" in bench.format_result(result)


def test_the_cli_finds_the_benchmark_of_its_source_tree():
    assert commands.find_bench() == ROOT / "benchmarks" / "bench.py"
    assert commands.find_bench([ROOT / "gradwatch"]) is None  # not a checkout's root


def _run_installed_copy(tmp_path, cwd, *argv):
    """``python -m gradwatch ...`` from a copy of the package alone (as a wheel installs it: no benchmarks/)."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "gradwatch", site / "gradwatch", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "gradwatch", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_bench_outside_a_checkout_says_where_the_benchmark_is(tmp_path):
    done = _run_installed_copy(tmp_path, tmp_path, "bench", "--quick")
    assert done.returncode == 2, done.stderr
    err = done.stderr
    assert "gradwatch bench: error: the benchmark ships with gradwatch's source tree" in err
    assert "benchmarks/bench.py" in err
    assert "make bench" in err
    assert str(tmp_path) in err
    assert "Traceback" not in err and done.stdout == ""


def test_bench_from_a_checkouts_root_runs_its_benchmark(tmp_path):
    # The package is a copy elsewhere; the current directory is this checkout: its benchmark runs
    # (here up to its own check of the flags, which names the unknown model).
    done = _run_installed_copy(tmp_path, ROOT, "bench", "--models", "resnet")
    assert done.returncode == 2, done.stderr
    assert "unknown model(s) resnet" in done.stderr and "source tree" not in done.stderr
