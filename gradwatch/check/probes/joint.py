"""Detection of a unit's tensors along one joint line: every tensor's detection probe applied at once.

A unit of the module form (a module's input, weight and bias) costs two evaluations per tensor when
each tensor's detection probe (:func:`~gradwatch.check.probes.reexamine.screen_sample`) is taken alone.
The central difference is linear in the perturbation, so the probes taken together, ``θ_t ± s_t·u_t``
for every tensor ``t`` at once, give the sum of the tensors' slopes in two evaluations: each tensor's
contribution ``c_t = s_t·(g_t·u_t)`` is known from its analytic gradient, and the numeric side sees the
sum of what the backward should have given. Where they agree, a tensor is settled when an error its own
probe would have seen (``0.1 * bands[1]`` of its slope, as :func:`~gradwatch.check.probes.reexamine.screened`
asks) would still have stood above the joint probe's noise and the EXCELLENT band of the sum: its share
of the sum is large enough. The others (a share drawn near zero, a bias the objective does not depend
on), and every tensor of a unit whose joint probe disagrees, are probed alone as before.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, cast

import torch

from gradwatch.check.probes.lines import (
    EngineSettings,
    Evaluator,
    Outcome,
    Sample,
    Target,
    Terms,
    TermScales,
    all_finite,
    floor_at,
    perturb,
    prepare_slopes,
    probable_floor,
    restore_line,
    rise,
)
from gradwatch.check.probes.reexamine import base_step, param_norm, screen_sample

#: Largest memory the joint probe holds beyond what one tensor's probe holds (copies and directions of the
#: unit's other tensors) and beyond what the room already counts for them; a unit over it is probed tensor by tensor.
#: A parameter's or a called module's output's entries are counted at 48 bytes each where the room is sized
#: (:data:`gradwatch.plan.memory.MODULE_BYTES_PER_ENTRY`: their copy, gradient, the engine's saved copy and a
#: transient as large), so their saved copy and direction (16 bytes an entry) are held within it; a unit's
#: inputs are counted three times (captured, working, fresh per call), with no room for a copy more.
JOINT_EXTRA_BYTES = 16 << 20
#: Longest joint step, in detection steps (``eps^(1/3)`` of each tensor's scale): a central difference's curvature
#: error grows with the step's square, about 1e-9 of the slope at 8 times the detection step for a smooth unit.
JOINT_STEP_MAX = 32.0


#: Rounds at most: the tensors a round leaves unsettled (their share too small to show their errors) are probed
#: together again, balanced among themselves, while each round settles some.
JOINT_ROUNDS = 3

Line = Tuple[str, torch.Tensor, Dict[str, torch.Tensor], Sample, torch.Tensor]


def joint_detect(targets: Sequence[Target], evaluate: Evaluator, settings: EngineSettings, seed: int,
                 scales: Optional[TermScales] = None, always: bool = False) -> Dict[str, Tuple[Sample, Outcome]]:
    """The tensors of ``targets`` settled by joint detection probes (two evaluations each): the line and outcome
    each is recorded with, by key.

    Taken only where the objective's terms are known (``settings.term_norm``: the module form), or ``always`` (the
    experts of one fused tensor on the whole objective, its worst-case floor), and detection comes first; a tensor
    with per-term gradients, a single entry or a non-finite gradient keeps its own probe. The first round probes
    every tensor at once; the tensors it leaves unsettled are probed again together (:data:`JOINT_ROUNDS` at most).
    A round whose slopes disagree ends it: every tensor not settled yet is probed alone (where a wrong gradient is
    diagnosed). The tensors are perturbed in place and restored bit for bit. With ``scales``, a round's noise is that
    of the terms its tensors move
    (:class:`~gradwatch.check.probes.lines.TermScales`).
    A settled tensor's record is its own detection line (its step in that round and label
    ``("joint", n)``): its own analytic slope along it, and as numeric slope the analytic one plus the whole
    disagreement of the round's sum (all of it taken as the tensor's own).

    Example:
        >>> from gradwatch.bands import Verdict
        >>> g = torch.Generator().manual_seed(0)  # a draw of its own: the doctest's outcome whatever ran before
        >>> w, x = torch.randn(3, 4, dtype=torch.float64, generator=g), torch.randn(4, dtype=torch.float64, generator=g)
        >>> f = lambda: {"loss": float((w @ x).square().sum())}
        >>> y = w @ x
        >>> gw, gx = 2 * torch.outer(y, x), 2 * w.T @ y
        >>> settings = EngineSettings(4, 0, None, (1e-7, 1e-4, 1e-2), Verdict.SUSPICIOUS, True, 2.0 ** -52,
        ...                           magnitude=float(y.square().sum()), screen=True,
        ...                           term_norm=float(y.square().norm()))
        >>> ev = Evaluator(f)
        >>> sorted(joint_detect([("w", "w", w, {"total": gw}), ("x", "x", x, {"total": gx})], ev, settings, 0))
        ['w', 'x']
        >>> ev.count
        2
        >>> ev = Evaluator(f)  # a backward 1% off: nothing settled, both probed alone
        >>> joint_detect([("w", "w", w, {"total": 1.01 * gw}), ("x", "x", x, {"total": gx})], ev, settings, 0)
        {}
    """
    if (settings.term_norm is None and not always) or not settings.detection_first:
        return {}
    h = base_step(settings)
    drawn = []
    for key, name, p, grads in targets:
        if set(grads) != {"total"} or not p.is_floating_point() or not all_finite(grads["total"]):
            continue
        sample = screen_sample(name, p, settings, seed, h)
        if sample is not None:
            drawn.append((key, p, grads, sample))
    sizes = [p.numel() * p.element_size() * 2 for _, p, _, _ in drawn]
    counted = sum(size for size, (key, _, _, _) in zip(sizes, drawn) if not key.startswith("input"))
    if not drawn or sum(sizes) - max(sizes) > JOINT_EXTRA_BYTES + counted:
        return {}
    with torch.no_grad():
        lines: List[Line] = [(key, p, grads, sample, p.detach().clone()) for key, p, grads, sample in drawn]
        for _, _, grads, sample, saved in lines:
            prepare_slopes([sample], saved, grads)
    settled: Dict[str, Tuple[Sample, Outcome]] = {}
    evaluate.focus(None)
    try:
        for _ in range(JOINT_ROUNDS):
            pending = [line for line in lines if line[0] not in settled]
            got = _round(pending, evaluate, settings, scales) if pending else None
            if not got:
                break
            settled.update(got)
    finally:
        for _, _, _, sample, _ in lines:
            sample.forget()
    return settled


def _round(lines: Sequence[Line], evaluate: Evaluator, settings: EngineSettings,
           scales: Optional[TermScales] = None) -> Optional[Dict[str, Tuple[Sample, Outcome]]]:
    """One joint probe of ``lines`` (balanced, :func:`balance`): the tensors it settles; None when its slopes
    disagree (or it cannot be taken)."""
    contributions = [sample.step * cast(Terms, sample.slope)["total"] for _, _, _, sample, _ in lines]
    # Each line taken the way its own slope rises (a negative weight walks it backwards): every share is positive,
    # so one factor wrong in several tensors (a kernel shared by a module's weights, each expert of a fused tensor)
    # adds up in the sum instead of cancelling between shares of opposite signs.
    kept = [(line, math.copysign(w, c)) for line, w, c in zip(lines, balance(contributions), contributions) if w > 0.0]
    if not kept:
        return None
    if scales is not None:
        settings = scales.settings(settings, [line[0] for line, _ in kept])
    # The noise of the sum does not grow with the step, its slope does: a longer step (up to JOINT_STEP_MAX times
    # the detection step, where a smooth function's curvature still stays far under the EXCELLENT band) puts the
    # noise under a hundredth of that band of the slopes, so that every share, not only the largest, shows its errors.
    floor = floor_at(settings, 1.0)
    probable = probable_floor(settings, 1.0, math.sqrt(sum(param_norm(line[4], line[2]) ** 2 for line, _ in kept)))
    floor = min(floor, probable) if probable is not None else floor
    expected = sum(abs(w * line[3].step * cast(Terms, line[3].slope)["total"]) for line, w in kept)
    longer = min(JOINT_STEP_MAX, max(1.0, floor / (1e-2 * settings.bands[0] * expected))) if expected > 0 else 1.0
    kept = [(line, w * longer) for line, w in kept]
    with torch.no_grad():
        try:
            sides = []
            for sign in (1.0, -1.0):
                lins = [perturb(p, saved, grads, sample, sign * w * sample.step)["total"]
                        for (_, p, grads, sample, saved), w in kept]
                terms = evaluate()
                sides.append((terms, lins))
        finally:
            for (_, p, _, sample, saved), _ in kept:
                restore_line(p, saved, sample)
    (jp, lp), (jm, lm) = sides
    shares = [(a_p - a_m) / 2 for a_p, a_m in zip(lp, lm)]  # each tensor's slope along the joint line (τ = ±1)
    analytic, numeric = sum(shares), rise(jp, jm) / 2
    scale = abs(analytic) + abs(numeric)
    if not (math.isfinite(analytic) and math.isfinite(numeric)) or scale == 0.0:
        return None
    if abs(analytic - numeric) - floor > settings.bands[0] * scale or floor > 0.1 * settings.bands[1] * scale:
        return None
    # What could hide in the sum: its noise and the EXCELLENT band; a tensor is settled where an error of a tenth
    # of the GOOD band of its own slope (what its probe alone would have seen) stands above that.
    hidden = floor + settings.bands[0] * scale
    settled: Dict[str, Tuple[Sample, Outcome]] = {}
    for ((key, _, _, sample, _), w), share in zip(kept, shares):
        if hidden <= 0.1 * settings.bands[1] * 2 * abs(share):
            # In the tensor's own units: its own analytic slope, and the numeric one that takes the whole
            # disagreement of the sum as its own (the most this probe can say of it).
            step = w * sample.step
            record = Sample(label=("joint", len(kept)), step=abs(step))
            settled[key] = (record, Outcome({"total": share / step}, {"total": (share + numeric - analytic) / step},
                                            floor / abs(step)))
    return settled


def balance(contributions: Sequence[float], least: float = 1e-3, room: float = 50.0) -> List[float]:
    """How far along its own detection line each tensor goes in a joint probe (0: left out of it).

    A tensor whose slope is under ``least`` of the largest is left out (a later round, or its own probe, sees
    it better); the others are shortened so that none is over ``room / n`` times the smallest kept, so each keeps
    a share of the sum that shows an error of its own (:func:`joint_detect` asks for about 1% at the default bands).

    Example:
        >>> balance([1.0, 0.5, 1e-6])
        [1.0, 1.0, 0.0]
        >>> balance([100.0, -0.5])
        [0.125, 1.0]
        >>> balance([3.0]), balance([0.0])
        ([1.0], [0.0])
    """
    top = max((abs(c) for c in contributions), default=0.0)
    keep = [abs(c) >= least * top and c != 0.0 for c in contributions]
    n = sum(keep)
    if n == 0:
        return [0.0] * len(contributions)
    cap = room / n * min(abs(c) for c, k in zip(contributions, keep) if k)
    return [min(1.0, cap / abs(c)) if k else 0.0 for c, k in zip(contributions, keep)]
