"""The planner: every op inside a checked unit, big parameters in row slices, a cycle of K checks, coverage.

- a bug in a composite module's own code (hand-written attention), in ``loss_fn``'s own code and in a
  few rows of a big Linear is caught and named by the module form;
- an embedding and an LM head over the room are checked by rows, only the slice copied;
- the cycle probes every unit and every row the data reaches within K checks;
- ``GradWatch.coverage`` matches a hand count.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch
from gradwatch.check.modules.module_form import run_module_check
from gradwatch.check.objective.terms import Objective
from gradwatch.cli import commands, main
from gradwatch.options import CheckOptions
from gradwatch.plan.cycle import ROWS_PER_SLICE, Cycle, row_slices
from gradwatch.plan.units import LOSS_FN, plan_units

VOCAB, WIDTH = 600, 16
# The planted bugs of the real-size benchmark: a softmax 10% off, a head's last rows, rare tokens dropped.
_bench = commands.load_bench(Path(__file__).resolve().parents[2] / "benchmarks" / "real_size.py")
BadSoftmax, RowBugLinear, RareDropEmbedding = _bench.BadSoftmax, _bench.RowBugLinear, _bench.RareDropEmbedding


class Attention(nn.Module):
    """Hand-written causal attention: the math between the projections is this module's own code."""

    def __init__(self, bug: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.bug = bug

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, 2, d // 2).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = (q @ k.transpose(-1, -2)) / math.sqrt(d // 2)
        a = a.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        a = BadSoftmax.apply(a) if self.bug else a.softmax(-1)
        return self.o((a @ v).transpose(1, 2).reshape(b, t, d))


def rare_drop_embedding(*args, **kwargs):
    """An Embedding whose custom backward drops the gradient of the rarest tokens (ids 590 and up)."""
    return RareDropEmbedding(*args, rare_from=590, **kwargs)


class LM(nn.Module):
    """Embedding, one pre-norm block with hand-written attention, an untied head of ``VOCAB`` rows."""

    def __init__(self, attention_bug: bool = False, head: type = nn.Linear, emb: type = nn.Embedding) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = emb(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.attn = Attention(attention_bug)
        self.head = head(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.attn(self.ln(x))
        return self.head(x)


def lm_loss(model, ids):
    return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def tokens(seed: int = 1, n: int = 2, t: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


def test_units_cover_own_code_leaves_and_loss_fn():
    units = {u.name: u for u in plan_units(LM(), lm_loss, tokens())}
    assert units[LOSS_FN].kind == "loss_fn"
    assert units[""].kind == "own" and units[""].stubbed == ("emb", "ln", "attn", "head")
    assert units["attn"].kind == "own" and units["attn"].stubbed == ("attn.q", "attn.k", "attn.v", "attn.o")
    assert all(units[n].kind == "module" for n in ("emb", "ln", "attn.q", "head"))
    assert sorted(units["head"].params) == ["head.bias", "head.weight"]


def test_a_bug_in_a_composite_modules_own_code_is_caught_and_named():
    with GradWatch(LM(attention_bug=True), lm_loss, every=1, log_dir=None, form="module") as watch:
        checks = 0
        for _ in range(3):  # K = 3: the whole units are spread over the checks the head's and embedding's blocks take
            watch.model.zero_grad()
            lm_loss(watch.model, tokens()).backward()
            report = watch.step(tokens())
            checks += 1
            if report.failures:
                break
    assert checks <= watch.cycle_length == 3
    failing = [m for m in report.localized if m.failed]
    assert [m.name for m in failing] == ["attn"] and "own code" in failing[0].type, str(report)
    assert failing[0].functions == ["BadSoftmax"]
    assert {t.name for t in report.failures} <= {"attn.q:output", "attn.k:output", "attn.v:output", "attn:input"}
    assert watch.alerts and all(a.tensor.startswith("attn") for a in watch.alerts if a.kind == "threshold")


def test_the_correct_model_gives_no_alert_over_a_whole_cycle():
    model = LM()
    with GradWatch(model, lm_loss, every=1, log_dir=None, form="module") as watch:
        for i in range(4):
            lm_loss(model, tokens(i)).backward()
            report = watch.step(tokens(i))
            model.zero_grad()
            assert report.ok, str(report)
    assert watch.alerts == []


def test_a_bug_in_loss_fn_own_code_is_caught():
    def bad_loss(model, ids):
        logits = model(ids).flatten(0, 1)
        return -BadSoftmax.apply(logits).gather(1, ids.flatten()[:, None]).log().mean()

    report = run_module_check(LM(), Objective(bad_loss), tokens(), CheckOptions())
    failing = [m for m in report.localized if m.failed]
    assert [m.name for m in failing] == [LOSS_FN] and failing[0].functions == ["BadSoftmax"]
    assert "<model>:output" in {t.name for t in report.failures}


def test_embedding_and_head_over_the_room_are_checked_by_rows():
    model, ids = LM(), tokens()
    units = plan_units(model, lm_loss, ids)
    cycle = Cycle({u.name: (VOCAB if u.name in ("emb", "head") else None) for u in units})
    assert cycle.slices["head"] == row_slices(VOCAB) and len(cycle.slices["head"]) == math.ceil(VOCAB / ROWS_PER_SLICE)
    report = run_module_check(model, Objective(lm_loss), ids, CheckOptions(), units=units, pieces=cycle.pieces(0))
    assert report.ok, str(report)
    (head_rows,) = [p for p in report.pieces if p.startswith("head[")]
    first, end = (int(v) for v in head_rows[5:-1].split(":"))
    assert report.tensors["head.weight"].shape == (end - first, WIDTH)  # only the slice was copied
    (emb_rows,) = [p for p in report.pieces if p.startswith("emb[")]
    lo, hi = (int(v) for v in emb_rows[4:-1].split(":"))
    used = torch.unique(ids[(ids >= lo) & (ids < hi)])
    if used.numel():
        assert report.tensors["emb.weight"].shape == (used.numel(), WIDTH)  # the rows the batch uses in the slice
    probed = dict((n, r) for n, r in report.probed if n == "head.weight")
    assert probed["head.weight"] == (first, end)


def test_a_custom_linears_backward_is_checked_in_place_on_its_row_blocks():
    """A block of a Linear subclass with its own forward is checked on the module at its full size, only the
    block's rows moved (a copy holding only those rows would run another computation): the planted bug (the
    last 4 rows of the weight its backward is given) shows in the block that holds rows 596:600 only, within K."""
    model = LM(head=RowBugLinear)
    caught = []
    with GradWatch(model, lm_loss, every=1, log_dir=None, form="module") as watch:
        for i in range(3):
            lm_loss(model, tokens(i)).backward()
            report = watch.step(tokens(i))
            model.zero_grad()
            heads = [m for m in report.localized if m.name == "head"]
            assert heads and all("(in place)" in m.type for m in heads), [m.type for m in heads]
            failing = [m for m in report.localized if m.failed]
            if failing:
                caught.append(i)
                assert [m.name for m in failing] == ["head"] and failing[0].functions == ["_RowBug"]
                assert "head.weight" in {t.name for t in report.failures}
                assert any(p.startswith("head[") and p.endswith(":600]") for p in report.pieces), report.pieces
        assert watch.cycle_length == 3 and len(caught) == 1, caught  # once in the K checks: its block's turn


def test_rare_tokens_dropped_by_an_embedding_subclass_are_caught_within_k():
    """An Embedding subclass is checked at its full size with only the block's rows moved: a backward that drops
    the rarest ids (590 and up) is caught when the cycle reaches their block, within K, and only then."""
    model = LM(emb=rare_drop_embedding)
    rare = torch.tensor([[595, 3, 7, 11, 13, 17, 19, 23]])
    with GradWatch(model, lm_loss, every=1, log_dir=None, form="module") as watch:
        caught = []
        for i in range(3):
            batch = torch.cat([tokens(i, n=1), rare])
            lm_loss(model, batch).backward()
            report = watch.step(batch)
            model.zero_grad()
            failing = [m for m in report.localized if m.failed]
            if failing:
                caught.append(i)
                assert [m.name for m in failing] == ["emb"] and "in place" in failing[0].type, str(report)
                assert "emb.weight" in {t.name for t in report.failures}
                assert any(p.startswith("emb[400:600]") for p in report.pieces)
        assert watch.cycle_length == 3 and len(caught) == 1  # the block of rows 400:600, once in the K checks


def test_the_cycle_probes_every_piece_once_per_pass():
    cycle = Cycle({"a": None, "b": None, "c": 100, "head": 1000, "emb": 5000}, per_check=1, seed=3)
    for pass_no in range(2):
        seen = [str(p) for i in range(cycle.length) for p in cycle.pieces(pass_no * cycle.length + i)]
        expected = ["a", "b", "c"] + [f"head[{a}:{b}]" for a, b in row_slices(1000)] + \
            [f"emb[{a}:{b}]" for a, b in row_slices(5000)]
        assert set(seen) == set(expected)  # every piece within K checks
        slices = [p for p in seen if "[" in p]
        assert len(slices) == len(set(slices))  # each slice once a pass: drawn without replacement
    assert cycle.length == 8 and cycle.take["emb"] == math.ceil(len(row_slices(5000)) / 8)


def test_coverage_matches_a_hand_count_and_reaches_every_reached_row_within_k():
    model, ids = LM(), tokens()
    with GradWatch(model, lm_loss, every=1, log_dir=None, form="module") as watch:
        lm_loss(model, ids).backward()
        report = watch.step(ids)
        k = watch.cycle_length
        assert k == len(row_slices(VOCAB))  # 3 slices of 200 rows, one of each big unit per check
        (head_rows,) = [p for p in report.pieces if p.startswith("head[")]
        first, end = (int(v) for v in head_rows[5:-1].split(":"))
        cov = watch.coverage
        assert cov["head.weight"] == {"backward": round((end - first) / VOCAB, 6), "training": 1.0}
        # the whole units are spread over the K checks: each is checked once a pass, its tensors whole
        whole = {"ln": ("ln.weight",), "attn": ("attn.q.weight",)}
        for unit, names in whole.items():
            for name in names:
                assert cov[name] == {"backward": 1.0 if unit in report.pieces else 0.0, "training": 1.0}, (name, report.pieces)
        for _ in range(k - 1):
            watch.step(ids)
        cov = watch.coverage
        assert all(v == {"backward": 1.0, "training": 1.0} for n, v in cov.items() if n != "emb.weight"), cov
        used = torch.unique(ids).numel()
        assert cov["emb.weight"]["backward"] == round(used / VOCAB, 6)  # the rows the data reached, no more
        assert watch.planner.coverage.unreached("emb.weight") == VOCAB - used
        # 8 whole units, 3 a check: each once in the pass, the first again at its last check
        assert watch.modules_checked["attn"] == 1 and watch.modules_checked[LOSS_FN] == 2
        whole_units = watch.planner._cycle.whole
        assert len(whole_units) == 8 and all(watch.modules_checked[u] >= 1 for u in whole_units)
        assert sum(watch.modules_checked[u] for u in whole_units) == 3 * k


@pytest.mark.parametrize("every", [1])
def test_k_is_said_once_and_recorded(tmp_path, every, caplog):
    import json

    model, ids = LM(), tokens()
    with caplog.at_level("INFO", logger="gradwatch"):
        with GradWatch(model, lm_loss, every=every, log_dir=str(tmp_path), tensorboard=False, form="module") as watch:
            for _ in range(2):
                lm_loss(model, ids).backward()
                watch.step(ids)
    said = [r.getMessage() for r in caplog.records if "checked within K" in r.getMessage()]
    assert len(said) == 1 and "within K = 3 checks (about 3 steps)" in said[0]
    checks = [json.loads(line) for line in (tmp_path / "checks.jsonl").read_text().splitlines()]
    checks = [c for c in checks if c["type"] == "check"]
    assert [c["cycle_length"] for c in checks] == [3, 3]
    assert checks[-1]["coverage"]["ln.weight"] == {"backward": 1.0, "training": 1.0}


def test_report_and_tensorboard_show_coverage_and_what_was_not_checked(tmp_path, capsys):
    import threading

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Locked(nn.Module):
        """A leaf that cannot be copied alone (it holds a lock): named as not checked, never skipped silently."""

        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()

        def forward(self, x):
            return torch.tanh(x)

    model, ids = LM(), tokens()
    model.ln = nn.Sequential(model.ln, Locked())
    with GradWatch(model, lm_loss, every=1, log_dir=str(tmp_path), form="module") as watch:
        reports = []
        for _ in range(3):
            lm_loss(model, ids).backward()
            reports.append(watch.step(ids))
            model.zero_grad()
    notes = [n for r in reports for n in r.notes]
    assert any("`ln.1` (Locked) not checked: cannot copy module Locked alone" in n for n in notes), notes
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "coverage after 3 checks (K = 3, about 3 steps): backward" in out
    assert "not checked: `ln.1` (Locked) in the backward part, never checked in the run (1 check planned it): cannot copy" in out
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    backward = [e.value for e in acc.Scalars("gradwatch/coverage/backward")]
    assert len(backward) == 3 and backward[0] < backward[1] <= 1.0  # the second check probed more rows
    assert [e.value for e in acc.Scalars("gradwatch/coverage/training")] == [1.0, 1.0, 1.0]
    assert [e.value for e in acc.Scalars("gradwatch/coverage/cycle_length")] == [3.0, 3.0, 3.0]


def test_auto_weighs_the_forms_measured_cost_where_the_whole_objective_fits():
    from gradwatch.plan.planner import Planner

    model = LM()
    names = [n for n, _ in model.named_parameters()]

    def choose(planner, plain=True):
        return planner.choose_form(model, names, None, torch.float64, False, 0, False, plain=plain)

    planner = Planner()
    assert choose(planner)[0] == "objective"  # nothing timed yet: the whole objective, where it fits
    planner.timed("objective", 4.0)
    assert choose(planner)[0] == "objective"  # under 5 s: the whole objective's fuller view stays
    planner.timed("objective", 12.0)
    form, estimate, note = choose(planner)
    assert (form, estimate) == ("module", None) and "timed against it once" in note
    assert choose(planner, plain=False)[0] == "objective"  # regularizers, weight decay: only the whole objective
    planner.timed("module", 0.8)
    assert choose(planner)[0] == "module" and "against 12.0 s a check of the whole objective" in choose(planner)[2]
    planner.timed("module", 30.0)
    assert choose(planner)[0] == "objective"
    assert Planner(form="objective").choose_form(model, names, None, torch.float64, False, 0, False, plain=True)[0] \
        == "objective"
