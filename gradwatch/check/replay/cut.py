"""How a step was cut, named: the weights training gave its micro-batches and ranks, against the step's objective.

The step's objective weighs micro-batch ``j`` (of any rank) by ``w_j = n_j / N``, its items over the
step's (:mod:`gradwatch.check.replay.items`). When training's gradient is not that, the usual culprits
put the very same per-micro-batch gradients together with other weights: each micro-batch's own
mean divided by ``k`` (the 2024 gradient accumulation bug), each rank's own mean averaged by DDP
(per-rank normalization), a partial window divided by the full one, a count that includes
labels the loss never predicts. Each is a weight vector ``h``; :func:`explain_cut` tests them on
sketches (:mod:`gradwatch.check.numerics.sketch`) of each micro-batch's gradient and of training's, with a
free scale, and says in words the one that explains training's gradient (to within 1%), with
the counts. Pure math and words: no model, no I/O.

Example:
    >>> g = torch.eye(3, dtype=torch.float64)  # three micro-batches' gradients (sketched)
    >>> parts = [Part(0, i, c) for i, c in enumerate([5.0, 30.0, 15.0])]
    >>> live = g.sum(0) / 3  # training: each micro-batch's mean divided by 3
    >>> text = explain_cut(parts, g, live, ItemRule("tokens", ("labels",), 1))
    >>> text.split(":")[0]
    'training weighs the 3 micro-batches equally, but they hold 5, 30 and 15 target tokens (labels[..., 1'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from gradwatch.check.replay.items import ItemRule, candidates, counts_by_rule, path_text, proportional

#: Misfit (relative to training's sketch) under which a weighting explains training's gradient.
EXPLAINED = 1e-2
#: Largest accumulation window a scale is read as (as :data:`gradwatch.check.judging.training_judge.MAX_ACCUMULATION`).
MAX_WINDOW = 64


@dataclass
class Part:
    """One micro-batch of one rank in a step.

    Attributes:
        rank: The rank that trained on it.
        index: Its place among that rank's micro-batches.
        count: Its items under the step's rule.
        others: Its items under the batch's other rules (``{rule key: count}``).
    """

    rank: int
    index: int
    count: float
    others: Dict[str, float] = field(default_factory=dict)


def _number(x: float) -> str:
    return str(int(round(x))) if abs(x - round(x)) < 1e-9 else f"{x:.4g}"


def _series(values: Sequence[str]) -> str:
    values = list(values)
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " and " + values[-1]


def _misfit(live: torch.Tensor, basis: torch.Tensor, h: torch.Tensor) -> Tuple[float, float]:
    """``(scale, misfit)`` of ``live ~ scale * basis^T h`` (least squares in the scale)."""
    sh = h @ basis
    nn = float(sh @ sh)
    if nn == 0.0:
        return 0.0, float("inf")
    s = float(live @ sh) / nn
    return s, float(torch.linalg.vector_norm(live - s * sh)) / max(float(torch.linalg.vector_norm(live)), 1e-300)


def _names(parts: Sequence[Part], world: int) -> List[str]:
    ks = {p.rank: 0 for p in parts}
    for p in parts:
        ks[p.rank] += 1
    if world > 1 and all(k == 1 for k in ks.values()):
        return [f"rank {p.rank}" for p in parts]
    if world > 1:
        return [f"micro-batch {p.index + 1} on rank {p.rank}" for p in parts]
    return [f"micro-batch {p.index + 1}" for p in parts]


def _held(parts: Sequence[Part], world: int, counts: Sequence[float]) -> str:
    """The counts as a person reads them: ``5, 31 and 12`` or ``rank 0: 5, 31; rank 1: 12, 40``."""
    if world > 1 and any(p.index for p in parts):
        by_rank: Dict[int, List[str]] = {}
        for p, c in zip(parts, counts):
            by_rank.setdefault(p.rank, []).append(_number(c))
        return "; ".join(f"rank {r}: {', '.join(v)}" for r, v in sorted(by_rank.items()))
    return _series([_number(c) for c in counts])


def _unequal(parts: Sequence[Part], v: Sequence[float], world: int, unit: str) -> str:
    """``a target token in micro-batch 1 counts 8.0x one in micro-batch 4`` (per-item weights ``v_j / n_j``)."""
    per = [(vj / p.count, i) for i, (p, vj) in enumerate(zip(parts, v)) if p.count > 0]
    hi, lo = max(per), min(per)
    names = _names(parts, world)
    where = "on" if names[0].startswith("rank") else "in"
    return (f"a {unit} {where} {names[hi[1]]} counts {hi[0] / lo[0]:.1f}x one {where} {names[lo[1]]}"
            if lo[0] > 0 else f"a {unit} {where} {names[lo[1]]} counts nothing")


def _fix(parts: Sequence[Part], world: int, total: float, rule: ItemRule, ranks: bool) -> str:
    what = "rank's" if ranks and not any(p.index for p in parts) else "micro-batch's"
    across = (f" (all-reduced over the ranks) and multiply it by the {world} ranks DDP averages over"
              if world > 1 else "")
    hf = ("in Hugging Face: average_tokens_across_devices=True and a model whose forward takes num_items_in_batch"
          if world > 1 else "in Hugging Face: a model whose forward takes num_items_in_batch (or **kwargs)")
    return (f"The step's objective is the mean over all its {_number(total)} {rule.unit}s: divide each {what} summed "
            f"loss by {_number(total)}, the step's count{across} ({hf})")


def _window(scale_each: float, k: int) -> Optional[int]:
    """The window ``K`` when each of ``k`` micro-batches weighs ``1 / K`` with ``K`` a whole number other than ``k``."""
    if scale_each <= 0:
        return None
    big = 1.0 / scale_each
    window = round(big)
    if 2 <= window <= MAX_WINDOW and window != k and abs(big - window) <= 1e-2 * window:
        return window
    return None


def explain_cut(parts: Sequence[Part], sketches: torch.Tensor, live: torch.Tensor, rule: ItemRule, world: int = 1,
                others: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Name the weights training gave the step's micro-batches and ranks, when they explain its gradient.

    Args:
        parts: The step's micro-batches, every rank's, in the order of ``sketches``' rows.
        sketches: ``(len(parts), m)``: each micro-batch's own objective gradient, sketched.
        live: ``(m,)``: training's ``.grad`` (averaged over the ranks), sketched alike.
        rule: What the step's objective averages over.
        world: Ranks whose ``.grad`` training averaged.
        others: ``{rule key: text}`` of the other rules in ``Part.others``.

    Returns:
        The words, or None when no weighting of the micro-batches explains training's gradient better than
        the step's own weights (the difference is elsewhere: a factor, a term, a hook).
    """
    n = len(parts)
    if n < 2 and world < 2:
        return None
    basis = sketches.to(torch.float64)
    live = live.to(torch.float64)
    counts = torch.tensor([p.count for p in parts], dtype=torch.float64)
    total = float(counts.sum())
    if total <= 0 or float(torch.linalg.vector_norm(live)) == 0.0:
        return None
    w = counts / total
    fixed = float(torch.linalg.vector_norm(live - w @ basis)) / float(torch.linalg.vector_norm(live))
    ranks = sorted({p.rank for p in parts})
    step = _Step(parts, rule, world, total, ranks, {r: sum(p.count for p in parts if p.rank == r) for r in ranks})
    misfit, name, h, s = _best_fit(live, basis, _hypotheses(step, w, others))
    if misfit > EXPLAINED or fixed <= 10 * misfit and name != "ref" or fixed < 1e-3:
        return None
    v = [s * float(x) for x in h]
    if name == "equal":
        return _say_equal(step, v)
    if name == "ranks":
        return _say_ranks(step, v)
    if name != "ref":
        assert others is not None
        return _say_other(step, name, others)
    return _say_scale(step, s, w, others)


@dataclass
class _Step:
    """The step whose cut :func:`explain_cut` names: its micro-batches, what they count, its ranks."""

    parts: Sequence[Part]
    rule: ItemRule
    world: int
    total: float  # the step's items under ``rule``
    ranks: List[int]  # the ranks that hold its micro-batches, in order
    per_rank: Dict[int, float]  # each rank's items


def _hypotheses(step: _Step, w: torch.Tensor, others: Optional[Dict[str, str]]) -> List[Tuple[str, torch.Tensor]]:
    """The weightings tested against training's gradient, by name: ``"equal"`` (each micro-batch's mean over ``k``),
    ``"ranks"`` (each rank's mean, averaged), each other count's key, and the step's own weights ``w`` (``"ref"``)."""
    parts, n = step.parts, len(step.parts)
    hyps: List[Tuple[str, torch.Tensor]] = [("equal", torch.ones(n, dtype=torch.float64))]
    if len(step.ranks) > 1 and all(step.per_rank.values()):
        hyps.append(("ranks", torch.tensor([p.count / step.per_rank[p.rank] for p in parts], dtype=torch.float64)))
    for key in (others or {}):
        if all(key in p.others for p in parts):
            hyps.append((key, torch.tensor([p.others[key] for p in parts], dtype=torch.float64)))
    # A weighting proportional to the step's own is the step's own up to a scale: judged as such ("ref").
    return [(name, h) for name, h in hyps if not proportional(h.tolist(), w.tolist(), 1e-6)] + [("ref", w)]


def _best_fit(live: torch.Tensor, basis: torch.Tensor, hyps: List[Tuple[str, torch.Tensor]]
              ) -> Tuple[float, str, torch.Tensor, float]:
    """``(misfit, name, weights, scale)`` of the weighting in ``hyps`` that fits ``live`` best (the first of equals)."""
    best: Optional[Tuple[float, str, torch.Tensor, float]] = None
    for name, h in hyps:
        s, misfit = _misfit(live, basis, h)
        if best is None or misfit < best[0] - 1e-12:
            best = (misfit, name, h, s)
    assert best is not None
    return best


def _say_equal(step: _Step, v: Sequence[float]) -> str:
    """Training weighs the micro-batches (or ranks) equally, with weights ``v``, where they hold unequal counts."""
    parts, world, rule, n = step.parts, step.world, step.rule, len(step.parts)
    unit, held = rule.unit, _held(parts, world, [p.count for p in parts])
    names = _names(parts, world)
    if world > 1 and len(step.ranks) == n:
        what = f"the {world} ranks equally, but " + _series([f"{nm} holds {_number(p.count)}" for nm, p in zip(names, parts)])
        text = f"training weighs {what} {rule.text}"
    elif world > 1:
        text = f"training weighs the {n} micro-batches of the {world} ranks equally, but they hold {held} {rule.text}"
    else:
        text = f"training weighs the {n} micro-batches equally, but they hold {held} {rule.text}"
    text += f": {_unequal(parts, v, world, unit)}"
    window = _window(v[0] * world, n // max(1, len(step.ranks)))
    if window is not None and world == 1:
        text += f", and each is divided by {window} where the step has {n} (a partial accumulation window)"
    return text + ". " + _fix(parts, world, step.total, rule, ranks=True)


def _say_ranks(step: _Step, v: Sequence[float]) -> str:
    """Training weighs the ranks equally (each its own mean), with weights ``v``, where they hold unequal counts."""
    held_r = _series([f"rank {r} holds {_number(c)}" for r, c in step.per_rank.items()])
    return (f"training weighs the {len(step.ranks)} ranks equally, but {held_r} {step.rule.text}: "
            f"{_unequal(step.parts, v, step.world, step.rule.unit)} (the micro-batches within each rank are weighed "
            "right). " + _fix(step.parts, step.world, step.total, step.rule, ranks=True))


def _say_other(step: _Step, name: str, others: Dict[str, str]) -> str:
    """Training weighs the micro-batches by another count (``name``) than the one loss_fn averages over."""
    parts, world, rule = step.parts, step.world, step.rule
    held = _held(parts, world, [p.count for p in parts])
    alt = [p.others[name] for p in parts]
    return (f"training weighs the {'ranks' if world > 1 and len(step.ranks) == len(parts) else 'micro-batches'} by "
            f"their {others[name]} ({_held(parts, world, alt)}), but loss_fn averages over {rule.text} ({held})"
            f"{_first_labels(rule, name)}")


def _say_scale(step: _Step, s: float, w: torch.Tensor, others: Optional[Dict[str, str]]) -> Optional[str]:
    """The weights are right relative to each other and their sum is ``s``: a partial window or another total."""
    if abs(s - 1.0) <= 1e-2:
        return None
    rule, total, k = step.rule, step.total, len(step.parts) // max(1, len(step.ranks))
    window = _window(s / k if k else 0.0, k) if len(set(round(float(x), 12) for x in w)) == 1 else None
    if window is not None and window > k:
        return (f"each of the step's {k} micro-batches is divided by {window}, the full accumulation window, where the "
                f"step has {k} (a partial window, as at the end of an epoch): training's gradient is {s:.3f}x the step's; "
                f"divide by the micro-batches the step has, or by its item count")
    near = sorted((others or {}).items(), key=lambda kv: (not kv[0].startswith(rule.kind + ":"), kv[0]))
    for key, text in near:  # the same kind of count first (the labels before the shift, rather than a mask)
        if all(key in p.others for p in step.parts):
            alt_total = sum(p.others[key] for p in step.parts)
            if alt_total > 0 and abs(s - total / alt_total) <= 1e-3 * s:
                return (f"the weights are right relative to each other, but training divides by {_number(alt_total)}, "
                        f"the step's {text}, where loss_fn averages over {_number(total)} {rule.text}: training's "
                        f"gradient is {s:.4f}x the step's{_first_labels(rule, key)}")
    return None


def explain_uncut(batch: Any, ratio: float) -> Optional[str]:
    """A one-micro-batch step whose gradient is ``ratio`` x the objective's: a count of the labels before the shift?

    Where the loss averages over the target tokens after the next-token shift but training divided by every label
    (one per row too many), ``ratio`` is the shifted count over the unshifted one.

    Example:
        >>> batch = {"input_ids": torch.ones(2, 5, dtype=torch.long),
        ...          "labels": torch.tensor([[1, 1, 1, 1, -100], [1, 1, 1, -100, -100]])}
        >>> explain_uncut(batch, 5 / 7).split(", where")[0]
        "training divides by 7, the step's target tokens (labels != -100)"
    """
    rules = candidates([batch])
    counts = counts_by_rule(rules, [batch])
    for rule in rules:
        twin = ItemRule("tokens", rule.path)
        if rule.kind != "tokens" or rule.shift != 1 or rule.key not in counts or twin.key not in counts:
            continue
        shifted, every = counts[rule.key][0], counts[twin.key][0]
        if every > shifted > 0 and abs(ratio - shifted / every) <= 2e-3 * ratio:
            return (f"training divides by {_number(every)}, the step's {twin.text}, where loss_fn averages over "
                    f"{_number(shifted)} {rule.text}: training's gradient is {ratio:.4f}x the step's"
                    f"{_first_labels(rule, twin.key)}")
    return None


def _first_labels(rule: ItemRule, other: str) -> str:
    """Why a count of the labels before the shift is off by one per sample, and the fix (empty for other pairs)."""
    if not (rule.kind == "tokens" and rule.shift == 1 and other == ItemRule("tokens", rule.path).key):
        return ""
    where = path_text(rule.path) + "[..., 1:]"
    return ("; the count includes each sample's first label, which the next-token shift never predicts: count "
            f"{where} != -100 (in Hugging Face, the Trainer counts every label for a model it does not know as a causal "
            "LM, such as GPT2LMHeadModel, whose loss_type is None: set model.loss_type = 'ForCausalLM' before building "
            "the Trainer)")


def describe_counts(parts: Sequence[Part], rule: ItemRule, world: int) -> str:
    """The step's counts in one sentence (where no fit can be made: a sharded model's replay sums the ranks).

    Example:
        >>> describe_counts([Part(0, 0, 57.0), Part(1, 0, 210.0)], ItemRule("samples"), 2)
        'the step holds rank 0: 57 and rank 1: 210 samples'
    """
    names = _names(parts, world)
    return f"the step holds {_series([f'{nm}: {_number(p.count)}' for nm, p in zip(names, parts)])} {rule.text}"
