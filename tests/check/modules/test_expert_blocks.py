"""A unit of fused experts too big for the room is checked a block of experts at a time (issues 71 and 72).

At 8 experts of a 256-wide Mixtral (29.6M parameters, ``benchmarks/shapes.py``'s ``moe8``), one MoE layer's experts
need about 158 MB for their float64 check beside training's 98 to 116 MB of room: the unit was "not checked" at some
checks and its experts judged only where the room happened to allow. Now the planner cuts such a unit into blocks
of experts that fit (as it cuts a big Linear into rows), and each block is checked in place inside a float64 copy of
the whole unit: the unit's own forward runs as in training, only the block's experts are leaves. Tiny random Mixtral
and Qwen2-MoE models from transformers (``test_moe_hooks``'s), on CPU.
"""

from __future__ import annotations

import pytest
import torch

from gradwatch.check.modules.module_form import run_module_check
from gradwatch.check.objective.terms import Objective
from gradwatch.options import CheckOptions
from gradwatch.plan.cycle import Piece
from gradwatch.plan.planner import Planner
from gradwatch.plan.units import expert_bytes

pytest.importorskip("transformers")
from test_experts import experts_of, failed, grouped_experts, one_wrong_expert, routed  # noqa: E402
from test_moe_hooks import KINDS, model_loss, padded_batch, tiny_moe  # noqa: E402

EXPERTS = "model.layers.1.mlp.experts"
GATE_UP = f"{EXPERTS}.gate_up_proj"


def block_check(model, rows, batch=None):
    return run_module_check(model, Objective(model_loss), batch or padded_batch(rows=4, seq=8), CheckOptions(seed=0),
                            pieces=[Piece(EXPERTS, rows)], screen=True)


@pytest.mark.parametrize("kind", KINDS[:2])
def test_a_block_judges_its_experts_only_under_their_own_names(kind):
    model = tiny_moe(kind)
    model.train()
    report = block_check(model, (2, 4))
    experts = {n for n in report.tensors if "[expert" in n}
    assert experts == {f"{EXPERTS}.{t}[expert {e}]" for t in ("gate_up_proj", "down_proj") for e in (2, 3)}, str(report)
    assert failed(report) == [], str(report)
    # the experts' other tensors and own code go with the first block only
    first = block_check(model, (0, 2))
    assert {n for n in first.tensors if "[expert" in n} == {f"{EXPERTS}.{t}[expert {e}]" for t in ("gate_up_proj",
                                                                                                    "down_proj") for e in (0, 1)}
    assert any(":output" in n for n in first.tensors) and not any(":output" in n for n in report.tensors), str(first)


def test_a_wrong_backward_in_one_expert_is_named_by_its_block_and_by_no_other():
    model = tiny_moe("mixtral")
    model.train()
    one_wrong_expert(model.model.layers[1].mlp.experts, 3)
    batch = padded_batch(rows=4, seq=8)
    assert 3 in routed(model, batch)[1]
    report = block_check(model, (2, 4), batch)
    assert list(experts_of(failed(report), GATE_UP)) == [3], str(report)
    assert not [n for n in failed(report) if "down_proj" in n], str(report)
    other = block_check(model, (0, 2), batch)
    assert not experts_of(failed(other), GATE_UP), str(other)  # expert 3 is a constant of this block's copy


def test_a_fused_kernel_over_all_experts_with_a_wrong_backward_is_named_in_a_block_with_its_ratio():
    model = tiny_moe("mixtral")
    model.train()
    grouped_experts(model.model.layers[1].mlp.experts, 1.5)  # one custom autograd.Function over every expert
    batch = padded_batch(rows=4, seq=8)
    report = block_check(model, (1, 3), batch)
    failing = experts_of(failed(report), GATE_UP)
    assert failing and set(failing) <= {1, 2} and set(failing) == {1, 2} & routed(model, batch)[1], str(report)
    assert all(report.tensors[n].ratio == pytest.approx(1.5, rel=1e-3) for n in failing.values()), str(report)


def test_the_planner_cuts_experts_over_the_room_into_blocks_and_a_cycle_judges_every_expert():
    model = tiny_moe("mixtral")
    model.train()
    batch = padded_batch(rows=4, seq=8)
    unit_fixed, per_expert = expert_bytes(next(u for u in Planner().module_pieces(
        model, model_loss, batch, [n for n, _ in model.named_parameters()])[0] if u.name == EXPERTS))
    room = 2 * (unit_fixed + per_expert)  # one expert a block
    planner = Planner(form="module")
    names = [n for n, _ in model.named_parameters()]
    judged: set = set()
    for _ in range(4):
        units, pieces = planner.module_pieces(model, model_loss, batch, names, key=("k",), room=room)
        blocks = [p for p in pieces if p.unit == EXPERTS]
        assert blocks and all(p.rows is not None and p.rows[1] - p.rows[0] == 1 for p in blocks), pieces
        report = run_module_check(model, Objective(model_loss), batch, CheckOptions(seed=0), units=units,
                                  pieces=blocks, screen=True)
        assert failed(report) == [], str(report)
        judged |= {n for n, tc in report.tensors.items() if n.startswith(GATE_UP + "[") and tc.verdict is not None}
    reached = routed(model, batch)[1]
    assert judged == {f"{GATE_UP}[expert {e}]" for e in reached}, (judged, reached)
    # without a room, or with enough, the unit stays whole
    _, pieces = Planner(form="module").module_pieces(model, model_loss, batch, names, key=("k",), room=None)
    assert Piece(EXPERTS) in pieces


def test_a_block_copy_leaves_the_live_model_untouched():
    model = tiny_moe("mixtral")
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    block_check(model, (1, 3))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
