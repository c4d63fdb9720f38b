"""Which tensors a training-part replay judges when not all fit the room (gradwatch.check.replay.subset)."""

from __future__ import annotations

import torch
from torch import nn

from gradwatch.check.replay.subset import replay_subset

MB = 2**20


def _rounds(params, rounds, room, transient=0, cap=None, linears=None):
    """``rounds`` turns of the choice with its counts and row cursors kept, as the training part keeps them."""
    counts, cursors, turns = {}, {}, []
    for _ in range(rounds):
        chosen, rows = replay_subset(params, counts, cursors, room, transient, linears, cap)
        turns.append((sorted(chosen), dict(rows)))
        for n in chosen:
            counts[n] = counts.get(n, 0) + 1
            if n in rows:
                cursors[n] = rows[n][1] % params[n].shape[0]
    return turns


def test_a_cap_bounds_the_gradients_outside_the_blocks_and_a_head_over_it_is_judged_by_the_rows_that_fit():
    head = nn.Linear(64, 4000)
    params = {"blocks.0.weight": torch.zeros(64, 64), "head.weight": head.weight, "norm.weight": torch.zeros(64)}
    cap = (MB // 4, {"head.weight", "norm.weight"})  # a quarter MB for the head's and the norm's gradients together
    turns = _rounds(params, 4, room=64 * MB, cap=cap, linears={"head.weight": head})
    assert all("blocks.0.weight" in chosen for chosen, _ in turns)  # uncapped: it fits the room
    blocks = [rows["head.weight"] for chosen, rows in turns if "head.weight" in chosen]
    assert len(blocks) == 2 and all(0 < 2 * (end - first) * 64 * 4 <= MB // 4 for first, end in blocks), blocks
    assert blocks[1][0] == blocks[0][1]  # the next block of rows at its next turn (the norm's turn between)
    assert [chosen for chosen, _ in turns][1] == ["blocks.0.weight", "norm.weight"]


def test_a_tensor_the_cap_keeps_out_gets_its_turn_alone_every_third_turn():
    params = {"a": torch.zeros(1000), "b": torch.zeros(1000), "stem": torch.zeros(50_000)}  # stem: 200 KB, not rows
    turns = _rounds(params, 6, room=10 * MB, cap=(0, {"stem"}))
    # kept out while the others were judged twice as often: judged alone, within the room, every third turn
    assert [chosen for chosen, _ in turns] == [["a", "b"], ["a", "b"], ["stem"], ["a", "b"], ["a", "b"], ["stem"]]


def test_without_a_cap_everything_that_fits_is_judged_together():
    params = {"a": torch.zeros(10), "b": torch.zeros(20)}
    assert _rounds(params, 2, room=MB) == [(["a", "b"], {}), (["a", "b"], {})]


def test_looking_for_sliceable_weights_leaves_a_spectral_norm_power_iteration_alone():
    from gradwatch.check.replay.rows import sliceable_linears

    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(6, 5)), nn.Tanh(), nn.Linear(5, 1)).train()
    u = model[0].parametrizations.weight[0]._u.clone()
    # reading a parametrized module's weight computes it: in train mode spectral_norm's power iteration moves u (and
    # so training's next weight; the training part asks at every check where not every tensor fits)
    assert sorted(sliceable_linears(model)) == ["2.weight"]
    assert torch.equal(model[0].parametrizations.weight[0]._u, u)
