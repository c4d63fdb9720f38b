"""One step, one objective: the training verdict judges a step's .grad against the loss over its whole batch.

In a plain loop with gradient accumulation (``watch.accumulate`` per micro-batch), on padded,
variable-length token batches: each bug class that weighs the step's items unequally raises a
training alert at the first check naming the cut and its counts; each correct form raises nothing
over several checks; where the cut legitimately matters (train-mode BatchNorm, a loss that couples
the samples of a batch, ``items="micro_batches"``) the step is judged per micro-batch and says so.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from token_batches import TinyLM, all_targets, padded_batch, targets, token_loss, uneven_micro_batches
from token_batches import accumulation_run as train
from torch import nn

from gradwatch import GradWatch
from gradwatch.check.replay.cut import Part, explain_cut
from gradwatch.check.replay.item_probe import SUM_KEY, decide
from gradwatch.check.replay.items import ItemRule, candidates, step_weights
from gradwatch.errors import ConfigError


def watch_of(model, loss_fn=token_loss, **kw):
    return GradWatch(model, loss_fn, every=1, tensorboard=False, jsonl=False, **kw)


def four_uneven(gen):
    return uneven_micro_batches(4, gen)


def mean_over_k(model, micro, i):
    (token_loss(model, micro[i]) / len(micro)).backward()  # the 2024 bug: each micro-batch's own mean, over k


def sum_over_step(model, micro, i):
    (token_loss(model, micro[i], "sum") / sum(targets(b) for b in micro)).backward()  # the fix


def first_alert(watch):
    training = [a for a in watch.alerts if a.part == "training"]
    assert training, f"no training alert; alerts: {[a.message[:120] for a in watch.alerts]}"
    return training[0]


# ---------------------------------------------------------------------------- bug classes
def test_each_micro_batch_mean_over_k_is_named_with_its_counts():
    model = TinyLM()
    watch = watch_of(model)
    reports, micro = train(model, watch, 1, four_uneven, mean_over_k)
    alert = first_alert(watch)
    assert alert.step == 0 and alert.severity == "error"
    counts = [targets(b) for b in micro[0]]
    held = ", ".join(map(str, counts[:-1])) + f" and {counts[-1]}"
    assert f"training weighs the 4 micro-batches equally, but they hold {held} target tokens (labels[..., 1:] != -100)" in alert.message
    ratio = max(counts) / min(counts)
    assert re.search(rf"a target token in micro-batch \d counts {ratio:.1f}x one in micro-batch \d", alert.message)
    assert f"divide each micro-batch's summed loss by {sum(counts)}" in alert.message
    assert all(t.failed for t in reports[0].training.values())
    assert reports[0].training_items == {"rule": "target tokens (labels[..., 1:] != -100)", "equal": False,
                                         "counts": [[float(c) for c in counts]]}


def test_sample_means_over_k_with_unequal_micro_batches_are_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    ce = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    watch = watch_of(model, ce)
    sizes = [2, 6, 3, 5]

    def make(gen):
        return [(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)) for n in sizes]

    train(model, watch, 1, make, lambda m, micro, i: (ce(m, micro[i]) / len(micro)).backward())
    assert "training weighs the 4 micro-batches equally, but they hold 2, 6, 3 and 5 samples" in first_alert(watch).message


def test_partial_window_divided_by_the_full_window_is_named():
    torch.manual_seed(0)
    model = TinyLM()
    watch = watch_of(model)

    def make(gen):  # equal micro-batches: only the divisor is off
        return [padded_batch([8, 8], gen) for _ in range(3)]

    train(model, watch, 1, make, lambda m, micro, i: (token_loss(m, micro[i]) / 4).backward())
    msg = first_alert(watch).message
    assert "each of the step's 3 micro-batches is divided by 4, the full accumulation window" in msg
    assert "0.750x the step's" in msg


def test_a_count_that_includes_the_first_labels_is_named():
    model = TinyLM()
    watch = watch_of(model)

    def off_by_one(m, micro, i):  # the step's count taken before the next-token shift: one label per row too many
        (token_loss(m, micro[i], "sum") / sum(all_targets(b) for b in micro)).backward()

    _, micro = train(model, watch, 1, four_uneven, off_by_one)
    msg = first_alert(watch).message
    wrong, right = sum(all_targets(b) for b in micro[0]), sum(targets(b) for b in micro[0])
    assert (f"training divides by {wrong}, the step's target tokens (labels != -100), where loss_fn averages over "
            f"{right} target tokens (labels[..., 1:] != -100)") in msg


# ---------------------------------------------------------------------------- correct forms
def test_token_sum_over_the_step_count_is_clean():
    model = TinyLM()
    watch = watch_of(model)
    reports, _ = train(model, watch, 4, four_uneven, sum_over_step)
    assert watch.alerts == []
    for r in reports:
        assert r.training and all(t.verdict.value == "excellent" for t in r.training.values())
        assert r.training_note.startswith("the step's objective: the mean over its")


def test_equal_micro_batches_divided_by_k_give_the_same_bits():
    model = TinyLM()
    watch = watch_of(model)

    def make(gen):
        return [padded_batch([6, 6], gen) for _ in range(4)]

    reports, _ = train(model, watch, 4, make, mean_over_k)
    assert watch.alerts == []
    assert all(t.rel_diff == 0.0 for r in reports for t in r.training.values())


def test_batchnorm_with_accumulation_is_judged_per_micro_batch():
    model = TinyLM(norm="batch")
    watch = watch_of(model)
    reports, _ = train(model, watch, 4, four_uneven, mean_over_k)
    assert watch.alerts == []
    assert all(r.training and r.training_items["equal"] for r in reports)
    assert "BatchNorm in train mode (norm)" in reports[0].training_note
    assert "judged per micro-batch" in reports[0].training_note


def test_a_loss_that_couples_the_samples_is_judged_per_micro_batch():
    """An in-batch contrastive loss: the union of two samples is no weighted sum of them alone (the probe says so)."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))

    def contrastive(m, b):
        a, p = F.normalize(m(b[0]), dim=-1), F.normalize(m(b[1]), dim=-1)
        return F.cross_entropy(a @ p.T / 0.1, torch.arange(len(a)))

    watch = watch_of(enc, contrastive)
    sizes = [3, 5, 4]

    def make(gen):
        out = []
        for n in sizes:
            x = torch.randn(n, 6, generator=gen)
            out.append((x, x + 0.1 * torch.randn(n, 6, generator=gen), (torch.rand(n, 4, generator=gen) > 0.5).long()))
        return out

    reports, _ = train(enc, watch, 4, make, lambda m, micro, i: (contrastive(m, micro[i]) / len(micro)).backward())
    assert watch.alerts == [], [a.message[:200] for a in watch.alerts]
    assert "couples the samples of a batch" in reports[0].training_note


def test_items_micro_batches_judges_the_mean_of_micro_batch_means():
    model = TinyLM()
    watch = watch_of(model, items="micro_batches")
    reports, _ = train(model, watch, 4, four_uneven, mean_over_k)
    assert watch.alerts == []
    assert "items='micro_batches'" in reports[0].training_note


def test_items_callable_declares_the_count():
    model = TinyLM()
    watch = watch_of(model, items=targets)
    reports, _ = train(model, watch, 4, four_uneven, sum_over_step)
    assert watch.alerts == [] and watch.step_objective.decision is None  # declared: no probe
    assert reports[0].training_items["rule"] == "items (counted by items=)"
    bad = watch_of(TinyLM(), items=targets)
    train(bad.model, bad, 1, four_uneven, mean_over_k)
    assert "weighs the 4 micro-batches equally" in first_alert(bad).message


def test_items_that_raise_leave_the_training_part_not_judged_and_training_going():
    model = TinyLM()
    watch = watch_of(model, items=lambda b: b["missing"])
    reports, _ = train(model, watch, 2, four_uneven, sum_over_step)
    assert all(r.training == {} for r in reports)
    assert "not judged: counting the step's items failed: items(batch) raised KeyError" in reports[0].training_note
    with pytest.raises(ConfigError, match="items: got 'tokens', expected one of auto, micro_batches, samples"):
        watch_of(TinyLM(), items="tokens")


# ---------------------------------------------------------------------------- the pure parts
def test_candidates_counts_and_weights():
    gen = torch.Generator().manual_seed(0)
    b = padded_batch([5, 2], gen)
    keys = [r.key for r in candidates([b])]
    assert keys == ["samples::0", "mask:attention_mask:0", "mask:attention_mask:1", "tokens:labels:0", "tokens:labels:1"]
    assert [ItemRule("tokens", ("labels",), s).count(b) for s in (0, 1)] == [7.0, 5.0]
    assert step_weights([[1, 3], [4]], 2) == [[0.25, 0.75], [1.0]]


@pytest.mark.parametrize("reduction, expected", [("mean", "tokens:labels:1"), ("sum", SUM_KEY), ("rows", "samples::0")])
def test_the_probe_decides_what_a_loss_averages_over(reduction, expected):
    torch.manual_seed(0)
    model = TinyLM()
    params = [p for p in model.parameters()]

    def loss(batch):
        if reduction == "rows":  # the mean over rows of each row's token mean
            logits = model(batch["input_ids"])[:, :-1]
            per = F.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100, reduction="none")
            return (per.sum(1) / (batch["labels"][:, 1:] != -100).sum(1)).mean()
        return token_loss(model, batch, reduction)

    def evaluate(batch):
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss(batch), params)]).double()

    micro = uneven_micro_batches(2, torch.Generator().manual_seed(3), sizes=(3, 3))
    decision = decide(evaluate, micro, candidates(micro))
    assert decision.survivors == [expected] and decision.coupled is None


def test_explain_cut_names_ranks_weighed_alike():
    g = torch.eye(2, dtype=torch.float64)
    parts = [Part(0, 0, 57.0), Part(1, 0, 210.0)]
    text = explain_cut(parts, g, g.mean(0), ItemRule("tokens", ("labels",), 1), world=2)
    assert text.startswith("training weighs the 2 ranks equally, but rank 0 holds 57 and rank 1 holds 210 target tokens")
    assert "a target token on rank 0 counts 3.7x one on rank 1" in text
    assert explain_cut(parts, g, torch.tensor([57.0, 210.0], dtype=torch.float64) / 267, ItemRule("samples"), 2) is None


def test_a_batch_without_countable_tensors_is_weighed_alike_and_says_so():
    class Box:  # a batch type gradwatch does not read
        def __init__(self, x, y):
            self.x, self.y = x, y

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ce = lambda m, b: F.cross_entropy(m(b.x), b.y)  # noqa: E731
    watch = watch_of(model, ce)

    def make(gen):
        return [Box(torch.randn(n, 4, generator=gen), torch.randint(0, 2, (n,), generator=gen)) for n in (2, 5, 3)]

    reports, _ = train(model, watch, 2, make, lambda m, micro, i: (ce(m, micro[i]) / 3).backward())
    assert watch.alerts == [] and all(r.training and r.training_items["equal"] for r in reports)
    assert "the batch holds no tensor gradwatch counts items in" in reports[0].training_note


@pytest.mark.parametrize("form", ["mean_over_k", "sum_over_step"])
def test_one_row_micro_batches_without_padding(form):
    """Batch 1 x 8 accumulation steps (TRL #2175): no row is padded, so no label is -100 yet; the labels are still
    what the loss counts (the probe masks some to tell), and the rows' lengths weigh the step."""
    model = TinyLM()

    def make(gen):
        return [padded_batch([int(torch.randint(3, 30, (1,), generator=gen))], gen) for _ in range(8)]

    watch = watch_of(model)
    train(model, watch, 4, make, mean_over_k if form == "mean_over_k" else sum_over_step)
    assert watch.step_objective.decision.rule == ItemRule("tokens", ("labels",), 1)
    if form == "sum_over_step":
        assert watch.alerts == []
    else:
        assert "training weighs the 8 micro-batches equally, but they hold" in first_alert(watch).message


def test_labels_shifted_by_the_data_are_counted_unshifted():
    """Inputs ids[:-1] and labels ids[1:] (the data shifts, the loss does not): the probe finds no shift."""
    def loss(model, b, reduction="mean"):
        logits = model(b["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction=reduction)

    def make(gen):
        return [{"input_ids": b["input_ids"][:, :-1], "labels": b["labels"][:, 1:]} for b in uneven_micro_batches(4, gen)]

    def right(model, micro, i):
        (loss(model, micro[i], "sum") / sum(int((b["labels"] != -100).sum()) for b in micro)).backward()

    model = TinyLM()
    watch = watch_of(model, loss)
    reports, _ = train(model, watch, 4, make, right)
    assert watch.alerts == [] and watch.step_objective.decision.rule == ItemRule("tokens", ("labels",))
    assert reports[0].training_items["rule"] == "target tokens (labels != -100)"
