"""One-shot checks: :func:`check_model` for a model and loss, :func:`check_numpy` for NumPy backprop."""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, cast

import numpy as np
import torch
from torch import nn

from gradwatch.check.judging.judge import NOISE_FACTOR, inconclusive
from gradwatch.check.judging.report import CheckReport, InconclusiveKind
from gradwatch.check.modules.unresolved import UNSEEN, flat_on_leaves, judge_unseen_on_modules
from gradwatch.check.numerics.differences import machine_eps
from gradwatch.check.numerics.sampling import match_names
from gradwatch.check.objective.checkpointed import reentrant_checkpoint_leaves
from gradwatch.check.objective.dtensor import is_sharded
from gradwatch.check.objective.functional_dropout import recomputed_alike
from gradwatch.check.objective.generators import HeldGenerators
from gradwatch.check.objective.gradients import analytic_gradients, validate_grads
from gradwatch.check.objective.guards import BufferGuard, frozen_batchnorm_stats
from gradwatch.check.objective.padding_idx import padding_note
from gradwatch.check.objective.precision import ShadowPrecision
from gradwatch.check.objective.rng import Reseeder, preserved_rng, seed_everything
from gradwatch.check.objective.shadow import Shadow, cast_floats, keep_shadow, kept_shadow, restore_params, snapshot_params
from gradwatch.check.objective.surrogate import SurrogateCut, find_surrogates, surrogate_note, surrogate_parameters
from gradwatch.check.objective.terms import Objective, coupled_weight_decay
from gradwatch.check.probes.batched import compiled_modules
from gradwatch.check.probes.engine import check_tensors
from gradwatch.check.probes.evaluation import Both, InMode, ObjectiveEvaluation, evaluation_context, focus, hooks_note
from gradwatch.check.probes.experts import in_order
from gradwatch.check.probes.lines import EngineSettings, Evaluator, total
from gradwatch.check.probes.prefix import KEEP_BYTES, REPLAY_MIN_SECONDS, PrefixCache
from gradwatch.options import CheckOptions, check_options
from gradwatch.plan.memory import release_freed
from gradwatch.trees import real_view

GradFn = Callable[[nn.Module, Any], Mapping[str, torch.Tensor]]
_LOW_PRECISION = (torch.float16, torch.bfloat16)

def trainable_names(model: nn.Module) -> List[str]:
    """Names of floating (or complex) parameters that require grad, in model order (tied parameters once)."""
    return [n for n, p in model.named_parameters() if p.requires_grad and (p.is_floating_point() or p.is_complex())]


def check_model(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    *,
    regularizers: Any = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    grad_fn: Optional[GradFn] = None,
    options: Optional[CheckOptions] = None,
    localize: Optional[bool] = None,
    batched: Optional[bool] = None,
    screen: Optional[bool] = None,
    **keywords: Any,
) -> CheckReport:
    """Check backprop of a whole model and loss against two-sided numerical gradients.

    The objective is ``loss_fn(model, batch)`` plus each regularizer (plus ``0.5 * wd * ||p||^2`` for coupled
    weight decay when ``optimizer`` is given). By default it runs on a float64 copy of the model with dropout off
    and BatchNorm in train mode; the live model, its buffers, ``.grad`` and every RNG stream are left bit-identical.

    Args:
        model: The model.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        batch: Passed to ``loss_fn``; floating tensors inside standard containers
            are cast to the check dtype, other objects are passed as they are.
        regularizers: ``{"l2": 1e-4}``, ``{"name": reg(model)}`` or a list of callables.
        optimizer: Read coupled ``weight_decay`` from its param groups.
        grad_fn: Hand-written backprop ``grad_fn(model, batch) -> {name: grad}`` of the
            full objective, used instead of autograd.
        options: A :class:`gradwatch.options.CheckOptions`; default: every option at its default. The keywords
            below override its fields.
        localize: Overrides ``options.localize`` (default False). True: when a tensor fails, check each module
            alone (:func:`gradwatch.check.modules.localize.localize`) to name the module or custom autograd.Function
            whose backward is wrong; results go to ``report.localized`` and ``str(report)``.
        batched: Overrides ``options.batched`` (default True): evaluate perturbations in vmapped batches where the
            model allows it (:mod:`gradwatch.check.probes.batched`, automatic fallback); False: one evaluation each.
        screen: Overrides ``options.screen`` (default True): detection first, each tensor probed along one random
            direction, which settles it where analytic and numeric slopes agree to the EXCELLENT band; the others
            get the full sample, and a disagreement the full sample does not fail is traced to one entry by halving
            (:func:`gradwatch.check.probes.reexamine.pinpoint`). False: the full sample on every tensor.
        **keywords: Override the other fields of ``options`` (:class:`gradwatch.options.CheckOptions`: ``coords``,
            ``directions``, ``eps``, ``bands``, ``fail_at``, ``seed``, ``dtype``, ``detect_kinks``, ``per_term``,
            ``tensors``, ``surrogates``).

    Returns:
        A :class:`CheckReport`.

    Example:
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
        >>> report = check_model(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), (x, y))
        >>> report.ok
        True
    """
    entered = time.perf_counter()
    given = {k: v for k, v in (("localize", localize), ("batched", batched), ("screen", screen)) if v is not None}
    opts = check_options(options, **given, **keywords)
    _refuse_uncheckable(model)
    weight_decay, notes = coupled_weight_decay(model, optimizer)
    objective = Objective(loss_fn, regularizers, weight_decay)
    before = time.perf_counter() - entered
    report = run_model_check(model, objective, batch, opts, grad_fn=grad_fn, batched=opts.batched, screen=opts.screen,
                             mark_unseen=grad_fn is None, keep=True)
    report.seconds += before
    report.verdict_seconds += before
    report.notes[:0] = notes
    if grad_fn is None:
        judge_unseen_on_modules(report, model, objective, batch, opts, opts.screen)
    if objective.differentiates:  # it trains on the model's second derivatives: each module's double backward too
        _check_inner_derivatives(report, model, objective, batch, opts)
    if opts.localize and report.failures:
        _localize_failures(report, model, loss_fn, batch, opts)
    return report


def _refuse_uncheckable(model: Any) -> None:
    """Refuse what :func:`check_model` cannot check: not a module, or a sharded one."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if is_sharded(model):
        raise ValueError(
            f"check_model cannot check {type(model).__name__}: it is sharded (FSDP2 fully_shard, DTensor "
            "parameters), it cannot be copied, and evaluating it makes collectives the other ranks do not make. "
            "Check the model before fully_shard, or use GradWatch, which gathers a replica on every rank at each check"
        )


def _check_inner_derivatives(report: CheckReport, model: nn.Module, objective: Objective, batch: Any,
                             opts: CheckOptions) -> None:
    """Each module's double backward, for an objective that trains on the model's second derivatives."""
    from gradwatch.check.higher_order.inner import check_inner_derivatives

    start = time.perf_counter()
    report.tensors.update(check_inner_derivatives(model, objective.loss, batch, seed=opts.seed, fail_at=report.fail_at))
    report.seconds += time.perf_counter() - start
    report.verdict_seconds = report.seconds  # these verdicts come after the diagnosis of the others
    report.verdict_evaluations = report.evaluations


def _localize_failures(report: CheckReport, model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                       batch: Any, opts: CheckOptions) -> None:
    """``localize``: each module checked alone after a failure; the failing ones go to ``report.localized``."""
    from gradwatch.check.modules.localize import localize as run_localize

    start = time.perf_counter()
    report.localized = run_localize(model, loss_fn, batch, enclosing=True, **opts.shared())
    report.localize_seconds += time.perf_counter() - start
    report.seconds += time.perf_counter() - start


def _validate_target(model: nn.Module, opts: CheckOptions, names: Sequence[str]) -> None:
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no trainable floating-point parameters to check "
            "(all are frozen with requires_grad=False, or the model has none)"
        )
    if opts.dtype is None:
        params = dict(model.named_parameters())
        low = sorted({str(params[n].dtype) for n in names if params[n].dtype in _LOW_PRECISION})
        if low:
            raise ValueError(
                f"dtype=None checks in place, but parameters are {', '.join(low)}: finite differences in half "
                "precision cannot resolve gradients; use the default dtype=torch.float64 shadow copy"
            )


#: Activations (bytes, as counted) from which the analytic side's freed memory is given back before the probes run
#: (glibc's ``malloc_trim``: a few milliseconds; on a batch of 16,384 samples through an MLP of 256 units it kept the
#: check's peak from standing on what the backward had freed).
RELEASE_BYTES = 16 * 2**20


@dataclass
class _Target:
    """What one check evaluates and perturbs."""

    module: nn.Module  # the live model (in place) or its shadow copy's module
    batch: Any  # cast to the shadow's dtype
    dtype: Optional[torch.dtype]  # None: in place
    shadow: Optional[Shadow]
    surrogates: Dict[str, nn.Module]
    cut: Optional[SurrogateCut]
    leaves: Dict[str, nn.Parameter]  # the checked parameters
    params: Dict[str, torch.Tensor]  # what the engine perturbs: complex ones as (re, im) pairs, then surrogate outputs
    real: bool  # every checked parameter is real (``params`` are the ``leaves`` themselves)

    @property
    def in_place(self) -> bool:
        return self.dtype is None


class _Scales(NamedTuple):
    """The sizes the engine's steps and noise floors follow."""

    magnitude: float  # sum of |term|
    eval_eps: float  # machine eps of the coarsest precision a parameter-dependent op ran in
    objective_dtype_eps: float  # machine eps of the objective's own dtype
    coarse: Optional[str]  # where a coarser precision ran, in words


def run_model_check(
    model: nn.Module,
    objective: Objective,
    batch: Any,
    opts: CheckOptions,
    *,
    grad_fn: Optional[GradFn] = None,
    names: Optional[Sequence[str]] = None,
    shadow: Optional[Shadow] = None,
    batched: bool = True,
    screen: bool = False,
    mark_unseen: bool = False,
    prefix_bytes: Optional[int] = KEEP_BYTES,
    activations: int = 0,
    keep: bool = False,
) -> CheckReport:
    """The check behind :func:`check_model` and the training hook.

    Args:
        names: Tensors to check (default: trainable ones matching ``opts.tensors``).
        shadow: A :class:`Shadow` to reuse (refreshed in place) instead of a new copy.
        batched: Evaluate the perturbations of a tensor in vmapped batches where the model
            allows it (see :mod:`gradwatch.check.probes.batched`); False: one evaluation each.
        screen: Detection first (see :func:`check_model`).
        mark_unseen: A tensor whose gradient the objective cannot resolve is inconclusive (``below_resolution``
            or ``flat``) instead of passing (see :class:`gradwatch.check.probes.lines.EngineSettings`).
        prefix_bytes: Most bytes of leaf outputs and inputs a probe may replay from
            (:class:`~gradwatch.check.probes.prefix.PrefixCache`); None or 0: every evaluation runs the whole forward.
        activations: Bytes of one evaluation's activations (the batched evaluations hold one set per perturbation
            and are sized to that); 0: not known, only the perturbed copies are counted.
        keep: Without ``shadow``, reuse the one kept from this model's last check where it is still faithful, and keep
            this one for the next (:func:`~gradwatch.check.objective.shadow.kept_shadow`: one-shot checks).
    """
    start = time.perf_counter()
    t = _target(model, batch, opts, names, shadow, keep)
    batched = batched and t.cut is None and t.real
    report = CheckReport(tensors={}, fail_at=opts.fail_verdict, seed=opts.seed)
    if t.surrogates:
        report.surrogates = list(t.surrogates)
        report.notes.append(surrogate_note(t.surrogates, "objective"))
    roots = [objective.loss_fn, *objective.regularizers.values(), grad_fn, model]
    prefix = _prefix_cache(t, objective, prefix_bytes, batched)
    with evaluation_context(t.module, t.in_place, t.params, roots, prefix) as (guard, held, hooks, dropout, padding):
        _note_setting(report, dropout, padding, hooks)
        precision = ShadowPrecision(t.dtype) if t.dtype is not None else None
        analytic = _analytic_side(report, t, objective, opts, grad_fn, prefix, dropout, precision)
        if analytic is None:  # the objective is not finite at the point
            report.seconds = time.perf_counter() - start
            return report
        values, grads, graph_leaves = analytic
        if activations >= RELEASE_BYTES:  # the forward's and backward's activations, freed and given back: what
            release_freed()  # glibc keeps of them would sit under the probes' evaluations in the process's peak
        # Only now: a train-mode BatchNorm saves its running stats for backward, and restoring them
        # (the forward above updated them) bumps their version counters.
        guard.restore_changed()
        dropout.settle()  # counts are per forward; the interception stays on only where the forward needs it
        if dropout.functional or dropout.stays_on or dropout.random_draws:
            report.notes.append(dropout.summary())
        reseed = Reseeder(opts.seed, held)
        mode = precision if precision is not None and precision.needed else None
        evaluator = _evaluator(t, objective, guard, reseed, mode, prefix, graph_leaves)
        scales = _scales(report, values, t.params, precision, opts)
        probe = _batched_probe(model, t, objective, guard, reseed, evaluator, prefix, mode, scales, activations) \
            if batched else None
        verdict_at, flat_spent, flat_evaluations = _judge(report, t, grads, evaluator, opts, scales, probe, prefix,
                                                          screen=screen, mark_unseen=mark_unseen, values=values)
    _timings(report, start, evaluator.count, verdict_at, flat_spent, flat_evaluations)
    if keep and t.shadow is not None:
        keep_shadow(model, t.shadow)
    return report


def _target(model: nn.Module, batch: Any, opts: CheckOptions, names: Optional[Sequence[str]], shadow: Optional[Shadow],
            keep: bool) -> _Target:
    """The module checked (the model, or its shadow copy in ``opts.dtype``), and the tensors chosen in it."""
    all_names = trainable_names(model)
    _validate_target(model, opts, all_names)
    chosen = list(names) if names is not None else match_names(all_names, opts.tensors)
    dtype = opts.torch_dtype
    if dtype is None:
        target = model
    else:
        if shadow is None and keep:
            shadow = kept_shadow(model, dtype)
        if shadow is None or shadow.dtype != dtype or not shadow.matches(model):
            shadow = Shadow(model, dtype)
        shadow.refresh(model)
        target = shadow.module
        batch = cast_floats(batch, dtype)
    surrogates = find_surrogates(target, opts.surrogates)
    cut = SurrogateCut(surrogates) if surrogates else None
    if surrogates:  # their own parameters' gradient is the surrogate's: not compared
        by_design = set(surrogate_parameters(surrogates))
        chosen = [n for n in chosen if n not in by_design]
    wanted = set(chosen)
    leaves = {n: p for n, p in target.named_parameters() if n in wanted}
    params = {n: real_view(p) for n, p in leaves.items()}  # what the engine perturbs: complex ones as (re, im) pairs
    return _Target(target, batch, dtype, shadow, surrogates, cut, leaves, params,
                   real=all(p is leaves[n] for n, p in params.items()))


def _prefix_cache(t: _Target, objective: Objective, prefix_bytes: Optional[int], batched: bool) -> Optional[PrefixCache]:
    """A probe of one tensor replays the leaf modules it does not reach (on the float64 copy, real tensors only)."""
    if prefix_bytes and not t.in_place and t.cut is None and batched and not objective.differentiates and t.real \
            and not compiled_modules(t.module):
        return PrefixCache(t.module, t.params, prefix_bytes)
    return None


def _note_setting(report: CheckReport, dropout: Any, padding: List[str], hooks: List[str]) -> None:
    """The setting the check runs in, in the report: dropout, constant padding rows, the hooks it did not run."""
    report.dropout = dropout
    if padding:
        report.notes.append(padding_note(padding))
    if hooks:
        report.notes.append(hooks_note(hooks))
        warnings.warn(report.notes[-1], stacklevel=4)  # shown once per distinct text by the default filter


def _analytic_side(report: CheckReport, t: _Target, objective: Objective, opts: CheckOptions, grad_fn: Optional[GradFn],
                   prefix: Optional[PrefixCache], dropout: Any, precision: Optional[ShadowPrecision],
                   ) -> Optional[Tuple[Dict[str, float], Dict[str, Dict[str, torch.Tensor]], Optional[List[torch.Tensor]]]]:
    """One forward with grad, then autograd.grad (never the caller's .grad): ``(term values, gradients, the leaves
    a reentrant checkpoint hides)``; None when the objective is not finite. On a shadow the forward also measures
    the precision the objective really computes in (:mod:`gradwatch.check.objective.precision`)."""
    seed_everything(opts.seed)
    terms_t, total_t = _forward(t, objective, prefix, precision)
    if t.cut is not None:
        t.cut.take_gradients(total_t)
    values = {k: float(v.detach()) for k, v in terms_t.items()}
    report.terms = values
    report.objective = float(total_t.detach())
    report.dtype = str(total_t.dtype).replace("torch.", "")
    if not math.isfinite(report.objective):
        _not_finite(report, t.params, f"objective is not finite ({report.objective}); gradients not checked")
        return None
    # A reentrant checkpoint hides the parameters inside it from autograd.grad: go through backward().
    graph_leaves = reentrant_checkpoint_leaves(total_t) if total_t.requires_grad else None
    if graph_leaves is not None:
        graph_leaves += [p for p in t.module.parameters() if p.requires_grad]
    with recomputed_alike(dropout):  # a checkpoint recomputing in backward drops what the forward dropped
        grads = analytic_gradients(objective, terms_t, total_t, t.leaves, t.module, t.batch, grad_fn, opts.per_term,
                                   graph_leaves)
    # torch's gradient of a real loss by a complex z = x + iy is dJ/dx + i dJ/dy: as a real view, (dJ/dx, dJ/dy).
    grads = {n: {k: real_view(g) for k, g in by_term.items()} for n, by_term in grads.items()}
    for name, (output, g) in (t.cut.outputs.items() if t.cut is not None else ()):  # checked like a parameter
        t.params[name], grads[name] = real_view(output), {"total": real_view(g)}
    return values, grads, graph_leaves  # the graph goes with this frame, before release_freed


def _forward(t: _Target, objective: Objective, prefix: Optional[PrefixCache], precision: Optional[ShadowPrecision],
             ) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """The analytic forward: ``(terms, their total)`` with their graph; a quick one declines the prefix replay."""
    forward_at = time.perf_counter()
    with torch.enable_grad(), (precision.tracing(t.module) if precision is not None else contextlib.nullcontext()), \
            (t.cut.capturing() if t.cut is not None else contextlib.nullcontext()):
        terms_t = objective.terms(t.module, t.batch)
        total_t = cast(torch.Tensor, sum(terms_t[k] for k in sorted(terms_t)))
    if prefix is not None and time.perf_counter() - forward_at < REPLAY_MIN_SECONDS:
        prefix.decline()  # a forward of tens of microseconds: capturing and replaying it costs more than it saves
    return terms_t, total_t


def _evaluator(t: _Target, objective: Objective, guard: BufferGuard, reseed: Reseeder, mode: Optional[ShadowPrecision],
               prefix: Optional[PrefixCache], graph_leaves: Optional[List[torch.Tensor]]) -> Evaluator:
    """The numeric side's counted evaluations of the objective (:class:`ObjectiveEvaluation`)."""
    casting = t.shadow if not t.in_place else None
    if casting is not None:
        casting.trim_cast_hooks()
    evaluation = ObjectiveEvaluation(objective, t.module, t.batch, guard, reseed, mode=mode, cut=t.cut, casting=casting,
                                     prefix=prefix, graph_leaves=graph_leaves)
    evaluator = Evaluator(evaluation, recordable=not compiled_modules(t.module))
    if prefix is not None:
        evaluator.on_focus = lambda p: focus(prefix, p, evaluator)
    return evaluator


def _scales(report: CheckReport, values: Dict[str, float], params: Dict[str, torch.Tensor],
            precision: Optional[ShadowPrecision], opts: CheckOptions) -> _Scales:
    """The scales of the check; on a shadow, the precision it measured goes to the report."""
    magnitude = sum(abs(v) for v in values.values())
    eval_eps = max(machine_eps(p.dtype) for p in params.values()) if params else 0.0
    coarse = None
    if precision is not None:
        # The step and the noise floor follow the coarsest precision a parameter-dependent op ran in.
        eval_eps = max(eval_eps, precision.eps())
        coarse = precision.island_text() or None
        report.precision = precision.summary()
        report.precision["step"] = opts.eps if opts.eps is not None else eval_eps ** (1.0 / 3.0)
        report.notes.extend(precision.notes(report.precision["step"]))
    return _Scales(magnitude, eval_eps, machine_eps(getattr(torch, report.dtype)), coarse)


def _batched_probe(model: nn.Module, t: _Target, objective: Objective, guard: BufferGuard, reseed: Reseeder,
                   evaluator: Evaluator, prefix: Optional[PrefixCache], mode: Optional[ShadowPrecision], scales: _Scales,
                   activations: int) -> Any:
    """The vmapped evaluations of a tensor's perturbations (:class:`~gradwatch.check.probes.batched.BatchedProbe`)."""
    from gradwatch.check.probes.batched import BatchedProbe

    tolerance = 2 * NOISE_FACTOR * max(scales.eval_eps, scales.objective_dtype_eps) * max(scales.magnitude, 1e-30)
    probe: Any = BatchedProbe(model, t.module, objective, t.batch, reseed if prefix is None else Both(reseed, prefix.begin),
                              guard, evaluator, tolerance, activations=activations)
    return InMode(probe, mode) if mode is not None else probe


def _judge(report: CheckReport, t: _Target, grads: Dict[str, Dict[str, torch.Tensor]], evaluator: Evaluator,
           opts: CheckOptions, scales: _Scales, probe: Any, prefix: Optional[PrefixCache], *, screen: bool,
           mark_unseen: bool, values: Dict[str, float]) -> Tuple[List[Tuple[float, int]], float, int]:
    """Every tensor judged, the flat ones on their leaf modules after: ``(when the verdicts were known, the time of
    the flat ones, their evaluations)``."""
    verdict_at: List[Tuple[float, int]] = []
    with frozen_batchnorm_stats(t.module):
        _judge_all(report, t.params, grads, evaluator, opts, magnitude=scales.magnitude, eval_eps=scales.eval_eps,
                   objective_dtype_eps=scales.objective_dtype_eps, probe_batch=probe, coarse=scales.coarse, screen=screen,
                   mark_unseen=mark_unseen, base_terms=values,
                   on_verdict=lambda: verdict_at.append((time.perf_counter(), evaluator.count)))
        flat_at = time.perf_counter()
        flat_evaluations = flat_on_leaves(report, t.module, prefix, opts, screen) \
            if prefix is not None and prefix.enabled else 0
        flat_spent = time.perf_counter() - flat_at
    return verdict_at, flat_spent, flat_evaluations


def _timings(report: CheckReport, start: float, count: int, verdict_at: List[Tuple[float, int]], flat_spent: float,
             flat_evaluations: int) -> None:
    """The report's evaluations and times: in all, to every verdict, and after it (the failures' diagnosis)."""
    report.evaluations = count + 1 + flat_evaluations
    end = time.perf_counter()
    report.seconds = end - start
    at, counted = verdict_at[0] if verdict_at else (end, count)
    report.verdict_seconds, report.verdict_evaluations = at - start + flat_spent, counted + 1 + flat_evaluations
    report.localize_seconds = end - at if report.failures else 0.0


def _judge_all(report: CheckReport, params: Dict[str, torch.Tensor], grads, evaluator: Evaluator, opts: CheckOptions,
               magnitude: float, eval_eps: float, objective_dtype_eps: float, exhaustive: bool = False,
               probe_batch: Any = None, coarse: Optional[str] = None, screen: bool = False,
               on_verdict: Optional[Callable[[], None]] = None, mark_unseen: bool = False,
               base_terms: Optional[Dict[str, float]] = None) -> None:
    """Judge every tensor (:func:`gradwatch.check.probes.engine.check_tensors`); fills ``report``."""
    settings = EngineSettings.from_options(opts, max(eval_eps, objective_dtype_eps), magnitude, exhaustive=exhaustive,
                                           coarse=coarse, screen=screen, mark_unseen=mark_unseen)
    targets = [(n, n, p, grads[n]) for n, p in params.items()]
    for judged in check_tensors(targets, evaluator, settings, opts.seed, probe_batch=probe_batch, on_verdict=on_verdict,
                                base_terms=base_terms):
        report.tensors[judged.key] = judged.check
        for term, tc in judged.per_term.items():
            report.term_checks.setdefault(term, {})[judged.key] = tc
        if judged.before_sampling is InconclusiveKind.NONDETERMINISTIC:
            report.nondeterministic = True
        elif judged.before_sampling is InconclusiveKind.NONFINITE:
            report.nonfinite = True
    report.tensors = in_order(report.tensors, list(params))  # model order (failing ones came last), experts in place


def _not_finite(report: CheckReport, params: Mapping[str, torch.Tensor], why: str) -> None:
    """The objective is not finite at the point: no tensor can be judged."""
    report.nonfinite = True
    for n, p in params.items():
        report.tensors[n] = inconclusive(n, p.shape, InconclusiveKind.NONFINITE, why)


def check_numpy(
    loss_fn: Callable[..., float],
    params: Mapping[str, np.ndarray],
    grads: Mapping[str, np.ndarray],
    *,
    regularizers: Optional[Mapping[str, Callable[[Mapping[str, np.ndarray]], float]]] = None,
    **options: Any,
) -> CheckReport:
    """Check hand-written NumPy backprop: ``grads`` against numerical gradients of ``loss_fn``.

    ``params`` arrays are perturbed in place (the network reads them) and
    restored bit for bit. ``loss_fn`` takes no argument, or the ``params``
    dict, and returns the full objective (data loss plus every penalty the
    hand-written gradient is supposed to include).

    Args:
        loss_fn: ``loss_fn() -> float`` or ``loss_fn(params) -> float``.
        params: ``{name: array}`` read by ``loss_fn``.
        grads: ``{name: array}`` hand-written gradients, same names and shapes.
        regularizers: Extra terms ``{name: reg(params) -> float}`` added to the objective.
        **options: ``coords``, ``directions``, ``eps``, ``bands``, ``fail_at``, ``seed``,
            ``detect_kinks``, ``tensors`` (``dtype`` must stay None: arrays are checked in place).

    Returns:
        A :class:`CheckReport`.

    Example:
        >>> w = {"w": np.array([1.0, -2.0])}
        >>> check_numpy(lambda: float((w["w"] ** 2).sum()), w, {"w": 2 * w["w"]}).ok
        True
    """
    options.setdefault("dtype", None)
    opts = CheckOptions(**options)
    if opts.dtype is not None:
        raise ValueError(f"check_numpy checks arrays in place in their own dtype; got dtype={opts.dtype}, pass dtype=None")
    views = _array_views(params, opts)
    given = validate_grads(grads, views, "grads")
    evaluate = _NumpyObjective(loss_fn, params, dict(regularizers or {}), opts.seed)
    start = time.perf_counter()
    dtype = str(next(iter(views.values())).dtype).replace("torch.", "")
    report = CheckReport(tensors={}, fail_at=opts.fail_verdict, seed=opts.seed, dtype=dtype)
    saved = snapshot_params(views)
    try:
        with preserved_rng():
            evaluator = Evaluator(evaluate)
            values = evaluator()
            report.terms = values
            report.objective = total(values)
            if not math.isfinite(report.objective):
                _not_finite(report, views, f"objective is not finite ({report.objective})")
            else:
                analytic = {n: {"total": g} for n, g in given.items()}
                eps = max(machine_eps(v.dtype) for v in views.values())
                _judge_all(report, views, analytic, evaluator, opts, magnitude=sum(abs(v) for v in values.values()),
                           eval_eps=eps, objective_dtype_eps=eps)
    finally:
        evaluate.held.reset()
        restore_params(views, saved)
    report.evaluations = evaluator.count
    report.seconds = time.perf_counter() - start
    return report


def _array_views(params: Mapping[str, np.ndarray], opts: CheckOptions) -> Dict[str, torch.Tensor]:
    """The chosen arrays as tensors sharing their memory (the check perturbs them in place)."""
    if not isinstance(params, Mapping) or not params:
        raise TypeError(f"params must be a non-empty dict of numpy arrays, got {type(params).__name__}")
    views: Dict[str, torch.Tensor] = {}
    for n, arr in params.items():
        if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.floating):
            raise TypeError(f"params[{n!r}] must be a floating numpy array, got {type(arr).__name__} {getattr(arr, 'dtype', '')}")
        if not arr.flags.writeable:
            raise ValueError(f"params[{n!r}] is read-only; gradwatch perturbs arrays in place")
        views[n] = torch.from_numpy(arr)
    chosen = match_names(list(views), opts.tensors)
    return {n: views[n] for n in chosen}


class _NumpyObjective:
    """``evaluate() -> {term: float}`` of :func:`check_numpy`: ``loss_fn`` and each regularizer, seeded alike."""

    def __init__(self, loss_fn: Callable[..., float], params: Mapping[str, np.ndarray],
                 regs: Dict[str, Callable[[Mapping[str, np.ndarray]], float]], seed: int) -> None:
        self.loss_fn, self.params, self.regs, self.seed = loss_fn, params, regs, seed
        self.takes_params = _takes_argument(loss_fn)
        self.held = HeldGenerators([loss_fn, *regs.values()])

    def __call__(self) -> Dict[str, float]:
        seed_everything(self.seed)
        self.held.reset()
        loss_fn, params = self.loss_fn, self.params
        out = {"loss": _as_float(loss_fn(params) if self.takes_params else loss_fn(), "loss_fn")}
        for name, reg in self.regs.items():
            out[name] = _as_float(reg(params), f"regularizer {name!r}")
        return out


def _takes_argument(fn: Callable) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    required = [p for p in sig.parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return len(required) >= 1


def _as_float(value: Any, what: str) -> float:
    if isinstance(value, tuple) and value:
        raise TypeError(f"{what} returned a tuple; return only the loss (e.g. lambda: net.loss(X, y)[0])")
    arr = np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value, dtype=np.float64)
    if arr.size != 1:
        raise ValueError(f"{what} must return a scalar, got shape {arr.shape}")
    return float(arr.reshape(()))


__all__ = ["GradFn", "KEEP_BYTES", "RELEASE_BYTES", "REPLAY_MIN_SECONDS", "UNSEEN", "check_model", "check_numpy",
           "judge_unseen_on_modules", "run_model_check", "trainable_names", "validate_grads"]
