"""GradWatch on a ``torch.compile``'d model: the user's names everywhere, the compiled graph replayed, eager checks.

``torch.compile(model)`` returns an ``OptimizedModule`` whose parameters are named ``_orig_mod.<name>``. The watch
looks through it: ``tensors=`` patterns, reports, ``checks.jsonl``, TensorBoard tags and alerts use the model's own
names; the training part's replay runs the compiled module (what training ran), and the check's float64
evaluations run the eager original (no recompilation for float64). Cheap backends only (``aot_eager`` and a
counting backend over the traced graph); inductor costs half a minute on two cores. No mocks.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import sgd_loop
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from gradwatch import GradWatch
from gradwatch.check.probes.batched import batched_state

NAMES = ["0.weight", "0.bias", "3.weight", "3.bias"]


class Scaled(torch.autograd.Function):
    """tanh with a hand-written backward ``factor`` times the true one (1.0: correct)."""

    factor = 1.0

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y) * Scaled.factor


class Act(nn.Module):
    def forward(self, x):
        return Scaled.apply(x)


def model_with(dropout=0.2):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Act(), nn.Dropout(dropout), nn.Linear(8, 3))


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def train(compiled, model, watch, data):
    return sgd_loop(compiled, watch, loss_fn, data, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    Scaled.factor = 1.0
    yield
    Scaled.factor = 1.0
    torch._dynamo.reset()


def test_names_patterns_records_and_tags_are_the_users(tmp_path):
    model = model_with()
    compiled = torch.compile(model, backend="aot_eager")
    watch = GradWatch(compiled, loss_fn, every=1, tensors=["0.*"], log_dir=tmp_path)  # refused before: `_orig_mod.0.*`
    assert watch.model is model
    reports = train(compiled, model, watch, batches(2))
    watch.close()
    assert watch.alerts == []
    for report in reports:
        assert list(report.tensors) == ["0.weight", "0.bias"] and list(report.training) == ["0.weight", "0.bias"]
        assert report.ok and all(t.verdict is not None for t in report.training.values()), report.training_note
    records = [json.loads(line) for line in (tmp_path / "checks.jsonl").read_text().splitlines()]
    assert "_orig_mod" not in json.dumps(records) and "0.weight" in json.dumps(records)
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "gradwatch/rel_diff/0.weight" in tags and not any("_orig_mod" in t for t in tags)


def test_both_verdicts_replay_the_compiled_graph_and_the_check_runs_eager():
    runs = {"compiled": 0, "ran": 0}

    def backend(gm, example_inputs):  # a real backend: the traced graph, counted
        runs["compiled"] += 1

        def run(*args):
            runs["ran"] += 1
            return gm.forward(*args)

        return run

    torch.manual_seed(0)  # no custom Function, no dropout: the check's evaluations can batch (vmap)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
    compiled = torch.compile(model, backend=backend)
    watch = GradWatch(compiled, loss_fn, every=1, tensorboard=False, jsonl=False)
    reports = train(compiled, model, watch, batches(3))
    assert watch.alerts == []
    names = ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    for report in reports:
        assert list(report.tensors) == names and list(report.training) == names
        assert report.ok and all(t.rel_diff == 0.0 for t in report.training.values())  # the same graph, the same bits
    # Three training forwards and three replays ran the compiled graph; the float64 checks ran the eager model,
    # batched under vmap, so nothing was compiled again and training kept its compiled graph.
    assert runs == {"compiled": 1, "ran": 6}
    assert batched_state(model)["batches"] > 0


def test_a_planted_backward_bug_in_a_compiled_model_is_named():
    Scaled.factor = 1.5
    model = model_with()
    compiled = torch.compile(model, backend="aot_eager")
    watch = GradWatch(compiled, loss_fn, every=1, tensorboard=False, jsonl=False)
    (report,) = train(compiled, model, watch, batches(1))
    for name in ("0.weight", "0.bias"):
        assert report.tensors[name].failed and "1.50x" in report.tensors[name].diagnosis, str(report)
    assert not any(report.training[n].failed for n in NAMES)  # training applied what its backward computes
    # one cause of both, one alert (issue 73: it was one per tensor)
    assert [(a.tensor, a.tensors) for a in watch.alerts] == [("*", ["0.weight", "0.bias"])]


def test_a_fabric_module_of_a_compiled_model():
    fabric_mod = pytest.importorskip("lightning.fabric")
    fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    model = model_with()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fmodel, fopt = fabric.setup(torch.compile(model, backend="aot_eager"), opt)  # _FabricModule(OptimizedModule(model))
    watch = GradWatch(fmodel, loss_fn, every=1, tensors=["3.*"], tensorboard=False, jsonl=False)
    assert watch.model is model
    for batch in batches(2):
        fopt.zero_grad()
        fabric.backward(loss_fn(fmodel, batch))
        report = watch.step(batch)
        fopt.step()
        assert list(report.tensors) == ["3.weight", "3.bias"] and list(report.training) == ["3.weight", "3.bias"]
        assert report.ok and all(t.verdict is not None for t in report.training.values()), report.training_note
        assert {t.dtype for t in report.training.values()} == {"bfloat16"}  # recorded inside Fabric's autocast
    assert watch.alerts == []
