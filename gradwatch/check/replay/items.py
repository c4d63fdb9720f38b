"""What a loss averages over, found in the batch: the item counts that weigh a step's micro-batches.

Gradient accumulation and data parallelism promise the gradient of the loss on the step's whole
batch. For a loss that is a mean over items (the target tokens whose label is not ``-100``, the
samples), that is the mean over every item of the step: each micro-batch ``i`` (on each rank) weighs
``n_i / N``, its item count over the step's, not ``1 / k``. This module is the pure part of that:
the rules an item count can follow (:class:`ItemRule`), the rules a batch offers
(:func:`candidates`), the samples and labels a probe batch is made of (:func:`take_samples`,
:func:`keep_labels`) and the weights (:func:`step_weights`). Which rule a ``loss_fn`` follows is
decided by evaluating it (:mod:`gradwatch.check.replay.item_probe`); no model is evaluated here.

Example:
    >>> labels = torch.tensor([[5, 6, -100], [7, -100, -100]])
    >>> batch = {"input_ids": torch.tensor([[3, 9, 4], [8, 2, 0]]), "labels": labels}
    >>> [r.text for r in candidates([batch])]
    ['samples', 'target tokens (labels != -100)', 'target tokens (labels[..., 1:] != -100)']
    >>> ItemRule("tokens", ("labels",), 1).count(batch)
    1.0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from gradwatch.trees import named_leaves, rebuild, rebuild_at

#: The label value torch's and Hugging Face's losses ignore (``cross_entropy(ignore_index=-100)``).
IGNORE_INDEX = -100

Path = Tuple[Union[str, int], ...]

#: Values of the ``items`` option that are not a callable.
ITEMS_MODES = ("auto", "micro_batches", "samples")


class ItemCountError(ValueError):
    """A batch in which an item rule cannot count (its tensor missing, a callable that raised or returned no number)."""


def path_text(path: Path) -> str:
    """A path as a person reads it: ``labels`` for a key at the top, else ``batch[1]['y']``.

    Example:
        >>> path_text(("labels",)), path_text((1,)), path_text(("x", 0))
        ('labels', 'batch[1]', "batch['x'][0]")
    """
    if len(path) == 1 and isinstance(path[0], str):
        return path[0]
    return "batch" + "".join(f"[{p!r}]" for p in path)


def tensor_at(batch: Any, path: Path) -> torch.Tensor:
    """The tensor at ``path`` in ``batch``.

    Raises:
        ItemCountError: The batch has no tensor there.
    """
    obj = batch
    for p in path:
        try:
            obj = obj[p]
        except (KeyError, IndexError, TypeError):
            raise ItemCountError(f"the batch has no {path_text(path)}") from None
    if not isinstance(obj, torch.Tensor):
        raise ItemCountError(f"{path_text(path)} is a {type(obj).__name__}, not a tensor")
    return obj


def leading_size(batch: Any) -> Optional[int]:
    """The batch size: the first dimension of the first tensor with one (None when there is none).

    Example:
        >>> leading_size((torch.zeros(4, 2), torch.zeros(4)))
        4
    """
    first = next((t for _, t in named_leaves(batch) if t.dim()), None)
    return None if first is None else int(first.shape[0])


@dataclass(frozen=True)
class ItemRule:
    """How to count the items a loss averages over in one batch.

    Attributes:
        kind: ``"samples"`` (the batch size), ``"tokens"`` (entries of ``path`` that are not ``-100``),
            ``"mask"`` (the sum of a 0/1 tensor at ``path``), ``"declared"`` (``items(batch)``, a callable
            the user gave) or ``"micro_batches"`` (one per micro-batch: each weighs alike).
        path: Where the counted tensor is in the batch.
        shift: Positions left out at the start of the second dimension (1: the next-token shift of a
            causal language model, whose first label is never a target).
        declared: The callable of ``"declared"``.

    Example:
        >>> ItemRule("mask", ("attention_mask",)).count({"attention_mask": torch.tensor([[1, 1, 0]])})
        2.0
    """

    kind: str
    path: Path = ()
    shift: int = 0
    declared: Optional[Callable[[Any], Any]] = field(default=None, compare=False, hash=False, repr=False)

    @property
    def key(self) -> str:
        """One string per rule (travels between ranks, where callables do not)."""
        return f"{self.kind}:{path_text(self.path) if self.path else ''}:{self.shift}"

    @property
    def text(self) -> str:
        """What is counted, in words: ``"target tokens (labels[..., 1:] != -100)"``."""
        where = path_text(self.path) + ("[..., 1:]" if self.shift else "")
        if self.kind == "tokens":
            return f"target tokens ({where} != {IGNORE_INDEX})"
        if self.kind == "mask":
            return f"positions ({where} summed)"
        if self.kind == "declared":
            return "items (counted by items=)"
        if self.kind == "micro_batches":
            return "micro-batches"
        return "samples"

    @property
    def unit(self) -> str:
        """One item, in words: ``"target token"``, ``"sample"``, ``"position"``, ``"item"``."""
        return {"tokens": "target token", "mask": "position", "declared": "item", "micro_batches": "micro-batch"}.get(
            self.kind, "sample")

    def count(self, batch: Any) -> float:
        """The items of ``batch`` under this rule.

        Raises:
            ItemCountError: The batch has no tensor at ``path``, or ``items(batch)`` raised or gave no number.
        """
        if self.kind == "micro_batches":
            return 1.0
        if self.kind == "samples":
            size = leading_size(batch)
            if size is None:
                raise ItemCountError("the batch holds no tensor with a batch dimension")
            return float(size)
        if self.kind == "declared":
            assert self.declared is not None
            try:
                value = self.declared(batch)
            except Exception as exc:  # noqa: BLE001 - the user's callable: say what it raised
                raise ItemCountError(f"items(batch) raised {type(exc).__name__}: {exc}") from exc
            try:
                number = float(value.detach().sum()) if isinstance(value, torch.Tensor) else float(value)
            except (TypeError, ValueError):
                raise ItemCountError(f"items(batch) returned {type(value).__name__} {value!r:.40}, expected a "
                                     "number of items (an int, a float or a one-element tensor)") from None
            if not number >= 0 or number == float("inf"):
                raise ItemCountError(f"items(batch) returned {number!r}, expected a count >= 0")
            return number
        t = tensor_at(batch, self.path)
        if self.shift:
            t = t[:, self.shift:] if t.dim() > 1 else t[self.shift:]
        if self.kind == "tokens":
            return float((t != IGNORE_INDEX).sum())
        return float(t.sum())


def _is_mask(path: Path, t: torch.Tensor) -> bool:
    """A 0/1 tensor of two or more dimensions with a 1 in it: an integer or boolean one (an attention mask),
    or a floating one whose name says it is a mask (``loss_mask``)."""
    if t.dim() < 2 or t.numel() == 0 or t.is_complex():
        return False
    if t.is_floating_point() and not (path and "mask" in str(path[-1]).lower()):
        return False
    if t.dtype == torch.bool:
        return bool(t.any())
    return bool(((t == 0) | (t == 1)).all()) and bool((t == 1).any())


def _targets(path: Path, first: Optional[Path]) -> bool:
    """A token tensor that looks like the targets though no entry is -100 yet (a batch without padding): named
    ``...label...`` or ``...target...``, or in a tuple or list batch, an integer tensor after the first tensor."""
    name = str(path[-1]).lower() if path else ""
    if "label" in name or "target" in name:
        return True
    return isinstance(path[-1], int) and path != first if path else False


def candidates(batches: Sequence[Any]) -> List[ItemRule]:
    """The item rules the batches of one step offer, most specific last: the samples; for each integer
    tensor holding ``-100`` somewhere in the step, or that looks like the targets (``labels``, a tuple's
    integer tensor after the first), its target tokens (and, with two dimensions, after the next-token
    shift); for each mask (a 0/1 tensor of two dimensions or more, integer or boolean, or floating
    and named ``...mask``), its sum (and after the shift).

    Example:
        >>> [r.key for r in candidates([{"x": torch.randn(2, 3), "mask": torch.tensor([[1, 0, 1], [1, 1, 1]])}])]
        ['samples::0', 'mask:mask:0', 'mask:mask:1']
    """
    found: Dict[Path, Dict[str, bool]] = {}  # per tensor, over the step's micro-batches
    for batch in batches:
        first = next((p for p, t in named_leaves(batch) if t.dim()), None)
        size = leading_size(batch)
        for path, t in named_leaves(batch):
            if not t.dim():
                continue
            integer = not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
            seen = found.setdefault(path, {"ignored": False, "targets": False, "mask": True, "rows": t.dim() > 1})
            seen["ignored"] = seen["ignored"] or (integer and bool((t == IGNORE_INDEX).any()))
            seen["targets"] = seen["targets"] or (integer and t.dim() > 1 and _targets(path, first))
            seen["mask"] = seen["mask"] and _is_mask(path, t) and size == int(t.shape[0])
    out = [ItemRule("samples")]
    for path, seen in found.items():
        if seen["ignored"] or seen["targets"]:
            out += [ItemRule("tokens", path)] + ([ItemRule("tokens", path, 1)] if seen["rows"] else [])
        if seen["mask"] and not seen["ignored"]:  # a 0/1 tensor of targets may also be a mask: both are tried
            out += [ItemRule("mask", path), ItemRule("mask", path, 1)]
    return out


def label_shift(batches: Sequence[Any], path: Path) -> Optional[int]:
    """From the data alone, whether the loss shifts the labels at ``path``: 1 when they equal the batch's token ids
    where they count (the model predicts the next one: Hugging Face's ``labels = input_ids``), 0 when they equal the
    ids one position on (the data shifted them), None when neither holds (or no ids of their shape).

    Example:
        >>> ids = torch.tensor([[5, 6, 7, 8]])
        >>> label_shift([{"input_ids": ids, "labels": ids.clone()}], ("labels",))
        1
        >>> label_shift([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], ("labels",))
        0
    """
    verdicts = set()
    for batch in batches:
        try:
            labels = tensor_at(batch, path)
        except ItemCountError:
            continue
        counted = labels != IGNORE_INDEX
        for other, ids in named_leaves(batch):
            if other == path or ids.shape != labels.shape or ids.is_floating_point() or labels.dim() < 2:
                continue
            if bool((ids[counted] == labels[counted]).all()):
                verdicts.add(1)
            elif bool((ids[:, 1:][counted[:, :-1]] == labels[:, :-1][counted[:, :-1]]).all()):
                verdicts.add(0)
            break
    return verdicts.pop() if len(verdicts) == 1 else None


def proportional(a: Sequence[float], b: Sequence[float], tol: float = 1e-9) -> bool:
    """True when two count vectors give the same weights (one is a multiple of the other).

    Example:
        >>> proportional([2, 4], [1, 2]), proportional([2, 4], [1, 1])
        (True, False)
    """
    sa, sb = float(sum(a)), float(sum(b))
    if sa <= 0 or sb <= 0:
        return sa == sb
    return all(abs(x / sa - y / sb) <= tol * max(x / sa, y / sb, 1e-300) for x, y in zip(a, b))


def step_weights(counts: Sequence[Sequence[float]], world: int) -> List[List[float]]:
    """Each rank's micro-batch weights in the step's objective, as that rank's replay applies them before the
    ranks' gradients are averaged (DDP and FSDP average ``.grad``): ``world * n_ri / N``.

    ``counts[r][i]`` is micro-batch ``i`` of rank ``r``'s item count, ``N`` their sum. The averaged replays then
    weigh every item of the step alike: the gradient of the mean over all of them.

    Example:
        >>> step_weights([[5, 15]], 1)
        [[0.25, 0.75]]
        >>> step_weights([[10], [30]], 2)
        [[0.5], [1.5]]
    """
    total = float(sum(sum(c) for c in counts))
    if total <= 0:
        raise ItemCountError("the step holds no item to average over (every count is 0)")
    return [[world * float(c) / total for c in rank] for rank in counts]


def equal_weights(counts: Sequence[Sequence[float]]) -> List[List[float]]:
    """Each micro-batch weighs ``1 / k`` on its rank (the mean of micro-batch means; the ranks are averaged).

    Example:
        >>> equal_weights([[5, 15, 7]])
        [[0.3333333333333333, 0.3333333333333333, 0.3333333333333333]]
    """
    return [[1.0 / len(rank)] * len(rank) if rank else [] for rank in counts]


def take_samples(batch: Any, index: Sequence[int]) -> Any:
    """The samples ``index`` of ``batch``: every tensor whose first dimension is the batch size, indexed by them.

    Example:
        >>> take_samples({"x": torch.arange(6).view(3, 2), "n": 7}, [2, 0])["x"].tolist()
        [[4, 5], [0, 1]]
    """
    size = leading_size(batch)
    rows = torch.tensor(list(index), dtype=torch.long)

    def cut(t: torch.Tensor) -> torch.Tensor:
        if size is not None and t.dim() and int(t.shape[0]) == size:
            return t.index_select(0, rows.to(t.device))
        return t

    return rebuild(batch, cut)


def keep_labels(batch: Any, path: Path, row: int, keep: Sequence[int]) -> Any:
    """``batch`` with the labels at ``path`` of sample ``row`` set to ``-100`` except at positions ``keep``
    (a kept position whose label was ``-100`` takes the value of the first kept label that was not).

    Example:
        >>> b = {"labels": torch.tensor([[-100, 4, 5, 6]])}
        >>> keep_labels(b, ("labels",), 0, [0, 2])["labels"].tolist()
        [[5, -100, 5, -100]]
    """
    target = tensor_at(batch, path)

    def edit(p: Path, t: torch.Tensor) -> torch.Tensor:
        if p != path:
            return t
        out = t.clone()
        line = out[row]
        valid = [j for j in keep if int(target[row, j]) != IGNORE_INDEX]
        fill = target[row, valid[0]] if valid else None
        kept = line.clone()
        line.fill_(IGNORE_INDEX)
        for j in keep:
            line[j] = kept[j] if int(kept[j]) != IGNORE_INDEX or fill is None else fill
        return out

    return rebuild_at(batch, edit)


def counts_by_rule(rules: Sequence[ItemRule], batches: Sequence[Any]) -> Dict[str, List[float]]:
    """``{rule.key: [count of each batch]}`` for every rule that can count every batch (the others left out).

    Example:
        >>> counts_by_rule([ItemRule("samples")], [torch.zeros(2, 1), torch.zeros(3, 1)])
        {'samples::0': [2.0, 3.0]}
    """
    out: Dict[str, List[float]] = {}
    for rule in rules:
        try:
            out[rule.key] = [rule.count(b) for b in batches]
        except ItemCountError:
            continue
    return out
