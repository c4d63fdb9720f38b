"""The derivatives an objective takes inside: each module's double backward, on inputs captured from the objective.

An objective that differentiates through the model (a gradient penalty, a physics-informed residual,
double backprop) trains on the model's *second* derivatives. A wrong double backward (a custom
``autograd.Function`` whose backward is right and whose backward's backward is not) changes the
objective's value; its gradient is then consistent with the wrong value, and the objective's own
gradient check may not see it (the physics-informed case). So each module is checked on its own, as
Chainer's ``check_double_backward`` does: a float64 copy of the module, on the inputs it received
in one evaluation of the objective, its first-order vector-Jacobian product (with respect to its
inputs and parameters, ``create_graph=True``) checked against central differences with random
``y_grad``, ``x_grad_grad`` and ``params_grad_grad``. Each result is one entry of the check's
report, named ``"<module>:double_backward"`` (the worst of its inputs, ``y_grad`` and parameters).

The modules are the leaves of the module tree that the objective calls with floating positional
inputs (a module's own code between its children is not checked second-order yet).

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    >>> def loss(m, x):
    ...     x = x.requires_grad_(True)
    ...     (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    ...     return g.pow(2).sum()
    >>> checks = check_inner_derivatives(model, loss, torch.randn(5, 3), names=["1"])
    >>> checks["1:double_backward"].verdict.value
    'excellent'
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from gradwatch.bands import Verdict
from gradwatch.check.higher_order.double_backward import check_double_backward
from gradwatch.check.judging.report import CheckReport, TensorCheck
from gradwatch.check.objective.rng import preserved_rng, seed_everything
from gradwatch.errors import GradientCheckError

#: Suffix of the report entries of this part.
SUFFIX = ":double_backward"
#: Finite-difference step on the float64 copy (truncation ~eps**2 = 1e-8 relative, rounding ~1e-16 / eps).
EPS = 1e-4
#: Lines per array: every element up to 16, else 8 sampled coordinates and 8 random blocks (a watch's budget).
LIMITS = (16, 8, 8)


def leaf_modules(model: nn.Module) -> List[str]:
    """Names of the modules with no children (the root itself when it has none), in model order.

    Example:
        >>> leaf_modules(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Tanh())))
        ['0', '1.0']
    """
    return [n for n, m in model.named_modules() if not any(True for _ in m.children())]


def _capture_hook(name: str, seen: Dict[str, Tuple[torch.Tensor, ...]], refused: set) -> Callable:
    """A forward pre-hook keeping the first positional inputs of a module (detached copies).

    A module called with a non-floating tensor, a tensor keyword argument or a non-tensor argument is left
    out (its inputs are not a point to differentiate at).
    """
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if name in seen or name in refused:
            return
        if (not args or kwargs and any(isinstance(v, torch.Tensor) for v in kwargs.values())
                or not all(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args)):
            refused.add(name)
            return
        seen[name] = tuple(a.detach().clone() for a in args)
    return hook


def _first_tensors(out: Any) -> Tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return tuple(o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point())
    return ()


def check_module_double_backward(name: str, module: nn.Module, inputs: Sequence[torch.Tensor],
                                 seed: int = 0) -> Optional[TensorCheck]:
    """The double backward of ``module`` at ``inputs``, on a float64 copy; the worst entry, renamed
    ``"<name>:double_backward"`` (None when the module returns no floating tensor)."""
    unit = copy.deepcopy(module).to(torch.float64)
    xs = tuple(x.detach().to(torch.float64) for x in inputs)
    g = torch.Generator().manual_seed(seed)
    with preserved_rng():
        seed_everything(seed)
        with torch.no_grad():
            outs = _first_tensors(unit(*xs))
    if not outs:
        return None
    gys = tuple(torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs)
    ggx = tuple(torch.randn(x.shape, generator=g, dtype=torch.float64) for x in xs)
    params = [p for p in unit.parameters() if p.requires_grad]
    ggp = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]

    def func(*args: torch.Tensor) -> Any:
        out = _first_tensors(unit(*args))
        return out if len(out) > 1 else out[0]

    report: Optional[CheckReport]
    try:
        report = check_double_backward(func, xs, gys, ggx, params=params, params_grad_grad=ggp, eps=EPS,
                                       limits=LIMITS)
    except GradientCheckError as err:
        report = cast(Optional[CheckReport], err.report)
    if report is None or not report.tensors:
        return None
    worst = max(report.tensors.values(), key=lambda t: -1.0 if t.judged_rel_diff is None else t.judged_rel_diff)
    return dataclasses.replace(worst, name=name + SUFFIX)


def capture_inner_inputs(model: nn.Module, loss: Callable[[nn.Module, Any], Any], batch: Any, names: Sequence[str],
                         seed: int = 0) -> Dict[str, Tuple[torch.Tensor, ...]]:
    """The positional inputs ``loss(model, batch)`` gives each of the named modules at its first call (detached
    copies; a module called with other than floating tensors is left out): one forward of the live model as the
    backward part runs it (dropout off, buffers put back), with autograd on (the objective differentiates).

    Example:
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        >>> [x.shape for x in capture_inner_inputs(model, lambda m, b: m(b).sum(), torch.ones(2, 3), ["1"])["1"]]
        [torch.Size([2, 4])]
    """
    from gradwatch.plan.units import isolated_forward  # the planner's forward, as the module form captures its inputs

    seen: Dict[str, Tuple[torch.Tensor, ...]] = {}
    refused: set = set()

    def with_grad(m: nn.Module, b: Any) -> Any:
        with torch.enable_grad():
            value = loss(m, b)
        return value.detach() if isinstance(value, torch.Tensor) else value

    modules = dict(model.named_modules())
    isolated_forward(model, with_grad, batch, seed, pre={n: _capture_hook(n, seen, refused) for n in names if n in modules})
    return seen


def check_inner_derivatives(model: nn.Module, loss: Callable[[nn.Module, Any], Any], batch: Any,
                            names: Optional[Sequence[str]] = None, seed: int = 0,
                            fail_at: Verdict = Verdict.SUSPICIOUS) -> Dict[str, TensorCheck]:
    """Each named leaf module's double backward at the inputs ``loss(model, batch)`` gives it.

    Args:
        model: The model (left as it is: one forward as the backward part runs it, dropout off, buffers
            put back; each module is then checked on a float64 copy).
        loss: The objective, ``loss(model, batch)`` (run with autograd on: it differentiates inside).
        batch: Its batch.
        names: Module names (default: every leaf module).
        seed: Seed of the random ``y_grad`` / ``x_grad_grad`` / ``params_grad_grad``.
        fail_at: The verdict at which an entry counts as failed.

    Returns:
        ``"<module>:double_backward"`` -> :class:`TensorCheck`, in model order.
    """
    names = leaf_modules(model) if names is None else list(names)
    seen = capture_inner_inputs(model, loss, batch, names, seed)
    modules = dict(model.named_modules())
    out: Dict[str, TensorCheck] = {}
    for i, name in enumerate(n for n in names if n in seen):
        check = check_module_double_backward(name, modules[name], seen[name], seed + i)
        if check is not None:
            check.failed = check.verdict is not None and check.verdict.is_failure(fail_at)
            out[check.name] = check
    return out
