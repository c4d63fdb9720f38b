"""`gradwatch report` reads the update records (issue 74): the optimizer's step verified after each check, in the text
report, its JSON and the HTML page. Real training loops (AdamW with clip_grad_norm_, an AdamW subclass without bias
correction, clipping per parameter group, no optimizer), then the real CLI on their log directories."""

from __future__ import annotations

import json

import pytest
import torch
from test_optimizer_replay import NoBiasCorrection
from torch import nn
from torch.nn import functional as F

from gradwatch import GradWatch
from gradwatch.cli import commands as cli
from gradwatch.io.update_summary import NOT_VERIFIED

#: (AdamW's decoupled weight decay is left out of the check objective, with a warning: not what is tested here.)
pytestmark = pytest.mark.filterwarnings("ignore:AdamW applies decoupled weight decay")

THRESHOLD = 0.05
STEPS = 4
TENSORS = ["0.weight", "0.bias", "2.weight", "2.bias"]


def loss_fn(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def clip_all(model, opt):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), THRESHOLD)


def clip_per_group(model, opt):  # each parameter group by its own norm: a clipping problem
    for group in opt.param_groups:
        torch.nn.utils.clip_grad_norm_(group["params"], THRESHOLD)


def train(log_dir, make_opt=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), clip=clip_all,
          watch_optimizer=True):
    """A plain loop of :data:`STEPS` steps, a check at each; returns each step's clipping factor (clip_grad_norm_'s)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = make_opt(model)
    watch = GradWatch(model, loss_fn, optimizer=opt if watch_optimizer else None, every=1, log_dir=str(log_dir))
    g = torch.Generator().manual_seed(1)
    factors = []
    for _ in range(STEPS):
        batch = (torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g))
        opt.zero_grad()
        loss_fn(model, batch).backward()
        watch.step(batch)
        norm = clip(model, opt)
        if norm is not None:
            factors.append(min(1.0, THRESHOLD / (float(norm) + 1e-6)))
        opt.step()
    watch.close()
    return factors


def report(capsys, *argv):
    code = cli.main(["report", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def table(out, heading):
    """The rows of the report's table under ``heading``: ``{tensor: [cells]}``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = {}
    for line in lines[start + 2:]:  # (its header line first)
        if not line.startswith("  ") or line.startswith("  values:") or line.endswith(":"):
            break
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return rows


def test_adamw_with_clipping_every_step_verified_clipped_and_excellent(capsys, tmp_path):
    factors = train(tmp_path)
    assert len(factors) == STEPS and max(factors) < 1.0  # every step clipped
    code, out, err = report(capsys, tmp_path)
    assert code == 0, err
    assert f"optimizer step: verified after {STEPS} of {STEPS} checks, AdamW replayed in float64" in out.splitlines()
    assert out.count("optimizer step:") == 1

    code, doc, _ = report(capsys, tmp_path, "--format", "json")
    update = json.loads(doc)["update"]
    assert update["verified_steps"] == list(range(STEPS)) and update["algorithms"] == {"AdamW": STEPS}
    assert update["clipping"]["factors"] == pytest.approx(factors, rel=1e-5)  # the factors clip_grad_norm_ applied
    assert update["clipping"]["thresholds"] == [pytest.approx(THRESHOLD, rel=1e-4)] and update["clipping"]["problems"] == []
    low, high = min(update["clipping"]["factors"]), max(update["clipping"]["factors"])
    assert (f"clipping: by the global norm at {STEPS} of {STEPS} verified steps, factor {low:.3g} to {high:.3g}, "
            f"threshold {update['clipping']['thresholds'][0]:.4g}") in out.splitlines()
    assert f"threshold {THRESHOLD:g}" in out

    rows = table(out, "update (the step's update against AdamW's, replayed in float64")
    assert sorted(rows) == sorted(TENSORS), out
    for cells in rows.values():  # checks, first, last, worst, verdict, alerts, history
        assert cells[0] == str(STEPS) and cells[4] == "excellent" and cells[5] == "0", cells
    assert {t["tensor"]: t["worst_verdict"] for t in update["tensors"]} == dict.fromkeys(TENSORS, "excellent")
    assert all(len(t["history"]) == STEPS for t in update["tensors"])
    assert "Alerts: none" in out


def test_an_adamw_without_bias_correction_is_wrong_in_the_report(capsys, tmp_path):
    train(tmp_path, lambda m: NoBiasCorrection(m.parameters(), lr=1e-2, weight_decay=0.0))
    code, out, err = report(capsys, tmp_path)
    assert code == 0, err
    assert f"optimizer step: verified after {STEPS} of {STEPS} checks, AdamW replayed in float64" in out
    rows = table(out, "update (the step's update against AdamW's")
    assert {t: rows[t][4] for t in TENSORS} == dict.fromkeys(TENSORS, "WRONG"), out  # each tensor's last verdict
    assert rows["*"][5] == "1"  # the run's one update alert, on the whole step
    alert = next(line for line in out.splitlines() if "update/update" in line)
    assert "WRONG optimizer update" in alert and "not AdamW's" in alert, alert

    code, doc, _ = report(capsys, tmp_path, "--format", "json")
    worst = {t["tensor"]: t["worst_verdict"] for t in json.loads(doc)["update"]["tensors"] if t["tensor"] != "*"}
    assert worst == dict.fromkeys(TENSORS, "wrong")
    ratios = [e["ratio"] for t in json.loads(doc)["update"]["tensors"] for e in t["history"][:1]]
    assert ratios == [pytest.approx(0.1 / 0.001 ** 0.5, rel=2e-2)] * 4, ratios  # at step 1: m / sqrt(v), 3.16x AdamW's


def test_clipping_per_parameter_group_is_a_clipping_problem_in_the_report(capsys, tmp_path):
    def two_groups(m):
        return torch.optim.SGD([{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}], lr=0.1)

    train(tmp_path, two_groups, clip_per_group)
    code, out, _ = report(capsys, tmp_path)
    assert f"optimizer step: verified after {STEPS} of {STEPS} checks, SGD replayed in float64" in out
    line = next(line for line in out.splitlines() if line.startswith("clipping:"))
    assert line == (f"clipping: WRONG at {STEPS} of {STEPS} verified steps from step 0: tensors scaled by different "
                    "factors (see the alerts)"), line
    assert "update/clipping" in out


def test_a_run_without_optimizer_says_once_that_the_step_is_not_verified(capsys, tmp_path):
    train(tmp_path, watch_optimizer=False)
    code, out, _ = report(capsys, tmp_path)
    assert code == 0
    assert out.splitlines().count(NOT_VERIFIED) == 1 and out.count("optimizer step") == 1, out
    assert "update (" not in out and "clipping:" not in out
    code, doc, _ = report(capsys, tmp_path, "--format", "json")
    assert json.loads(doc)["update"]["verified_steps"] == []
    code, out, _ = report(capsys, tmp_path, "--source", "events")  # event files hold no update record: said so
    assert "optimizer step: not read from event files (see checks.jsonl)" in out.splitlines()


def test_the_html_page_has_the_update_map_and_lines(capsys, tmp_path):
    train(tmp_path / "run", lambda m: NoBiasCorrection(m.parameters(), lr=1e-2, weight_decay=0.0))
    page = tmp_path / "report.html"
    code, _, err = report(capsys, tmp_path / "run", "--html", page)
    assert code == 0 and "wrote" in err
    html = page.read_text(encoding="utf-8")
    maps = [m.split('"')[0] for m in html.split('id="verdict-map-')[1:]]
    assert maps == ["backward", "training", "update"], maps
    assert "<h3>Verdict map: update</h3>" in html and "by 4 steps verified after a check" in html
    assert f"optimizer step: verified after {STEPS} of {STEPS} checks, AdamW replayed in float64" in html
    flagged = html[html.index("Verdict map: update"):html.index("<h3>Summary</h3>")]
    assert all(f"<code>{t}</code></td><td class=\"wrong\">wrong</td>" in flagged for t in TENSORS), flagged


def test_a_step_the_watch_could_not_verify_is_said_with_why(capsys, tmp_path, monkeypatch):
    from gradwatch.watch.parts.update import UpdatePart

    judge, calls = UpdatePart._judge, []

    def fails_from_the_third(self, optimizer, at):  # gradwatch's own failure while judging the step: said, not raised
        calls.append(at["step"])
        if len(calls) > 2:
            raise RuntimeError("boom")
        return judge(self, optimizer, at)

    monkeypatch.setattr(UpdatePart, "_judge", fails_from_the_third)
    train(tmp_path / "late")
    code, out, _ = report(capsys, tmp_path / "late")
    assert code == 0
    assert (f"optimizer step: verified after 2 of {STEPS} checks, AdamW replayed in float64; then not verified from "
            "step 2 (see the alerts)") in out.splitlines(), out
    assert "update/not_checked" in out

    monkeypatch.setattr(UpdatePart, "_arm", lambda self, step: 1 / 0)  # watching it raised at the first check
    train(tmp_path / "never")
    code, out, _ = report(capsys, tmp_path / "never")
    assert "optimizer step: not verified: watching it raised ZeroDivisionError (step 0)" in out.splitlines(), out
    assert sum(line.startswith("optimizer step:") for line in out.splitlines()) == 1  # (the alert's lines below)
