"""One-shot checks: :func:`check_model` for a model and loss, :func:`check_numpy` for NumPy backprop."""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np
import torch
from torch import nn

from gradwatch.check.judging.judge import NOISE_FACTOR, inconclusive
from gradwatch.check.judging.report import CheckReport, InconclusiveKind
from gradwatch.check.numerics.differences import machine_eps
from gradwatch.check.numerics.sampling import match_names
from gradwatch.check.objective.checkpointed import CHECKPOINT_NO_GRAD_WARNING, grad_by_backward, reentrant_checkpoint_leaves
from gradwatch.check.objective.dropout_off import dropout_off
from gradwatch.check.objective.dtensor import is_sharded
from gradwatch.check.objective.functional_dropout import recomputed_alike
from gradwatch.check.objective.generators import HeldGenerators
from gradwatch.check.objective.guards import BufferGuard, frozen_batchnorm_stats, frozen_power_iteration, suspended_hooks
from gradwatch.check.objective.padding_idx import padding_note, padding_rows_constant
from gradwatch.check.objective.precision import ShadowPrecision
from gradwatch.check.objective.rng import Reseeder, preserved_rng, seed_everything
from gradwatch.check.objective.shadow import Shadow, cast_floats, keep_shadow, kept_shadow, restore_params, snapshot_params
from gradwatch.check.objective.surrogate import SurrogateCut, find_surrogates, surrogate_note, surrogate_parameters
from gradwatch.check.objective.terms import Objective, coupled_weight_decay
from gradwatch.check.probes.batched import compiled_modules
from gradwatch.check.probes.engine import check_tensors
from gradwatch.check.probes.experts import in_order, tensor_of
from gradwatch.check.probes.lines import EngineSettings, Evaluator, total
from gradwatch.check.probes.prefix import KEEP_BYTES, REPLAY_MIN_SECONDS, PrefixCache
from gradwatch.errors import blame
from gradwatch.options import CheckOptions
from gradwatch.plan.memory import release_freed
from gradwatch.trees import dense, real_view, tensor_leaves

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
    localize: bool = False,
    batched: bool = True,
    screen: bool = True,
    **options: Any,
) -> CheckReport:
    """Check backprop of a whole model and loss against two-sided numerical gradients.

    The objective is ``loss_fn(model, batch)`` plus each regularizer (plus
    ``0.5 * wd * ||p||^2`` for coupled weight decay when ``optimizer`` is
    given). By default it runs on a float64 copy of the model with dropout
    off and BatchNorm in train mode; the live model, its buffers, ``.grad``
    and every RNG stream are left bit-identical.

    Args:
        model: The model.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        batch: Passed to ``loss_fn``; floating tensors inside standard containers
            are cast to the check dtype, other objects are passed as they are.
        regularizers: ``{"l2": 1e-4}``, ``{"name": reg(model)}`` or a list of callables.
        optimizer: Read coupled ``weight_decay`` from its param groups.
        grad_fn: Hand-written backprop ``grad_fn(model, batch) -> {name: grad}`` of the
            full objective, used instead of autograd.
        localize: When a tensor fails, check each module alone (:func:`gradwatch.check.modules.localize.localize`)
            to name the module or custom autograd.Function whose backward is wrong; results go to
            ``report.localized`` and ``str(report)``.
        batched: Evaluate perturbations in vmapped batches where the model allows it
            (:mod:`gradwatch.check.probes.batched`, automatic fallback); False: one evaluation each.
        screen: Detection first: each tensor is probed along one random direction, and where analytic
            and numeric slopes agree to the EXCELLENT band (with a noise floor that could have shown an
            error) that settles it; only the others get the full sample (``coords``, ``directions``, kink
            re-examination), and where the probe disagrees but the full sample does not fail, the
            disagreement is traced to one entry by halving (:func:`gradwatch.check.probes.reexamine.pinpoint`).
            False: the full sample on every tensor.
        **options: See :class:`gradwatch.options.CheckOptions` (``coords``,
            ``directions``, ``eps``, ``bands``, ``fail_at``, ``seed``, ``dtype``,
            ``detect_kinks``, ``per_term``, ``tensors``).

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
    opts = CheckOptions(**options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if is_sharded(model):
        raise ValueError(
            f"check_model cannot check {type(model).__name__}: it is sharded (FSDP2 fully_shard, DTensor "
            "parameters), it cannot be copied, and evaluating it makes collectives the other ranks do not make. "
            "Check the model before fully_shard, or use GradWatch, which gathers a replica on every rank at each check"
        )
    weight_decay, notes = coupled_weight_decay(model, optimizer)
    objective = Objective(loss_fn, regularizers, weight_decay)
    before = time.perf_counter() - entered
    report = run_model_check(model, objective, batch, opts, grad_fn=grad_fn, batched=batched, screen=screen,
                             mark_unseen=grad_fn is None, keep=True)
    report.seconds += before
    report.verdict_seconds += before
    report.notes[:0] = notes
    if grad_fn is None:
        judge_unseen_on_modules(report, model, objective, batch, opts, screen)
    if objective.differentiates:  # it trains on the model's second derivatives: each module's double backward too
        from gradwatch.check.higher_order.inner import check_inner_derivatives

        start = time.perf_counter()
        report.tensors.update(check_inner_derivatives(model, objective.loss, batch, seed=opts.seed, fail_at=report.fail_at))
        report.seconds += time.perf_counter() - start
        report.verdict_seconds = report.seconds  # these verdicts come after the diagnosis of the others
        report.verdict_evaluations = report.evaluations
    if localize and report.failures:
        from gradwatch.check.modules.localize import localize as run_localize

        start = time.perf_counter()
        report.localized = run_localize(model, loss_fn, batch, enclosing=True, **options)
        report.localize_seconds += time.perf_counter() - start
        report.seconds += time.perf_counter() - start
    return report


#: What differences of the whole objective could not judge, and each module alone can (see below).
UNSEEN = (InconclusiveKind.BELOW_RESOLUTION, InconclusiveKind.UNRESOLVED, InconclusiveKind.FLAT)


def judge_unseen_on_modules(report: CheckReport, model: nn.Module, objective: Objective, batch: Any,
                             opts: CheckOptions, screen: bool) -> None:
    """Tensors the whole objective could not resolve, judged on their modules alone (the module form).

    At weights near zero a layer's gradient is tiny against the objective: differences of the whole
    objective lose it in rounding (``below_resolution``; ``flat`` where the objective does not move at all
    at the widest step, as for a bias before a normalization), or cannot tell a kink from an error at a
    step small enough (``unresolved``). Each module alone, ``<module(x), c>`` on its inputs from the batch
    (:func:`gradwatch.check.modules.module_form.run_module_check`), differences outputs whose size follows the
    weights', and resolves them at every scale. Such a tensor takes its module's verdict; an input
    gradient that fails there (a unit's backward wrong where the objective could not see it) joins the
    report under ``"<module>:input"``. Only on the float64 copy (the default ``dtype``).
    """
    unseen = [n for n, t in report.tensors.items() if t.inconclusive_kind in UNSEEN]
    if not unseen or opts.torch_dtype != torch.float64:
        return  # in a lower precision (dtype=None on a float32 model) modules alone cannot resolve kinks either
    from gradwatch.check.modules.module_form import run_module_check
    from gradwatch.plan.units import plan_units

    start = time.perf_counter()
    units = plan_units(model, objective.loss, batch, opts.seed)
    if all(report.tensors[n].inconclusive_kind is InconclusiveKind.FLAT for n in unseen):
        # The objective is bit-for-bit flat in each of them (a bias before a normalization, or a gradient far
        # below rounding): what can still be wrong is their own module's backward, so only it is checked.
        units = [u for u in units if any(tensor_of(n) in u.params for n in unseen)]
    modular = run_module_check(model, objective, batch, opts, units=units, screen=screen)
    judged = []
    for n in unseen:
        check = modular.tensors.get(n)
        if check is not None and check.inconclusive is None:
            report.tensors[n] = check
            judged.append(n)
    for n, check in modular.tensors.items():
        if n not in report.tensors and check.failed:
            report.tensors[n] = check
    spent = time.perf_counter() - start
    report.evaluations += modular.evaluations
    report.seconds += spent
    # Their verdicts need none of the failing tensors' diagnosis, which ran before them: the work to a verdict.
    report.verdict_seconds += spent
    report.verdict_evaluations += modular.evaluations
    if judged:
        report.notes.append(_alone_note(judged))


def _alone_note(judged: Sequence[str]) -> str:
    """The note naming the tensors judged on their modules alone."""
    return (f"judged on their modules alone (each module on its inputs from the batch), since differences of the "
            f"whole objective could not resolve their gradient (weights near zero): {', '.join(judged)}")


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


def validate_grads(grads: Any, params: Mapping[str, torch.Tensor], source: str) -> Dict[str, torch.Tensor]:
    if not isinstance(grads, Mapping):
        raise TypeError(f"{source} must return a mapping {{name: gradient}}, got {type(grads).__name__}")
    missing = [n for n in params if n not in grads]
    if missing:
        raise ValueError(
            f"{source} returned no gradient for {missing}; it returned {sorted(map(str, grads))}, "
            f"and the checked parameters are {list(params)}"
        )
    out = {}
    for n, p in params.items():
        g = grads[n]
        g = torch.as_tensor(np.asarray(g)) if not isinstance(g, torch.Tensor) else g
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"{source}: gradient for {n!r} has shape {tuple(g.shape)}, but the parameter has shape {tuple(p.shape)}")
        out[n] = dense(g.to(p.device))
    return out


@contextlib.contextmanager
def _evaluation_context(target: nn.Module, in_place: bool, params: Dict[str, torch.Tensor],
                        roots: Sequence[Any], prefix: Optional[PrefixCache] = None,
                        ) -> Iterator[Tuple[BufferGuard, HeldGenerators, List[str], Any, List[str]]]:
    saved = snapshot_params(params) if in_place else None
    held = HeldGenerators([*roots, target])
    try:
        with preserved_rng(), dropout_off(target) as dropout, frozen_power_iteration(target), \
                padding_rows_constant(target) as padding, suspended_hooks(target) as hooks, \
                (prefix.installed() if prefix is not None else contextlib.nullcontext()):
            # Inside: the attributes dropout_off switched are saved as switched (see AttributeGuard).
            guard = BufferGuard(target, attributes=True)
            try:
                yield guard, held, hooks, dropout, padding
            finally:
                guard.restore_changed()
    finally:
        held.reset()
        if saved is not None:
            restore_params(params, saved)


def _hooks_note(hooks: List[str]) -> str:
    shown = "; ".join(hooks[:3]) + (f"; and {len(hooks) - 3} more" if len(hooks) > 3 else "")
    return (
        f"the check did not run {len(hooks)} hook(s) your code registered on the model ({shown}): at every "
        "evaluation of a check they would run again and their side effects would reach training; if one changes "
        "what its module returns, the check objective differs from the training loss (move that into forward())"
    )


#: Activations (bytes, as counted) from which the analytic side's freed memory is given back before the probes run
#: (glibc's ``malloc_trim``: a few milliseconds; on a batch of 16,384 samples through an MLP of 256 units it kept the
#: check's peak from standing on what the backward had freed).
RELEASE_BYTES = 16 * 2**20


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
    all_names = trainable_names(model)
    _validate_target(model, opts, all_names)
    chosen = list(names) if names is not None else match_names(all_names, opts.tensors)
    dtype = opts.torch_dtype
    in_place = dtype is None
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
    batched = batched and cut is None and all(p is leaves[n] for n, p in params.items())
    eval_seed = opts.seed
    report = CheckReport(tensors={}, fail_at=opts.fail_verdict, seed=opts.seed)
    if surrogates:
        report.surrogates = list(surrogates)
        report.notes.append(surrogate_note(surrogates, "objective"))

    roots = [objective.loss_fn, *objective.regularizers.values(), grad_fn, model]
    # A probe of one tensor replays the leaf modules it does not reach (on the float64 copy, real tensors only).
    prefix = PrefixCache(target, params, prefix_bytes) if prefix_bytes and not in_place and cut is None and batched \
        and not objective.differentiates and \
        all(p is leaves[n] for n, p in params.items()) and not compiled_modules(target) else None
    with _evaluation_context(target, in_place, params, roots, prefix) as (guard, held, hooks, dropout, padding):
        report.dropout = dropout
        if padding:
            report.notes.append(padding_note(padding))
        if hooks:
            report.notes.append(_hooks_note(hooks))
            warnings.warn(report.notes[-1], stacklevel=3)  # shown once per distinct text by the default filter
        # Analytic side: one forward with grad, then autograd.grad (never the caller's .grad).
        # On a shadow it also measures the precision the objective really computes in (gradwatch.check.objective.precision).
        precision = ShadowPrecision(dtype) if dtype is not None else None
        seed_everything(eval_seed)
        forward_at = time.perf_counter()
        with torch.enable_grad(), (precision.tracing(target) if precision is not None else contextlib.nullcontext()), \
                (cut.capturing() if cut is not None else contextlib.nullcontext()):
            terms_t = objective.terms(target, batch)
            total_t = cast(torch.Tensor, sum(terms_t[k] for k in sorted(terms_t)))
        if prefix is not None and time.perf_counter() - forward_at < REPLAY_MIN_SECONDS:
            prefix.decline()  # a forward of tens of microseconds: capturing and replaying it costs more than it saves
        if cut is not None:
            cut.take_gradients(total_t)
        values = {k: float(v.detach()) for k, v in terms_t.items()}
        report.terms = values
        report.objective = float(total_t.detach())
        report.dtype = str(total_t.dtype).replace("torch.", "")
        if not math.isfinite(report.objective):
            _not_finite(report, params, f"objective is not finite ({report.objective}); gradients not checked")
            report.seconds = time.perf_counter() - start
            return report
        # A reentrant checkpoint hides the parameters inside it from autograd.grad: go through backward().
        graph_leaves = reentrant_checkpoint_leaves(total_t) if total_t.requires_grad else None
        if graph_leaves is not None:
            graph_leaves += [p for p in target.parameters() if p.requires_grad]
        with recomputed_alike(dropout):  # a checkpoint recomputing in backward drops what the forward dropped
            grads = _analytic(objective, terms_t, total_t, leaves, target, batch, grad_fn, opts.per_term, graph_leaves)
        # torch's gradient of a real loss by a complex z = x + iy is dJ/dx + i dJ/dy: as a real view, (dJ/dx, dJ/dy).
        grads = {n: {k: real_view(g) for k, g in by_term.items()} for n, by_term in grads.items()}
        for name, (output, g) in (cut.outputs.items() if cut is not None else ()):  # checked like a parameter
            params[name], grads[name] = real_view(output), {"total": real_view(g)}
        del terms_t, total_t
        if activations >= RELEASE_BYTES:  # the forward's and backward's activations, freed and given back: what
            release_freed()  # glibc keeps of them would sit under the probes' evaluations in the process's peak
        # Only now: a train-mode BatchNorm saves its running stats for backward, and restoring them
        # (the forward above updated them) bumps their version counters.
        guard.restore_changed()

        dropout.settle()  # counts are per forward; the interception stays on only where the forward needs it
        if dropout.functional or dropout.stays_on or dropout.random_draws:
            report.notes.append(dropout.summary())
        reseed = Reseeder(eval_seed, held)
        mode = precision if precision is not None and precision.needed else None
        casting = shadow if not in_place else None
        if casting is not None:
            casting.trim_cast_hooks()

        def terms_no_grad() -> Dict[str, torch.Tensor]:
            if mode is not None:
                with mode:
                    return _terms_no_grad()
            return _terms_no_grad()

        def _terms_no_grad() -> Dict[str, torch.Tensor]:
            if cut is not None:
                with cut.cut():
                    terms = _terms_cast_retried()
                return {**terms, "surrogates": torch.tensor(cut.term(), dtype=torch.float64)}
            return _terms_cast_retried()

        def _terms_cast_retried() -> Dict[str, torch.Tensor]:
            try:
                return objective.terms(target, batch)
            except Exception as first:
                # A module that needed no input cast in the first evaluation needs one now: put the hooks back.
                casts = casting.casts() if casting is not None else 0
                if casting is None or not casting.restore_cast_hooks():
                    raise
                guard.restore_changed()
                reseed()
                terms = objective.terms(target, batch)
                if casting.casts() == casts:
                    raise first  # no module needed the cast: the user's code itself raised, retrying hid it
                return terms

        def evaluate() -> Dict[str, float]:
            reseed()
            capturing = prefix is not None and prefix.phase == "capture"
            if prefix is not None:
                prefix.begin()
            try:
                if graph_leaves is not None:  # checkpoint(use_reentrant=True) warns at every evaluation without grad
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message=CHECKPOINT_NO_GRAD_WARNING)
                        terms = terms_no_grad() if not torch.is_grad_enabled() else _no_grad(terms_no_grad)
                elif torch.is_grad_enabled():
                    with torch.no_grad():
                        terms = terms_no_grad()
                else:  # the engine probes under no_grad already; entering it again costs more than the check
                    terms = terms_no_grad()
            finally:
                if capturing and prefix is not None:
                    prefix.captured()  # (the first evaluation: what it kept is replayed from now on)
            guard.restore_fast()
            out = _floats(terms)
            if capturing and prefix is not None:
                prefix.expected = total(out)
            return out

        evaluator = Evaluator(evaluate, recordable=not compiled_modules(target))
        if prefix is not None:
            evaluator.on_focus = lambda p: _focus(prefix, p, evaluator)
        magnitude = sum(abs(v) for v in values.values())
        eval_eps = max(machine_eps(t.dtype) for t in params.values()) if params else 0.0
        coarse = None
        if precision is not None:
            # The step and the noise floor follow the coarsest precision a parameter-dependent op ran in.
            eval_eps = max(eval_eps, precision.eps())
            coarse = precision.island_text() or None
            report.precision = precision.summary()
            report.precision["step"] = opts.eps if opts.eps is not None else eval_eps ** (1.0 / 3.0)
            report.notes.extend(precision.notes(report.precision["step"]))
        objective_dtype_eps = machine_eps(getattr(torch, report.dtype))
        probe: Any = None
        if batched:
            from gradwatch.check.probes.batched import BatchedProbe

            tolerance = 2 * NOISE_FACTOR * max(eval_eps, objective_dtype_eps) * max(magnitude, 1e-30)
            probe = BatchedProbe(model, target, objective, batch, reseed if prefix is None else _Both(reseed, prefix.begin),
                                 guard, evaluator, tolerance, activations=activations)
            if mode is not None:
                probe = _InMode(probe, mode)
        verdict_at: List[Tuple[float, int]] = []
        with frozen_batchnorm_stats(target):
            _judge_all(report, params, grads, evaluator, opts, magnitude=magnitude, eval_eps=eval_eps,
                       objective_dtype_eps=objective_dtype_eps, probe_batch=probe, coarse=coarse, screen=screen,
                       mark_unseen=mark_unseen, base_terms=values,
                       on_verdict=lambda: verdict_at.append((time.perf_counter(), evaluator.count)))
            flat_at = time.perf_counter()
            flat_evaluations = _flat_on_leaves(report, target, prefix, opts, screen) \
                if prefix is not None and prefix.enabled else 0
            flat_spent = time.perf_counter() - flat_at
    report.evaluations = evaluator.count + 1 + flat_evaluations
    end = time.perf_counter()
    report.seconds = end - start
    at, count = verdict_at[0] if verdict_at else (end, evaluator.count)
    report.verdict_seconds, report.verdict_evaluations = at - start + flat_spent, count + 1 + flat_evaluations
    report.localize_seconds = end - at if report.failures else 0.0
    if keep and shadow is not None:
        keep_shadow(model, shadow)
    return report


def _flat_on_leaves(report: CheckReport, target: nn.Module, prefix: PrefixCache, opts: CheckOptions,
                    screen: bool) -> int:
    """Tensors the objective is flat in (a bias before a normalization) whose module is a leaf that ran once:
    judged on that module alone, on the inputs the first evaluation kept, with no forward of the model more
    (:func:`judge_unseen_on_modules` judges the others). Returns the evaluations of those modules made."""
    from gradwatch.check.modules.localize import check_module

    flat = [n for n, t in report.tensors.items() if t.inconclusive_kind is InconclusiveKind.FLAT]
    evaluations = 0
    if not flat:
        return 0
    owners = {(f"{m_name}.{local}" if m_name else local): (m_name, m, local, p)
              for m_name, m in target.named_modules() for local, p in m.named_parameters(recurse=False)}
    judged = []
    for n in flat:
        if n not in owners:
            continue
        m_name, module, local, p = owners[n]
        got = prefix.inputs_of(module)
        if got is None:
            continue
        constants = {id(t) for t in tensor_leaves(got)}  # only the parameter's verdict is wanted here
        result = check_module(m_name, module, got[0], got[1], opts, params={local: p}, constants=constants,
                              screen=screen)
        evaluations += result.evaluations
        check = result.tensors.get(local)
        if check is not None and check.inconclusive is None:
            check.name = n
            report.tensors[n] = check
            judged.append(n)
    if judged:
        report.notes.append(_alone_note(judged))
    return evaluations


class _Both:
    """Two calls in one: the batched evaluations' reseeding, and the start of an evaluation's call count."""

    def __init__(self, first: Callable[[], None], second: Callable[[], None]) -> None:
        self.first, self.second = first, second

    def __call__(self) -> None:
        self.first()
        self.second()


def _focus(prefix: PrefixCache, p: Optional[torch.Tensor], evaluator: Evaluator) -> None:
    """The engine probes ``p`` now: replay what it does not reach, once the replay is found exact (one evaluation)."""
    if p is not None and not prefix.verified and prefix.enabled:
        prefix.verify(lambda: total(evaluator()))
    prefix.focus(p)


class _InMode:
    """A batched probe whose evaluations run inside a :class:`ShadowPrecision` mode."""

    def __init__(self, probe: Any, mode: ShadowPrecision) -> None:
        self._probe, self._mode = probe, mode

    def wants(self, name: str) -> bool:
        return self._probe.wants(name)

    def chunk(self, p: torch.Tensor) -> int:
        return self._probe.chunk(p)

    def __call__(self, *args: Any) -> Any:
        with self._mode:
            return self._probe(*args)


def _no_grad(fn: Callable[[], Any]) -> Any:
    with torch.no_grad():
        return fn()


def _floats(terms: Mapping[str, torch.Tensor]) -> Dict[str, float]:
    """Term values as Python floats, with one device sync for all of them (not one per term)."""
    if len(terms) == 1:
        return {k: float(v) for k, v in terms.items()}
    devices = {v.device for v in terms.values()}
    if all(d.type == "cpu" for d in devices):
        return {k: float(v) for k, v in terms.items()}
    dev = next(d for d in devices if d.type != "cpu")
    return dict(zip(terms, torch.stack([v.detach().to(dev, torch.float64).reshape(()) for v in terms.values()]).tolist()))


def _analytic(objective, terms_t, total_t, params, target, batch, grad_fn, per_term, leaves=None) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{tensor: {"total": grad, term: grad, ...}}``; through ``backward()`` into ``leaves`` when given
    (see :mod:`gradwatch.check.objective.checkpointed`)."""
    plist = list(params.values())
    out: Dict[str, Dict[str, torch.Tensor]] = {n: {} for n in params}
    if grad_fn is not None:
        try:
            with torch.enable_grad():
                given = validate_grads(grad_fn(target, batch), params, "grad_fn")
        except Exception as exc:
            blame(exc, "grad_fn")
            raise
        for n in params:
            out[n]["total"] = given[n]
    else:
        gs = _grad(total_t, plist, retain=per_term, leaves=leaves)
        for n, g in zip(params, gs):
            out[n]["total"] = g
    if per_term:
        for term in sorted(terms_t):
            gs = _grad(terms_t[term], plist, retain=True, leaves=leaves)
            for n, g in zip(params, gs):
                out[n][term] = g
    return out


def _grad(value: torch.Tensor, plist: List[torch.Tensor], retain: bool,
          leaves: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
    if not value.requires_grad:
        return [torch.zeros_like(p) for p in plist]
    gs: Sequence[Optional[torch.Tensor]]
    if leaves is not None:  # see gradwatch.check.objective.checkpointed
        gs = grad_by_backward(value, plist, leaves, retain)
    else:
        gs = torch.autograd.grad(value, plist, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(p) if g is None else dense(g) for g, p in zip(gs, plist)]


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
    views = {n: views[n] for n in chosen}
    given = validate_grads(grads, views, "grads")
    takes_params = _takes_argument(loss_fn)
    regs = dict(regularizers or {})

    held = HeldGenerators([loss_fn, *regs.values()])

    def evaluate() -> Dict[str, float]:
        seed_everything(opts.seed)
        held.reset()
        out = {"loss": _as_float(loss_fn(params) if takes_params else loss_fn(), "loss_fn")}
        for name, reg in regs.items():
            out[name] = _as_float(reg(params), f"regularizer {name!r}")
        return out

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
        held.reset()
        restore_params(views, saved)
    report.evaluations = evaluator.count
    report.seconds = time.perf_counter() - start
    return report


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
