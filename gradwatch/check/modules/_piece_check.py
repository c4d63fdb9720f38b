"""One piece of the module form checked alone: its ``dtype`` copy (a unit's own code with stubs, a block of its rows
or experts, or the unit whole), the check of that copy on the unit's captured inputs, and its result filed in the
report under the model's names.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch.options import CheckOptions
    >>> from gradwatch.plan.units import Unit
    >>> lin = nn.Linear(3, 2)
    >>> unit = Unit("head", lin, {f"head.{k}": p for k, p in lin.named_parameters()})
    >>> x = torch.randn(4, 3, dtype=torch.float64)
    >>> result, probed = check_piece(unit, (0, 1), (x,), {}, {}, CheckOptions(), torch.float64, {})
    >>> result.type, sorted(result.tensors), probed
    ('Linear rows 0:1', ['bias', 'input', 'weight'], [('head.weight', (0, 1)), ('head.bias', (0, 1))])
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple, Union

import torch
from torch import nn

from gradwatch.check.judging.report import OVER_ROOM, CheckReport, worse
from gradwatch.check.modules._module_check import ModuleCheck, check_module
from gradwatch.check.modules.capture import Captured
from gradwatch.check.modules.expert_blocks import expert_block
from gradwatch.check.modules.own_code import LossCode, ModelStub, OwnCode, RowsInPlace, embedding_rows_copy, own_code_copy, rows_copy
from gradwatch.check.modules.own_rows import row_blocks
from gradwatch.check.modules.piece_cuts import float_entries, in_place_weight_bytes, piece_params_bytes, rows_cost
from gradwatch.check.modules.replay_failure import stateless, uncopyable, whole_instead, whole_params, why_not_alone
from gradwatch.check.modules.row_groups import NO_TOKEN, first_ids, param_of
from gradwatch.check.objective.dropout_off import dropout_off
from gradwatch.check.objective.guards import frozen_power_iteration, suspended_hooks
from gradwatch.check.objective.padding_idx import padding_rows_constant
from gradwatch.check.objective.precision import ShadowPrecision
from gradwatch.check.objective.rng import preserved_rng
from gradwatch.check.probes.experts import expert_count, reached_rows
from gradwatch.options import CheckOptions
from gradwatch.plan.memory import (
    LOSS_CODE_BYTES_PER_ENTRY,
    MODULE_BYTES_PER_ENTRY,
    MODULE_SAVED_COPIES,
    conv_workspace_bytes,
    float_bytes,
    mb,
    module_bytes,
    numel_of,
)
from gradwatch.plan.units import LOSS_FN, Unit, block_rows, expert_rows, faithful_rows, in_place_param, relative
from gradwatch.trees import rebuild, tensor_leaves

#: A piece's copy as its check runs it: ``(copy, the leaves it checks by their name in the copy, (args, kwargs))``.
Made = Tuple[nn.Module, Dict[str, Any], Tuple[Any, Any]]


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
        raise TypeError(f"cannot copy module {type(module).__name__} alone in {dtype}: {uncopyable(err)}") from err


def _cast_tree(obj: Any, dtype: torch.dtype, constants: Set[int], out: Set[int]) -> Any:
    """``obj`` with floating tensors in ``dtype``; the copies of ``constants`` go into ``out``."""
    def cast_one(t: torch.Tensor) -> torch.Tensor:
        c = t.to(dtype) if t.is_floating_point() else t
        if id(t) in constants:
            out.add(id(c))
        return c

    return rebuild(obj, cast_one)


def cast_capture(got: Captured, unit: Unit, rows: Optional[Tuple[int, int]], dtype: torch.dtype
                 ) -> Tuple[Tuple[Any, Any], Dict[str, List[Any]], int, int, Set[int]]:
    """A unit's captured inputs and stubs' outputs in ``dtype``, as ``((args, kwargs), children, output bytes, what
    checking the piece (the unit, or its ``rows``) on them needs, ids of the constants)``."""
    constants: Set[int] = set()
    inputs = _cast_tree(got.inputs[unit.name], dtype, got.constants, constants)
    children = {rel: [_cast_tree(o, dtype, got.constants, constants) for o in outs]
                for rel, outs in got.children.get(unit.name, {}).items()}
    out_bytes = got.output_bytes.get(unit.name, 0)
    if rows is None or block_rows(unit):
        leaf_entries = numel_of(t for t in tensor_leaves(inputs) if t.is_floating_point() and id(t) not in constants)
        need = module_bytes(unit.params.values() if rows is None else (), inputs, out_bytes, leaf_entries) \
            + (piece_params_bytes(unit, rows) if rows is not None else 0) + float_entries(children) * per_stub_entry(unit) \
            + (conv_workspace_bytes(unit.module, out_bytes) if unit.kind == "module" else 0) \
            + int(MODULE_SAVED_COPIES * unit.saved_ratio * float_bytes(inputs))
    else:
        fixed, per_row = rows_cost(unit, inputs, out_bytes)
        need = fixed + int(per_row * (rows[1] - rows[0]))
    return inputs, children, out_bytes, need, constants


def per_stub_entry(unit: Unit) -> int:
    """Bytes a piece's check holds per float64 entry of what it is given: the model's output under ``loss_fn``'s own
    code at ``LOSS_CODE_BYTES_PER_ENTRY`` (its intermediates have that size), any other at ``MODULE_BYTES_PER_ENTRY``."""
    return LOSS_CODE_BYTES_PER_ENTRY if unit.kind == "loss_fn" else MODULE_BYTES_PER_ENTRY


def check_piece(unit: Unit, rows: Optional[Tuple[int, int]], args: Any, kwargs: Any, children: Dict[str, List[Any]],
                opts: CheckOptions, dtype: torch.dtype, canonical: Dict[int, str],
                loss_fn: Any = None, constants: Optional[Set[int]] = None,
                faithful_room: float = float("inf"), offset: int = 0,
                screen: bool = False) -> Tuple[ModuleCheck, List[Tuple[str, Any]]]:
    """One piece alone: a ``dtype`` copy of the unit (its own code with stubs, its rows, or whole), checked on
    its captured inputs, then dropped; and what it probed (parameter name, rows).

    ``offset``: the unit's weight holds rows ``offset:`` of the model's (one rank's shard); ``rows`` and what
    is reported stay the model's rows."""
    piece = _PieceCopy(unit, rows, dtype, canonical, offset)
    try:
        made = piece.make(args, kwargs, children, loss_fn, faithful_room)
    except (TypeError, RuntimeError) as err:
        said = str(err) if str(err).startswith("cannot copy module") else why_not_alone(err, own=unit.kind == "own")
        return ModuleCheck(name=unit.name, type=piece.kind, calls=unit.calls, inconclusive=said, error=repr(err)), []
    if isinstance(made, ModuleCheck):  # nothing to check: said why
        return made, piece.probed
    local, params, (args, kwargs) = made
    result = checked_copy(unit.name, local, args, kwargs, params, opts, unit.calls, dtype, constants, screen)
    kind = piece.kind
    if rows is None and whole_instead(unit, result.error, children, faithful_room, dtype):
        # its own code cannot run apart from the modules it calls: checked whole, with them, on the same inputs
        whole = float64_copy(unit.module, dtype)
        again = checked_copy(unit.name, whole, args, kwargs, whole_params(whole, unit), opts, unit.calls, dtype,
                             constants, screen) if stateless(whole, args, kwargs) else None
        if again is not None and again.error is None:
            result, kind = again, f"{type(unit.module).__name__}, whole: {result.inconclusive}"
    result.type = kind
    return result, piece.probed


class _PieceCopy:
    """A piece's ``dtype`` copy, made the way its kind of piece is checked. What it probes (parameter name, rows) and
    what its check is called (``kind``) grow as it is made: a copy refused midway is reported under what it was."""

    def __init__(self, unit: Unit, rows: Optional[Tuple[int, int]], dtype: torch.dtype, canonical: Dict[int, str],
                 offset: int) -> None:
        self.unit, self.rows, self.dtype, self.offset = unit, rows, dtype, offset
        self.kind = type(unit.module).__name__
        self.probed: List[Tuple[str, Any]] = []
        self.names = {k: canonical.get(id(p), k) for k, p in unit.params.items()}
        self.prefix = f"{unit.name}." if unit.name else ""

    def name_of(self, key: str) -> str:
        """The model's name of the unit's parameter ``key``."""
        return self.names.get(self.prefix + key, self.prefix + key)

    def make(self, args: Any, kwargs: Any, children: Dict[str, List[Any]], loss_fn: Any,
             faithful_room: float) -> Union[Made, ModuleCheck]:
        """The copy and what it runs on; a :class:`ModuleCheck` saying why where there is nothing to check."""
        unit, rows = self.unit, self.rows
        local: nn.Module
        if unit.kind == "loss_fn":
            return self.loss_code(children, loss_fn) + ((args, kwargs),)
        if rows is not None and block_rows(unit):
            local, params, self.probed, what = _block_piece(unit, rows, children, self.dtype, self.names)
            self.kind += f"{', own code' if unit.kind == 'own' else ''}, {what} {rows[0]}:{rows[1]} (in place)"
            return local, params, (args, kwargs)
        if unit.kind == "own":
            inner, stubs, params = unit_copy(unit, children, self.dtype)
            local = OwnCode(inner, stubs)
            self.kind += ", own code"
            self.probed = [(self.names[k], None) for k in unit.params] + [(unit.name, "code")]
            return local, params, (args, kwargs)
        if rows is None:
            local, _, params = unit_copy(unit, children, self.dtype)
            self.probed = [(self.names[k], None) for k in unit.params] + [(unit.name, "code")]
            return local, params, (args, kwargs)
        return self.rows_of(rows, args, kwargs, faithful_room)

    def loss_code(self, children: Dict[str, List[Any]], loss_fn: Any) -> Tuple[nn.Module, Dict[str, Any]]:
        """``loss_fn``'s own code, the model a stub replaying its captured output."""
        stub = ModelStub(self.unit.module, children.get("", ()))
        local = OwnCode(LossCode(loss_fn, stub), [stub])
        several = len(stub.outputs) > 1 or any(len(leaves) > 1 for leaves in stub.outputs)
        params = {(f"<model>:output[{k}][{i}]" if several else "<model>:output"): leaf
                  for k, leaves in enumerate(stub.outputs) for i, leaf in enumerate(leaves)}
        self.kind = "loss_fn"
        self.probed = [(LOSS_FN, "code")]
        return local, params

    def rows_of(self, rows: Tuple[int, int], args: Any, kwargs: Any, faithful_room: float) -> Union[Made, ModuleCheck]:
        """A block of a Linear's or an Embedding's rows: sliced, or moved in place where a slice would run another
        computation (a subclass with its own forward), or not checked where that does not fit ``faithful_room``."""
        unit, module, offset = self.unit, self.unit.module, self.offset
        if not faithful_rows(module) and (full := in_place_weight_bytes(module, self.dtype)) > faithful_room:
            return ModuleCheck(name=unit.name, type=f"{self.kind} rows {rows[0]}:{rows[1]}", calls=unit.calls, inconclusive=(
                f"its own forward is checked at its full size (a slice of its rows would run another computation), "
                f"which needs about {mb(full)}, {OVER_ROOM}"))
        if isinstance(module, nn.Linear) and not faithful_rows(module):
            # A Linear subclass with its own forward (quantized, fused, adapter linears): checked at its full size,
            # only this block's rows moved, so a kernel that treats some rows apart runs as it did in training.
            self.kind += f" rows {rows[0]}:{rows[1]} (in place)"
            return self.in_place(torch.arange(rows[0] - offset, rows[1] - offset), rows) + ((args, kwargs),)
        if isinstance(module, nn.Embedding) and not faithful_rows(module):
            return self.embedding_in_place(rows, args, kwargs)
        if isinstance(module, nn.Embedding):
            return self.embedding_rows(rows, args, kwargs)
        local = rows_copy(module, rows[0] - offset, rows[1] - offset, self.dtype)
        params = {k: p for k, p in local.named_parameters(recurse=False) if p.requires_grad}
        self.kind += f" rows {rows[0]}:{rows[1]}"
        self.probed = [(self.name_of(k), rows) for k in params]
        return local, params, (args, kwargs)

    def in_place(self, index: torch.Tensor, probed: Any) -> Tuple[nn.Module, Dict[str, Any]]:
        """The unit at its full size in ``dtype``, only the rows ``index`` moved (probed as ``probed``)."""
        local = RowsInPlace(self.unit.module, index, self.dtype)
        params = {"weight": local.block}
        if local.bias_base is not None:
            params["bias"] = local.bias_block
        self.probed.extend((self.name_of(k), probed) for k in params)
        return local, params

    def embedding_in_place(self, rows: Tuple[int, int], args: Any, kwargs: Any) -> Union[Made, ModuleCheck]:
        """An Embedding subclass (its own forward, maybe a custom backward): checked at its full size, only the rows
        of this block moved, so a backward that treats some token ids apart sees them at their index."""
        ids = first_ids(args, kwargs)
        reached = torch.unique(ids.reshape(-1)) if ids is not None else torch.zeros(0, dtype=torch.long)
        self.probed.append((self.name_of("weight"), ("reached", reached)))
        block = reached[(reached >= rows[0]) & (reached < rows[1])]
        if not block.numel():
            return ModuleCheck(name=self.unit.name, type=f"{self.kind} rows {rows[0]}:{rows[1]}", calls=self.unit.calls,
                               inconclusive=NO_TOKEN)
        self.kind += f" rows {rows[0]}:{rows[1]} ({block.numel()} used, in place)"
        return self.in_place(block, block) + ((args, kwargs),)

    def embedding_rows(self, rows: Tuple[int, int], args: Any, kwargs: Any) -> Union[Made, ModuleCheck]:
        """A block of a plain Embedding's rows: the rows the batch's token ids use in it, copied, on those ids."""
        unit, offset = self.unit, self.offset
        ids = first_ids(args, kwargs)
        made = None if ids is None else embedding_rows_copy(unit.module, ids - offset, rows[0] - offset,
                                                            rows[1] - offset, self.dtype)
        if ids is not None:
            self.probed.append((self.name_of("weight"), ("reached", torch.unique(ids.reshape(-1)))))
        if made is None:
            return ModuleCheck(name=unit.name, type=f"{self.kind} rows {rows[0]}:{rows[1]}", calls=unit.calls,
                               inconclusive=NO_TOKEN)
        local, local_ids, used = made
        used = used + offset
        params = {k: p for k, p in local.named_parameters(recurse=False) if p.requires_grad}
        self.kind += f" rows {rows[0]}:{rows[1]} ({used.numel()} used)"
        self.probed.append((self.name_of("weight"), used))
        return local, params, ((local_ids,), {})


def checked_copy(name: str, local: nn.Module, args: Any, kwargs: Any, params: Dict[str, Any], opts: CheckOptions,
                 calls: int, dtype: torch.dtype, constants: Optional[Set[int]], screen: bool) -> ModuleCheck:
    """:func:`check_module` of a piece's ``dtype`` copy, with its dropout off, its hooks and power iterations held."""
    modules = list(local.modules())
    # An Embedding's padding row is a constant by torch's contract, as in the whole objective (padding_idx.py): the
    # unit's random cotangent reaches the padding positions, which the loss masks.
    with preserved_rng(), dropout_off(local), frozen_power_iteration(local, modules), suspended_hooks(local, modules), \
            padding_rows_constant(local), ShadowPrecision(dtype):
        try:
            return check_module(name, local, args, kwargs, opts, calls, params=params, restore=False,
                                constants=constants, screen=screen)
        finally:
            if isinstance(local, OwnCode):
                local.release()


def unit_copy(unit: Unit, children: Dict[str, List[Any]], dtype: torch.dtype
              ) -> Tuple[nn.Module, List[Any], Dict[str, Any]]:
    """A unit's ``dtype`` copy as a piece checks it: ``(copy, its stubs, the leaves it checks by their name in the
    copy)``; a composite's own code with the modules it calls stubbed (:func:`own_code_copy`), any other whole."""
    if unit.kind == "own":
        inner, stubs, params = own_code_copy(unit.module, unit.name, [relative(unit, c) or c for c in unit.stubbed],
                                             children, unit.params, dtype)
        return inner, list(stubs), dict(params)
    whole = float64_copy(unit.module, dtype)
    return whole, [], dict(whole_params(whole, unit))


def _block_piece(unit: Unit, rows: Tuple[int, int], children: Dict[str, List[Any]], dtype: torch.dtype,
                 names: Mapping[str, str]) -> Tuple[nn.Module, Dict[str, Any], List[Tuple[str, Any]], str]:
    """A block of a unit's experts, or of the rows of its own code's big parameter, checked in place: ``(the copy, the
    leaves it checks, what it probes, what the block is of)``; the unit's other parameters and own code with the first."""
    prefix = f"{unit.name}." if unit.name else ""
    split = bool(expert_rows(unit))
    fused = [k for k, p in unit.params.items() if expert_count(k, tuple(p.shape))] if split else [str(in_place_param(unit))]
    inner, stubs, params = unit_copy(unit, children, dtype)
    block, params = expert_block(inner, params, [k[len(prefix):] for k in fused], rows) if split else \
        row_blocks(inner, params, fused[0][len(prefix):], [rows])
    probed: List[Tuple[str, Any]] = [(names[k], rows) for k in fused]
    if not rows[0]:
        probed += [(names[k], None) for k in unit.params if k not in fused] + [(unit.name, "code")]
    return (OwnCode(block, stubs) if unit.kind == "own" else block), params, probed, "experts" if split else f"{fused[0]} rows"


def file_check(report: CheckReport, unit: Unit, result: ModuleCheck, probed: List[Tuple[str, Any]]) -> int:
    """A piece's check into the report (its tensors under the model's names, a block's under its parameter's, the
    worse verdict kept); 1 when it was an embedding slice the batch used no token of, else 0."""
    if result.inconclusive == NO_TOKEN:
        report.probed.extend(probed)  # the rows the batch reached
        return 1
    report.localized.append(result)
    report.evaluations += result.evaluations
    if result.inconclusive and not result.tensors:
        report.notes.append(f"module form: {result.label} not checked: {result.inconclusive}")
        return 0
    report.probed.extend(_reached(probed, result, unit))
    for key, tc in result.tensors.items():
        if key.startswith("input"):
            name = f"{unit.name or '<model>'}:{key}"
        elif unit.kind == "loss_fn":
            name = key
        else:
            name = f"{unit.name}.{param_of(key)}" if unit.name else param_of(key)
        tc.name = name
        report.tensors[name] = worse(report.tensors.get(name), tc)
    if result.inconclusive:
        report.notes.append(f"module form: {result.label} not checked: {result.inconclusive}")
    return 0


def _reached(probed: List[Tuple[str, Any]], result: ModuleCheck, unit: Unit) -> List[Tuple[str, Any]]:
    """What a piece probed, a fused expert tensor's rows only those of the experts it judged (not those no token
    reached)."""
    prefix = f"{unit.name}." if unit.name and unit.kind != "loss_fn" else ""
    checks = {prefix + k: tc for k, tc in result.tensors.items()}
    return [(name, rows if (experts := reached_rows(checks, name)) is None else experts) for name, rows in probed]
