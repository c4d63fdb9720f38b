"""Fused expert tensors judged expert by expert: one verdict per expert's slice, and experts no token reached.

A mixture of experts often holds its E experts in one parameter (transformers 5's ``experts.gate_up_proj`` of shape
``(E, 2 * intermediate, hidden)`` and ``experts.down_proj``). Judged whole, a backward wrong in one expert is diluted
by the others and named on the tensor alone. Here such a tensor is judged as E sub-tensors, ``name[expert i]``: each a
view of the parameter's slice ``i`` (perturbed in place like any tensor), with its slice of the gradient, so that
each expert gets its own verdict, its own history and its own alert (``...experts.gate_up_proj[expert 3]``).

An expert that no token of the check's batch was routed to (none whose output the objective depends on: a causal
LM's last position predicts nothing) is *not reached*: its analytic gradient is exactly zero
and the objective does not move at all (bit for bit) along a random direction of its slice. It gets no verdict
(``InconclusiveKind.NOT_REACHED``, no alert) and does not count as checked. A zero gradient where the objective does
move is judged as usual (a detached expert: "analytic gradient is zero where numeric is not").

A fused expert tensor is a parameter of three or more dimensions, of at least two slices along its first, whose name
says ``expert`` (:func:`expert_count`).

Example:
    >>> w = torch.zeros(4, 3, 2)
    >>> [key for key, _, _, _ in split_experts([("experts.w1", "experts.w1", w, {"total": w})])[0]][:2]
    ['experts.w1[expert 0]', 'experts.w1[expert 1]']
    >>> expert_of("experts.w1[expert 3]"), expert_of("experts.w1")
    (('experts.w1', 3), None)
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import torch

from gradwatch.check.judging.judge import inconclusive
from gradwatch.check.judging.report import InconclusiveKind, TensorCheck, TrainingCheck
from gradwatch.check.numerics.sampling import generator, tensor_seed
from gradwatch.check.probes.lines import EngineSettings, Evaluator, Target, TermScales, total
from gradwatch.check.probes.reexamine import base_step

#: Why an expert got no verdict: the check's batch routed no token to it.
NOT_REACHED = ("not reached: the check's batch routed to this expert no token the objective depends on (its gradient is "
               "zero and the objective does not move along it); not counted as checked")

_KEY = re.compile(r"^(.*)\[expert (\d+)\]$")
V = TypeVar("V")


def expert_key(name: str, index: int) -> str:
    """The name expert ``index`` of a fused tensor ``name`` is judged under (``"experts.w1[expert 3]"``)."""
    return f"{name}[expert {index}]"


def expert_of(key: str) -> Optional[Tuple[str, int]]:
    """``(tensor, expert)`` of an expert's key (:func:`expert_key`); None for any other name."""
    found = _KEY.match(key)
    return (found.group(1), int(found.group(2))) if found else None


def tensor_of(key: str) -> str:
    """The tensor an expert's key names (``"experts.w1"`` for ``"experts.w1[expert 3]"``); any other name as it is."""
    found = expert_of(key)
    return key if found is None else found[0]


def expert_count(name: str, shape: Sequence[int]) -> Optional[int]:
    """E for a fused expert tensor (a name that says ``expert``, three or more dimensions, E >= 2 along the first);
    None for any other tensor.

    Example:
        >>> expert_count("mlp.experts.gate_up_proj", (8, 64, 32)), expert_count("mlp.gate.weight", (8, 32))
        (8, None)
    """
    if len(shape) < 3 or int(shape[0]) < 2 or "expert" not in name.lower() or expert_of(name) is not None:
        return None
    return int(shape[0])


def split_experts(targets: Sequence[Target], scales: Optional[TermScales] = None
                  ) -> Tuple[List[Target], Optional[TermScales]]:
    """``targets`` with each fused expert tensor replaced by one target per expert (a view of its slice and the
    slices of its gradients), in place of the whole; ``scales`` extended to the experts' keys (each moves what its
    tensor moves)."""
    out: List[Target] = []
    moved = dict(scales.moved) if scales is not None else {}
    for key, name, p, grads in targets:
        count = expert_count(name, tuple(p.shape))
        if count is None or any(g.shape != p.shape for g in grads.values()):
            out.append((key, name, p, grads))
            continue
        for i in range(count):
            out.append((expert_key(key, i), expert_key(name, i), p[i], {t: g[i] for t, g in grads.items()}))
            if key in moved:
                moved[expert_key(key, i)] = moved[key]
    return out, (replace(scales, moved=moved) if scales is not None else None)


def expert_counts(targets: Sequence[Target]) -> Dict[str, int]:
    """Per fused tensor among ``targets`` (split), its number of experts."""
    counts: Dict[str, int] = {}
    for key, _, _, _ in targets:
        found = expert_of(key)
        if found is not None:
            counts[found[0]] = counts.get(found[0], 0) + 1
    return counts


def expert_groups(targets: Sequence[Target]) -> List[List[Target]]:
    """The experts among ``targets`` (split), one list per fused tensor (of two experts or more)."""
    groups: Dict[str, List[Target]] = {}
    for target in targets:
        found = expert_of(target[0])
        if found is not None:
            groups.setdefault(found[0], []).append(target)
    return [group for group in groups.values() if len(group) > 1]


def shared_samples(settings: EngineSettings, key: str, counts: Mapping[str, int]) -> EngineSettings:
    """An expert's settings: its tensor's coordinates and directions spread over its experts (at least one of each),
    so that a fused tensor judged expert by expert takes about the probes it took whole; any other key's as they are.

    Example:
        >>> from gradwatch.bands import Verdict
        >>> s = EngineSettings(8, 4, None, (1e-7, 1e-4, 1e-2), Verdict.SUSPICIOUS, True, 2.0 ** -52, magnitude=1.0)
        >>> e = shared_samples(s, "w[expert 1]", {"w": 4})
        >>> (e.coords, e.directions), shared_samples(s, "b", {"w": 4}) is s
        ((2, 1), True)
    """
    found = expert_of(key)
    count = counts.get(found[0], 0) if found is not None else 0
    if count < 2:
        return settings
    return replace(settings, coords=max(1, -(-settings.coords // count)),
                   directions=max(1, -(-settings.directions // count)) if settings.directions else 0)


def idle(target: Target) -> bool:
    """An expert's slice whose analytic gradient is exactly zero: not reached, unless the objective moves along it."""
    key, _, _, grads = target
    return expert_of(key) is not None and all(not bool(g.any()) for g in grads.values())


def not_reached(target: Target, evaluate: Evaluator, settings: EngineSettings, seed: int) -> Optional[TensorCheck]:
    """The not-reached check of an :func:`idle` expert when the objective is bit for bit the same at both ends of a
    probe along a random direction of its slice (two evaluations; the slice restored bit for bit); None when it
    moves (the expert is reached: judged as usual)."""
    key, name, p, _ = target
    g = generator(tensor_seed(seed, name + "/reached"))
    direction = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.device, p.dtype)
    step = base_step(settings) * max(1.0, float(p.detach().abs().max()) if p.numel() else 1.0)
    saved = p.detach().clone()
    try:
        with torch.no_grad():
            p.add_(direction, alpha=step)
            plus = total(evaluate())
            p.copy_(saved)
            p.sub_(direction, alpha=step)
            minus = total(evaluate())
    finally:
        with torch.no_grad():
            p.copy_(saved)
    if plus != minus:
        return None
    return inconclusive(name, tuple(p.shape), InconclusiveKind.NOT_REACHED, NOT_REACHED)


def in_order(checks: Mapping[str, V], keys: Sequence[str]) -> Dict[str, V]:
    """``checks`` in the order of ``keys``, each key's experts (in order) in its place.

    Example:
        >>> list(in_order({"b": 1, "w[expert 1]": 2, "w[expert 0]": 3}, ["w", "b"]))
        ['w[expert 0]', 'w[expert 1]', 'b']
    """
    experts: Dict[str, List[Tuple[int, str]]] = {}
    for k in checks:
        found = expert_of(k)
        if found is not None:
            experts.setdefault(found[0], []).append((found[1], k))
    out: Dict[str, V] = {}
    for key in keys:
        if key in checks:
            out[key] = checks[key]
        for _, k in sorted(experts.get(key, [])):
            out[k] = checks[k]
    return out


def reached_rows(checks: Mapping[str, Union[TensorCheck, TrainingCheck]], name: str) -> Optional[torch.Tensor]:
    """The experts of fused tensor ``name`` that ``checks`` judged (those not reached left out), as row indices; None
    when ``checks`` holds no expert of it."""
    rows = [found[1] for k, tc in checks.items() if (found := expert_of(k)) is not None and found[0] == name
            and tc.inconclusive != NOT_REACHED]
    if not rows and not any((found := expert_of(k)) is not None and found[0] == name for k in checks):
        return None
    return torch.tensor(sorted(rows), dtype=torch.long)


def by_expert(training: Mapping[str, TrainingCheck], first: Mapping[str, TrainingCheck],
              lives: Mapping[str, Optional[torch.Tensor]], refs: Mapping[str, torch.Tensor],
              judged: Mapping[str, Tuple[torch.Tensor, torch.dtype]], judge: Callable[..., TrainingCheck]
              ) -> Dict[str, TrainingCheck]:
    """The training verdicts with each fused expert tensor judged expert by expert, in its place: the live ``.grad``'s
    slice against the replayed gradient's (``judge(key, live, ref, param, dtype)``, as the whole was judged); an expert
    whose two slices are both exactly zero is not reached. A tensor whose whole verdict a later explanation replaced
    (``training[n] is not first[n]``: judged against a window or a term's weight), or whose gradients are not of its
    shape (a shard, a partition), keeps its whole verdict.

    Example:
        >>> from gradwatch.check.judging.training_judge import judge_training
        >>> ref = torch.zeros(2, 3, 1); ref[0] = 1.0
        >>> whole = {"experts.w": judge_training("experts.w", ref, ref, ref, torch.float64)}
        >>> out = by_expert(whole, whole, {"experts.w": ref}, {"experts.w": ref}, {"experts.w": (ref, torch.float64)},
        ...                 judge_training)
        >>> [(k, tc.verdict and tc.verdict.value, tc.inconclusive == NOT_REACHED) for k, tc in out.items()]
        [('experts.w[expert 0]', 'excellent', False), ('experts.w[expert 1]', None, True)]
    """
    out: Dict[str, TrainingCheck] = {}
    for n, tc in training.items():
        live, ref = lives.get(n), refs.get(n)
        param, dtype = judged[n] if n in judged else (None, None)
        count = expert_count(n, tuple(param.shape)) if param is not None else None
        if count is None or param is None or ref is None or tc is not first.get(n) or ref.shape != param.shape \
                or (live is not None and live.shape != param.shape):
            out[n] = tc
            continue
        for i in range(count):
            key = expert_key(n, i)
            if not bool(ref[i].any()) and (live is None or not bool(live[i].any())):
                out[key] = TrainingCheck(name=key, shape=tuple(param[i].shape), inconclusive=NOT_REACHED)
            else:
                out[key] = judge(key, None if live is None else live[i], ref[i], param[i], dtype)
    return out


__all__ = ["NOT_REACHED", "by_expert", "expert_count", "expert_counts", "expert_groups", "expert_key", "expert_of", "idle", "in_order",
           "not_reached", "reached_rows", "shared_samples", "split_experts", "tensor_of"]
