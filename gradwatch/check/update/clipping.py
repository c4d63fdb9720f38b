"""Clipping judged: from ``.grad`` as backprop left it to ``.grad`` as the optimizer takes it, one factor for all.

Gradient clipping by the global norm scales every tensor by one factor ``c = min(1, T / ‖g‖)``. On the sampled
coordinates of each tensor, :func:`factors` reads the factor training applied (a least-squares fit of the clipped
values on the unclipped ones, with its misfit: a clipping that is not a scaling is named too). :func:`judge_clipping`
then names:

- tensors scaled by different factors, grouped (per parameter group, or the tensors of each factor): a norm taken per
  group, per rank or per shard instead of over the whole gradient;
- a threshold ``c · ‖g‖`` that differs from the one asked for (``max_grad_norm`` where known) or from one clipped
  step to the next: the norm was taken over a part of the gradient, or the threshold scaled (by the world size);
- clipping where none was asked for (``max_grad_norm`` known and off).

Pure math and words: no model, no hook.

Example:
    >>> before = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, 0.0])}
    >>> after = {"a": torch.tensor([1.5, 2.0]), "b": torch.tensor([0.5, 0.0])}
    >>> found = judge_clipping(factors(before, after), {"a": 0, "b": 0}, norm=10.0, asked=5.0)
    >>> found.factor, round(found.threshold, 4), found.problem is None
    (0.5, 5.0, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, cast

import torch

#: Factors within this (relative) of each other are one factor; a threshold within it (plus torch's 1e-6 added to
#: the norm) of another is the same threshold. float32 rounding of a scaled gradient is 6e-8 an entry.
FACTOR_TOLERANCE = 1e-5
#: A fit whose misfit (relative) is over this is no scaling at all: the tensor's clipped values are not a multiple
#: of its unclipped ones (an elementwise clip by value, an edit of .grad).
SCALING_MISFIT = 1e-4
#: Thresholds within this (relative) of each other are one: training takes the norm in its gradients' precision (a
#: float32 sum over millions of entries; TRL's Llama with a 32,000-token vocabulary: 1.3e-4 from the watch's float64
#: norm), where a threshold scaled by a world size or taken over a shard is off by a factor.
THRESHOLD_TOLERANCE = 1e-3
#: Tensors named in words, at most.
NAMED = 3


@dataclass
class Factor:
    """The factor one tensor was scaled by between the check and the optimizer's step, on its sampled coordinates.

    Attributes:
        value: ``<after, before> / <before, before>`` (None where ``before`` is zero there).
        misfit: ``‖after - value · before‖ / ‖after‖`` (0 for an exact scaling).
    """

    value: Optional[float]
    misfit: float = 0.0


def factors(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> Dict[str, Factor]:
    """Each tensor's :class:`Factor` from its sampled ``.grad`` values at the check (``before``) and at the optimizer's
    pre-step hook (``after``), in float64.

    Example:
        >>> factors({"w": torch.tensor([2.0, -2.0])}, {"w": torch.tensor([1.0, -1.0])})["w"].value
        0.5
    """
    out: Dict[str, Factor] = {}
    for name, b in before.items():
        a = after.get(name)
        if a is None:
            continue
        b64, a64 = b.detach().to(torch.float64).reshape(-1), a.detach().to(torch.float64).reshape(-1)
        bb = float(b64 @ b64)
        if bb == 0.0 or not math.isfinite(bb):
            out[name] = Factor(None)
            continue
        c = float(a64 @ b64) / bb
        norm = float(torch.linalg.vector_norm(a64))
        out[name] = Factor(c, float(torch.linalg.vector_norm(a64 - c * b64)) / norm if norm else 0.0)
    return out


def _same(a: float, b: float, tolerance: float = FACTOR_TOLERANCE) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b), 1e-30)


def _groups(found: Mapping[str, float]) -> List[Tuple[float, List[str]]]:
    """Tensors grouped by factor (within :data:`FACTOR_TOLERANCE`), largest group first."""
    groups: List[Tuple[float, List[str]]] = []
    for name, c in found.items():
        for value, names in groups:
            if _same(value, c):
                names.append(name)
                break
        else:
            groups.append((c, [name]))
    return sorted(groups, key=lambda g: -len(g[1]))


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:NAMED])
    return shown + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")


@dataclass
class Clipping:
    """What one step's clipping was, and what is wrong with it.

    Attributes:
        factor: The one factor every tensor was scaled by (None where they differ, or none could be read).
        threshold: ``factor · ‖g‖`` where the step was clipped (``factor < 1``), the bound of a clipping by value
            (``factor`` None), else None.
        problem: The words naming what is wrong (None: nothing).
        kind: ``"groups"`` (different factors), ``"threshold"`` (another threshold than asked or than before),
            ``"unasked"`` (clipped where none was asked for), ``"not_scaling"`` (no factor explains it); None.
        groups: ``[(factor, tensors)]`` where the factors differ.
    """

    factor: Optional[float]
    threshold: Optional[float] = None
    problem: Optional[str] = None
    kind: Optional[str] = None
    groups: List[Tuple[float, List[str]]] = field(default_factory=list)
    #: What the groups of different factors are: ``"rank"`` (each rank's shards), ``"parameter group"``, or ``""``.
    by: str = ""

    def record(self) -> Dict[str, object]:
        """Plain data for a check record."""
        return {"factor": self.factor, "threshold": self.threshold, "problem": self.problem, "kind": self.kind,
                "groups": [{"factor": c, "tensors": len(n), "first": n[:NAMED]} for c, n in self.groups]}


def value_bound(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> Optional[float]:
    """The bound ``v`` of a clipping by value (``clip_grad_value_``) that explains every sampled coordinate: each
    changed one is ``±v`` with the sign it had and was beyond ``v``, each unchanged one within it; None where some
    coordinate changed otherwise, or none changed.

    Example:
        >>> value_bound({"w": torch.tensor([3.0, -0.5, -2.0])}, {"w": torch.tensor([1.0, -0.5, -1.0])})
        1.0
    """
    pairs = [(b.detach().to(torch.float64).reshape(-1), after[n].detach().to(torch.float64).reshape(-1))
             for n, b in before.items() if n in after]
    changed = torch.cat([a[a != b] for b, a in pairs]) if pairs else torch.zeros(0)
    if not changed.numel():
        return None
    v = float(changed.abs().max())
    for b, a in pairs:
        moved = a != b
        if not bool(torch.isclose(a[moved].abs(), torch.full_like(a[moved], v), rtol=1e-6).all()) \
                or not bool((torch.sign(a[moved]) == torch.sign(b[moved])).all()) \
                or not bool((b[moved].abs() >= v * (1 - 1e-6)).all()) or not bool((b[~moved].abs() <= v * (1 + 1e-6)).all()):
            return None
    return v


def judge_clipping(found: Mapping[str, Factor], param_group: Mapping[str, int], norm: float,
                   asked: Optional[float] = None, before: Sequence[float] = (),
                   by_value: Optional[float] = None, rank_of: Optional[Mapping[str, int]] = None) -> Clipping:
    """One step's clipping judged.

    Args:
        found: Each tensor's :class:`Factor` (:func:`factors`).
        param_group: Each tensor's optimizer parameter group (to name groups that match them).
        norm: The whole gradient's norm at the check, ``‖g‖`` over every tensor, in float64.
        asked: The threshold training asked for (``max_grad_norm``, ``gradient_clip_val``; 0: none asked; None: not
            known).
        before: The thresholds of the run's earlier clipped steps.
        by_value: The bound of a clipping by value that explains the coordinates (:func:`value_bound`), if one does.
        rank_of: Sharded: the rank whose shard each entry of ``found`` was read on (to name the ranks where the
            factors differ by rank: each rank's norm taken over its own shards).

    Example:
        >>> f = {"a": Factor(0.5), "b": Factor(0.25)}
        >>> judge_clipping(f, {"a": 0, "b": 1}, norm=4.0).kind
        'groups'
    """
    bent = [n for n, f in found.items() if f.value is not None and f.misfit > SCALING_MISFIT]
    if bent and by_value is not None:
        return Clipping(None, by_value)  # clipped by value: every changed coordinate at one bound (clip_grad_value_)
    if bent:
        return Clipping(None, None, (
            f"the .grad the optimizer steps with is not a multiple of .grad at the check for {len(bent)} tensor"
            f"{'s' if len(bent) > 1 else ''} ({_listed(bent)}; misfit up to "
            f"{max(found[n].misfit for n in bent):.1e}): something other than a clipping by norm changed it between "
            "the check and the step (a clip by value, a hook or an edit of .grad)"), "not_scaling")
    values = {n: float(f.value) for n, f in found.items() if f.value is not None}
    if not values:
        return Clipping(None)
    groups = _groups(values)
    if len(groups) > 1:
        by = "rank" if rank_of and _matches(groups, rank_of) else "parameter group" if _matches(groups, param_group) else ""
        return Clipping(None, None, _group_words(groups, param_group, rank_of or {}), "groups", groups, by)
    c = groups[0][0]
    if _same(c, 1.0) or c > 1.0:
        if c > 1.0 and not _same(c, 1.0):
            return Clipping(c, None, (f"every tensor's .grad was scaled by {c:.4g} between the check and the step: "
                                      "a clipping never scales up; something multiplied the gradient"), "threshold")
        return Clipping(1.0)
    threshold = c * (norm + 1e-6)  # torch's clip_grad_norm_: max_norm / (total_norm + 1e-6)
    if asked is not None and asked <= 0:
        return Clipping(c, threshold, (f"every tensor's .grad was scaled by {c:.4g} (clipped to a norm of "
                                       f"{threshold:.4g}) where no clipping was asked for"), "unasked")
    if asked is not None and not _same(threshold, asked, THRESHOLD_TOLERANCE):
        ratio = asked / threshold
        hint = f" (x{ratio:.3g}: the threshold divided by {round(ratio)}, the world size?)" \
            if ratio > 1.5 and abs(ratio - round(ratio)) < 1e-3 else ""
        return Clipping(c, threshold, (f"the gradient was clipped to a norm of {threshold:.4g} where {asked:.4g} was "
                                       f"asked for{hint}: the norm was taken over a part of the gradient, or the "
                                       "threshold scaled"), "threshold")
    moved = [t for t in before if not _same(t, threshold, THRESHOLD_TOLERANCE)]
    if asked is None and moved:
        return Clipping(c, threshold, (f"the clipping threshold moves with the gradient: {threshold:.4g} at this step, "
                                       f"{moved[-1]:.4g} at an earlier one (c·‖g‖ with ‖g‖ the whole gradient's "
                                       "norm): the norm was taken over a part of the gradient"), "threshold")
    return Clipping(c, threshold)


def _matches(groups: List[Tuple[float, List[str]]], owner_of: Mapping[str, int]) -> Optional[List[int]]:
    """The owner (a parameter group, a rank) of each group of tensors, where every group has one and no two share
    it; else None."""
    owners = [{owner_of.get(n) for n in names} for _, names in groups]
    if all(len(o) == 1 and None not in o for o in owners) and len({next(iter(o)) for o in owners}) == len(owners):
        return [int(cast(int, next(iter(o)))) for o in owners]
    return None


def _group_words(groups: List[Tuple[float, List[str]]], param_group: Mapping[str, int],
                 rank_of: Mapping[str, int]) -> str:
    """Words for tensors scaled by different factors: by rank where the groups are the ranks' shards, by parameter
    group where they are the optimizer's."""
    ranks = _matches(groups, rank_of) if rank_of else None
    owners = ranks or _matches(groups, param_group)
    parts = []
    for i, (c, names) in enumerate(groups):
        count = f"{len(names)} tensor{'s' if len(names) > 1 else ''}"
        where = _listed(names) if owners is None else \
            f"{'rank' if ranks else 'parameter group'} {owners[i]} ({'shards of ' if ranks else ''}{count})"
        parts.append(f"{where} x{c:.4g}")
    cause = ("each rank clipped by the norm of its own shards, not the whole gradient's (sum the squared norms "
             "over the ranks before the clip: torch's clip_grad_norm_ on the DTensors does)" if ranks else
             "each parameter group clipped by its own norm, not the whole gradient's" if owners else
             "the norm was taken over a part of the gradient (a rank's shard, one group, one stage)")
    return f"the tensors were scaled by {len(groups)} different factors between the check and the step: " \
           f"{'; '.join(parts)}: {cause}"


__all__ = ["Clipping", "Factor", "factors", "judge_clipping", "value_bound"]
