"""The row blocks of a plain Linear or Embedding that one check takes are checked in one piece, each its own tensor.

Checked one piece each, 25 blocks of an LM head's rows paid 25 pieces' fixed cost; grouped they share one copy, one
forward and one cotangent, and the joint detection probe settles them together where they agree. A block that
disagrees is still judged on its own, the report keeps the worse verdict under the parameter's name, and coverage
counts every block's rows (an embedding's: the rows the batch used).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradwatch.bands import Verdict
from gradwatch.check.modules.localize import check_module
from gradwatch.check.modules.module_form import Sharded, run_module_check
from gradwatch.check.modules.row_groups import EmbeddingRowBlocks, LinearRowBlocks, fewer_positions
from gradwatch.check.objective.terms import Objective
from gradwatch.options import CheckOptions
from gradwatch.plan.cycle import Piece


def test_a_linear_group_computes_the_rows_the_module_computes():
    torch.manual_seed(0)
    lin = nn.Linear(12, 700)
    blocks = [(0, 100), (350, 400), (650, 700)]
    group = LinearRowBlocks(lin, blocks, torch.float64)
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    whole = F.linear(x, lin.weight.double(), lin.bias.double())
    want = torch.cat([whole[..., a:b] for a, b in blocks], dim=-1)
    torch.testing.assert_close(group(x), want, rtol=1e-12, atol=1e-12)  # the same rows (BLAS may block them apart)
    assert sorted(group.tensors()) == sorted([f"{p}[{a}:{b}]" for a, b in blocks for p in ("weight", "bias")])


def test_an_embedding_group_leaves_out_the_padding_row_and_the_tokens_of_other_rows():
    torch.manual_seed(0)
    emb = nn.Embedding(1000, 6, padding_idx=3, scale_grad_by_freq=True)
    ids = torch.tensor([[3, 10, 10, 500, 999], [600, 3, 11, 10, 250]])
    group = EmbeddingRowBlocks(emb, ids, [(0, 256), (900, 1000), (400, 500)], torch.float64)
    assert [u.tolist() for u in group.used] == [[10, 11, 250], [999], []]  # the padding row 3 is not among them
    assert sorted(group.tensors()) == ["weight[0:256]", "weight[900:1000]"]
    kept = [t for t in ids.reshape(-1).tolist() if t in (10, 11, 250, 999)]
    assert torch.equal(group(group.ids), emb.weight.double()[kept])
    # per-token counts are the batch's (scale_grad_by_freq): the gradient of row 10, seen 3 times, is scaled by 1/3
    group(group.ids).sum().backward()
    assert torch.allclose(group.weights[0].grad[0], torch.full((6,), 1.0, dtype=torch.float64))


def test_a_group_on_one_ranks_shard_computes_and_names_the_models_rows():
    """Sharded (tensor parallel, FSDP2), a rank's blocks are checked on its shard of the weight, which holds rows
    ``offset:`` of the model's: the same outputs, the same keys as on the whole module."""
    torch.manual_seed(0)
    lin, emb = nn.Linear(12, 700), nn.Embedding(1000, 6, padding_idx=600)
    shard_lin = nn.Linear(12, 350)  # rank 1 of 2: rows 350:700
    shard_emb = nn.Embedding(500, 6, padding_idx=100)  # rows 500:1000, its padding row 600 counted from there
    vars(shard_emb)["num_embeddings"] = 1000  # as the shard view's copy of the live module keeps it
    with torch.no_grad():
        shard_lin.weight.copy_(lin.weight[350:]), shard_lin.bias.copy_(lin.bias[350:])
        shard_emb.weight.copy_(emb.weight[500:])
    blocks = [(350, 400), (650, 700)]
    x = torch.randn(3, 12, dtype=torch.float64)
    whole, shard = LinearRowBlocks(lin, blocks, torch.float64), LinearRowBlocks(shard_lin, blocks, torch.float64, 350)
    assert torch.equal(whole(x), shard(x)) and sorted(whole.tensors()) == sorted(shard.tensors())
    ids = torch.tensor([[600, 510, 999, 510, 700]])
    whole_e = EmbeddingRowBlocks(emb, ids, [(500, 750), (750, 1000)], torch.float64)
    shard_e = EmbeddingRowBlocks(shard_emb, ids, [(500, 750), (750, 1000)], torch.float64, 500)
    assert [u.tolist() for u in shard_e.used] == [[510, 700], [999]]  # the padding row left out
    assert torch.equal(whole_e(whole_e.ids), shard_e(shard_e.ids)) and sorted(whole_e.tensors()) == sorted(shard_e.tensors())


def test_fewer_positions_keeps_whole_rows_of_the_input():
    x = torch.arange(4 * 32 * 3, dtype=torch.float64).view(4, 32, 3)
    cut = fewer_positions(x, 32, seed=5)
    assert cut.shape == (32, 3)
    rows = {tuple(r) for r in x.reshape(-1, 3).tolist()}
    assert all(tuple(r) in rows for r in cut.tolist())
    assert not torch.equal(cut, fewer_positions(x, 32, seed=6))


def test_a_block_wrong_in_a_few_rows_is_judged_wrong_on_its_own_in_a_group():
    torch.manual_seed(0)
    lin = nn.Linear(16, 2000)
    blocks = [(0, 256), (512, 768), (1024, 1280), (1744, 2000)]
    group = LinearRowBlocks(lin, blocks, torch.float64)
    params = group.tensors()
    scale = torch.ones(256, 1, dtype=torch.float64)
    scale[-4:] = 1.2  # the gradient of the block's last 4 rows 20% off, as a wrong backward would give
    params["weight[512:768]"].register_hook(lambda g: g * scale)
    x = torch.randn(8, 16, dtype=torch.float64)
    result = check_module("head", group, (x,), {}, CheckOptions(), params=params, restore=False, screen=True)
    wrong = {k for k, tc in result.tensors.items() if tc.failed}
    assert wrong == {"weight[512:768]"}, {k: tc.verdict for k, tc in result.tensors.items()}
    assert all(tc.verdict == Verdict.EXCELLENT for k, tc in result.tensors.items() if k != "weight[512:768]")


class Tiny(nn.Module):
    """An embedding of 3,000 tokens and an LM head over them (their rows are checked in blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(3000, 16)
        self.head = nn.Linear(16, 3000)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def test_a_check_takes_each_weights_blocks_in_one_piece_and_covers_every_row():
    torch.manual_seed(0)
    model = Tiny()
    ids = torch.randint(0, 3000, (4, 40))

    def loss_fn(m, b):
        return F.cross_entropy(m(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())

    blocks = [(0, 256), (768, 1024), (2744, 3000)]
    pieces = [Piece("head", b) for b in blocks] + [Piece("emb", b) for b in blocks]
    report = run_module_check(model, Objective(loss_fn), ids, CheckOptions(), pieces=pieces, screen=True)
    assert report.pieces == [str(p) for p in pieces]
    groups = [c for c in report.localized if "blocks" in c.type]
    assert len(groups) == 2, [c.type for c in report.localized]
    assert {"head.weight", "head.bias", "head:input", "emb.weight"} <= set(report.tensors)
    assert report.ok and not any(c.failed for c in report.localized)
    head_rows = [rows for name, rows in report.probed if name == "head.weight"]
    assert sorted(head_rows) == blocks
    used = torch.cat([r for name, r in report.probed if name == "emb.weight" and isinstance(r, torch.Tensor)])
    want = torch.unique(ids[:, :-1][((ids[:, :-1] < 256) | ((ids[:, :-1] >= 768) & (ids[:, :-1] < 1024))
                                     | (ids[:, :-1] >= 2744))])
    assert torch.equal(torch.sort(used).values, want)


def test_shard_by_shard_a_ranks_one_block_is_checked_as_a_group_on_the_groups_positions():
    """A rank holds fewer rows, so a check often gives it one block of a Linear: it goes the group's way, on 32 of
    its input's positions, as blocks of a group do (before: the whole input; on the 20.8M tensor parallel model of
    ``benchmarks/parallel.py``, ``fc1``'s blocks took 0.061 s to 0.072 s per 256 rows on a rank, 0.027 s since).
    One process holds the view here: :class:`~gradwatch.parallel.shard_check.ShardView` on a plain model."""
    from gradwatch.check.modules.module_form import run_module_check
    from gradwatch.check.objective.terms import Objective
    from gradwatch.options import CheckOptions
    from gradwatch.parallel.shard_check import ShardView

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 3))
    batch = torch.randn(4, 20, 8)  # 80 positions

    def loss(m, b):
        return m(b).square().mean()

    piece = [Piece("0", (16, 32))]
    alone = run_module_check(model, Objective(loss), batch, CheckOptions(seed=0), pieces=piece)
    sharded = run_module_check(model, Objective(loss), batch, CheckOptions(seed=0), pieces=piece,
                               sharded=Sharded(ShardView(model, {}, {})))
    assert "on 32 of its input's 80 positions" not in alone.localized[0].type  # one process: the piece's whole input
    assert "rows 16:32, 1 blocks, on 32 of its input's 80 positions" in sharded.localized[0].type, sharded.localized[0].type
    assert sharded.ok
    assert {"0.weight", "0.bias"} <= set(sharded.tensors)
    assert {"0.weight", "0.bias"} <= set(alone.tensors)
    assert sharded.piece_seconds["0"][1] == 16  # its rows counted in the cost table, as a group's
