"""Units: the pieces of a model the module form checks one at a time, chosen so that every op is inside one.

One counting forward of the live model (no grad, dropout off, nothing changed) shows which modules
run and which module called which. Each module that ran gives one unit:

- a module whose forward called no other module (a leaf, or ``MultiheadAttention``, which uses
  ``out_proj`` through its weight) is checked whole: its input gradient and its own parameters
  (none of either, as diffusers' ``Timesteps`` on integer timesteps: nothing to check, no unit);
- a module whose forward called others is checked for its **own code**: the ops of its ``forward``
  between the calls (hand-written attention, residual adds, a loss computed inside ``forward``),
  as a function of its inputs, its own parameters and the outputs of the modules it called. Those
  modules are replaced by stubs that hand back the outputs they gave in the live forward (see
  :mod:`gradwatch.check.modules.own_code`) and are checked as units of their own.

So every op the forward executes lies in the unit of the innermost module that ran it. Code of a
``nn.Sequential`` or ``nn.ModuleList`` (torch's own, nothing but calls) is not a unit.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    >>> [(u.name, u.kind, sorted(u.params)) for u in plan_units(model, lambda m, b: m(b).sum(), torch.ones(1, 2))]
    [('<loss_fn>', 'loss_fn', []), ('0', 'module', ['0.bias', '0.weight']), ('1', 'module', [])]
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from gradwatch.check.objective.dropout_off import dropout_off
from gradwatch.check.objective.guards import BufferGuard, frozen_batchnorm_stats, frozen_power_iteration, suspended_hooks
from gradwatch.check.objective.padding_idx import padding_rows_constant
from gradwatch.check.objective.rng import Reseeder, preserved_rng
from gradwatch.check.probes.experts import expert_count
from gradwatch.plan.memory import MODULE_BYTES_PER_ENTRY, numel_of
from gradwatch.trees import tensor_leaves

#: Module classes whose own code is torch's plain calling of children (no op of their own to check).
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
#: The unit of ``loss_fn``'s own code: what it computes from the model's outputs and the batch.
LOSS_FN = "<loss_fn>"


@dataclass
class Unit:
    """A piece of the model the module form checks alone.

    Attributes:
        name: Qualified module name (``""`` for the model itself).
        module: The live module.
        params: Full parameter name -> live parameter, of the parameters its own code uses.
        calls: How often the module ran in one forward.
        kind: ``"module"`` (checked whole: it called no other module), ``"own"`` (its own code,
            with the modules it called replaced by stubs) or ``"loss_fn"`` (``loss_fn``'s own code, the
            model replaced by a stub; named :data:`LOSS_FN`).
        stubbed: For ``"own"``: the modules its first call called, in call order (full names).
        saved_ratio: What its own ops save for their backward per byte of its input, as counted on the check's
            batch (:mod:`gradwatch.check.modules.activations`; 0: not counted): an attention's scores over a
            sequence, which its inputs and outputs do not tell.

    Example:
        >>> Unit("fc", nn.Linear(2, 2)).label
        '`fc` (Linear)'
    """

    name: str
    module: nn.Module
    params: Dict[str, nn.Parameter] = field(default_factory=dict)
    calls: int = 1
    kind: str = "module"
    stubbed: Tuple[str, ...] = ()
    saved_ratio: float = 0.0

    @property
    def label(self) -> str:
        """```name``` (Type), with "own code of" for a composite module."""
        if self.kind == "loss_fn":
            return "own code of `loss_fn`"
        text = f"`{self.name or '<model>'}` ({type(self.module).__name__})"
        return f"own code of {text}" if self.kind == "own" else text


@dataclass
class Calls:
    """What one forward ran: calls per module, and for each module the modules its first call called.

    Example:
        >>> Calls().called("x")
        []
    """

    counts: Dict[str, int] = field(default_factory=dict)
    children: Dict[str, List[str]] = field(default_factory=dict)
    #: Modules whose first call was given no floating tensor (integer timesteps, token ids).
    inputless: Set[str] = field(default_factory=set)

    def called(self, name: str) -> List[str]:
        """Modules (full names) the first call of ``name`` called directly, in call order, once each."""
        return self.children.get(name, [])


@contextlib.contextmanager
def isolated(model: nn.Module, modules: Optional[List[nn.Module]] = None) -> Iterator[Any]:
    """The live model as the backward part evaluates it: dropout off, BatchNorm's running stats, the power
    iteration of ``spectral_norm``, ``padding_idx`` rows and hooks your code registered untouched; every
    generator, buffer and plain attribute put back after. Yields what was switched off and what randomness stays
    on (:class:`~gradwatch.check.objective.functional_dropout.DropoutRecord`).

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Dropout(0.5))
        >>> with isolated(m):
        ...     _ = m(torch.randn(4, 2))
        >>> int(m[1].num_batches_tracked)
        0
    """
    modules = list(model.modules()) if modules is None else modules
    with preserved_rng(), dropout_off(model) as record, frozen_batchnorm_stats(model), \
            frozen_power_iteration(model, modules), padding_rows_constant(model), suspended_hooks(model, modules):
        guard = BufferGuard(model, attributes=True, modules=modules)
        try:
            yield record
        finally:
            guard.restore_changed()


class Enough(Exception):
    """Raised by a hook of :func:`isolated_forward` once the forward gave all it was run for: it stops there."""


def isolated_forward(model: nn.Module, loss_fn: Any, batch: Any, seed: int,
                     pre: Optional[Dict[str, Callable]] = None, post: Optional[Dict[str, Callable]] = None,
                     randomness: Optional[List[Any]] = None) -> Optional[float]:
    """One forward of the live model without grad, as the backward part evaluates it (:func:`isolated`), with
    forward pre-hooks ``pre`` and forward hooks ``post`` (module name -> hook) attached; returns the loss (None
    where a hook stopped the forward with :class:`Enough`). ``randomness`` gets :func:`isolated`'s record."""
    named = dict(model.named_modules())
    handles = []
    with isolated(model, list(named.values())) as record:
        if randomness is not None:
            randomness.append(record)
        try:
            for name, hook in (pre or {}).items():
                handles.append(named[name].register_forward_pre_hook(hook, with_kwargs=True))
            for name, hook in (post or {}).items():
                handles.append(named[name].register_forward_hook(hook, always_call=True))
            Reseeder(seed)()
            with torch.no_grad():
                try:
                    value = loss_fn(model, batch)
                except Enough:
                    return None
            return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        finally:
            for h in handles:
                h.remove()


def count_calls(model: nn.Module, loss_fn: Any, batch: Any, seed: int = 0) -> Calls:
    """One counting forward: how often each module ran and which modules each one's first call called.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
        >>> calls = count_calls(model, lambda m, b: m(b).sum(), torch.ones(1, 2))
        >>> calls.counts, calls.called("")
        ({'': 1, '0': 1, '1': 1}, ['0', '1'])
    """
    calls = Calls()
    stack: List[Tuple[str, bool]] = []  # (name, is this its first call)

    def enter(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            first = name not in calls.counts
            calls.counts[name] = calls.counts.get(name, 0) + 1
            if first and not any(t.is_floating_point() and t.numel() for t in tensor_leaves((args, kwargs))):
                calls.inputless.add(name)
            if stack and stack[-1][1]:
                siblings = calls.children.setdefault(stack[-1][0], [])
                if name not in siblings:
                    siblings.append(name)
            stack.append((name, first))

        return hook

    def leave(name: str):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            while stack and stack[-1][0] != name:  # a forward that raised inside left its frame behind
                stack.pop()
            if stack:
                stack.pop()

        return hook

    named = dict(model.named_modules())
    isolated_forward(model, loss_fn, batch, seed, pre={n: enter(n) for n in named}, post={n: leave(n) for n in named})
    return calls


def owned(module: nn.Module, name: str, calls: Calls) -> Dict[str, nn.Parameter]:
    """Trainable floating parameters a module's own code uses, by full name: its direct ones, and
    those of submodules that no call ran (``MultiheadAttention.out_proj`` is used through its weight)."""
    prefix = f"{name}." if name else ""
    out = {prefix + n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad and p.is_floating_point()}
    for sub_name, sub in module.named_modules():
        if not sub_name or calls.counts.get(prefix + sub_name, 0):
            continue
        parts = sub_name.split(".")
        if any(calls.counts.get(prefix + ".".join(parts[:i]), 0) for i in range(1, len(parts))):
            continue  # below a submodule that ran: its parameters belong to that one
        for n, p in sub.named_parameters(recurse=False):
            if p.requires_grad and p.is_floating_point():
                out[f"{prefix}{sub_name}.{n}"] = p
    return out


def units_from_calls(model: nn.Module, calls: Calls, own_code: bool = True) -> List[Unit]:
    """The units of one forward, in model order (see the module docstring), ``loss_fn``'s own code first.

    ``own_code=False``: the modules that called no other module only (the module form before own-code units).
    """
    out = []
    if own_code and calls.counts.get("", 0):
        out.append(Unit(LOSS_FN, model, {}, calls.counts[""], kind="loss_fn", stubbed=("",)))
    for n, m in model.named_modules():
        count = calls.counts.get(n, 0)
        if not count:
            continue
        children = calls.called(n)
        if not children:
            params = owned(m, n, calls)
            if params or n not in calls.inputless:  # else no gradient to check: no input's, no parameter's
                out.append(Unit(n, m, params, count))
        elif own_code and not isinstance(m, CONTAINERS):
            out.append(Unit(n, m, owned(m, n, calls), count, kind="own", stubbed=tuple(children)))
    return out


def plan_units(model: nn.Module, loss_fn: Any, batch: Any, seed: int = 0, own_code: bool = True) -> List[Unit]:
    """The units of ``model`` on ``batch`` (one counting forward of the live model).

    Example:
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = nn.Linear(2, 2)
        ...     def forward(self, x):
        ...         return x + torch.tanh(self.fc(x))  # the residual and the tanh are the block's own code
        >>> [(u.name, u.kind, u.stubbed) for u in plan_units(Block(), lambda m, b: m(b).sum(), torch.ones(1, 2))]
        [('<loss_fn>', 'loss_fn', ('',)), ('', 'own', ('fc',)), ('fc', 'module', ())]
    """
    return units_from_calls(model, count_calls(model, loss_fn, batch, seed), own_code)


def sliceable_rows(module: nn.Module) -> Optional[int]:
    """Rows a module's check can be sliced by: a Linear's output rows, an Embedding's token rows (their
    subclasses too, whose forward uses ``self.weight``); None for any other module.

    Example:
        >>> sliceable_rows(nn.Linear(3, 700)), sliceable_rows(nn.Embedding(50, 2)), sliceable_rows(nn.Tanh())
        (700, 50, None)
    """
    if isinstance(module, nn.Linear):
        return int(module.out_features)
    if isinstance(module, nn.Embedding) and module.max_norm is None:
        return int(module.num_embeddings)
    return None


def expert_rows(unit: Unit) -> Optional[int]:
    """Experts a unit's check can be cut by: E where the parameters its own code uses include fused expert tensors
    (:func:`~gradwatch.check.probes.experts.expert_count`), all of E experts; None for any other unit. A block of
    experts is checked in place, inside a copy of the whole unit (:mod:`gradwatch.check.modules.expert_blocks`).

    Example:
        >>> class Experts(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.gate_up_proj = nn.Parameter(torch.zeros(8, 6, 4))
        >>> m = Experts()
        >>> expert_rows(Unit("experts", m, {"experts.gate_up_proj": m.gate_up_proj})), expert_rows(Unit("fc", nn.Linear(2, 2)))
        (8, None)
    """
    if unit.kind not in ("module", "own"):
        return None
    counts = {expert_count(n, tuple(p.shape)) for n, p in unit.params.items()} - {None}
    return counts.pop() if len(counts) == 1 else None


def expert_bytes(unit: Unit) -> Tuple[int, int]:
    """``(fixed bytes, bytes per expert)`` a block of a unit's experts holds for its parameters whatever the batch: the
    whole unit in float64 (8 bytes an entry: the experts outside the block are constants there) and the rest of its
    parameters checked (:data:`~gradwatch.plan.memory.MODULE_BYTES_PER_ENTRY` an entry); per expert its slice of the
    fused tensors checked (the same).

    Example:
        >>> class Experts(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.zeros(8, 6, 4))
        >>> m = Experts()
        >>> expert_bytes(Unit("experts", m, {"experts.w": m.w}))
        (1536, 1152)
    """
    count = expert_rows(unit) or 1
    fused = sum(int(p.numel()) for n, p in unit.params.items() if expert_count(n, tuple(p.shape)))
    other = sum(int(p.numel()) for n, p in unit.params.items() if not expert_count(n, tuple(p.shape)))
    return fused * 8 + other * MODULE_BYTES_PER_ENTRY, fused * MODULE_BYTES_PER_ENTRY // count


def in_place_param(unit: Unit) -> Optional[str]:
    """The parameter a unit's own code is cut by when it is too big to check whole: its largest plain tensor of two or
    more dimensions (a head's weight the code reads itself, as TRL's fused LM head reads ``lm_head.weight``), checked
    a block of its rows at a time inside a copy of the whole unit (:mod:`gradwatch.check.modules.expert_blocks`);
    None for any unit but own code, and for own code holding fused experts (cut by experts) or no such tensor.

    Example:
        >>> class Head(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body, self.out = nn.Linear(2, 4), nn.Linear(4, 50)
        ...     def forward(self, x):
        ...         return torch.nn.functional.linear(self.body(x), self.out.weight)
        >>> m = Head()
        >>> in_place_param(Unit("", m, {"out.weight": m.out.weight}, kind="own"))
        'out.weight'
    """
    if unit.kind != "own" or expert_rows(unit):
        return None
    big = [(int(p.numel()), n) for n, p in unit.params.items()
           if type(p) in (torch.Tensor, nn.Parameter) and p.dim() >= 2 and int(p.shape[0]) >= 2]
    return max(big)[1] if big else None


def in_place_bytes(unit: Unit) -> Tuple[int, int]:
    """``(fixed bytes, bytes per row)`` a block of the rows of a unit's :func:`in_place_param` holds for its parameters
    whatever the batch: that tensor whole in float64 twice (the copy the code reads, and the whole gradient the code's
    backward makes of it before the block's is taken out), the unit's other parameters checked
    (:data:`~gradwatch.plan.memory.MODULE_BYTES_PER_ENTRY` an entry); per row its slice of the tensor checked (the same).

    Example:
        >>> m = nn.Linear(4, 50)
        >>> in_place_bytes(Unit("", m, {"weight": m.weight, "bias": m.bias}, kind="own"))
        (5600, 192)
    """
    name = in_place_param(unit)
    if name is None:
        return numel_of(unit.params.values()) * MODULE_BYTES_PER_ENTRY, 0
    big = unit.params[name]
    other = numel_of(p for n, p in unit.params.items() if n != name)
    return int(big.numel()) * 16 + other * MODULE_BYTES_PER_ENTRY, int(big.numel()) // int(big.shape[0]) * MODULE_BYTES_PER_ENTRY


def block_rows(unit: Unit) -> Optional[int]:
    """Rows a unit's blocks are checked in place by: its experts (:func:`expert_rows`), or the rows of its own code's
    :func:`in_place_param`; None for a unit that has neither.

    Example:
        >>> m = nn.Linear(4, 50)
        >>> block_rows(Unit("", m, {"weight": m.weight}, kind="own")), block_rows(Unit("fc", m, {"weight": m.weight}))
        (50, None)
    """
    name = in_place_param(unit)
    return expert_rows(unit) or (int(unit.params[name].shape[0]) if name is not None else None)


def block_bytes(unit: Unit) -> Tuple[int, int]:
    """``(fixed bytes, bytes per row)`` of a block checked in place (:func:`block_rows`): :func:`expert_bytes` for
    experts, :func:`in_place_bytes` for the rows of an own code's big parameter."""
    return expert_bytes(unit) if expert_rows(unit) else in_place_bytes(unit)


def faithful_rows(module: nn.Module) -> bool:
    """Whether a block of a module's rows, sliced out, computes what the module computes: an ``nn.Linear`` or
    ``nn.Embedding`` whose forward is the library's own (a subclass that only adds attributes too). A subclass
    with its own forward (quantized, fused, adapter linears; a kernel that treats some rows apart) would run
    another computation on a slice: its rows are checked in place, at its full size.

    Example:
        >>> class Fused(nn.Linear):
        ...     def forward(self, x): return super().forward(x)
        >>> faithful_rows(nn.Linear(2, 3)), faithful_rows(Fused(2, 3)), faithful_rows(nn.Embedding(5, 2))
        (True, False, True)
    """
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward
    if isinstance(module, nn.Embedding):
        return type(module).forward is nn.Embedding.forward and module.max_norm is None
    return False


def known_first(unit: Unit) -> bool:
    """Whether a unit's output is known from its kind alone, before it runs: a plain Linear or Embedding module unit
    (:func:`faithful_rows`). The answer depends on nothing a rank holds, so a forward of several ranks may stop there.

    Example:
        >>> known_first(Unit("h", nn.Linear(8, 50))), known_first(Unit("t", nn.Tanh()))
        (True, False)
    """
    return unit.kind == "module" and faithful_rows(unit.module)


def output_shape(unit: Unit, args: Any, kwargs: Any) -> Optional[Tuple[int, ...]]:
    """The output shape of a plain ``nn.Linear`` or ``nn.Embedding`` unit (:func:`faithful_rows`) called on one tensor,
    known before it runs; None for any other unit or call.

    Example:
        >>> output_shape(Unit("h", nn.Linear(8, 50)), (torch.ones(4, 3, 8),), {})
        (4, 3, 50)
        >>> output_shape(Unit("e", nn.Embedding(9, 5)), (torch.ones(2, 7, dtype=torch.long),), {})
        (2, 7, 5)
        >>> output_shape(Unit("t", nn.Tanh()), (torch.ones(2),), {}) is None
        True
    """
    module = unit.module
    if not known_first(unit) or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if isinstance(module, nn.Linear) and x.dim() >= 1 and x.shape[-1] == module.in_features:
        return (*x.shape[:-1], int(module.out_features))
    if isinstance(module, nn.Embedding) and not x.is_floating_point():
        return (*x.shape, int(module.embedding_dim))
    return None


def relative(unit: Unit, name: str) -> Optional[str]:
    """``name`` relative to ``unit``'s module, or None when it is not one of its submodules."""
    if not unit.name or unit.kind == "loss_fn":
        return name
    return name[len(unit.name) + 1:] if name.startswith(unit.name + ".") else None


