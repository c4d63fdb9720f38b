"""check_independence on planted leaks of the four structures, each judged against brute force.

Every planted model (``tests/independence_models.py``) is a small token LM whose block 1 mixer is
correct or leaks; the ground truth is brute force (change the forbidden token ids, look at the
outputs that must not move). Each leak must be flagged with its structure and the module it starts
in; each correct twin, train-mode BatchNorm and an ``allow=``-ed module must give no alarm; and the
model's state must be bit-identical after every call.
"""

from __future__ import annotations

import copy
from typing import Any, Dict

import pytest
import torch
from independence_models import MIXERS, TinyLM, inputs_for, leaks
from torch import nn

from gradwatch import IndependenceReport, check_independence
from gradwatch.check.independence.structures import (
    batch_probes,
    causal_probes,
    document_probes,
    documents_from_positions,
    padding_probes,
    parse_structures,
)

STRUCTURE_OF = {  # which structure each kind is checked for (its own, or its leaky twin's)
    "causal_ok": "causal", "sdpa_ok": "causal", "conv_causal_ok": "causal", "norm_over_features_ok": "batch",
    "flat_batch_attention_ok": "batch", "seq_first_transpose_ok": "batch", "documents_ok": "documents",
    "padding_ok": "padding", "mean_context_ok": "padding",
}


def _state(model: nn.Module) -> Dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "modes": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        return x == y
    return all(eq(a[k], b[k]) for k in a)


def _check(kind: str, **extra: Any) -> Any:
    torch.manual_seed(0)
    model = TinyLM(kind).train()
    structure = model.breaks or STRUCTURE_OF[kind]
    inputs = inputs_for(structure)
    kwargs = {"document_ids": inputs["document_ids"]} if structure == "documents" else {}
    model(**inputs).sum().backward()  # .grad present: the check must leave it alone
    before = _state(model)
    report = check_independence(model, inputs, structure, **kwargs, **extra)
    assert _same(before, _state(model)), f"{kind}: the model's state changed"
    return model, inputs, structure, report


@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_each_planted_leak_is_flagged_like_brute_force_with_its_structure_and_module(kind):
    model, inputs, structure, report = _check(kind)
    truth = leaks(copy.deepcopy(model), inputs, structure)
    assert truth == (model.breaks is not None), f"{kind}: the planted case is not what brute force says"
    assert isinstance(report, IndependenceReport)
    assert report.ok == (not truth), f"{kind}:\n{report}"
    if truth:
        worst = report.worst
        assert worst is not None and worst.structure == structure
        assert worst.module is not None and worst.module.startswith("blocks.1.mixer"), f"{kind}:\n{report}"
        assert worst.change > 1e-5 and worst.gradient > 1e-6
        assert "LEAK" in str(report) and structure in str(report)
    else:
        assert report.results[structure].probes > 0 and report.worst is None


def test_leaks_of_at_least_ten_kinds_across_the_four_structures():
    planted = {k: v[1] for k, v in MIXERS.items() if v[1] is not None}
    assert len(planted) >= 10 and set(planted.values()) == {"batch", "causal", "documents", "padding"}


def test_an_allowed_module_is_expected_not_a_leak():
    _, _, _, report = _check("roll_over_batch", allow=["blocks.1.mixer"])
    assert report.ok and report.worst is None
    assert [v.module for v in report.expected] == ["blocks.1.mixer"]
    assert "expected (allow=)" in str(report)
    _, _, _, by_class = _check("roll_over_batch", allow=[type(TinyLM("roll_over_batch").blocks[1].mixer)])
    assert by_class.ok


def test_train_mode_batchnorm_gives_no_alarm_and_says_why():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).train()
    x = torch.randn(6, 5)
    before = _state(model)
    report = check_independence(model, x, "batch")
    assert report.ok and report.results["batch"].probes == 6  # 2 * ceil(log2 6)
    assert any("BatchNorm1d" in n and "by design" in n for n in report.notes)
    assert _same(before, _state(model))  # running statistics and num_batches_tracked untouched


def test_a_batch_leak_in_a_float_input_model_is_caught_and_placed():
    class Center(nn.Module):
        def forward(self, x):
            return x - x.mean(0, keepdim=True)  # statistics of the batch, in eval mode too

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), Center(), nn.Linear(8, 3))
    report = check_independence(model, torch.randn(4, 5), "batch")
    assert not report.ok
    assert report.worst.module == "1"
    assert report.worst.structure == "batch"


def test_a_leak_in_the_models_own_forward_is_placed_there_and_held_generators_are_put_back():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)
            self.gen = torch.Generator().manual_seed(3)

        def forward(self, x):
            h = self.a(x) + 0.01 * torch.randn(x.shape[0], 8, generator=self.gen)  # noise from its own generator
            return self.b(h - h.mean(0, keepdim=True))  # the batch mixed in the model's own code

    torch.manual_seed(0)
    model = Noisy()
    state = model.gen.get_state()
    report = check_independence(model, torch.randn(4, 5), "batch")
    assert not report.ok
    assert report.worst.module == ""
    assert "in the model's own forward" in str(report)
    assert torch.equal(model.gen.get_state(), state)


def test_bad_arguments_name_what_would_be_accepted():
    model = TinyLM("causal_ok")
    ids = inputs_for("causal")["input_ids"]
    with pytest.raises(ValueError, match="structure: got 'casual'.*batch, causal, documents, padding"):
        check_independence(model, ids, "casual")
    with pytest.raises(ValueError, match="documents.*needs document_ids="):
        check_independence(model, ids, "documents")
    with pytest.raises(ValueError, match="padding.*needs attention_mask="):
        check_independence(model, ids, "padding")
    with pytest.raises(ValueError, match="allow: no module named 'nope'"):
        check_independence(model, ids, "causal", allow=["nope"])
    with pytest.raises(ValueError, match="attention_mask: got shape"):
        check_independence(model, ids, "padding", attention_mask=torch.ones(2, 2))
    with pytest.raises(TypeError, match="inputs: got str"):
        check_independence(model, "tokens", "causal")


def test_no_padding_in_the_batch_is_said_not_claimed():
    model = TinyLM("padding_ok")
    inputs = inputs_for("causal")  # an all-ones mask
    report = check_independence(model, inputs, "padding")
    assert report.ok and report.results["padding"].probes == 0
    assert "no padded position" in report.results["padding"].note


def test_the_report_is_json_ready():
    import json

    _, _, _, report = _check("causal_off_by_one")
    d = json.loads(json.dumps(report.to_dict()))
    assert d["ok"] is False and d["structures"]["causal"]["violation"]["module"] == "blocks.1.mixer"
    assert d["forwards"] >= 3 and d["backwards"] >= 1


# ------------------------------------------------------------------- the probes (pure)


def test_batch_probes_separate_every_pair_of_samples():
    for b in (2, 3, 5, 8):
        probes = batch_probes(b, 1)
        for i in range(b):
            for j in range(b):
                if i != j:
                    assert any(p.outputs[i, 0] and p.forbidden[j, 0] for p in probes), (b, i, j)
        assert all(not (p.outputs & p.forbidden).any() for p in probes)


def test_causal_probes_cut_at_both_ends_and_forbid_only_later_positions():
    probes = causal_probes(2, 10, 2, torch.Generator().manual_seed(0))
    cuts = sorted(int(p.outputs[b].sum()) - 1 for p in probes for b in range(2))
    assert cuts[0] == 0 and cuts[-1] == 8
    for p in probes:
        for b in range(2):
            last = int(p.outputs[b].nonzero().max())
            assert not p.forbidden[b, :last + 1].any() and p.forbidden[b, last + 1:].all()


def test_document_probes_separate_every_pair_of_documents_in_a_sample():
    docs = documents_from_positions(torch.tensor([[0, 1, 0, 1, 2, 0, 0, 1]]))
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2, 3, 3]]
    probes = document_probes(docs)
    for a in range(4):
        for b in range(4):
            if a != b:
                assert any(p.outputs[0][docs[0] == a].all() and p.forbidden[0][docs[0] == b].all() for p in probes)


def test_padding_probe_and_structure_names():
    p = padding_probes(torch.tensor([[1, 1, 0], [1, 1, 1]]))[0]
    assert p.outputs.tolist() == [[True, True, False], [True, True, True]]
    assert p.forbidden.tolist() == [[False, False, True], [False, False, False]]
    assert parse_structures("CAUSAL") == ("causal",)


def test_a_tuple_of_arguments_and_a_tuple_output():
    class TwoArgs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale):
            h = self.lin(x) * scale
            return h.cumsum(1), h  # a causal running sum over positions, and a second output

    torch.manual_seed(0)
    report = check_independence(TwoArgs(), (torch.randn(2, 6, 4), 2.0), ["causal", "batch"])
    assert report.ok and report.results["causal"].probes == 2, str(report)
    assert "argument 0" in report.notes[0]
