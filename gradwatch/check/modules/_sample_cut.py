"""A piece over the room on the whole batch, captured again on a cut of the batch that fits: its first samples, one
sample's first positions (a token batch), or a window of one sample's positions (:mod:`~gradwatch.check.modules.window_cut`).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch.plan.units import Unit
    >>> lin = nn.Linear(8, 8)
    >>> unit = Unit("0", lin, {f"0.{k}": p for k, p in lin.named_parameters()})
    >>> model, batch = nn.Sequential(lin), torch.randn(64, 8)
    >>> (args, kwargs), children, need, what, constants = fewer_samples(
    ...     model, lambda m, b: m(b).sum(), batch, unit, need=40_000, room=20_000, seed=0, dtype=torch.float64)
    >>> what, args[0].shape
    ("21 of the batch's 64 samples", torch.Size([21, 8]))
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from gradwatch.check.modules._piece_check import cast_capture
from gradwatch.check.modules.batch_cut import batch_dims, cuts_to_try, sub_batch
from gradwatch.check.modules.capture import capture
from gradwatch.check.modules.piece_cuts import piece_params_bytes
from gradwatch.check.modules.window_cut import WINDOWED, windowed_piece
from gradwatch.plan.units import Unit


def fewer_samples(model: nn.Module, loss_fn: Any, batch: Any, unit: Unit, need: int, room: int, seed: int,
                   dtype: torch.dtype, rows: Optional[Tuple[int, int]] = None
                   ) -> Optional[Tuple[Tuple[Any, Any], Dict[str, List[Any]], int, str, Set[int]]]:
    """For a unit (or its ``rows``) too big for the room on the whole batch: its inputs (and stubs' outputs) captured
    on a cut of the batch that fits (:func:`cuts_to_try`): its first samples, or one sample's first positions (a
    token batch), as ``((args, kwargs), children, bytes, what was kept, constants)``; None when no cut fits (or the
    model refuses the cut batch).

    A cut shrinks what depends on the batch only: the piece's share of the parameters (:func:`piece_params_bytes`)
    stays. Where that share alone fills the room no forward is run; otherwise the cuts are sized on the rest.
    """
    fixed = piece_params_bytes(unit, rows)
    if fixed >= room:
        return None  # no cut of the batch fits: the parameters' copies alone fill the room
    size, seq = batch_dims(batch)
    cuts = cuts_to_try(size, seq, max(1, need - fixed), room - fixed)
    if (isinstance(unit.module, WINDOWED) and unit.kind == "module" or unit.kind == "own" and seq == 1) and (1, None) not in cuts:
        cuts = [c for c in cuts if c[1] is None] + [(1, None)]  # one sample, to window its positions (own code: images)
    retried = False
    one: Optional[Tuple[Tuple[Any, Any], Dict[str, List[Any]], int, Set[int]]] = None  # one sample's capture
    while cuts:
        kept, length = cuts.pop(0)
        part, _, _ = sub_batch(batch, kept, length)
        try:
            got = capture(model, loss_fn, part, [unit], seed, budget=room // 3)
        except Exception:  # noqa: BLE001 - a model that refuses this cut (of positions): the next; none, named
            continue
        if unit.name not in got.inputs:
            continue
        inputs, children, _, cost, constants = cast_capture(got, unit, rows, dtype)  # costed as on the whole batch
        if cost <= room:
            what = f"{kept} of the batch's {size} samples" + ("" if length is None else f", its first {length} of {seq} positions")
            return inputs, children, cost, what, constants
        if kept == 1 and length is None:
            one = (inputs, children, cost, constants)
        if length is None and not retried and cost > fixed:  # once: as many samples as this cut's cost says fit
            retried = True
            fit = int(kept * (room - fixed) / (cost - fixed))
            if 1 <= fit < kept:
                cuts.insert(0, (fit, None))
    return windowed_piece(unit, one, fixed, room, seed, size)
