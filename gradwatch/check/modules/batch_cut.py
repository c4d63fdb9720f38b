"""Cuts of a batch: its first samples (and positions), the cuts a piece too big for the room tries, and the batch a
sharded check's forwards run on where a whole forward would not fit its room.

Example:
    >>> part, size, seq = sub_batch(torch.zeros(4, 6), 1, 3)
    >>> part.shape, size, seq
    (torch.Size([1, 3]), 4, 6)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from gradwatch.check.judging.report import CheckReport
from gradwatch.plan.memory import FORWARD_BYTES_PER_OUTPUT_BYTE, mb
from gradwatch.trees import rebuild, tensor_leaves


def batch_dims(batch: Any) -> Tuple[int, int]:
    """The batch size and sequence length of ``batch``: the first two dimensions of the first tensor in it with a
    dimension (the length 1 where it has one, and where it has four or more: an image's second is its channels;
    ``(1, 1)`` where there is none).

    Example:
        >>> batch_dims({"input_ids": torch.zeros(4, 6)}), batch_dims(torch.zeros(3)), batch_dims(2.0)
        ((4, 6), (3, 1), (1, 1))
        >>> batch_dims((torch.zeros(2, 3, 64, 64), torch.zeros(2)))
        (2, 1)
    """
    return _dims(_first(batch))


def _first(batch: Any) -> Optional[torch.Tensor]:
    """The first tensor in ``batch`` that has a dimension."""
    return next((t for t in tensor_leaves(batch) if t.dim()), None)


def _dims(first: Optional[torch.Tensor]) -> Tuple[int, int]:
    if first is None:
        return 1, 1
    return int(first.shape[0]), int(first.shape[1]) if 1 < first.dim() <= 3 else 1


def sub_batch(batch: Any, keep: int, length: Optional[int] = None, start: int = 0) -> Tuple[Any, int, int]:
    """The first ``keep`` samples of ``batch`` (from sample ``start``; and with ``length``, their first ``length``
    positions): every tensor whose first dimension is the batch size (that of the first tensor in it) cut to
    ``keep``, and those whose second dimension is the sequence length (the first tensor's) cut to ``length``;
    returns it, the batch size and the sequence length (1 where the first tensor has one dimension).

    Example:
        >>> part, size, seq = sub_batch({"input_ids": torch.zeros(4, 6), "scale": 2.0}, 1, 3)
        >>> part["input_ids"].shape, size, seq
        (torch.Size([1, 3]), 4, 6)
    """
    first = _first(batch)
    if first is None:
        return batch, 1, 1
    size, seq = _dims(first)

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[0] == size:
            t = t[start:start + keep]
        if length is not None and t.dim() > 1 and t.shape[1] == seq:
            t = t[:, :length]
        return t

    return rebuild(batch, cut), size, seq


def capture_window(batch: Any, held: int, captured: int, deferred: int, share: int, seed: int,
                   needs: Sequence[int] = (), room: int = 0) -> Tuple[Any, Optional[str]]:
    """The batch the next forward of a one-process check captures on, after a first forward on the whole batch held
    ``held`` bytes of captures for ``captured`` bytes of the units' inputs and deferred units with ``deferred`` bytes
    of inputs, and left whole pieces whose checks need ``needs`` bytes on the whole batch: the whole batch where the
    deferred units (their inputs at the first forward's ratio of captures to inputs) fit the captures' ``share`` of
    the room and every need fits ``room``, else a window of its samples where they do, at least one, at an offset
    that moves with the check's ``seed`` (each check a new draw, as the row blocks rotate); with what was kept, said
    (None for the whole batch).

    A forward per share of the rest, and one per piece on the samples that fit it, would run the whole model again
    and again (a small UNet's check made 36 forwards of up to 8 samples this way).

    Example:
        >>> part, what = capture_window(torch.zeros(8, 3), 10, 10, 40, 10, seed=1)
        >>> part.shape, what
        (torch.Size([2, 3]), "samples 2 to 3 of the batch's 8")
        >>> capture_window(torch.zeros(8, 3), 10, 10, 10, 10, seed=1)[1] is None
        True
        >>> capture_window(torch.zeros(8, 3), 10, 10, 0, 10, seed=3, needs=[30], room=10)[1]
        "samples 6 to 7 of the batch's 8"
    """
    rest = deferred * held / max(1, captured)
    size, _ = batch_dims(batch)
    keep = size if rest <= share else int(size * share // rest)
    for need in needs:
        keep = min(keep, int(size * room // max(1, need)))
    keep = max(1, keep)
    if keep >= size:
        return batch, None
    start = (seed * keep) % (size - keep + 1)
    part, _, _ = sub_batch(batch, keep, start=start)
    return part, (f"sample {start}" if keep == 1 else f"samples {start} to {start + keep - 1}") + \
        f" of the batch's {size}"


def cuts_to_try(size: int, seq: int, need: int, room: int) -> List[Tuple[int, Optional[int]]]:
    """``(samples, positions)`` cuts of a batch of ``size`` x ``seq`` to try, in order, for a piece that needs ``need``
    bytes on the whole batch and has ``room``: the first samples that fit by that estimate, then one sample's first
    positions, about as many as fit, then half of them twice (the estimate by samples may keep one that does not fit:
    GPT-2's logits and loss over its 50,257 tokens, a piece several times the room at batch 8 x 64).

    Example:
        >>> cuts_to_try(8, 64, 1184, 190)
        [(1, None), (1, 63), (1, 31), (1, 15)]
        >>> cuts_to_try(8, 64, 4000, 190)
        [(1, 24), (1, 12), (1, 6)]
        >>> cuts_to_try(4, 1, 100, 60)
        [(2, None)]
    """
    cuts: List[Tuple[int, Optional[int]]] = []
    keep = min(size - 1, int(size * room / max(need, 1)))
    if keep >= 1:
        cuts.append((keep, None))
    if seq > 1:
        fit = min(seq - 1, int(seq * size * room / max(need, 1)))
        cuts += [(1, n) for n in dict.fromkeys((fit, fit // 2, fit // 4)) if n >= 1]
    return cuts


def first_of_capture(inputs: Tuple[Any, Any], children: Dict[str, List[Any]], constants: Set[int], keep: int,
                      length: Optional[int] = None) -> Tuple[Tuple[Any, Any], Dict[str, List[Any]], Set[int], str]:
    """A unit's captured inputs and stubs' outputs cut to their first ``keep`` samples (every tensor whose first
    dimension is the batch size) and, with ``length``, those samples' first positions (every tensor whose second
    dimension is the sequence length, or one shorter: next-token logits beside the ids); with the ids of the cut
    constants and what was kept, said."""
    whole = (inputs, children)
    size, seq = batch_dims(inputs)

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[0] == size:
            t = t[:keep]
        if length is not None and t.dim() > 1 and t.shape[1] in (seq, seq - 1):  # next-token logits: one fewer
            t = t[:, :length - (seq - int(t.shape[1]))]
        return t

    cut_inputs, cut_children = rebuild(whole, cut)
    kept = {id(new) for old, new in zip(tensor_leaves(whole), tensor_leaves((cut_inputs, cut_children)))
            if id(old) in constants}
    what = f"{keep} of the batch's {size} samples" + ("" if length is None else f", its first {length} of {seq} positions")
    return cut_inputs, cut_children, kept, what + " (cut from the forward's capture)"


def positions(batch: Any) -> int:
    """Samples times positions of a batch (its first tensor's first two dimensions)."""
    size, seq = batch_dims(batch)
    return max(1, size * seq)


def forward_transient(output_per_position: float, batch: Any) -> int:
    """What a forward of the live model on ``batch`` holds beyond its captures: :data:`FORWARD_BYTES_PER_OUTPUT_BYTE`
    times its output (``output_per_position`` bytes per sample and position, as an earlier forward saw them).

    Example:
        >>> forward_transient(8.0, torch.zeros(4, 6, dtype=torch.long))
        576
    """
    return int(FORWARD_BYTES_PER_OUTPUT_BYTE * output_per_position * positions(batch))


def forward_cut(batch: Any, forward_bytes: int, share: int, agree: Callable[[int], Any], report: CheckReport) -> Any:
    """The batch a sharded check's forwards run on: the whole batch where a forward's ``forward_bytes`` fit the
    captures' ``share`` of the room on every rank, else its first samples, the share's fraction of them (at least
    one), the smallest fraction of the ranks' (an agreement point: tensor and sequence parallel peers share a batch,
    and their forwards' collectives must match)."""
    permille = 1000 if forward_bytes <= share else share * 1000 // max(1, forward_bytes)
    permille = agree(permille)
    size, _ = batch_dims(batch)
    keep = size if permille is None or permille >= 1000 else max(1, size * permille // 1000)
    if keep >= size:
        return batch
    report.notes.append(f"module form: this check's forwards ran on the first {keep} of the batch's {size} samples (a "
                        f"forward of the whole batch holds about {mb(forward_bytes)} beyond its captures, over their "
                        f"share of the room, {mb(share)})")
    return sub_batch(batch, keep)[0]
