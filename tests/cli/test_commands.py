"""The ``gradwatch`` command line: demo, report, validate, bench, --help, and the docs pages that document them.

One real subprocess run of the installed ``gradwatch`` executable (the late
bug, shared by the report tests); the other runs call ``cli.main`` in-process,
which is much faster than paying for ``import torch`` again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gradwatch.cli import commands as cli
from gradwatch.config import option_names
from gradwatch.io.runs import alert_key

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DOCS = ROOT / "docs"  # reference/cli.md documents the commands, reference/options.md the options
# "step   100  fc1.weight  threshold  ..." — the alert line both the demo and report print.
ALERT_LINE = re.compile(r"step\s+(\d+)\s+(\S+)\s+(threshold|drift|nonfinite|nondeterministic|error)\b")
DEMO_STEPS = "60"  # weights grow at step 30; checks at 0, 10, ..., 50


def _gradwatch_exe() -> list:
    exe = Path(sys.executable).with_name("gradwatch")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("gradwatch")
    return [found] if found else [sys.executable, "-m", "gradwatch"]


def _alert_keys(text: str) -> set:
    return {(m.group(2), m.group(3), int(m.group(1))) for m in ALERT_LINE.finditer(text)}


def _run_main(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def late_run(tmp_path_factory):
    """``gradwatch demo`` (late bug) as a real subprocess: (logdir, completed process)."""
    logdir = tmp_path_factory.mktemp("late") / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [*_gradwatch_exe(), "demo", "--steps", DEMO_STEPS, "--logdir", str(logdir)],
        capture_output=True, text=True, timeout=180, env=env, cwd=str(logdir.parent),
    )
    return logdir, proc


# --------------------------------------------------------------------- demo

@pytest.mark.slow
def test_demo_late_bug_alerts_name_the_tensor_and_print_the_summary(late_run):
    logdir, proc = late_run
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in out + proc.stderr
    assert "weights grow" in out
    keys = _alert_keys(out)
    # one alert names the buggy op's module, the tensors feeding it under it (issue 73: it was one per tensor)
    assert keys == {("act", "threshold", 30)}, out
    assert "(fc1.weight, fc1.bias)" in out
    # the summary table: header and one row per parameter tensor, fc1.weight WRONG with its alerts
    assert re.search(r"tensor\s+checks\s+first\s+last\s+worst\s+verdict\s+alerts\s+history", out), out
    row = re.search(r"^\s+fc1\.weight\s+(\d+)\s+\S+\s+\S+\s+\S+\s+WRONG\s+(\d+)", out, re.M)
    assert row and int(row.group(1)) == 6 and int(row.group(2)) >= 1, out
    assert re.search(r"^\s+out\.weight\s+6\s+.*excellent\s+0", out, re.M), out
    assert f"tensorboard --logdir {logdir}" in out
    assert (logdir / "checks.jsonl").is_file()


def test_demo_bug_none_reports_zero_alerts(capsys, tmp_path):
    code, out, err = _run_main(capsys, "demo", "--bug", "none", "--steps", "40", "--logdir", str(tmp_path / "none"),
                               "--fail-on-alerts")
    assert code == 0, out + err
    assert "No alerts" in out
    assert not _alert_keys(out)
    assert "WRONG" not in out and "SUSPICIOUS" not in out


def test_demo_bug_scale_shows_the_ratio_diagnosis(capsys, tmp_path):
    code, out, err = _run_main(capsys, "demo", "--bug", "scale", "--steps", "20", "--logdir", str(tmp_path / "scale"))
    assert code == 0, out + err
    assert "analytic is 1.50x numeric" in out
    # one cause of fc1's two tensors: one alert, named again by its module at the second check (issue 73: it was an
    # alert per tensor, then one more on the module)
    assert _alert_keys(out) == {("*", "threshold", 0)} and "(fc1.weight, fc1.bias)" in out


def test_demo_fail_on_alerts_exits_1(capsys, tmp_path):
    code, out, _ = _run_main(capsys, "demo", "--bug", "scale", "--steps", "2", "--every", "1",
                             "--logdir", str(tmp_path / "r"), "--fail-on-alerts")
    assert code == 1
    assert "analytic is 1.50x numeric" in out


def test_demo_config_overrides_defaults_and_flags_override_config(capsys, tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("gradwatch:\n  every: 5\n  coords: 2\n")
    code, out, err = _run_main(capsys, "demo", "--bug", "none", "--steps", "10", "--config", str(cfg),
                               "--logdir", str(tmp_path / "a"))
    assert code == 0, err
    assert "checks every 5 steps" in out
    assert "10 steps, 2 checks" in out
    code, out, err = _run_main(capsys, "demo", "--bug", "none", "--steps", "10", "--config", str(cfg),
                               "--every", "10", "--logdir", str(tmp_path / "b"))
    assert code == 0, err
    assert "10 steps, 1 check in" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--every", "0"], "--every"),
        (["--overhead-budget", "2"], "--overhead-budget"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_demo_bad_flags_exit_2_naming_the_flag(capsys, tmp_path, argv, needle):
    code, out, err = _run_main(capsys, "demo", *argv, "--logdir", str(tmp_path / "x"))
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_demo_bad_config_exits_2_naming_the_key(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("evry: 5\n")
    code, _, err = _run_main(capsys, "demo", "--config", str(bad), "--logdir", str(tmp_path / "x"))
    assert code == 2
    assert "evry" in err and "every" in err


def test_demo_refuses_a_logdir_that_holds_a_run(capsys, late_run):
    logdir, _ = late_run
    code, _, err = _run_main(capsys, "demo", "--steps", "2", "--logdir", str(logdir))
    assert code == 2
    assert "already holds a run" in err


# --------------------------------------------------------------------- report

def test_report_prints_the_same_alerts_as_the_demo(capsys, late_run):
    logdir, proc = late_run
    demo_keys = _alert_keys(proc.stdout)
    assert demo_keys
    code, out, err = _run_main(capsys, "report", str(logdir))
    assert code == 0, err
    assert _alert_keys(out) == demo_keys
    assert re.search(r"^\s+fc1\.weight\s+6\s+.*WRONG", out, re.M), out
    # the same from the TensorBoard event files alone
    code, out, err = _run_main(capsys, "report", str(logdir), "--source", "events")
    assert code == 0, err
    assert _alert_keys(out) == demo_keys
    assert re.search(r"^\s+fc1\.weight\s+6\s+.*WRONG", out, re.M), out


def test_report_reads_event_files_when_there_is_no_jsonl(capsys, late_run, tmp_path):
    logdir, proc = late_run
    copy = tmp_path / "events_only"
    shutil.copytree(logdir, copy)
    (copy / "checks.jsonl").unlink()
    code, out, err = _run_main(capsys, "report", str(copy), "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["source"] == "events"
    assert {alert_key(a) for a in doc["alerts"]} == _alert_keys(proc.stdout)
    rows = {r["tensor"]: r for r in doc["tensors"]}
    assert rows["fc1.weight"]["verdict"] == "wrong" and rows["out.weight"]["verdict"] == "excellent"


def test_report_json_parses(capsys, late_run):
    logdir, proc = late_run
    code, out, _ = _run_main(capsys, "report", str(logdir), "--format", "json")
    assert code == 0
    doc = json.loads(out)
    assert doc["source"] == "jsonl" and doc["checks"] == 6
    assert {alert_key(a) for a in doc["alerts"]} == _alert_keys(proc.stdout)
    rows = {r["tensor"]: r for r in doc["tensors"]}
    assert rows["fc1.weight"]["worst_verdict"] == "wrong"
    assert rows["fc1.weight"]["alerts"] >= 1 and rows["out.bias"]["alerts"] == 0
    assert len(rows["fc1.weight"]["history"]) == 6


def test_report_truncated_last_line_warns_and_still_reports(capsys, late_run, tmp_path):
    logdir, proc = late_run
    text = (logdir / "checks.jsonl").read_text()
    lines = text.splitlines(keepends=True)
    assert len(lines) > 3
    (tmp_path / "checks.jsonl").write_text("".join(lines) + lines[-2][: len(lines[-2]) // 2])
    code, out, err = _run_main(capsys, "report", str(tmp_path))
    assert code == 0
    assert "warning" in err and "truncated" in err
    assert _alert_keys(out) == _alert_keys(proc.stdout)
    assert re.search(r"^\s+fc1\.weight\s+6\s", out, re.M), out


def test_report_fail_on_alerts(capsys, late_run, tmp_path):
    logdir, _ = late_run
    code, _, _ = _run_main(capsys, "report", str(logdir), "--fail-on-alerts")
    assert code == 1
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"type": "check", "step": 0, "tensors": {
        "w": {"judged_rel_diff": 1e-10, "rel_diff": 1e-10, "verdict": "excellent"}}}) + "\n")
    code, out, _ = _run_main(capsys, "report", str(clean), "--fail-on-alerts")
    assert code == 0
    assert "Alerts: none" in out


def test_report_missing_logdir_exits_2(capsys, tmp_path):
    code, _, err = _run_main(capsys, "report", str(tmp_path / "nope"))
    assert code == 2 and "no such" in err
    code, _, err = _run_main(capsys, "report", str(tmp_path))
    assert code == 2 and "checks.jsonl" in err


# --------------------------------------------------------------------- validate

@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_validate_shipped_configs(capsys, path):
    code, out, err = _run_main(capsys, "validate", str(path))
    assert code == 0, err
    for name in option_names():
        assert re.search(rf"^\s+{name}\s", out, re.M), f"{name} missing from:\n{out}"


def test_validate_json(capsys):
    code, out, _ = _run_main(capsys, "validate", str(ROOT / "configs" / "strict.yaml"), "--format", "json")
    assert code == 0
    doc = json.loads(out)
    assert doc["valid"]
    assert doc["options"]["raise_on"] == "suspicious"
    assert "raise_on" in doc["set"]
    assert set(doc["options"]) == set(option_names())


@pytest.mark.parametrize(
    "text, key",
    [("evry: 5\n", "evry"), ("every: 0\n", "every"), ("overhead_budget: 3\n", "overhead_budget"),
     ("bands: [1e-4, 1e-7, 1e-2]\n", "bands"), ("gradwatch:\n  raise_on: always\n", "raise_on")],
)
def test_validate_broken_config_exits_2_naming_the_key(capsys, tmp_path, text, key):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    code, out, err = _run_main(capsys, "validate", str(path))
    assert code == 2
    assert key in err and str(path) in err
    assert "Traceback" not in err


# --------------------------------------------------------------------- bench, help, README

def _subparsers():
    parser = cli.build_parser(with_bench=True)
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return parser, action.choices


def _flags(parser):
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


@pytest.mark.parametrize("command", ["demo", "report", "validate", "bench", None])
def test_help_exits_0_and_mentions_every_flag(capsys, command):
    argv = ([command] if command else []) + ["--help"]
    code, out, _ = _run_main(capsys, *argv)
    assert code == 0
    parser, subs = _subparsers()
    target = subs[command] if command else parser
    for flag in _flags(target):
        assert flag in out, f"{flag} missing from `gradwatch {command or ''} --help`"
    assert "exit codes" in out or command == "bench"


def test_option_flags_are_the_kebab_case_option_names():
    _, subs = _subparsers()
    flags = set(_flags(subs["demo"]))
    for name in option_names():
        assert "--" + name.replace("_", "-") in flags


def test_docs_document_every_flag():
    # The CLI page names each command's own flags; the option flags (--coords, ...) are in the options table.
    text = (DOCS / "reference" / "cli.md").read_text() + (DOCS / "reference" / "options.md").read_text()
    _, subs = _subparsers()
    for command in ("demo", "report", "validate"):
        assert f"gradwatch {command}" in text
        for flag in _flags(subs[command]):
            if flag != "--help":
                assert flag in text, f"docs/reference/cli.md and options.md do not mention `gradwatch {command} {flag}`"


def test_docs_options_table_lists_every_option():
    text = (DOCS / "reference" / "options.md").read_text()
    listed = set(re.findall(r"^\|\s*`([a-z_]+)`\s*\|", text, re.M))
    assert set(option_names()) <= listed, sorted(set(option_names()) - listed)
    for page, heading in (("costs.md", "# What it costs"), ("guides/distributed.md", "# Distributed training")):
        assert re.search(rf"^{re.escape(heading)}\s*$", (DOCS / page).read_text(), re.M), (page, heading)
