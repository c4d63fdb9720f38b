"""Module-local checks: name the module, or the custom ``autograd.Function``, whose backward is wrong.

An end-to-end check says *which parameter's* gradient disagrees; a wrong
backward anywhere downstream of that parameter corrupts it. Here each module
is checked alone: forward hooks capture every leaf module's input on the
check batch (one forward of the float64 shadow), then each module is checked on
it (:func:`~gradwatch.check.modules._module_check.check_module`: its output against a seeded random
cotangent, by the same sampled two-sided differences as the end-to-end check). One
evaluation costs one module's forward, not the whole network's.

A custom ``torch.autograd.Function`` inside a module is named too: it shows
up as a node of the module's own backward graph (``grad_fn._forward_cls``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
    >>> checks = localize(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), (x, y))
    >>> [(c.name, c.type, c.failed) for c in checks]
    [('0', 'Linear', False), ('1', 'Tanh', False), ('2', 'Linear', False)]
"""

from __future__ import annotations

import contextlib
import fnmatch
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from gradwatch.check.judging.report import suspects
from gradwatch.check.modules._module_check import ModuleCheck, check_module
from gradwatch.check.modules._tensor_trees import copy_opaque, map_tensors
from gradwatch.check.objective.dropout_off import dropout_off
from gradwatch.check.objective.functional_dropout import DropoutRecord
from gradwatch.check.objective.guards import BufferGuard, frozen_batchnorm_stats
from gradwatch.check.objective.padding_idx import padding_rows_constant
from gradwatch.check.objective.precision import ShadowPrecision
from gradwatch.check.objective.rng import Reseeder, preserved_rng
from gradwatch.check.objective.shadow import Shadow, cast_floats, restore_params, snapshot_params
from gradwatch.options import CheckOptions

__all__ = ["ModuleCheck", "check_module", "copy_opaque", "localize", "map_tensors", "name_shared_module",
           "name_straight_through"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


# --------------------------------------------------------------------------- capture


def _select(model: nn.Module, modules: Sequence[Union[str, nn.Module]]) -> Dict[str, nn.Module]:
    """Modules named by ``modules`` (names, glob patterns or module objects), in model order."""
    named = dict(model.named_modules())
    by_id = {id(m): n for n, m in named.items()}
    out: Dict[str, nn.Module] = {}
    for spec in modules:
        if isinstance(spec, nn.Module):
            if id(spec) not in by_id:
                raise ValueError(f"modules: {type(spec).__name__} is not a submodule of {type(model).__name__}")
            out[by_id[id(spec)]] = spec
            continue
        hits = [n for n in named if n == spec or fnmatch.fnmatchcase(n, str(spec))]
        if not hits:
            shown = ", ".join(repr(n) for n in list(named)[1:9])
            raise ValueError(f"modules: {spec!r} matches no submodule; modules are: {shown}, ...")
        for n in hits:
            out[n] = named[n]
    return {n: out[n] for n in named if n in out}


def _owned(module: nn.Module, calls: Dict[str, int], name: str) -> Dict[str, nn.Parameter]:
    """Trainable parameters a module's own forward uses: its direct ones, and those of submodules
    the forward never called as modules (``MultiheadAttention.out_proj`` is used through its weight)."""
    out = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad and p.is_floating_point()}
    for sub_name, sub in module.named_modules():
        if not sub_name or calls.get(f"{name}.{sub_name}" if name else sub_name, 0):
            continue
        # skip submodules below a called submodule: they belong to it
        parts = sub_name.split(".")
        if any(calls.get(".".join(([name] if name else []) + parts[:i]), 0) for i in range(1, len(parts))):
            continue
        for n, p in sub.named_parameters(recurse=False):
            if p.requires_grad and p.is_floating_point():
                out[f"{sub_name}.{n}"] = p
    return out


def _capture(target: nn.Module, loss_fn: LossFn, batch: Any, chosen: Sequence[str]) -> Tuple[Dict[str, Tuple[Any, Any]], Dict[str, int]]:
    """How often each module runs in one forward, and the chosen modules' (args, kwargs) at their
    first call (detached copies)."""
    captured: Dict[str, Tuple[Any, Any]] = {}
    calls: Dict[str, int] = {}
    wanted = set(chosen)

    def hook_for(name: str, keep: bool):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls[name] = calls.get(name, 0) + 1
            if keep and name not in captured:
                # Opaque inputs (a KV cache) are copied as they are now: the rest of the forward mutates them.
                captured[name] = copy_opaque(map_tensors((args, kwargs), lambda t: t.detach().clone()))

        return hook

    handles = []
    for n, m in target.named_modules():
        keep = n in wanted
        handles.append(m.register_forward_pre_hook(hook_for(n, keep), with_kwargs=True))
    try:
        with torch.no_grad():
            loss_fn(target, batch)
    finally:
        for h in handles:
            h.remove()
    return captured, calls


def _innermost(named: Dict[str, nn.Module], calls: Dict[str, int]) -> List[str]:
    """Called modules whose forward called no other module (in model order): the default set.

    ``MultiheadAttention`` is one (it uses ``out_proj`` through its weight, never calls it);
    a ``Sequential`` or a model's top level is not.
    """
    out = []
    for n, m in named.items():
        if not calls.get(n, 0):
            continue
        prefix = f"{n}." if n else ""
        if not any(calls.get(prefix + d, 0) for d, _ in m.named_modules() if d):
            out.append(n)
    return out


def _ancestors(name: str) -> List[str]:
    """``"a.b.c"`` -> ``["a.b", "a", ""]`` (the model itself is ``""``)."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _enclosing_to_check(named: Dict[str, nn.Module], calls: Dict[str, int], done: set, failing: List[str]) -> List[str]:
    """Enclosing modules to check after the leaves, innermost first.

    Modules that hold a failing leaf are left out: they fail with it, whether its failure is
    genuine or not. Every other called module is a candidate even when some leaf failed: a leaf
    can fail alone falsely (a float32 island it cannot resolve in isolation, a forward that needs
    its enclosing module's state), and that must not hide a bug in another layer's own code.
    """
    holding = {a for leaf in failing for a in _ancestors(leaf)}
    order = list(named)
    parents = [n for n in named if calls.get(n, 0) and n not in done and n not in holding]
    parents.sort(key=lambda n: (-(n.count(".") + 1) if n else 0, order.index(n)))
    return parents


# --------------------------------------------------------------------------- public entry point


def localize(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    modules: Optional[Sequence[Union[str, nn.Module]]] = None,
    *,
    enclosing: bool = False,
    **options: Any,
) -> List[ModuleCheck]:
    """Check modules one at a time on their inputs from the check batch.

    Args:
        model: The model.
        loss_fn: ``loss_fn(model, batch) -> scalar`` (run once, to capture module inputs).
        batch: The batch.
        modules: Names (glob patterns allowed) or module objects to check. Default: every
            module the forward calls that calls no other module itself (leaf modules, and
            modules like ``MultiheadAttention`` that use a submodule's weights directly).
        enclosing: With the default ``modules``: check the enclosing modules next, innermost
            first, until one fails (a bug in a module's own code outside its submodules, e.g. a
            wrong custom softmax in an attention module's ``forward``). Modules that hold a failing
            leaf are skipped (they fail with it), but a failing leaf does not end the search: a
            leaf can fail alone falsely, and the layer with the bug is still named.
            ``check_model(..., localize=True)`` sets it: the end-to-end check failed.
        **options: ``coords``, ``directions``, ``eps``, ``bands``, ``fail_at``, ``seed``,
            ``dtype`` (float64 shadow copy by default; None: in place), ``detect_kinks``.

    Returns:
        One :class:`ModuleCheck` per checked module, in model order (failing ones have
        ``failed`` True and a ``summary()`` naming the module, its type and any custom Function).
    """
    options = {k: v for k, v in options.items() if k not in ("tensors", "per_term")}
    opts = CheckOptions(**options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    names = list(_select(model, modules)) if modules is not None else None  # module objects given are the live ones
    dtype = opts.torch_dtype
    if dtype is None:
        target = model
    else:
        shadow = Shadow(model, dtype)
        target = shadow.module
        batch = cast_floats(batch, dtype)
    in_place_params = {n: p for n, p in target.named_parameters()} if opts.dtype is None else {}
    saved = snapshot_params(in_place_params)
    run = _Localizer(target, loss_fn, batch, opts)
    try:
        # On a shadow, casts down stay in its dtype (as in check_model): a norm computing in float32 inside a
        # float64 copy would otherwise fail alone, falsely (gradwatch.check.objective.precision).
        precision = ShadowPrecision(dtype) if dtype is not None else contextlib.nullcontext()
        with preserved_rng(), dropout_off(target) as dropout, padding_rows_constant(target), precision:
            return run.check(names, enclosing, dropout)
    finally:
        run.guard.restore_changed()
        restore_params(in_place_params, saved)


class _Localizer:
    """The modules of ``target`` checked one at a time on their inputs from ``batch`` (:func:`localize`), its buffers
    put back after each capture's forward."""

    def __init__(self, target: nn.Module, loss_fn: LossFn, batch: Any, opts: CheckOptions) -> None:
        self.target, self.loss_fn, self.batch, self.opts = target, loss_fn, batch, opts
        self.named = dict(target.named_modules())
        self.guard = BufferGuard(target)

    def capture(self, chosen: Sequence[str]) -> Tuple[Dict[str, Tuple[Any, Any]], Dict[str, int]]:
        """One seeded forward: how often each module runs, and the ``chosen`` modules' inputs at their first call."""
        Reseeder(self.opts.seed)()
        with frozen_batchnorm_stats(self.target):
            out = _capture(self.target, self.loss_fn, self.batch, chosen)
        self.guard.restore_changed()
        return out

    def run(self, n: str, captured: Dict[str, Tuple[Any, Any]], calls: Dict[str, int]) -> ModuleCheck:
        """Module ``n`` checked alone on its captured inputs, with the parameters its own forward uses."""
        args, kwargs = captured[n]
        module = self.named[n]
        return check_module(n, module, args, kwargs, self.opts, calls.get(n, 1), params=_owned(module, calls, n))

    def check(self, names: Optional[List[str]], enclosing: bool, dropout: DropoutRecord) -> List[ModuleCheck]:
        """``names`` checked (default: the modules that call no other), then, with ``enclosing``, the enclosing
        modules innermost first until one fails."""
        if names is None:
            # One forward to see which modules run and which call others, one to capture inputs.
            _, calls = self.capture([])
            names = _innermost(self.named, calls)
            default = True
        else:
            default = False
        captured, calls = self.capture(names)
        dropout.settle()
        first = [n for n in self.named if n in captured]
        results = [self.run(n, captured, calls) for n in first]
        if default and enclosing:
            parents = _enclosing_to_check(self.named, calls, set(first), [r.name for r in results if r.failed])
            if parents:
                captured, calls = self.capture(parents)
            for n in parents:
                check = self.run(n, captured, calls)
                results.append(check)
                if check.failed:
                    break
        return results


def name_straight_through(report: Any, model: nn.Module, loss_fn: Any, batch: Any, opts: Any) -> bool:
    """Name the module of an undeclared straight-through the objective form only saw through its parameters.

    When :func:`suspects` finds one but no module, the report's modules are checked one at a time
    (:func:`gradwatch.check.modules.localize.localize`, as ``check_model(..., localize=True)`` does) and the failing
    ones go to ``report.localized``. Returns True when it ran (a watch runs it once); what it raised becomes a note.
    """
    modules, explained = suspects(report)
    if not explained or modules:
        return False

    try:
        report.localized = localize(model, loss_fn, batch, enclosing=True, dtype=opts.dtype, seed=opts.seed)
    except Exception as err:  # noqa: BLE001 - naming the module is a courtesy; the check stands without it
        report.notes.append(f"could not name the module of the straight-through: {type(err).__name__}: {err}")
    return True


def name_shared_module(report: Any, model: nn.Module, loss_fn: Any, batch: Any, opts: Any) -> bool:
    """Name the module whose backward several failing tensors share, where the objective form named none.

    A wrong backward in one module fails its own tensors and every tensor upstream of it: the objective form sees
    them all and names no module. Then the report's modules are checked one at a time (:func:`localize`, as
    ``check_model(..., localize=True)`` does) and the failing ones go to ``report.localized``, where a watch's trends
    list the upstream tensors under that module's one alert (:mod:`gradwatch.watch.causes`). Not where fewer than two
    tensors fail, where a module is named already, or where one factor explains every failure (a scale of the whole
    objective: no module has it). Returns True when it ran (a watch runs it once); what it raised becomes a note.

    Example:
        >>> from gradwatch.check.judging.report import CheckReport
        >>> name_shared_module(CheckReport(tensors={}), nn.Linear(2, 1), None, None, None)
        False
    """
    failing = report.failures
    if len(failing) < 2 or report.localized or any(":" in t.name for t in failing) or suspects(report)[1]:
        return False
    if failing[0].ratio is not None and len({t.diagnosis for t in failing}) == 1:
        return False
    began = time.perf_counter()
    try:
        report.localized = localize(model, loss_fn, batch, enclosing=True, dtype=opts.dtype, seed=opts.seed)
    except Exception as err:  # noqa: BLE001 - naming the module is a courtesy; the check stands without it
        report.notes.append(f"could not name the module the failing tensors share: {type(err).__name__}: {err}")
    spent = time.perf_counter() - began
    report.seconds += spent
    report.localize_seconds += spent
    return True
