"""An own code that reads a big weight itself is checked a block of that weight's rows at a time (issue 71).

TRL's ``SFTTrainer`` patches the model's forward with a fused LM head: the root's own code multiplies the hidden
states by ``lm_head.weight`` in chunks inside a custom ``autograd.Function``, so the head's weight is a parameter of
the root's own code, not of a Linear the module form can cut by rows. At a 32,000-token vocabulary its float64 check
needed about 376 MB beside 206 to 240 MB of room: the root was ``not_checked`` at every check. Now the planner cuts
such an own code by the rows of its big parameter (``own_rows``) and each block is checked in place, inside a float64
copy of the whole own code (``expert_block(..., split=False)``): the fused function runs as in training, only the
block's rows are leaves. A small fused-head LM of the same shape here.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import pytest
import torch
from torch import nn

from gradwatch.check.modules.module_form import run_module_check
from gradwatch.check.objective.terms import Objective
from gradwatch.options import CheckOptions
from gradwatch.plan.cycle import Piece
from gradwatch.plan.planner import Planner, own_rows
from gradwatch.plan.units import in_place_bytes, in_place_param

VOCAB, WIDTH = 2000, 32


class ChunkedLogProb(torch.autograd.Function):
    """Per-token log-probabilities of ``labels`` from ``hidden @ weight.T`` a chunk of tokens at a time (as TRL's
    ``_ChunkedLogProbFunction``); with ``wrong``, the weight's gradient from that row on is 1.5x."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                wrong: Optional[int]) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk, ctx.wrong = chunk, wrong
        return torch.cat([(hidden[i:i + chunk] @ weight.t()).log_softmax(-1).gather(-1, labels[i:i + chunk, None])[:, 0]
                          for i in range(0, hidden.shape[0], chunk)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden, grad_weight = torch.zeros_like(hidden), torch.zeros_like(weight)
        for i in range(0, hidden.shape[0], ctx.chunk):
            h, g = hidden[i:i + ctx.chunk], grad[i:i + ctx.chunk, None]
            d = -(h @ weight.t()).softmax(-1) * g
            d.scatter_add_(1, labels[i:i + ctx.chunk, None], g)
            grad_hidden[i:i + ctx.chunk] = d @ weight
            grad_weight += d.t() @ h
        if ctx.wrong is not None:
            grad_weight[ctx.wrong:] *= 1.5
        return grad_hidden, grad_weight, None, None, None


class FusedHeadLM(nn.Module):
    """An embedding, a block, and a head whose weight the model's own code reads (never calls the Linear)."""

    def __init__(self, wrong: Optional[int] = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.scale = nn.Parameter(torch.ones(WIDTH))  # a small parameter of the same own code
        self.wrong = wrong

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.body(self.embed(ids))) * self.scale
        per_token = ChunkedLogProb.apply(hidden.reshape(-1, WIDTH), self.head.weight, labels.reshape(-1), 16, self.wrong)
        return -per_token.mean()


def loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(*batch)


def make(wrong: Optional[int] = None) -> Tuple[FusedHeadLM, Tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = FusedHeadLM(wrong)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, VOCAB, (2, 12), generator=g), torch.randint(0, VOCAB, (2, 12), generator=g))


def root_unit(model: nn.Module, batch: Any) -> Any:
    units, _ = Planner(form="module").module_pieces(model, loss, batch, [n for n, _ in model.named_parameters()])
    return next(u for u in units if u.name == "" and u.kind == "own")


def room_for(unit: Any, rows: int) -> int:
    """A room that a block of ``rows`` rows takes half of, beside the whole copy."""
    fixed, per_row = in_place_bytes(unit)
    return fixed + 2 * rows * per_row


def test_the_root_reads_the_head_weight_itself_and_is_cut_by_its_rows_where_whole_it_would_not_fit():
    model, batch = make()
    unit = root_unit(model, batch)
    assert set(unit.params) == {"head.weight", "scale"}, unit.params
    assert own_rows(unit, room_for(unit, 500)) == VOCAB
    assert own_rows(unit, 10 * 2**30) is None and own_rows(unit, None) is None  # whole where it fits


def test_a_cycle_of_row_blocks_judges_every_row_and_the_rest_once_with_no_alert():
    model, batch = make()
    names = [n for n, _ in model.named_parameters()]
    planner = Planner(form="module")
    room = room_for(root_unit(model, batch), 500)
    rows: set = set()
    judged: set = set()
    units, pieces = planner.module_pieces(model, loss, batch, names, key=("k",), room=room)
    for check in range(planner._cycle.length):  # K checks: every piece of the cycle once
        if check:
            units, pieces = planner.module_pieces(model, loss, batch, names, key=("k",), room=room)
        blocks = [p for p in pieces if p.unit == ""]
        assert all(p.rows is not None and p.rows[1] - p.rows[0] <= 500 for p in blocks), pieces
        report = run_module_check(model, Objective(loss), batch, CheckOptions(seed=0), units=units, pieces=blocks,
                                  screen=True)
        assert not report.unfit, report.notes
        assert not [n for n, tc in report.tensors.items() if tc.failed], str(report)
        for p in blocks:
            assert p.rows is not None
            rows.update(range(*p.rows))
        judged |= {n for n, tc in report.tensors.items() if tc.verdict is not None}
    assert rows == set(range(VOCAB)), sorted(set(range(VOCAB)) - rows)[:5]
    assert {"head.weight", "scale"} <= judged, judged


def test_a_wrong_backward_on_the_last_rows_is_named_by_the_block_that_holds_them_and_by_no_other():
    model, batch = make(wrong=1500)
    wrong = run_module_check(model, Objective(loss), batch, CheckOptions(seed=0), pieces=[Piece("", (1000, 2000))],
                             screen=True)
    assert wrong.tensors["head.weight"].failed, str(wrong)
    right = run_module_check(model, Objective(loss), batch, CheckOptions(seed=0), pieces=[Piece("", (0, 1000))],
                             screen=True)
    assert not right.tensors["head.weight"].failed, str(right)
    assert "scale" in right.tensors and "scale" not in wrong.tensors  # the rest goes with the first block


def test_a_block_leaves_the_live_model_untouched():
    model, batch = make()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run_module_check(model, Objective(loss), batch, CheckOptions(seed=0), pieces=[Piece("", (100, 900))], screen=True)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_a_check_groups_its_blocks_in_one_piece_on_the_first_sample_s_first_positions():
    model, _ = make(wrong=1500)
    g = torch.Generator().manual_seed(2)
    batch = (torch.randint(0, VOCAB, (3, 40), generator=g), torch.randint(0, VOCAB, (3, 40), generator=g))
    report = run_module_check(model, Objective(loss), batch, CheckOptions(seed=0),
                              pieces=[Piece("", (0, 250)), Piece("", (1750, 2000))], screen=True)
    (root,) = [c for c in report.localized if c.name == ""]
    assert "2 blocks (in place)" in root.type and "1 of the batch's 3 samples" in root.type, root.type
    assert report.tensors["head.weight"].failed, str(report)  # rows 1750:2000 are wrong
    assert "scale" in report.tensors and not report.tensors["scale"].failed, str(report)
    assert sorted(report.pieces) == ["[0:250]", "[1750:2000]"], report.pieces


def test_trl_s_fused_lm_head_its_wrong_vocabulary_tile_is_named_by_the_block_that_holds_it(monkeypatch):
    """TRL's own fused head (``add_fused_lm_head``: ``ChunkedLogProbFunction`` over vocabulary tiles) on a tiny Llama:
    its weight is the root's own code's, cut by rows; a backward 1.5x on the rows from 2,500 on (a wrong tile) is
    named by the block over them, and the block over the first rows is clean."""
    pytest.importorskip("trl")
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=3000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    add_fused_lm_head(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3000, (2, 10), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def fused_loss(m: nn.Module, b: Any) -> torch.Tensor:
        return m(**b, fused_lm_head=True).loss

    units, _ = Planner(form="module").module_pieces(model, fused_loss, batch, [n for n, _ in model.named_parameters()])
    (root,) = [u for u in units if u.name == "" and u.kind == "own"]
    assert in_place_param(root) == "lm_head.weight" and own_rows(root, room_for(root, 500)) == 3000

    plain = ChunkedLogProbFunction.backward

    def wrong_tile(ctx: Any, *grads: Any) -> Any:
        out = list(plain(ctx, *grads))
        out[1] = out[1].clone()
        out[1][2500:] *= 1.5
        return tuple(out)

    monkeypatch.setattr(ChunkedLogProbFunction, "backward", staticmethod(wrong_tile))
    check = {rows: run_module_check(model, Objective(fused_loss), batch, CheckOptions(seed=0), pieces=[Piece("", rows)],
                                    screen=True) for rows in ((0, 500), (2500, 3000))}
    assert check[(2500, 3000)].tensors["lm_head.weight"].failed, str(check[(2500, 3000)])
    assert not check[(0, 500)].tensors["lm_head.weight"].failed, str(check[(0, 500)])


def test_a_block_s_float64_copy_of_a_hugging_face_model_is_freed_when_its_check_ends():
    """A Hugging Face model's copy is held in a reference cycle (a bound method of itself): the weight taken out for its
    rows, a float64 copy as big as the head, stayed alive until Python's full collection (on TRL's fused head at a
    32,000-token vocabulary, 62 MB carried into the next training steps). The copy's release drops it."""
    pytest.importorskip("trl")
    import gc
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=3000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    add_fused_lm_head(model)
    ids = torch.randint(0, 3000, (2, 10), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def fused_loss(m: nn.Module, b: Any) -> torch.Tensor:
        return m(**b, fused_lm_head=True).loss

    def head_copies() -> set:  # float64 tensors of the head's shape alive (as gc sees them)
        with warnings.catch_warnings():  # (isinstance on torch.distributed's deprecated reduce_op warns)
            warnings.simplefilter("ignore")
            return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.float64
                    and tuple(o.shape) == (3000, 16)}

    gc.collect()
    before = head_copies()  # what the worker's earlier tests hold: not this check's
    gc.disable()
    try:
        report = run_module_check(model, Objective(fused_loss), batch, CheckOptions(seed=0),
                                  pieces=[Piece("", (0, 500))], screen=True)
        assert report.tensors["lm_head.weight"].verdict is not None, str(report)
        assert not head_copies() - before
    finally:
        gc.enable()
