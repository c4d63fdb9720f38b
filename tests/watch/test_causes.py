"""Never silent, never noisy (issue 73, items 1 and 2): one alert per cause, and a verdict never given said once.

- A hand-written accumulation loop on a tiny Llama whose ``loss_fn`` calls the model with ``labels`` where training
  called it without: the training verdict is never given; one ``not_checked`` alert names the difference and
  ``gradwatch report`` lists it. The same loop with matching calls gets both verdicts and no alert.
- One cause explaining many tensors is one alert (its count, its first names), updated at later checks, never
  repeated: the accumulation bug named by its cut over 4 checks, a wrong activation in one module of an MoE model
  named with the tensors upstream of it listed under it, a resumed run continuing the same alert.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from token_batches import TinyLM, token_loss, uneven_micro_batches
from token_batches import accumulation_run as accumulate

from gradwatch import GradWatch
from gradwatch.bands import Verdict
from gradwatch.check.judging.report import CheckReport, TensorCheck, TrainingCheck
from gradwatch.check.probes.experts import NOT_REACHED
from gradwatch.cli import main
from gradwatch.watch.trend import TrendTracker

# ---------------------------------------------------------------- a verdict never given


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    return model.train()


def summed(model, batch):
    """Training's loss: the model called with the ids and the mask only, a summed next-token cross-entropy."""
    logits = model(batch["input_ids"], batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, 50), batch["labels"][:, 1:].reshape(-1), reduction="sum")


def with_labels(model, batch):
    """The same loss through the model's own, called with the whole batch (labels too): another call of the model."""
    return model(**batch).loss * batch["labels"][:, 1:].numel()


def llama_loop(loss_fn, log_dir, steps: int = 5):
    """A correct hand-written loop, 2 micro-batches a step, each handed to the watch; a check at every step."""
    pytest.importorskip("transformers")
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    reports = []
    with GradWatch(model, loss_fn, every=1, log_dir=str(log_dir), tensorboard=False) as watch:
        for _ in range(steps):
            opt.zero_grad()
            for _ in range(2):
                ids = torch.randint(0, 50, (2, 10), generator=gen)
                batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
                (summed(model, batch) / 2).backward()
                watch.accumulate(batch)
            reports.append(watch.step())
            opt.step()
    return model, watch, reports


@pytest.mark.slow  # twice 5 checks of a tiny Llama, and gradwatch report: about 7 s
def test_a_loss_fn_calling_the_model_otherwise_is_one_not_checked_alert_naming_the_difference(tmp_path, capsys):
    model, watch, reports = llama_loop(summed, tmp_path / "matching")  # its twin, loss_fn calling as training does
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    for report in reports:  # both verdicts at every check, no alert
        assert {n for n, t in report.training.items() if t.verdict is not None} == names
        assert {n for n, t in report.tensors.items() if t.verdict is not None}
    assert watch.alerts == [], [a.message[:200] for a in watch.alerts]
    _, watch, reports = llama_loop(with_labels, tmp_path)
    assert all(r.training == {} for r in reports)  # the training verdict is never given...
    (alert,) = watch.alerts  # ...and said once (there was no alert at all: watch.alerts == [] read as both passed)
    assert (alert.kind, alert.part, alert.tensor, alert.severity, alert.step) == ("not_checked", "training", "*",
                                                                                "warning", 2)
    assert "the training verdict not checked" in alert.message
    assert "your loss_fn calls the model with labels=..., training called it without" in alert.message
    assert "check it instead: pass loss_fn the call training makes" in alert.message
    assert all("labels=..." in r.training_note for r in reports)  # each check record repeats why
    assert main(["report", str(tmp_path)]) == 0
    summary = capsys.readouterr().out.split("\n\n")[0]
    line = next(x for x in summary.splitlines() if x.startswith("not checked: the training verdict"))
    assert "labels=..., training called it without" in line and "pass loss_fn the call training makes" in line


def test_a_part_with_no_verdict_is_said_after_three_checks_once_and_resumes_counting():
    def inconclusive(step):
        t = TensorCheck("w", (2,), rel_diff=0.0, max_rel_error=0.0, inconclusive="every sample below resolution")
        return CheckReport(tensors={"w": t}, training_note="not verified: a draw of its own")

    tracker = TrendTracker()
    said = [[(a.kind, a.part) for a in tracker.update(s, inconclusive(s))] for s in range(2)]
    resumed = TrendTracker()
    resumed.load_state_dict(json.loads(json.dumps(tracker.state_dict())))  # the count goes on after a resume
    said += [[(a.kind, a.part) for a in resumed.update(s, inconclusive(s))] for s in range(2, 6)]
    assert said == [[], [], [("not_checked", "backward"), ("not_checked", "training")], [], [], []]


# ---------------------------------------------------------------- one cause, one alert


def four_uneven(gen):
    return uneven_micro_batches(4, gen)


def mean_over_k(model, micro, i):
    (token_loss(model, micro[i]) / len(micro)).backward()  # the 2024 bug: each micro-batch's own mean, over k


def test_an_accumulation_bug_is_one_alert_naming_the_cut_over_any_number_of_checks():
    model = TinyLM()
    watch = GradWatch(model, token_loss, every=1, tensorboard=False, jsonl=False)
    reports, _ = accumulate(model, watch, 12, four_uneven, mean_over_k)  # past alert_cooldown=10
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    (alert,) = watch.alerts  # was one per tensor at the first check, and again after the cooldown (10 alerts)
    assert (alert.kind, alert.part, alert.tensor, alert.step) == ("threshold", "training", "*", 0)
    assert "training weighs the 4 micro-batches equally, but they hold" in alert.message
    assert alert.count == len(names) and set(alert.tensors) == names
    (cause,) = watch.tracker.causes  # updated at each later check: its last step and how many checks found it
    assert (cause["where"], cause["first_step"], cause["last_step"], cause["checks"]) == ("*", 0, 11, 12)
    for report in reports:  # each tensor keeps its own verdict; each check's record says the cause again
        assert all(t.verdict is Verdict.WRONG or t.failed for t in report.training.values())
        assert [(c["where"], c["new"], c["count"]) for c in report.causes] == [("*", report is reports[0], len(names))]
    assert [r.causes[0]["last_step"] for r in reports] == list(range(12))
    assert all(len(h) == 12 for h in watch.tracker.training_history.values())


def training_report(ratio_words: str, names, step_ratio: float = 2.0) -> CheckReport:
    checks = {n: TrainingCheck(n, (2,), rel_diff=0.3, judged_rel_diff=0.3, verdict=Verdict.WRONG, failed=True,
                               ratio=step_ratio, diagnosis=ratio_words) for n in names}
    return CheckReport(tensors={}, training=checks)


def test_a_resumed_run_updates_the_alert_of_a_cause_it_said_instead_of_alerting_again():
    words = "training's gradient is {}x the objective's (constant ratio): a factor in the training loss"
    tracker = TrendTracker(alert_cooldown=0)  # a repeating per-tensor alert would come back at every check
    first = tracker.update(0, training_report(words.format("2.00"), ["a", "b", "c", "d"]))
    assert [(a.tensor, a.count, a.tensors[:2]) for a in first] == [("*", 4, ["a", "b"])]
    assert first[0].headline == "WRONG training .grad: 4 tensors, one cause, rel_diff up to 3.0e-01 (step 0)"
    assert first[0].why.startswith("one cause: training's gradient is 2.00x"), first[0].message
    assert "(a, b, c and 1 more)" in first[0].message
    resumed = TrendTracker(alert_cooldown=0)
    resumed.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    report = training_report(words.format("2.10"), ["a", "b"])  # the same cause, its figure moved with the step
    assert resumed.update(5, report) == []
    assert [(c["new"], c["last_step"], c["checks"], c["count"]) for c in report.causes] == [(False, 5, 2, 4)]
    assert len(resumed.training_history["a"]) == 2  # each tensor still recorded


def backward(name: str, value: float, diagnosis=None) -> TensorCheck:
    verdict = Verdict.from_value(value)
    return TensorCheck(name, (2,), rel_diff=value, max_rel_error=value, judged_rel_diff=value, verdict=verdict,
                       failed=verdict.rank >= 2, diagnosis=diagnosis)


def test_two_factors_in_two_modules_are_two_alerts_and_one_failing_tensor_alerts_as_before():
    tracker = TrendTracker()
    twice, half = "analytic is 2.00x numeric (constant ratio): a factor in backward is wrong", \
        "analytic is 0.50x numeric (constant ratio): a factor in backward is wrong"
    alerts = tracker.update(0, CheckReport(tensors={t.name: t for t in [
        backward("a.weight", 0.3, twice), backward("a.bias", 0.3, twice), backward("b.weight", 0.3, half),
        backward("b.bias", 0.3, half), backward("c.weight", 1e-9), backward("d.weight", 0.2, "odd")]}))
    assert [(a.tensor, a.count, a.tensors) for a in alerts] == [
        ("*", 2, ["a.weight", "a.bias"]), ("*", 2, ["b.weight", "b.bias"]), ("d.weight", 1, [])]


def test_a_module_named_by_its_failing_input_lists_the_upstream_tensors_under_its_alert():
    tracker = TrendTracker()
    differs = "analytic differs from numeric at 3 of 8 sampled entries, not by a constant factor (worst: ...)"
    checks = [backward("emb.weight", 3e-3, differs), backward("blocks.0.fc.weight", 2e-3, differs),
              backward("blocks.1.act:input", 0.2, differs), backward("head.weight", 1e-9)]
    alerts = tracker.update(0, CheckReport(tensors={t.name: t for t in checks}))
    (alert,) = alerts  # was one per failing tensor
    assert (alert.tensor, alert.kind, alert.severity, alert.count) == ("blocks.1.act", "threshold", "error", 3)
    assert alert.tensors == ["blocks.1.act:input", "emb.weight", "blocks.0.fc.weight"]
    assert alert.headline.startswith("WRONG backward gradient: blocks.1.act, one cause of 3 tensors")
    assert alert.why.startswith("one cause of 3 failing tensors (blocks.1.act:input, "), alert.message
    assert "2 of them upstream of it fail through it: emb.weight, blocks.0.fc.weight" in alert.message
    # the objective form at a later check, where no module is named: the same cause, no new alert
    later = CheckReport(tensors={t.name: t for t in checks[:2]})
    assert tracker.update(1, later) == [] and [c["where"] for c in later.causes] == ["blocks.1.act"]


@pytest.mark.slow  # one check of the whole objective, then its modules one at a time: about 15 s
def test_a_wrong_activation_in_one_module_is_one_alert_naming_it_with_the_upstream_tensors_under_it():
    pytest.importorskip("transformers")
    from test_experts import one_wrong_expert, plain_loop
    from test_moe_hooks import tiny_moe

    model = tiny_moe("olmoe")
    one_wrong_expert(model.model.layers[1].mlp.experts, 1)
    watch, (report,) = plain_loop(model, steps=1)
    failing = [t.name for t in report.failures]
    assert len(failing) > 10  # the objective form fails every tensor upstream of the wrong SiLU
    (alert,) = watch.alerts  # was one alert per failing tensor (24)
    assert (alert.tensor, alert.kind, alert.part, alert.severity) == ("model.layers.1.mlp.experts", "threshold",
                                                                      "backward", "error")
    assert set(alert.tensors) == set(failing) and alert.count == len(failing)
    assert alert.tensors[0] == "model.layers.1.mlp.experts.gate_up_proj[expert 1]"  # its own tensor first
    assert "of them upstream of it fail through it: model.embed_tokens.weight" in alert.message
    assert all(report.tensors[n].verdict is not None for n in failing)  # each tensor keeps its verdict



def test_tensors_never_given_a_verdict_while_others_get_theirs_are_said_once():
    """Item 1, per tensor: a tensor the check tries and leaves without a verdict at 3 checks in a row while the rest
    get theirs is one not_checked alert for its part, naming it and why, said once; an expert no token reached is
    no gap (not counted as checked, said elsewhere)."""
    tracker = TrendTracker()

    def report(step):
        r = CheckReport(tensors={
            "a": TensorCheck("a", (2,), 1e-9, 1e-9, judged_rel_diff=1e-9, verdict=Verdict.EXCELLENT),
            "b": TensorCheck("b", (2,), math.nan, math.nan,
                             inconclusive="the objective does not move along it at any step"),
            "e[expert 1]": TensorCheck("e[expert 1]", (2,), math.nan, math.nan, inconclusive=NOT_REACHED),
        })
        r.training = {"a": TrainingCheck(name="a", shape=(2,), judged_rel_diff=0.0, verdict=Verdict.EXCELLENT),
                      "b": TrainingCheck(name="b", shape=(2,), judged_rel_diff=0.0, verdict=Verdict.EXCELLENT)}
        return r

    said = [a for step in range(6) for a in tracker.update(step, report(step)) if a.kind == "not_checked"]
    assert [(a.step, a.part) for a in said] == [(2, "backward")], [a.message for a in said]
    assert "never given to 1 tensor (b) at 3 checks in a row, while the others got theirs: the objective does not " \
           "move along it" in said[0].message, said[0].message
    resumed = TrendTracker()
    resumed.load_state_dict(tracker.state_dict())
    assert [a for a in resumed.update(6, report(6)) if a.kind == "not_checked"] == []  # once for the run
