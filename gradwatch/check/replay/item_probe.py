"""Which item count a ``loss_fn`` averages over, decided by evaluating it on two samples and their union.

For a loss that is a mean over items and a model that treats the samples of a batch apart, the
gradient on two samples together is a weighted sum of their gradients alone:

    grad L([x, y]) = a * grad L([x]) + b * grad L([y]),   a = n(x) / (n(x) + n(y)),  b = n(y) / (n(x) + n(y))

where ``n`` counts the items the loss averages over. A ``loss_fn`` that sums (or divides by a
constant) gives ``a = b = 1``. Fitting ``a`` and ``b`` on the gradients of three small batches
therefore tells which of the batch's count rules (:func:`gradwatch.check.replay.items.candidates`) the
loss follows, whatever the loss values are (at initialization every token's loss is about the
same, so comparing loss values would not tell). Two kinds of pairs are evaluated:

- **labels**: one sample twice, its labels ``-100`` except at a few positions, three kept in the first
  copy (its first position among them) and one in the second: the target-token counts, with and
  without the next-token shift, and the sample count predict three different weights;
- **samples**: two samples of one micro-batch whose counts differ most between the rules.

A fit that leaves a residual (the gradient of the union is no weighted sum) means the samples of
a batch are coupled (an in-batch contrastive loss, a batch statistic): the step is judged per
micro-batch then. Train-mode BatchNorm is recognized without an evaluation (:func:`coupling_modules`).

This module is the decision; evaluating a batch's gradient (the live model with dropout off, its
buffers put back) is the caller's, as ``evaluate(batch) -> sketch`` (:mod:`gradwatch.check.numerics.sketch`).

Example:
    >>> from gradwatch.check.replay.items import ItemRule
    >>> w = torch.tensor([0.5, -1.0])
    >>> def evaluate(batch):  # the gradient of a token mean over labels != -100
    ...     x, y = batch["x"], batch["labels"]
    ...     keep = (y != -100).double()
    ...     return ((x @ w.double()).unsqueeze(-1) * keep).sum(1) @ x.double() / keep.sum()
    >>> batch = {"x": torch.randn(2, 2, dtype=torch.float64), "labels": torch.tensor([[1, 2, 3, 4, 5], [1, 2, -100, -100, -100]])}
    >>> rules = [ItemRule("samples"), ItemRule("tokens", ("labels",)), ItemRule("tokens", ("labels",), 1)]
    >>> decide(evaluate, [batch], rules).rule.text
    'target tokens (labels != -100)'
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from gradwatch.check.replay.items import (
    IGNORE_INDEX,
    ItemCountError,
    ItemRule,
    Path,
    keep_labels,
    leading_size,
    path_text,
    take_samples,
    tensor_at,
)

#: The pseudo-rule of a ``loss_fn`` that sums over items (or divides by a constant): every micro-batch adds.
SUM_KEY = "sum"
#: Samples of one micro-batch searched for the most telling pair.
MAX_PAIR_SEARCH = 32

Evaluate = Callable[[Any], torch.Tensor]
Pair = Tuple[str, Any, Any, Any, Dict[str, Tuple[float, float]]]


@dataclass
class ItemDecision:
    """What the probes found (see the module docstring).

    Attributes:
        rule: The rule the loss follows (None when no single rule was left, or the samples are coupled).
        survivors: Keys of the rules no probe ruled out (``"sum"`` for a summing loss).
        coupled: Why the samples of a batch are coupled (then the step is judged per micro-batch), or None.
        evidence: The fit that decided, in words.
        evaluations: Gradients evaluated.
    """

    rule: Optional[ItemRule] = None
    survivors: List[str] = field(default_factory=list)
    coupled: Optional[str] = None
    evidence: Optional[str] = None
    evaluations: int = 0

    @property
    def sums(self) -> bool:
        """True when the loss sums over items (each micro-batch adds, whatever its count)."""
        return self.survivors == [SUM_KEY]


def coupling_modules(model: nn.Module) -> List[str]:
    """Names of the modules that couple the samples of a batch by design: BatchNorm in train mode
    (batch statistics; ``SyncBatchNorm`` too).

    Example:
        >>> coupling_modules(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
        ['1']
        >>> coupling_modules(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).eval())
        []
    """
    return [n or "<model>" for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]


def fit_pair(sx: torch.Tensor, sy: torch.Tensor, sxy: torch.Tensor) -> Optional[Tuple[float, float, float]]:
    """Least squares ``sxy ~ a * sx + b * sy``: ``(a, b, residual relative to ||sxy||)``; None when the two
    gradients are zero or parallel (no fit tells the weights apart).

    Example:
        >>> t = lambda *v: torch.tensor(v, dtype=torch.float64)
        >>> a, b, r = fit_pair(t(1.0, 0, 1), t(0, 1.0, 1), t(0.75, 0.25, 1.0))
        >>> round(a, 6), round(b, 6), r < 1e-9
        (0.75, 0.25, True)
    """
    nx, ny, nxy = (float(torch.linalg.vector_norm(v)) for v in (sx, sy, sxy))
    if nx == 0.0 or ny == 0.0 or nxy == 0.0 or not all(math.isfinite(v) for v in (nx, ny, nxy)):
        return None
    cos = float(sx @ sy) / (nx * ny)
    if abs(cos) > 1 - 1e-6:
        return None
    basis = torch.stack([sx, sy], dim=1)
    coef = torch.linalg.lstsq(basis, sxy.unsqueeze(1)).solution.squeeze(1)
    a, b = float(coef[0]), float(coef[1])
    residual = float(torch.linalg.vector_norm(sxy - basis @ coef)) / nxy
    return a, b, residual


def _label_pair(batches: Sequence[Any], path: Path, rules: Sequence[ItemRule]) -> Optional[Pair]:
    """One sample twice: the first copy keeps three labels (its first position and two more), the second one."""
    best: Optional[Tuple[int, int, List[int]]] = None  # (counted positions, micro-batch, row)
    for i, batch in enumerate(batches):
        try:
            labels = tensor_at(batch, path)
        except ItemCountError:
            continue
        if labels.dim() != 2:
            return None
        counted = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
        row = int(torch.argmax(counted))
        if best is None or int(counted[row]) > best[0]:
            best = (int(counted[row]), i, [row])
    if best is None or best[0] < 3:
        return None
    _, i, (row,) = best
    base = take_samples(batches[i], [row])
    labels = tensor_at(base, path)
    positions = [j for j in range(1, int(labels.shape[1])) if int(labels[0, j]) != IGNORE_INDEX]
    keep_x, keep_y = [0, positions[0], positions[1]], [positions[2]]
    x = keep_labels(base, path, 0, keep_x)
    y = keep_labels(base, path, 0, keep_y)
    xy = keep_labels(keep_labels(take_samples(base, [0, 0]), path, 0, keep_x), path, 1, keep_y)
    return f"one sample's labels ({path_text(path)}) kept at 3 positions, then at 1", x, y, xy, _predict(rules, x, y)


def _predict(rules: Sequence[ItemRule], x: Any, y: Any) -> Dict[str, Tuple[float, float]]:
    """Each rule's ``(a, b)`` for the pair (rules that cannot count it, or count 0 in a part, left out)."""
    out: Dict[str, Tuple[float, float]] = {SUM_KEY: (1.0, 1.0)}
    for rule in rules:
        try:
            cx, cy = rule.count(x), rule.count(y)
        except ItemCountError:
            continue
        if cx > 0 and cy > 0:
            out[rule.key] = (cx / (cx + cy), cy / (cx + cy))
    return out


def _sample_pairs(batches: Sequence[Any], rules: Sequence[ItemRule], alive: Sequence[str]) -> Iterator[Pair]:
    """Two samples of one micro-batch whose predicted weights differ most between the rules still alive (a
    summing loss among them); then the two halves of the largest micro-batch (a loss that couples samples
    may give one sample alone no gradient at all)."""
    best: Optional[Tuple[float, Any, int, int]] = None
    for batch in batches:
        size = leading_size(batch)
        if size is None or size < 2:
            continue
        rows = list(range(min(size, MAX_PAIR_SEARCH)))
        singles = [take_samples(batch, [r]) for r in rows]
        counts: Dict[str, List[float]] = {}
        for rule in rules:
            if rule.key not in alive:
                continue
            try:
                counts[rule.key] = [rule.count(s) for s in singles]
            except ItemCountError:
                continue
        for a, b in itertools.combinations(rows, 2):
            preds = [c[a] / (c[a] + c[b]) for c in counts.values() if c[a] > 0 and c[b] > 0]
            if len(preds) < len(counts):
                continue
            preds += [1.0] if SUM_KEY in alive else []
            spread = min((abs(p - q) for p, q in itertools.combinations(preds, 2)), default=0.0)
            if best is None or spread > best[0]:
                best = (spread, batch, a, b)
        break  # the first micro-batch with two samples is enough
    if best is not None and best[0] > 0.0:
        _, batch, a, b = best
        x, y, xy = take_samples(batch, [a]), take_samples(batch, [b]), take_samples(batch, [a, b])
        yield f"samples {a} and {b} of a micro-batch", x, y, xy, _predict(rules, x, y)
    sizes = [(leading_size(b) or 0, i) for i, b in enumerate(batches)]
    size, i = max(sizes, default=(0, 0))
    if size >= 4:
        half = size // 2
        batch = batches[i]
        x, y = take_samples(batch, range(half)), take_samples(batch, range(half, size))
        yield (f"the two halves of a micro-batch ({half} and {size - half} samples)", x, y, batch,
               _predict(rules, x, y))


def _pairs(batches: Sequence[Any], rules: Sequence[ItemRule], alive: List[str]) -> Iterator[Pair]:
    """The probe pairs, made as they are needed (``alive``: the rules still possible, narrowed by the caller)."""
    for path in dict.fromkeys(r.path for r in rules if r.kind == "tokens"):
        pair = _label_pair(batches, path, rules)
        if pair is not None:
            yield pair
    if len(alive) > 1:  # still two rules to tell apart ("sum" among them), or a coupling to find
        yield from _sample_pairs(batches, rules, list(alive))


def decide(evaluate: Evaluate, batches: Sequence[Any], rules: Sequence[ItemRule], noise: float = 1e-6) -> ItemDecision:
    """The rule ``loss_fn`` follows, from the gradients ``evaluate`` gives on probe batches (module docstring).

    Args:
        evaluate: ``evaluate(batch) -> sketch`` of the gradient of ``loss_fn`` on ``batch`` (float64 vector).
        batches: The step's micro-batches (probe batches are made of their samples).
        rules: The candidate rules (:func:`gradwatch.check.replay.items.candidates`).
        noise: Relative rounding of one gradient in the precision evaluated (the training tolerance of its dtype).

    Returns:
        An :class:`ItemDecision`; ``coupled`` is set when a fit leaves a residual beyond the rounding.
    """
    alive = [SUM_KEY] + [r.key for r in rules]
    by_key = {r.key: r for r in rules}
    decision = ItemDecision()
    coupled_at = max(1e-2, 30 * noise)
    for what, x, y, xy, predicted in _pairs(batches, rules, alive):
        try:
            sx, sy, sxy = evaluate(x), evaluate(y), evaluate(xy)
        except Exception as exc:  # noqa: BLE001 - loss_fn refused this pair (labels it cannot ignore): the next one
            decision.evidence = f"{what}: loss_fn raised {type(exc).__name__}: {exc}"
            continue
        decision.evaluations += 3
        fit = fit_pair(sx, sy, sxy)
        if fit is None:
            continue
        a, b, residual = fit
        if residual > coupled_at:
            decision.coupled = (f"the gradient of {what} together is no weighted sum of theirs alone (residual "
                                f"{residual:.2g}): loss_fn or the model couples the samples of a batch")
            decision.survivors = []
            return decision
        tol = max(2e-3, 3 * residual)
        kept = [k for k in alive if k in predicted and abs(predicted[k][0] - a) <= tol and abs(predicted[k][1] - b) <= tol]
        if len(kept) < len(alive):
            names = " and ".join(f"{by_key[k].text}" for k in kept if k in by_key) or (
                "none of the batch's counts" if not kept else "a sum over items")
            decision.evidence = f"{what}: together they weigh {a:.3f} and {b:.3f}, as {names} count"
        alive[:] = kept  # in place: the pairs still to come are chosen among these
        if len(alive) <= 1:
            break
    decision.survivors = alive
    if len(alive) == 1 and alive[0] in by_key:
        decision.rule = by_key[alive[0]]
    return decision
