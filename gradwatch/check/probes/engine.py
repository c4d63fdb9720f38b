"""The sampled two-sided comparison for one tensor.

Each *sample* is a line through parameter space (one coordinate, or one
random unit direction). Along it the engine evaluates the objective at
``±t`` and compares the central difference with the analytic slope
``g·(θ(t) - θ(-t)) / 2t``, computed from the perturbation actually applied
(so rounding of ``θ + t·u`` in low precision does not count as error).

Disagreeing samples are re-examined before they count (see
:func:`classify_kink`); :mod:`gradwatch.check.judging.judge` then judges the slopes
against the rounding-noise floor of the finite differences.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from gradwatch.check.judging.judge import (
    BandRule,
    Slope,
    allowed_jitter,
    base_point,
    inconclusive,
    judge,
)
from gradwatch.check.judging.report import InconclusiveKind, TensorCheck
from gradwatch.check.probes._smaller_steps import (
    KINK_SCALES,
    LOW_PRECISION_EPS,
    classify_kink,
    halved,
    resolve_low_precision,
    unresolvable,
)
from gradwatch.check.probes.experts import expert_counts, expert_groups, expert_of, idle, not_reached, shared_samples, split_experts
from gradwatch.check.probes.joint import joint_detect
from gradwatch.check.probes.kinks import adopt, disagrees, forward_kinks, kink_free
from gradwatch.check.probes.lines import (
    BatchProbe,
    EngineSettings,
    Evaluator,
    Outcome,
    Sample,
    Target,
    Terms,
    TermScales,
    all_finite,
    base_probes,
    build_samples,
    central_probe,
    outcome_of,
    prepare_slopes,
    total,
    unit_sample,
)
from gradwatch.check.probes.reexamine import (
    WideProbes,
    base_step,
    below_resolution,
    curved,
    fails_alone,
    flat_at_widest,
    judge_sample,
    pinpoint,
    resolves,
    screen,
    screen_sample,
    smooth_sides,
    unexplained,
    widened_in_batches,
)


@dataclass
class Detection:
    """A tensor's detection probe (:func:`detect`): one random direction, judged before any other sample.

    Attributes:
        sample: The probe's line (its direction is dropped once the tensor's verdict no longer needs it).
        outcome: Its slopes, taken at a wider step where the base step is lost in rounding, re-examined
            for a kink where they disagree beyond the SUSPICIOUS band.
        settled: Analytic and numeric agree to the EXCELLENT band (:func:`screened`): the tensor passes
            on this probe alone.
        confirmed: They disagree beyond the failing band with no kink or rounding to explain it (a smooth
            function whose gradient is wrong along the probe): the tensor fails on this probe alone, and the
            full sample (for the diagnosis) can come after every other tensor's verdict.
    """

    sample: Sample
    outcome: Outcome
    settled: bool = False
    confirmed: bool = False


def detect(name: str, p: torch.Tensor, grads: Dict[str, torch.Tensor], evaluate: Evaluator, j0: Terms,
           settings: EngineSettings, seed: int, probe_batch: Optional[BatchProbe] = None) -> Optional[Detection]:
    """The detection probe of one tensor, judged; None when it has none (one entry: its coordinate is the check).

    ``p`` is perturbed in place and restored bit for bit.
    """
    first = screen_sample(name, p, settings, seed, base_step(settings))
    if first is None:
        return None
    saved = p.detach().clone()
    try:
        with torch.no_grad():
            prepare_slopes([first], saved, grads)
            base = base_probes(name, p, saved, grads, [first], probe_batch)[0] \
                or central_probe(p, saved, grads, first, first.step, evaluate)
            out, settled = screen(p, saved, grads, first, base, j0, evaluate, settings,
                                  batch=(name, probe_batch) if probe_batch is not None else None)
            if not settled and curved(out, settings):
                out = halved(p, saved, grads, first, out, evaluate, settings) or out
            found = Detection(first, out, settled=settled)
            needs = not settled and _needs_reexamination(out, settings)
            shorter = kink_free(p, saved, grads, first, out, evaluate, settings) if needs else None
            if shorter is not None:
                # The probe crossed kinks seen in the forward: judged only where it crosses none (or excluded).
                found.outcome = out = shorter
                found.confirmed = not (out.kink or out.unresolved) and set(out.analytic) == {"total"} \
                    and disagrees(out, settings) and fails_alone(out, settings)
            elif needs:
                alone = set(out.analytic) == {"total"} and fails_alone(out, settings)
                found.confirmed = alone and smooth_sides(first, base, out, j0, settings)
                batch = (name, probe_batch) if probe_batch is not None else None
                taken: Dict[float, Tuple[Terms, Terms, Terms, Terms]] = {}
                if alone and not found.confirmed:
                    # One smaller step: a wrong gradient of a smooth function keeps its disagreement there, with
                    # one-sided slopes that agree; a kink crossed at the base step is left behind or bends one
                    # side, and one at the point keeps the sides apart at every step.
                    _reexamine(p, saved, grads, first, base, out, j0, evaluate, settings, scales=KINK_SCALES[:1],
                               batch=batch, taken=taken, forward=False)
                    found.confirmed = not (out.kink or out.unresolved)
                if not found.confirmed:  # a kink may explain it: every smaller step, as the full sample takes them
                    out.kink = out.unresolved = False
                    _reexamine(p, saved, grads, first, base, out, j0, evaluate, settings, batch=batch, taken=taken,
                               forward=False)
    finally:
        with torch.no_grad():
            p.copy_(saved)
        first.forget()
    if found.settled or found.confirmed:
        first.direction = first.signs = None  # judged: the full sample only needs its slopes
    first.alone = found.confirmed
    return found


def check_tensor(
    name: str,
    p: torch.Tensor,
    grads: Dict[str, torch.Tensor],
    evaluate: Evaluator,
    j0: Terms,
    settings: EngineSettings,
    seed: int,
    probe_batch: Optional["BatchProbe"] = None,
    detected: Optional[Detection] = None,
) -> Tuple[TensorCheck, Dict[str, TensorCheck]]:
    """Probe one tensor and judge it.

    Args:
        name: Tensor name for the report.
        p: The tensor, perturbed in place and restored bit for bit.
        grads: Analytic gradient per term; key ``"total"`` is the full objective.
        evaluate: Objective terms at the current parameters.
        j0: The objective's terms at the unperturbed point.
        settings: Sample sizes, step, bands and noise model.
        seed: Sampling seed.
        probe_batch: Evaluates the base probes of all samples in batches (see
            :func:`batched_bases`); None, or a batch it declines, means one evaluation each.
        detected: The tensor's :func:`detect` taken before (detection first): settled, it is the whole
            check; otherwise the full sample goes on from it. None: taken here when ``settings.screen``.

    Returns:
        The tensor's :class:`TensorCheck` and one per term (when grads has more than ``"total"``).
    """
    if detected is None and settings.detection_first:
        detected = detect(name, p, grads, evaluate, j0, settings, seed, probe_batch)
    samples: List[Sample] = [detected.sample] if detected is not None else []
    outcomes: List[Outcome] = [detected.outcome] if detected is not None else []
    unseen = unseen_flat = detected is not None and detected.outcome.flat and not detected.settled
    if (detected is None or not detected.settled) and not unseen:
        saved = p.detach().clone()
        h = base_step(settings)
        try:
            with torch.no_grad():
                rest = build_samples(name, p, grads["total"], settings, seed, h)
                prepare_slopes(rest, saved, grads)
                _probe_all(p, saved, grads, rest, base_probes(name, p, saved, grads, rest, probe_batch), outcomes, evaluate,
                           j0, settings, genuine=int(detected is not None and detected.confirmed),
                           batch=(name, probe_batch) if probe_batch is not None else None)
                samples += rest
                if detected is not None and unexplained(outcomes[0], settings) \
                        and not _summarize(name, tuple(p.shape), samples, outcomes, "total", settings).failed:
                    entry = pinpoint(p, saved, grads, detected.sample, evaluate, settings, h, unit_sample(name, p))
                    if entry is not None:
                        prepare_slopes([entry], saved, grads)
                        samples.append(entry)
                        _probe_all(p, saved, grads, [entry], None, outcomes, evaluate, j0, settings)
                if settings.mark_unseen and settings.detect_kinks and settings.eval_eps <= LOW_PRECISION_EPS \
                        and not resolves(outcomes, settings):
                    # (In float32 a 1% error is often below what any step resolves; there the judge's rules stand.)
                    line = next((s_ for s_ in samples if s_.index is None and (s_.direction is not None
                                                                              or s_.signs is not None)), None)
                    flat = flat_at_widest(p, saved, grads, line, evaluate, settings) if line is not None else None
                    unseen, unseen_flat = True, flat is not None
        finally:
            with torch.no_grad():
                p.copy_(saved)
            for sample in samples:
                sample.forget()
    main = _summarize(name, tuple(p.shape), samples, outcomes, "total", settings)
    if unseen:
        below_resolution(main, flat=unseen_flat)
    per_term = {
        term: _summarize(name, tuple(p.shape), samples, outcomes, term, settings)
        for term in grads
        if term != "total"
    }
    return main, per_term


@dataclass
class Judged:
    """One tensor's outcome from :func:`check_tensors`.

    Attributes:
        key: The caller's key for the tensor.
        check: Its :class:`TensorCheck`.
        per_term: One check per term of the objective (when the gradients have more than ``"total"``).
        before_sampling: Why no slope was taken at all (the objective at the base point is not finite
            or not deterministic, or the analytic gradient is not finite); None when it was sampled.
    """

    key: str
    check: TensorCheck
    per_term: Dict[str, TensorCheck] = field(default_factory=dict)
    before_sampling: Optional[InconclusiveKind] = None


def check_tensors(targets: Sequence[Target], evaluate: Evaluator, settings: EngineSettings, seed: int,
                  probe_batch: Optional[BatchProbe] = None,
                  on_verdict: Optional[Callable[[], None]] = None,
                  base_terms: Optional[Terms] = None, scales: Optional[TermScales] = None) -> Iterator[Judged]:
    """Judge a set of tensors of one objective: the base point first, then :func:`check_tensor` for each.

    Unless joint probes settle every tensor (below), the objective is evaluated twice at the unperturbed point: if
    the two values are not finite, or differ by more than rounding allows
    (:func:`gradwatch.check.judging.judge.base_point`), no tensor can be judged and each is inconclusive with that
    kind. Otherwise their difference (the jitter) joins the noise floor. A tensor whose analytic gradient is not
    finite is inconclusive without sampling.

    Detection first (``settings.screen``): every tensor's verdict comes before any diagnosis. Where the objective's
    terms are known (the module form), joint probes of the unit's tensors first settle those they can
    (:func:`~gradwatch.check.probes.joint.joint_detect`). A tensor whose probe settles it passes; one whose probe
    disagrees where nothing explains it but a wrong gradient (:class:`Detection` ``confirmed``) fails, and its full
    sample (which says how: a constant ratio, a sign, a missing term) is taken after every other tensor's verdict,
    so a buggy model's verdict costs about what a correct one's does. Those tensors are yielded last.

    Args:
        targets: ``(key, name, tensor, {term: gradient})`` per tensor (``"total"`` is the full objective).
        evaluate: Objective terms at the current parameters.
        settings: Sample sizes, step, bands and noise model (``jitter`` is measured here).
        seed: Sampling seed.
        probe_batch: Evaluates the base probes of each tensor it ``wants`` in batches.
        on_verdict: Called once every tensor's verdict (pass or fail) is known, before the failing
            tensors' full samples.
        base_terms: The terms at the unperturbed point from the caller's own forward (the analytic side's), if
            it has them: they stand for the first of the two evaluations there (a third is taken only when
            they differ from the second by more than rounding, to tell the forward's mode from nondeterminism).
        scales: Which terms of the objective each tensor moves, where the caller traced them (the module form): a
            tensor's probes then carry the rounding of those terms only (:class:`~gradwatch.check.probes.lines.TermScales`).

    Yields:
        A :class:`Judged` per tensor (a caller keeps those judged before an evaluation raised).
    """
    # The module form: joint probes first settle the unit's tensors whose shares show their errors. They need no
    # evaluation at the point (a central difference only): evaluations that differ from call to call would make
    # them disagree beyond the EXCELLENT band, and every tensor they leave goes the way below.
    # A fused expert tensor is judged expert by expert; an expert with a zero gradient waits for the base point.
    targets, scales = split_experts(targets, scales)
    experts = expert_counts(targets)  # (each expert takes its share of its tensor's samples)
    waiting = [t for t in targets if idle(t)]
    joint = joint_detect([t for t in targets if not idle(t)], evaluate, settings, seed, scales) \
        if probe_batch is None else {}
    if joint and not waiting and all(key in joint for key, _, _, _ in targets):
        for key, name, p, _ in targets:
            record, outcome = joint[key]
            yield Judged(key, _summarize(name, tuple(p.shape), [record], [outcome], "total", settings))
        if on_verdict is not None:
            on_verdict()
        return
    j0, jitter, kind, why = _base_point(evaluate, settings, base_terms)
    if kind is not None:
        for key, name, p, _ in targets:
            yield Judged(key, inconclusive(name, tuple(p.shape), kind, str(why)), before_sampling=kind)
        if on_verdict is not None:
            on_verdict()
        return
    sweep = _Sweep(evaluate, replace(settings, jitter=jitter), scales, experts, seed, j0, probe_batch)
    yield from sweep.verdicts(targets, waiting, joint)
    evaluate.focus(None)
    if on_verdict is not None:
        on_verdict()
    yield from sweep.diagnoses()


def _base_point(evaluate: Evaluator, settings: EngineSettings, base_terms: Optional[Terms]
                ) -> Tuple[Terms, float, Optional[InconclusiveKind], Optional[str]]:
    """The objective's terms at the unperturbed point, and ``(jitter, kind, why)`` of
    :func:`~gradwatch.check.judging.judge.base_point` from two evaluations there (``base_terms`` standing for the
    second where they agree with the first to rounding)."""
    # The first evaluation records the non-smooth ops the forward runs (kinks seen from the forward).
    allowed = allowed_jitter(settings.eval_eps, settings.magnitude)
    j_a = forward_kinks(evaluate).evaluate_base() if settings.detect_kinks else evaluate()
    j_b = base_terms if base_terms is not None and set(base_terms) == set(j_a) else None
    if j_b is None or base_point(total(j_a), total(j_b), allowed)[1] is not None:
        j_b = evaluate()
    jitter, kind, why = base_point(total(j_a), total(j_b), allowed)
    return j_a, jitter, kind, why


#: A tensor whose detection confirmed a wrong gradient, kept for its full sample: ``(key, name, tensor, grads, batched
#: evaluator, detection)``.
_Failing = Tuple[str, str, torch.Tensor, Dict[str, torch.Tensor], Optional[BatchProbe], Detection]


class _Sweep:
    """One objective's tensors judged once its base point is known: every verdict first (:meth:`verdicts`), then
    the full samples of the tensors whose detection confirmed a wrong gradient (:meth:`diagnoses`)."""

    def __init__(self, evaluate: Evaluator, common: EngineSettings, scales: Optional[TermScales],
                 experts: Dict[str, int], seed: int, j0: Terms, probe_batch: Optional[BatchProbe]) -> None:
        self.evaluate, self.common, self.scales, self.experts = evaluate, common, scales, experts
        self.seed, self.j0, self.probe_batch = seed, j0, probe_batch
        self.failing: List[_Failing] = []

    def own(self, key: str) -> EngineSettings:
        """A tensor's settings: the noise of the parts it moves, where traced."""
        return shared_samples(self.common if self.scales is None else self.scales.settings(self.common, [key]), key,
                              self.experts)

    def verdicts(self, targets: Sequence[Target], waiting: Sequence[Target],
                 joint: Dict[str, Tuple[Sample, Outcome]]) -> Iterator[Judged]:
        """Every tensor's verdict, but those whose detection confirms a wrong gradient (kept in :attr:`failing`)."""
        evaluate, seed, probe_batch = self.evaluate, self.seed, self.probe_batch
        if self.common.detection_first and self.common.term_norm is None:  # the whole objective: a fused tensor's experts together
            for group in expert_groups([t for t in targets if t[0] not in joint and not idle(t)]):
                joint.update(joint_detect(group, evaluate, self.own(group[0][0]), seed, always=True))
        for target in waiting:  # an expert no token reached: the objective does not move along it at all
            unmoved = not_reached(target, evaluate, self.own(target[0]), seed)
            if unmoved is not None:
                targets = [t for t in targets if t[0] != target[0]]
                yield Judged(target[0], unmoved)
        for key, name, p, grads in targets:
            settings = self.own(key)
            if not all(all_finite(t) for t in grads.values()):
                why = "analytic gradient has non-finite values (NaN or inf)"
                yield Judged(key, inconclusive(name, tuple(p.shape), InconclusiveKind.NONFINITE, why),
                             before_sampling=InconclusiveKind.NONFINITE)
                continue
            # (an expert's slice is a view: batched evaluations swap whole parameters)
            batch = probe_batch if probe_batch is not None and probe_batch.wants(key) and expert_of(key) is None else None
            evaluate.focus(p)
            if key in joint:
                detected: Optional[Detection] = Detection(*joint[key], settled=True)
            else:
                detected = detect(name, p, grads, evaluate, self.j0, settings, seed, batch) if settings.detection_first else None
            if detected is not None and detected.confirmed:
                self.failing.append((key, name, p, grads, batch, detected))
                continue
            main, per_term = check_tensor(name, p, grads, evaluate, self.j0, settings, seed, probe_batch=batch,
                                          detected=detected)
            yield Judged(key, main, per_term)

    def diagnoses(self) -> Iterator[Judged]:
        """The full sample of each tensor :meth:`verdicts` found failing (which says how its gradient is wrong)."""
        evaluate = self.evaluate
        for key, name, p, grads, batch, detected in self.failing:
            settings = self.own(key)
            evaluate.focus(p)
            try:
                main, per_term = check_tensor(name, p, grads, evaluate, self.j0, settings, self.seed, probe_batch=batch,
                                              detected=detected)
            except BaseException:
                # The verdict stands without its diagnosis: the probe alone, judged.
                evaluate.focus(None)
                yield Judged(key, _summarize(name, tuple(p.shape), [detected.sample], [detected.outcome], "total", settings))
                raise
            yield Judged(key, main, per_term)
        evaluate.focus(None)


def _probe_all(p, saved, grads, samples: List[Sample], bases, outcomes: List[Outcome], evaluate: Evaluator, j0: Terms,
               settings: EngineSettings, genuine: int = 0, batch: Optional[Tuple[str, BatchProbe]] = None) -> None:
    """Probe every sample (or judge its batched base probes), re-examining disagreements; appends to ``outcomes``.

    After three disagreements in a row found genuine (``genuine`` of them before these samples), the rest
    are taken as they are (a wrong gradient disagrees everywhere; re-examining every sample would only
    repeat it). With ``batch`` (the tensor's name and a batched evaluator), the wider steps of every base
    probe lost in rounding (:func:`widen`) are evaluated together, in batches, before the samples are judged.
    """
    wide = _wide_in_batches(p, saved, grads, samples, bases, settings, batch) if batch is not None and bases is not None else {}
    genuine_streak = genuine
    straight = 0  # curved samples whose gap did not shrink at half the step: after two, the rest are taken as they are
    for i, sample in enumerate(samples):
        base = bases[i] if bases is not None and bases[i] is not None else central_probe(p, saved, grads, sample, sample.step, evaluate)
        out = judge_sample(p, saved, grads, sample, base, j0, evaluate, settings, wide=wide.get(i))
        if straight < 2 and curved(out, settings):
            refined = halved(p, saved, grads, sample, out, evaluate, settings)
            if refined is None:
                straight += 1
            else:
                out = refined
        if genuine_streak < 3 and _needs_reexamination(out, settings):
            kink = _reexamine(p, saved, grads, sample, base, out, j0, evaluate, settings)
            if kink is not None:
                genuine_streak = 0 if kink else genuine_streak + 1
        outcomes.append(out)


def _wide_in_batches(p, saved, grads, samples: List[Sample], bases, settings: EngineSettings,
                     batch: Tuple[str, BatchProbe]) -> Dict[int, WideProbes]:
    """The probes :func:`widen` takes for each sample with a batched base probe that needs them, by sample index
    (:func:`widened_in_batches`)."""
    based = [(i, sample, outcome_of(sample, base, settings)) for i, (sample, base) in enumerate(zip(samples, bases))
             if base is not None]
    wide = widened_in_batches(batch[0], p, saved, grads, [(s, out) for _, s, out in based], batch[1], settings)
    return {i: probes for (i, _, _), probes in zip(based, wide) if probes is not None}


def _needs_reexamination(out: Outcome, settings: EngineSettings) -> bool:
    """True when a sample disagrees beyond the SUSPICIOUS band at its base step (a kink may explain it)."""
    return settings.detect_kinks and not out.widened and disagrees(out, settings)


def _reexamine(p, saved, grads, sample: Sample, base: Tuple[Terms, Terms, Terms, Terms], out: Outcome, j0: Terms,
               evaluate: Evaluator, settings: EngineSettings, scales: Sequence[float] = KINK_SCALES,
               batch: Optional[Tuple[str, BatchProbe]] = None,
               taken: Optional[Dict[float, Tuple[Terms, Terms, Terms, Terms]]] = None,
               forward: bool = True) -> Optional[bool]:
    """Kink (True), wrong gradient (False) or cannot tell (None) for a disagreeing sample; marked on ``out``.

    First the forward (``forward``, :func:`kink_free`): a probe that crossed kinks seen there is judged again
    where it crosses none, and only there; one that crossed none goes to the slopes' own rules.
    ``scales``: the smaller steps of :func:`classify_kink`; ``batch``: the tensor's name and a batched
    evaluator, to take those not yet ``taken`` in one batch; ``taken``: the probes at smaller steps so far, by
    scale (kept for a later call on the same sample).
    """
    shorter = kink_free(p, saved, grads, sample, out, evaluate, settings) if forward else None
    if shorter is not None:
        adopt(out, shorter)
        return None if out.unresolved else out.kink or not disagrees(out, settings)
    a, n = out.analytic["total"], out.numeric["total"]
    if unresolvable(sample, a, n, settings):
        kink = resolve_low_precision(p, saved, grads, sample, a, n, j0, evaluate, settings)
    else:
        taken = {} if taken is None else taken
        missing = [scale for scale in scales if scale not in taken]
        if batch is not None and missing:
            scaled = [replace(sample, step=sample.step * scale) for scale in missing]
            got = base_probes(batch[0], p, saved, grads, scaled, batch[1])
            taken.update((scale, probe) for scale, probe in zip(missing, got) if probe is not None)
        kink = classify_kink(p, saved, grads, sample, base, j0, evaluate, settings, scales=scales, taken=taken)
    if kink is None:
        out.unresolved = True
    else:
        out.kink = kink
    return kink


def _summarize(name, shape, samples: List[Sample], outcomes: List[Outcome], term: str, settings: EngineSettings) -> TensorCheck:
    """One term's slopes along every sample, judged by the bands (see :func:`gradwatch.check.judging.judge.judge`)."""
    slopes = [
        Slope(analytic=o.analytic[term], numeric=o.numeric.get(term, 0.0), floor=o.floor, coordinate=s.index is not None,
              label=tuple(s.index) if s.index is not None else s.label, excluded=o.kink, unresolved=o.unresolved,
              alone=s.alone, crossed=o.crossed)
        for s, o in zip(samples, outcomes)
    ]
    rule = BandRule(bands=settings.bands, fail_at=settings.fail_at, coarse=settings.coarse)
    return judge(name, shape, slopes, rule, step=samples[0].step if samples else 0.0)
