"""Sharing a sharded check's whole pieces out by what earlier checks measured (:func:`gradwatch.plan.shards.owners`).

A tensor parallel check has few whole pieces (an attention's own code, a block's own code, a LayerNorm) beside the
row pieces bound to the ranks that hold them; round-robin gave rank 0 the two costly ones in a check of
``benchmarks/parallel.py`` at 20.8M (0.45 s of pieces against 0.25 s on rank 1, which waited).
"""

from __future__ import annotations

from gradwatch.plan.cycle import Piece
from gradwatch.plan.shards import Holding, assign, owners, piece_cost

COSTS = {"blocks.2.attn": (0.129, 0), "blocks.3": (0.098, 0), "blocks.2.ln2": (0.034, 0), "head": (0.4, 2000),
         "blocks.0.fc1": (0.11, 512)}
PIECES = [Piece("blocks.2.attn"), Piece("blocks.3"), Piece("blocks.2.ln2"), Piece("head", (0, 500)),
          Piece("blocks.0.fc1", (0, 512))]
HELD = {"head": Holding(8000, world=2), "blocks.0.fc1": Holding(2048, world=2)}


def _loads(costs, world=2):
    """Each rank's estimated seconds under :func:`assign` with ``costs`` (None: round-robin)."""
    out = []
    for rank in range(world):
        held = {n: h._replace(rank=rank) for n, h in HELD.items()}
        mine = assign(PIECES, held, rank, world, costs=costs)
        out.append(sum(piece_cost(COSTS, p.unit, None if p.rows is None else p.rows[1] - p.rows[0]) for p, _ in mine))
    return out


def test_every_whole_piece_goes_to_exactly_one_rank_and_the_load_evens_out():
    given = [[str(p) for p, _ in assign(PIECES, {n: h._replace(rank=r) for n, h in HELD.items()}, r, 2, costs=COSTS)]
             for r in range(2)]
    wholes = {str(p) for p in PIECES if p.rows is None}
    assert {w for g in given for w in g if w in wholes} == wholes
    assert not set(given[0]) & set(given[1])
    by_cost, in_turn = _loads(COSTS), _loads(None)
    assert max(by_cost) < max(in_turn)  # rank 0 holds the head's and fc1's rows: the costly whole pieces go to rank 1
    assert abs(by_cost[0] - by_cost[1]) < 0.1, by_cost


def test_without_costs_the_whole_pieces_go_round_robin():
    assert [str(p) for p, _ in assign(PIECES, HELD, 0, 2)] == ["blocks.2.attn", "blocks.2.ln2", "head[0:500]",
                                                                "blocks.0.fc1[0:512]"]
    # an empty table: every piece costs the same, rank 0's two row pieces count, so rank 1 takes two whole ones
    assert owners(PIECES, HELD, 2, {}) == {0: 1, 1: 1, 2: 0}


def test_a_unit_never_measured_costs_what_the_measured_ones_typically_do():
    assert piece_cost(COSTS, "final_ln", None) == 0.098  # the median whole piece
    assert abs(piece_cost(COSTS, "blocks.1.fc2", 100) - 100 * 0.11 / 512) < 1e-12  # the median per row
    assert piece_cost({}, "x", None) == 1.0


def test_a_unit_never_measured_costs_what_the_same_unit_of_another_block_did():
    """A transformer's blocks repeat: a unit of block 1 not measured yet costs what block 2's measured, not the
    median of every unit (an attention's own code is several LayerNorms' worth)."""
    assert piece_cost(COSTS, "blocks.1.attn", None) == 0.129
    assert piece_cost(COSTS, "blocks.1", None) == 0.098  # a block's own code: block 3's
    assert abs(piece_cost(COSTS, "blocks.3.fc1", 100) - 100 * 0.11 / 512) < 1e-12  # per row, block 0's fc1
    two = {"blocks.0.attn": (0.1, 0), "blocks.2.attn": (0.3, 0), "blocks.1.ln": (0.01, 0)}
    assert abs(piece_cost(two, "blocks.1.attn", None) - 0.2) < 1e-12  # the mean of the blocks measured
    assert piece_cost({"blocks.0.attn": (0.1, 0)}, "blocks.1.attn.q", 10) == 1.0  # none alike, none by rows


def test_loss_fn_and_the_roots_own_code_go_to_different_ranks_whatever_they_cost():
    """Each copies the model's output (a language model's logits), over the capture's budget alone: a capture forward
    of its own, which every rank makes. On one rank, every rank made three forwards at that check of the 20.8M tensor
    parallel model of ``benchmarks/parallel.py`` (0.84 s against 0.29 s for one); on two, they share one."""
    pieces = [Piece("blocks.0.fc1", (0, 512)), Piece("blocks.1.attn"), Piece(""), Piece("<loss_fn>"), Piece("ln")]
    held = {"blocks.0.fc1": Holding(2048, world=2)}
    cheap = {"": (0.05, 0), "<loss_fn>": (0.04, 0), "blocks.1.attn": (0.5, 0), "ln": (0.01, 0), "blocks.0.fc1": (0.1, 512)}
    for costs in (cheap, None, {}):  # cheap enough for the least loaded rank to take both; never measured; in turn
        for world in (2, 3):
            given = [[p.unit for p, _ in assign(pieces, {n: h._replace(rank=r, world=world) for n, h in held.items()},
                                                r, world, costs=costs)] for r in range(world)]
            holders = [sum(u in ("", "<loss_fn>") for u in g) for g in given]
            assert sorted(holders)[-1] == 1 and sum(holders) == 2, (costs, world, given)
            assert sorted(u for g in given for u in g if u != "blocks.0.fc1") == sorted(p.unit for p in pieces[1:])
    one = [p.unit for p, _ in assign(pieces, held, 0, 1, costs=cheap)]  # one rank: everything, as before
    assert one.count("") == 1 and one.count("<loss_fn>") == 1
