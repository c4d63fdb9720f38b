"""Which watched tensors a training-part replay takes the gradient of, when not all of them fit the room.

The replay holds the objective's gradient of each tensor it judges beside training's live ``.grad`` and its own
activations. Where they do not all fit, the least-judged go first (in model order among equals), and the weights too
big for a share of the room are judged by a block of rows (:mod:`gradwatch.check.replay.rows`), the next block at
their next turn. Pure: the caller keeps the counts and the row cursors, and counts what was chosen.

Example:
    >>> import torch
    >>> params = {"a": torch.zeros(100), "b": torch.zeros(10)}
    >>> sorted(replay_subset(params, {"b": 1}, {}, room=10_000, transient=0)[0])  # both fit
    ['a', 'b']
    >>> sorted(replay_subset(params, {"a": 1}, {}, room=300, transient=0)[0])  # "b" is the least judged
    ['b']
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Set, Tuple

import torch
from torch import nn

from gradwatch.plan.memory import SAFETY, gradient_bytes

#: Row blocks of a weight judged by rows: name -> (first row, end row).
Rows = Dict[str, Tuple[int, int]]


def replay_subset(params: Mapping[str, torch.Tensor], counts: Mapping[str, int], cursors: Mapping[str, int], room: int,
                  transient: int, linears: Optional[Mapping[str, nn.Module]] = None,
                  cap: Optional[Tuple[int, Set[str]]] = None) -> Tuple[Dict[str, torch.Tensor], Rows]:
    """The tensors of ``params`` whose replayed gradients fit in ``room`` beside the replay's ``transient`` activations
    (all where they fit; else least-judged by ``counts`` first), and the weights among ``linears`` (sliceable: name ->
    module) judged by a block of rows from their ``cursors``.

    Only a weight bigger than a quarter of the free share is judged by rows, at its turn, in an equal part of half
    the share (the other half for the whole tensors): a smaller weight waits for a turn with room for it whole (a few
    fit each check), and the big weights never starve the rest. ``cap``: ``(bytes, names)``, the most the replayed
    gradients of ``names`` take together (those outside the checkpointed blocks, where every block checkpointed still
    leaves the replay over the room: :func:`~gradwatch.check.replay.checkpoint_blocks.outside_cap`); a weight among
    them over the cap is judged by the rows that fit it. One of them that the cap keeps out has its turn alone, within
    the room, once the most judged tensor was judged twice as often (where all the others fit, every third turn):
    every tensor is judged within a few checks, however tight the room.

    Example:
        >>> params = {"head": torch.zeros(8, 4), "b": torch.zeros(4)}
        >>> replay_subset(params, {}, {}, room=1_000, transient=0, cap=(0, {"head"}))[0].keys()
        dict_keys(['b'])
        >>> list(replay_subset(params, {"b": 4, "head": 1}, {}, room=1_000, transient=0, cap=(0, {"head"}))[0])
        ['head']
    """
    # The safe share beside the replay's activations; at least a quarter of what the room leaves beside them
    # (a transient near half the room would otherwise leave nothing, and one tensor a check).
    free = max(SAFETY * room - transient, SAFETY * SAFETY * (room - transient))
    left, capped = cap if cap is not None else (0, set())
    if gradient_bytes(params.values()) <= free and gradient_bytes(p for n, p in params.items() if n in capped) <= left:
        return dict(params), {}
    names = list(params)
    order = sorted(range(len(names)), key=lambda i: (counts.get(names[i], 0), i))
    linears = linears or {}
    big = {n for n in names if n in linears and params[n].dim() == 2 and params[n].shape[0] > 1
           and gradient_bytes([params[n]]) > (min(free / 4, left) if n in capped else free / 4)}
    share = free / (2 * max(1, len(big)))
    least = min(counts.get(n, 0) for n in names)
    chosen = []
    sliced: Rows = {}
    for i in order:  # the big weights' blocks first (an equal part each), then whole tensors in what is left
        n, p = names[i], params[names[i]]
        if n not in big or counts.get(n, 0) != least:
            continue
        per_row = 2 * p.shape[1] * p.element_size()  # the rows' copy and their gradient
        k = min(int(share // per_row), p.shape[0] - 1, int(left // per_row) if n in capped else p.shape[0])
        if k >= 1:
            first = cursors.get(n, 0) % p.shape[0]
            end = min(first + k, p.shape[0])
            sliced[n] = (first, end)
            chosen.append(i)
            free, left = free - (end - first) * per_row, left - (end - first) * per_row * (n in capped)
    for i in order:
        need = gradient_bytes([params[names[i]]])
        if names[i] not in big and need <= free and (names[i] not in capped or need <= left):
            chosen.append(i)
            free, left = free - need, left - need * (names[i] in capped)
    out = order[0] if order and order[0] not in chosen and names[order[0]] in capped else None
    others = max(counts.get(n, 0) for n in names)
    if out is not None and others >= 2 * (counts.get(names[out], 0) + 1) and gradient_bytes([params[names[out]]]) <= room:
        chosen, sliced = [out], {}  # kept out by the cap while the others had twice its turns: its turn, alone
    alone = next((i for i in order if names[i] not in capped), None)
    if not chosen and alone is not None and gradient_bytes([params[names[alone]]]) <= room:
        chosen.append(alone)  # a tensor bigger than the safe share still gets its turn, alone, within the room
    return {names[i]: params[names[i]] for i in sorted(chosen)}, sliced


__all__ = ["Rows", "replay_subset"]
