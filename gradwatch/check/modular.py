"""The module form of the backward part: one module at a time in float64, within the memory budget.

The whole-objective form (:func:`gradwatch.check.run_model_check`) evaluates a float64 copy
of the whole model; for a model that fills the machine that copy does not fit. The module
form checks each module alone, the way Chainer's ``check_backward`` does with ``y_grad``:

1. one forward of the *live* model on the check batch, without grad, with dropout off and
   BatchNorm's running stats untouched (as the backward part evaluates the objective), captures
   the chosen modules' inputs, cast to float64;
2. for each chosen module, a float64 copy of that module alone is made (its parameters and
   buffers cast straight from the live ones; nothing else of the model is copied), and its
   vector-Jacobian product with a seeded random cotangent ``y_grad`` (with respect to its inputs
   and its own parameters) is compared with central differences of ``<y_grad, module(x)>``
   (:func:`gradwatch.localize.check_module`); the copy is dropped before the next module.

Modules are the ones the forward calls that call no other module (leaf modules, and modules
such as ``MultiheadAttention`` that use a submodule's weights directly); they rotate from one
check to the next as ``tensors_per_check`` rotates tensors (``tensors_per_check`` modules per
check; 0: all). A module whose float64 check would not fit in the room the memory budget
leaves is skipped, and the report says so.

What the module form covers and misses: each module's own backward (its input gradient and
its parameters' gradients, custom ``autograd.Function`` s included), one module at a time. It
does not check the loss function, regularizers or coupled weight decay, code between modules
(a wrong custom op in the model's own ``forward`` outside any module), or a module's backward
on later calls than its first; the whole-objective form does, and runs whenever it fits.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch.check.objective import Objective
    >>> from gradwatch.options import CheckOptions
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    >>> batch = (torch.randn(8, 3), torch.randn(8, 1))
    >>> objective = Objective(lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    >>> report = run_module_check(model, objective, batch, CheckOptions())
    >>> report.form, report.ok, sorted(report.tensors)
    ('module', True, ['0.bias', '0.weight', '0:input', '1:input', '2.bias', '2.weight', '2:input'])
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from ..options import CheckOptions
from .isolation import (
    BufferGuard,
    Reseeder,
    dropout_off,
    frozen_batchnorm_stats,
    frozen_power_iteration,
    param_signature,
    preserved_rng,
    suspended_hooks,
)
from .localize import ModuleCheck, _copy_opaque, _innermost, _map, _owned, check_module
from .memory import MODULE_BYTES_PER_ENTRY, float_bytes, mb, module_bytes, release_freed
from .padding import padding_rows_constant
from .precision import ShadowPrecision
from .report import CheckReport


@dataclass
class Unit:
    """A module the module form checks alone.

    Attributes:
        name: Qualified module name (``""`` for the model itself).
        module: The live module.
        params: Full parameter name -> live parameter, of the parameters its own forward uses.
        calls: How often the module ran in one forward.
    """

    name: str
    module: nn.Module
    params: Dict[str, nn.Parameter] = field(default_factory=dict)
    calls: int = 1

    @property
    def label(self) -> str:
        """```name``` (Type)."""
        return f"`{self.name or '<model>'}` ({type(self.module).__name__})"


def _isolated_forward(model: nn.Module, loss_fn: Any, batch: Any, hooks: Dict[str, Any], seed: int) -> float:
    """One forward of the live model without grad, as the backward part evaluates it (dropout off,
    running stats and hooks your code registered untouched), with ``hooks`` (module name -> forward
    pre-hook) attached; returns the loss. Every buffer and plain attribute is put back after."""
    named = dict(model.named_modules())
    handles = []
    modules = list(named.values())
    with preserved_rng(), dropout_off(model), frozen_batchnorm_stats(model), frozen_power_iteration(model, modules), \
            padding_rows_constant(model), suspended_hooks(model, modules):
        guard = BufferGuard(model, attributes=True, modules=modules)
        try:
            for name, hook in hooks.items():
                handles.append(named[name].register_forward_pre_hook(hook, with_kwargs=True))
            Reseeder(seed)()
            with torch.no_grad():
                value = loss_fn(model, batch)
            return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        finally:
            for h in handles:
                h.remove()
            guard.restore_changed()


def module_units(model: nn.Module, loss_fn: Any, batch: Any, seed: int = 0) -> List[Unit]:
    """The modules the module form checks, in model order (one counting forward of the live model).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> [(u.name, sorted(u.params)) for u in module_units(model, lambda m, b: m(b).sum(), torch.ones(1, 2))]
        [('0', ['0.bias', '0.weight']), ('1', [])]
    """
    calls: Dict[str, int] = {}

    def counter(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls[name] = calls.get(name, 0) + 1

        return hook

    named = dict(model.named_modules())
    _isolated_forward(model, loss_fn, batch, {n: counter(n) for n in named}, seed)
    units = []
    for n in _innermost(named, calls):
        own = _owned(named[n], calls, n)
        prefix = f"{n}." if n else ""
        units.append(Unit(n, named[n], {prefix + k: p for k, p in own.items()}, calls.get(n, 1)))
    return units


def float64_copy(module: nn.Module, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A copy of ``module`` alone with its floating parameters and buffers in ``dtype``, cast straight
    from the live ones (no intermediate copy in the live dtype); the copy never receives ``.grad``.

    Example:
        >>> float64_copy(nn.Linear(2, 1)).weight.dtype
        torch.float64
    """
    memo: Dict[int, Any] = {}
    for p in module.parameters():
        if id(p) not in memo:
            value = p.detach().to(dtype) if p.is_floating_point() else p.detach().clone()
            memo[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
    for b in module.buffers():
        if id(b) not in memo:
            memo[id(b)] = b.detach().to(dtype) if b.is_floating_point() else b.detach().clone()
    try:
        return copy.deepcopy(module, memo)
    except Exception as err:  # noqa: BLE001 - say which module and why
        raise TypeError(f"cannot copy module {type(module).__name__} alone in {dtype} (copy.deepcopy failed: {err})") from err


def capture_inputs(model: nn.Module, loss_fn: Any, batch: Any, units: Sequence[Unit], seed: int,
                   dtype: torch.dtype = torch.float64) -> Tuple[Dict[str, Tuple[Any, Any]], Dict[str, int], float]:
    """The chosen modules' inputs at their first call in one forward of the live model, as ``dtype``
    copies; the float bytes of each one's first output; and the loss of that forward."""
    captured: Dict[str, Tuple[Any, Any]] = {}
    outputs: Dict[str, int] = {}

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype) if t.is_floating_point() else t.detach().clone()

    def keeper(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in captured:
                captured[name] = _copy_opaque(_map((args, kwargs), cast))
                handles.append(module.register_forward_hook(size_of(name)))

        return hook

    def size_of(name: str):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            outputs.setdefault(name, float_bytes(out))

        return hook

    handles: List[Any] = []
    try:
        loss = _isolated_forward(model, loss_fn, batch, {u.name: keeper(u.name) for u in units}, seed)
    finally:
        for h in handles:
            h.remove()
    return captured, outputs, loss


def run_module_check(
    model: nn.Module,
    objective: Any,
    batch: Any,
    opts: CheckOptions,
    *,
    units: Optional[Sequence[Unit]] = None,
    room: Optional[int] = None,
) -> CheckReport:
    """The module form of the backward part (see the module docstring).

    Args:
        model: The live model (never changed: its parameters, buffers and RNG streams are left as they were).
        objective: An :class:`~gradwatch.objective.Objective`; its ``loss_fn`` runs once, to capture inputs.
        batch: The check batch.
        opts: Check options (``coords``, ``directions``, ``eps``, ``bands``, ``fail_at``, ``seed``, ``detect_kinks``).
        units: The modules to check (default: every unit of :func:`module_units`).
        room: Bytes a module's check may hold (None: no bound); a module whose estimate exceeds it is skipped.

    Returns:
        A :class:`CheckReport` with ``form == "module"``: parameters under their names, a module's
        input gradient under ``"<module>:input"``, and one :class:`~gradwatch.localize.ModuleCheck`
        per module in ``localized``.
    """
    start = time.perf_counter()
    loss_fn = objective.loss_fn
    if units is None:
        units = module_units(model, loss_fn, batch, opts.seed)
    report = CheckReport(tensors={}, fail_at=opts.fail_verdict, seed=opts.seed, dtype="float64")
    report.form = "module"
    dtype = opts.torch_dtype or torch.float64
    captured, outputs, loss = capture_inputs(model, loss_fn, batch, units, opts.seed, dtype)
    report.objective = loss
    report.terms = {"loss": loss}
    skipped = []
    estimate = 0
    for unit in units:
        if unit.name not in captured:
            continue
        args, kwargs = captured.pop(unit.name)
        need = module_bytes(unit.params.values(), (args, kwargs), outputs.get(unit.name, 0))
        block = None
        if room is not None and need > room:
            block = _row_block(unit, (args, kwargs), outputs.get(unit.name, 0), room // 2, opts.seed)
            if block is None:
                skipped.append(f"{unit.label} needs about {mb(need)}")
                continue
            need = block[2]
            report.notes.append(f"module form: {unit.label} checked on output rows {block[0]}:{block[1]} of "
                                f"{unit.module.out_features} (its whole float64 check needs about "
                                f"{mb(module_bytes(unit.params.values(), (args, kwargs), outputs.get(unit.name, 0)))}; "
                                "the rows rotate from check to check)")
        estimate = max(estimate, need)
        result = _check_unit(unit, args, kwargs, opts, dtype, rows=block[:2] if block else None)
        del args, kwargs
        if room is not None and unit.params:
            release_freed()  # what this module's check freed, before the next one allocates
        report.localized.append(result)
        report.evaluations += result.evaluations
        for key, tc in result.tensors.items():
            if key.startswith("input"):
                name = f"{unit.name or '<model>'}:{key}"
            else:
                name = f"{unit.name}.{key}" if unit.name else key
            tc.name = name
            report.tensors[name] = tc
        if result.inconclusive:
            report.notes.append(f"module form: {result.label} not checked: {result.inconclusive}")
    if skipped:
        report.notes.append(
            f"module form: {len(skipped)} module(s) not checked, over the room the memory budget leaves "
            f"({mb(room)}): {'; '.join(skipped[:4])}{'; ...' if len(skipped) > 4 else ''}")
    report.memory = {"estimate_bytes": estimate}
    report.seconds = time.perf_counter() - start
    return report


def _row_block(unit: Unit, inputs: Any, output_bytes: int, room: int, seed: int) -> Optional[Tuple[int, int, int]]:
    """For a plain ``nn.Linear`` too big for the room: ``(first row, end row, bytes)`` of the largest block of
    output rows that fits (rows ``i`` of the output depend on rows ``i`` of the weight and bias alone), at an
    offset that moves with the check's seed; None for any other module, or when not one row fits."""
    module = unit.module
    if type(module) is not nn.Linear or module._forward_pre_hooks or module._forward_hooks:
        return None
    rows = module.out_features
    per_row = (module.in_features + (1 if module.bias is not None else 0)) * MODULE_BYTES_PER_ENTRY \
        + 4 * output_bytes // max(rows, 1)
    fixed = 3 * float_bytes(inputs)
    k = min(rows, (room - fixed) // per_row) if room > fixed else 0
    if k < 1:
        return None
    first = (seed * k) % rows
    first = min(first, rows - k)
    return first, first + k, fixed + k * per_row


def _rows_copy(module: nn.Linear, first: int, end: int, dtype: torch.dtype) -> nn.Module:
    """Rows ``first:end`` of a ``nn.Linear`` as a ``nn.Linear`` of their own in ``dtype``."""
    block = nn.Linear(module.in_features, end - first, bias=module.bias is not None, device="meta")
    block.weight = nn.Parameter(module.weight.detach()[first:end].to(dtype), requires_grad=module.weight.requires_grad)
    if module.bias is not None:
        block.bias = nn.Parameter(module.bias.detach()[first:end].to(dtype), requires_grad=module.bias.requires_grad)
    block.train(module.training)
    return block


def _check_unit(unit: Unit, args: Any, kwargs: Any, opts: CheckOptions, dtype: torch.dtype,
                rows: Optional[Tuple[int, int]] = None) -> ModuleCheck:
    """One module alone: a ``dtype`` copy of it (or of its output ``rows``), checked on its captured inputs, then dropped."""
    try:
        local = float64_copy(unit.module, dtype) if rows is None else _rows_copy(cast(nn.Linear, unit.module), rows[0], rows[1], dtype)
    except TypeError as err:
        return ModuleCheck(name=unit.name, type=type(unit.module).__name__, calls=unit.calls, inconclusive=str(err))
    prefix = f"{unit.name}." if unit.name else ""
    named = dict(local.named_parameters())
    params = {k[len(prefix):]: named[k[len(prefix):]] for k in unit.params if k[len(prefix):] in named}
    modules = list(local.modules())
    with preserved_rng(), dropout_off(local), frozen_power_iteration(local, modules), suspended_hooks(local, modules), \
            ShadowPrecision(dtype):
        result = check_module(unit.name, local, args, kwargs, opts, unit.calls, params=params, restore=False)
    result.type = type(unit.module).__name__ + ("" if rows is None else f" rows {rows[0]}:{rows[1]}")
    return result


def units_signature(model: nn.Module) -> Tuple:
    """When this changes, the units must be found again: parameters and buffers (names, shapes,
    devices), and every module and parameter by identity (a replaced layer of the same shape too)."""
    return (param_signature(model), tuple((n, id(m)) for n, m in model.named_modules()),
            tuple(id(p) for p in model.parameters()))
