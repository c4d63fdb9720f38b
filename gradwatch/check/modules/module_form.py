"""The module form of the backward part: the planned pieces, one at a time in float64, within the memory budget.

The whole-objective form (:func:`gradwatch.check.run_model_check`) evaluates a float64 copy
of the whole model; for a model that fills the machine that copy does not fit. The module
form checks the units :mod:`gradwatch.plan.units` finds (each module's own code, the modules
that call no other, ``loss_fn``'s own code) alone, the way Chainer's ``check_backward`` does
with ``y_grad``:

1. a forward of the *live* model on the check batch (dropout off, BatchNorm's running stats
   untouched, no grad) captures, in the live dtype, each chosen unit's inputs at its first call
   and, for own-code units, the outputs of the modules it calls; additive masks (``-inf``, or the
   dtype's lowest value) are kept as constants. Captures hold at most a third of
   the room: units that do not fit together are captured by further forwards;
2. for each piece (a unit, or a block of its rows, :mod:`gradwatch.plan.cycle`), a float64 copy
   of that piece alone is made (:mod:`gradwatch.check.modules.own_code`; nothing else of the model is
   copied), and its vector-Jacobian product with a seeded random cotangent ``y_grad`` (with respect
   to its differentiable inputs, its own parameters and its stubs' outputs) is compared with
   central differences of ``<y_grad, piece(x)>`` (:func:`gradwatch.localize.check_module`); the
   copy is dropped before the next piece.

A piece whose float64 check would not fit in the room is cut: a Linear block to the rows that fit,
any other to the first samples of the batch that fit; what fits in neither way is skipped, and the
report says so. Not checked here: regularizers and coupled weight decay, and a module's backward on
later calls than its first; the whole-objective form checks them, and runs whenever it fits.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch.check.objective.terms import Objective
    >>> from gradwatch.options import CheckOptions
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    >>> batch = (torch.randn(8, 3), torch.randn(8, 1))
    >>> objective = Objective(lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    >>> report = run_module_check(model, objective, batch, CheckOptions())
    >>> report.form, report.ok, [m.label for m in report.localized]
    ('module', True, ['`<loss_fn>` (loss_fn)', '`0` (Linear)', '`1` (Tanh)', '`2` (Linear)'])
    >>> sorted(report.tensors)[:7]
    ['0.bias', '0.weight', '0:input', '1:input', '2.bias', '2.weight', '2:input']
    >>> sorted(report.tensors)[7:]  # loss_fn's own code: the gradient it passes to the model's output
    ['<loss_fn>:input[0][0]', '<loss_fn>:input[0][1]', '<model>:output']
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from gradwatch.check.judging.report import OVER_ROOM, CheckReport, worse
from gradwatch.check.modules.batch_cut import batch_dims, capture_window, cuts_to_try, forward_cut, positions, sub_batch
from gradwatch.check.modules.capture import Captured, Forward, capture, live_bytes
from gradwatch.check.modules.expert_blocks import expert_block
from gradwatch.check.modules.localize import ModuleCheck, check_module
from gradwatch.check.modules.own_code import LossCode, ModelStub, OwnCode, RowsInPlace, embedding_rows_copy, own_code_copy, rows_copy
from gradwatch.check.modules.own_rows import own_group, own_rows_cost, row_blocks
from gradwatch.check.modules.piece_cuts import (
    cut_samples,
    float_entries,
    in_place_weight_bytes,
    piece_params_bytes,
    row_block,
    rows_cost,
    rows_of,
    rows_of_one_sample,
)
from gradwatch.check.modules.replay_failure import stateless, uncopyable, whole_instead, whole_params, why_not_alone
from gradwatch.check.modules.row_groups import NO_TOKEN, check_group, chunks, first_ids, groupable, grouped, param_of, positions_kept
from gradwatch.check.modules.window_cut import WINDOWED, windowed_piece
from gradwatch.check.objective.dropout_off import dropout_off
from gradwatch.check.objective.dtensor import no_collectives
from gradwatch.check.objective.guards import frozen_power_iteration, suspended_hooks
from gradwatch.check.objective.padding_idx import padding_rows_constant
from gradwatch.check.objective.precision import ShadowPrecision
from gradwatch.check.objective.rng import preserved_rng
from gradwatch.check.objective.shadow import param_signature
from gradwatch.check.objective.surrogate import find_surrogates, inside, surrogate_note
from gradwatch.check.probes.experts import expert_count, reached_rows
from gradwatch.options import CheckOptions
from gradwatch.plan.cycle import Piece
from gradwatch.plan.memory import (
    LOSS_CODE_BYTES_PER_ENTRY,
    MEASURE_FLOOR,
    MODULE_BYTES_PER_ENTRY,
    MODULE_SAVED_COPIES,
    TRIM_BYTES,
    conv_workspace_bytes,
    float_bytes,
    in_use_bytes,
    mb,
    model_device,
    module_bytes,
    numel_of,
    release_freed,
)
from gradwatch.plan.units import LOSS_FN, Unit, block_rows, expert_rows, faithful_rows, in_place_param, plan_units, relative
from gradwatch.trees import param_names, rebuild, tensor_leaves

#: ``view(unit, rows)``: a context giving ``(unit with plain parameters, offset of its rows)`` (sharded models).
PieceView = Callable[[Unit, Optional[Tuple[int, int]]], ContextManager[Tuple[Unit, int]]]


def module_units(model: nn.Module, loss_fn: Any, batch: Any, seed: int = 0) -> List[Unit]:
    """The modules that called no other module, in model order (one counting forward of the live model);
    :func:`gradwatch.plan.units.plan_units` adds the own code of the others.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> [(u.name, sorted(u.params)) for u in module_units(model, lambda m, b: m(b).sum(), torch.ones(1, 2))]
        [('0', ['0.bias', '0.weight']), ('1', [])]
    """
    return plan_units(model, loss_fn, batch, seed, own_code=False)


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


def run_module_check(
    model: nn.Module,
    objective: Any,
    batch: Any,
    opts: CheckOptions,
    *,
    units: Optional[Sequence[Unit]] = None,
    pieces: Optional[Sequence[Piece]] = None,
    room: Optional[int] = None,
    view: Optional[PieceView] = None,
    screen: bool = False,
    early: bool = False,
    everyone: Optional[Sequence[str]] = None,
    forward_bytes: int = 0,
    replay: Optional[Forward] = None,
    replay_budget: Optional[int] = None,
    seconds: Optional[float] = None,
) -> CheckReport:
    """The module form of the backward part (see the module docstring).

    Args:
        model: The live model (never changed: its parameters, buffers and RNG streams are left as they were).
        objective: An :class:`~gradwatch.objective.Objective`; its ``loss_fn`` runs once, to capture inputs.
        batch: The check batch.
        opts: Check options (``coords``, ``directions``, ``eps``, ``bands``, ``fail_at``, ``seed``, ``detect_kinks``).
        units: The units to choose from (default: every unit of :func:`gradwatch.plan.units.plan_units`).
        pieces: The pieces to check (:class:`gradwatch.plan.cycle.Piece`; default: each unit whole).
        room: Bytes a piece's check may hold (None: no bound); a Linear over it is checked on the block of
            rows that fits, any other piece over it is skipped, and the report says so.
        view: A sharded model (:mod:`gradwatch.watch.shard_check`): ``view(unit, rows)`` is a context giving
            the unit with plain parameters (this rank's rows, or the gathered whole) and the offset of its
            rows. Then exactly one forward of the live model runs (its collectives are the same on every rank,
            whatever this rank's pieces): no capture is deferred to another forward, and a piece over ``room``
            is cut to the first samples of what that forward captured instead of captured again. Its ``ready()``,
            where it has one, is called on every rank after the first capture (the whole pieces gathered then).
        screen: Detection first in each piece (see :func:`gradwatch.localize.check_module`).
        early: Stop each capture forward once every unit it was run for is captured (one process; with a ``view``, once
            every unit of ``everyone`` has made its first call, the same point on every rank): the loss is then not
            known here (``report.objective`` stays NaN, for the caller to fill).
        everyone: With a ``view``: the names of the units some rank checks in this check, the same on every rank (default:
            every unit); the capture gathers the DTensor inputs of those only.
        forward_bytes: With a ``view`` and a ``room``: what a forward of the live model on ``batch`` holds beyond its
            captures (its output and what the loss makes of it,
            :func:`~gradwatch.check.modules.batch_cut.forward_transient`). Where that is over the captures' share of
            the room (a third) and this check's forwards run to the model's output (not ``early``, or the root's or
            ``loss_fn``'s own code in ``everyone``), they run on the batch's first samples, as many as fit, the same
            count on every rank (an agreement point): its pieces are then cut from those.
        replay: The first capture's forward (:data:`~gradwatch.check.modules.capture.Forward`): the training part's
            replay of the step, run with the capture's hooks (where the batch is cut, without them, before the
            capture). Its ``usable`` attribute, set by the call, says whether the replay's forward computed what the
            isolated forward would (no random draw, no autocast), alike on every rank; where it did not, the capture
            runs again on an isolated forward.
        replay_budget: With ``replay`` and a ``room``: bytes its captures may hold (through the replay's backward);
            the units over it are captured by the next forward, as units over a forward's budget are.
        seconds: One process: no piece begins once the check has run this long; the pieces not begun are in
            ``report.later`` (a paced cycle gives them to the next checks: :meth:`gradwatch.plan.planner.Planner.pace`).

    Returns:
        A :class:`CheckReport` with ``form == "module"``: parameters under their names, a unit's input
        gradient under ``"<module>:input"``, the gradient an own-code unit passes back to a module it called
        under ``"<module>:output"``, and one :class:`~gradwatch.localize.ModuleCheck` per piece in ``localized``.
    """
    start = time.perf_counter()
    if units is None:
        units = plan_units(model, objective.loss, batch, opts.seed)
    surrogates = find_surrogates(model, opts.surrogates)
    units = [u for u in units if not inside(u.name, surrogates)]  # their gradient is a surrogate by design
    by_name = {u.name: u for u in units}
    if pieces is None:
        pieces = [Piece(u.name) for u in units]
    report = CheckReport(tensors={}, fail_at=opts.fail_verdict, seed=opts.seed, dtype="float64")
    report.form = "module"
    if surrogates:
        report.surrogates = list(surrogates)
        report.notes.append(surrogate_note(surrogates, "module"))
    if getattr(objective, "differentiates", None):
        # loss_fn differentiates through the model (a gradient penalty): its own code without the model cannot run
        if any(p.unit == LOSS_FN for p in pieces):
            report.notes.append(f"module form: `{LOSS_FN}` (loss_fn) not checked: loss_fn differentiates through the "
                                "model (torch.autograd.grad inside), which its own code cannot do without the model; "
                                "the objective form checks it where the whole objective fits memory_budget")
        pieces = [p for p in pieces if p.unit != LOSS_FN]
    chosen = list({p.unit: by_name[p.unit] for p in pieces if p.unit in by_name}.values())
    dtype = opts.torch_dtype or torch.float64
    canonical = param_names(model)
    skipped: List[str] = []
    estimate = 0
    unused = 0
    remaining = chosen
    got = Captured()
    solo: List[Tuple[Piece, Any]] = []  # pieces that fit the room only without the other captures beside them (and
    # the batch they were captured on)
    once = view is not None  # sharded: one forward on every rank, even with no piece of its own
    agree = getattr(view, "agree", None)
    checked = None if everyone is None else set(everyone)
    shared = () if view is None else units if checked is None else [u for u in units if u.name in checked]
    # Captures take a third of the room at most; units that do not fit together are captured by later forwards
    # (sharded: as many on every rank, agreed after each; without a way to agree, one forward holding them all).
    budget = None if room is None or (view is not None and agree is None) else room // 3
    # What the pieces leave in the process's heap (freed, not given back) is measured too: the pieces of a check never
    # hold more than the room above what the process held when they began (at least MEASURE_FLOOR above it: what a
    # process's first float64 evaluations take once).
    device = model_device(model)
    limit = None if room is None else in_use_bytes(device) + max(room, MEASURE_FLOOR)
    part = batch
    # Only forwards that run to the model's output are cut (FSDP2's and ZeRO-3's always do; under tensor and sequence
    # parallel, those of a check where some rank checks the root's or loss_fn's own code): the others stop before it.
    to_the_end = not early or any(u.name in (LOSS_FN, "") for u in shared)
    if budget is not None and agree is not None and to_the_end:  # alike on every rank: room, plan, engine and view
        part = forward_cut(batch, forward_bytes, budget, agree, report)
    per_position = 0.0  # bytes of the model's output per position of the batch, as a forward to its end saw them
    first, began = replay, False
    if first is not None and part is not batch:  # the batch cut (alike on every rank): the replay runs on its own
        first({}, {})
        first = None
    # one process: once, where the whole batch's captures leave units or pieces over the room, the rest is captured on
    # a window of the batch's samples (said once its capture ran)
    windowing = view is None and budget is not None
    window: Optional[str] = None
    ran = 0  # groups of pieces run (the pace never leaves a check without one)
    while remaining or once:
        once = False
        if began and limit is not None and in_use_bytes(device) > limit - (budget or 0):
            release_freed()  # what the pieces freed, before another forward captures
        try:
            got = capture(model, objective.loss, part, remaining, opts.seed,
                          budget=budget if first is None or replay_budget is None or budget is None
                          else min(budget, replay_budget),
                          everyone=shared, agree=agree, alone=view is not None, early=early, forward=first)
        except Exception:  # noqa: BLE001 - a model that refuses a window of its batch: the rest on the whole batch
            if part is batch:
                raise
            part, window = batch, None
            continue
        if window is not None:
            report.notes.append(f"module form: {len(remaining)} unit(s) captured and checked on {window} (a new "
                                "window each check): on the whole batch their inputs are over the captures' share of "
                                f"the room ({mb(budget)}), which would take a forward of the model per share")
            window = None
        if first is not None and (got.stale or not getattr(first, "usable", False)):  # not the isolated forward's values
            got = capture(model, objective.loss, part, remaining, opts.seed, budget=budget,
                          everyone=shared, agree=agree, alone=view is not None, early=early)
        ready = getattr(view, "ready", None)
        if ready is not None:  # on every rank, after its first capture: the whole pieces' parameters gathered now
            ready()
        if limit is not None and room is not None and not began and (first is not None or ready is not None):
            # what the process holds now, but the captures, is where the pieces begin: the whole pieces' parameters
            # just gathered, and what a replay run as this capture left (it ran after the limit was first taken)
            limit = in_use_bytes(device) - _held(got) + max(room, MEASURE_FLOOR)
        first, began = None, True
        per_position = per_position or got.model_bytes / positions(part)
        if report.objective != report.objective and got.loss is not None and part is batch:  # the first forward's loss
            report.objective = got.loss
            report.terms = {"loss": got.loss}
            report.nonfinite = report.nonfinite or not math.isfinite(got.loss)  # said once, for the whole check
        held = _held(got)
        # one process, the whole batch: whole pieces over the room (or only alone in it) are captured again by one
        # forward, with the deferred units, on a window of the batch that fits them all (unit name -> need)
        later: Optional[Dict[str, int]] = {} if windowing else None
        for item in grouped(pieces, by_name):
            unit = by_name.get(item[0].unit)
            if unit is None or (unit.name not in got.inputs and unit.name not in got.big):
                continue
            if ran and _late(start, seconds):  # (a check runs one piece at least: never all overhead)
                report.later.extend(str(p) for p in item)
                continue
            ran += 1
            left = None if room is None else max(0, room - held)
            if limit is not None and left is not None:
                left = _measured(left, limit, device)
            # shard by shard, a rank's one block of a unit too (it holds fewer rows: often one block a check), on the
            # group's positions, as the blocks of a group are
            if (len(item) > 1 or ((view is not None or unit.kind == "own") and groupable(item[0], unit))) and unit.name in got.inputs:
                estimate, unused, item = _run_group(opts, unit, [p.rows for p in item if p.rows], got, dtype, canonical,
                                                    left, report, estimate, unused, screen, view)
            for piece in item:
                estimate, unused = _run_piece(model, objective, part, opts, unit, piece, got, dtype, canonical, left,
                                              report, skipped, estimate, unused,
                                              solo=solo if len(got.inputs) > 1 and view is None else None,
                                              full_room=room, view=view, screen=screen, later=later,
                                              in_window=part is not batch)
        progress = len(got.inputs) + len(got.big)
        remaining = [by_name[n] for n in got.deferred + list(later or ()) if n in by_name] if progress else []
        if later is not None and remaining and room is not None and budget is not None:
            windowing = False
            part, window = capture_window(batch, held, live_bytes(got.inputs), got.deferred_bytes, budget, opts.seed,
                                          list(later.values()), room - budget)
        if remaining and ran and _late(start, seconds):  # not captured: their pieces wait for the next checks
            names = {u.name for u in remaining}
            report.later.extend(str(p) for p in pieces if p.unit in names)
            remaining = []
        if not progress and got.deferred:
            skipped.extend(f"{by_name[n].label} (its inputs do not fit in the room)" for n in got.deferred)
        del got
        if view is not None and budget is not None and agree is not None:
            once = agree(0 if remaining else 1) == 0  # another forward on every rank while any rank needs one
    for piece, on in solo:  # each alone: its own captures only beside its check
        unit = by_name[piece.unit]
        if ran and _late(start, seconds):
            report.later.append(str(piece))
            continue
        ran += 1
        if limit is not None:
            release_freed()  # what the pieces before freed, before this capture's forward
        got = capture(model, objective.loss, on, [unit], opts.seed, budget=None if room is None else room // 3,
                      early=early)
        if unit.name in got.inputs or unit.name in got.big:
            left = None if room is None else max(0, room - _held(got))
            if limit is not None and left is not None:
                left = _measured(left, limit, device)
            estimate, unused = _run_piece(model, objective, on, opts, unit, piece, got, dtype, canonical, left, report,
                                          skipped, estimate, unused, screen=screen, in_window=on is not batch)
        del got
    if report.later:
        report.notes.append(f"module form: {len(report.later)} piece(s) left to the next checks, this check's pieces "
                            f"having taken the {seconds:.2f} s its pace gives them: {', '.join(p or '<model>' for p in report.later[:4])}"
                            f"{', ...' if len(report.later) > 4 else ''}")
    if unused:
        report.notes.append(f"module form: {unused} embedding slice(s) held no token of this batch (their rows count "
                            "as unreached until a batch uses them)")
    if skipped:
        report.notes.append(
            f"module form: {len(skipped)} piece(s) not checked, over the room the memory budget leaves "
            f"({mb(room)}): {'; '.join(skipped[:4])}{'; ...' if len(skipped) > 4 else ''}")
    report.memory = {"estimate_bytes": estimate, "output_per_position": per_position}
    report.seconds = time.perf_counter() - start
    return report


def _late(start: float, seconds: Optional[float]) -> bool:
    """Whether a check that began at ``start`` has run its ``seconds`` (None: never)."""
    return seconds is not None and time.perf_counter() - start > seconds


def _run_group(opts: CheckOptions, unit: Unit, blocks: List[Tuple[int, int]], got: Captured, dtype: torch.dtype,
               canonical: Dict[int, str], room: Optional[int], report: CheckReport, estimate: int, unused: int,
               screen: bool, view: Optional[PieceView] = None) -> Tuple[int, int, List[Piece]]:
    """The row blocks of a plain Linear or Embedding, or of an own code's big parameter (in place: own_rows.py), in one
    piece each run of them that fits the room; returns the largest estimate, the count of blocks with no token and the
    blocks alone in their run (checked as any piece). With a ``view`` (sharded), the blocks are this rank's rows,
    checked on its shard (one offset for them all)."""
    own = unit.kind == "own"
    (args, kwargs), children, _, _, constants = _cast_capture(got, unit, None, dtype)
    fixed, per_row = own_rows_cost(unit, (args, kwargs), children) if own else rows_cost(
        unit, (args, kwargs), got.output_bytes.get(unit.name, 0), positions_kept(unit.module, args, kwargs))
    capacity = (rows_of(unit) or block_rows(unit) or 1) if room is None else int(max(0, room - fixed) // max(per_row, 1.0))
    single: List[Piece] = []
    for run in chunks(sorted(blocks), capacity):
        if len(run) == 1 and (view is None and not own or run[0][1] - run[0][0] > capacity):  # over the room: a piece
            single.append(Piece(unit.name, run[0]))
            continue
        covered = sum(b - a for a, b in run)
        need = fixed + int(per_row * covered)
        estimate = max(estimate, need)
        began = time.perf_counter()
        with view(unit, run[0]) if view is not None else contextlib.nullcontext((unit, 0)) as (local_unit, offset), \
                _one_rank(view, local_unit):  # one rank alone
            if own:
                local, (a, k), leaves, kept, probed, kind = own_group(unit, run, (args, kwargs), children, set(constants),
                                                                      dtype, canonical, _unit_copy)
                result, empty = _checked_copy(unit.name, local, a, k, leaves, opts, unit.calls, dtype, kept, screen), 0
                result.type = kind
            else:
                result, probed, empty = check_group(local_unit, run, args, kwargs, opts, dtype, canonical, constants,
                                                    screen, offset)
        report.spent(unit.name, time.perf_counter() - began, covered)
        report.pieces.extend(str(Piece(unit.name, b)) for b in run)
        unused += max(empty, _file(report, unit, result, probed))
        if room is not None and need >= TRIM_BYTES:
            release_freed()
    return estimate, unused, single


_TORCH_MODULES = "torch.nn.modules."


def _one_rank(view: Optional[PieceView], unit: Unit) -> ContextManager[Any]:
    """Around a piece checked by one rank alone (with a ``view``): collectives refused
    (:func:`~gradwatch.check.objective.dtensor.no_collectives`), unless the piece is torch's own modules only (a
    Linear, a LayerNorm, an Embedding: on the view's plain tensors they make none). The refusing mode sees every
    operator of the piece's evaluations (about 10 ms a check of ``benchmarks/parallel.py``'s 4.2M model), so only
    code of yours (a module's own code, a module of your class) and a module with a parameter left a DTensor run in
    it."""
    if view is None or (unit.kind == "module"
                        and all(type(m).__module__.startswith(_TORCH_MODULES) for m in unit.module.modules())
                        and all(type(p) in (torch.Tensor, nn.Parameter) for p in unit.module.parameters())):
        return contextlib.nullcontext()
    return no_collectives()


def _measured(left: int, limit: int, device: torch.device) -> int:
    """``left`` (the room an estimate leaves a piece) within what the process may still add under ``limit``: where the
    heap kept what earlier pieces freed, it is given back first (glibc's ``malloc_trim``; elsewhere nothing)."""
    if in_use_bytes(device) + left <= limit:
        return left
    release_freed()
    return max(0, min(left, limit - in_use_bytes(device)))


def _held(got: Captured) -> int:
    """Bytes the captures of one forward hold."""
    return sum(live_bytes(v) for v in got.inputs.values()) + sum(live_bytes(v) for v in got.children.values())


def _run_piece(model: nn.Module, objective: Any, batch: Any, opts: CheckOptions, unit: Unit, piece: Piece, got: Captured,
               dtype: torch.dtype, canonical: Dict[int, str], room: Optional[int], report: CheckReport,
               skipped: List[str], estimate: int, unused: int, solo: Optional[List[Tuple[Piece, Any]]] = None,
               full_room: Optional[int] = None, view: Optional[PieceView] = None,
               screen: bool = False, later: Optional[Dict[str, int]] = None, in_window: bool = False
               ) -> Tuple[int, int]:
    """One piece of a captured unit: fit it to the room (rows, or fewer samples), check it, file the result.

    ``batch`` is the batch the piece was captured on. With ``solo``: a whole piece that fits ``full_room`` but not
    beside the other captures is put there (with ``batch``), to be checked again alone. With ``later``: such a whole
    piece, and a whole piece over the room (no row block fits), is put there instead (unit name -> its need on
    ``batch``), to be captured by the next forward on a window of the batch's samples that fits it, instead of by a
    forward of its own. ``in_window``: ``batch`` is a window of the check's batch (:func:`capture_window`)."""
    constants: Set[int] = set()
    rows = piece.rows
    began = time.perf_counter()
    if unit.name in got.inputs:
        (args, kwargs), children, out_bytes, need, constants = _cast_capture(got, unit, rows, dtype)
    else:  # over the capture budget alone: its float64 check cannot fit the room on the whole batch
        args = kwargs = None
        children = {}
        out_bytes = 0
        need = got.big[unit.name] * 2 * _per_stub_entry(unit) // 8  # float32 to float64, then its copies
    if room is not None and solo is not None and full_room is not None and (args is None or _alone(
            unit, rows, need, dtype, room, full_room - live_bytes(got.inputs.get(unit.name))
            - live_bytes(got.children.get(unit.name)))):  # (not captured: a forward of its own captures it)
        if later is not None and rows is None:
            later[unit.name] = need
        else:
            solo.append((piece, batch))
        return estimate, unused
    if room is not None and (need > room or args is None):  # (not captured: cut, or said, never checked on nothing)
        block = None if args is None else row_block(unit, (args, kwargs), out_bytes, room // 2, opts.seed, rows)
        samples = ""  # the samples a row block is checked on, where not the whole batch
        if block is None and later is not None and rows is None:
            later[unit.name] = need
            return estimate, unused
        if block is not None:
            smaller = None
        elif view is not None:  # one forward only (sharded): cut what it captured
            smaller = None if args is None else cut_samples(unit, (args, kwargs), children, constants, need, room, rows)
            if smaller is None and args is not None:  # a Linear whose rows and inputs both fill the room: cut both
                both = rows_of_one_sample(unit, (args, kwargs), children, constants, out_bytes, room, opts.seed, rows)
                if both is not None:
                    (args, kwargs), children, constants, block, what = both
                    samples = f", on {what}"
        else:
            smaller = _fewer_samples(model, objective.loss, batch, unit, need, room, opts.seed, dtype, rows)
        if block is None and smaller is None:
            skipped.append(f"{unit.label}{'' if rows is None else f' rows {rows[0]}:{rows[1]}'} needs about {mb(need)} "
                           f"with {mb(room)} left to it")  # the check's whole room is said once, after every piece
            report.unfit.append(str(piece))
            return estimate, unused
        if block is not None:
            report.notes.append(f"module form: {unit.label} checked on output rows {block[0]}:{block[1]} of "
                                f"{rows_of(unit)}{samples} (its {'slice' if rows else 'whole'} float64 check needs about "
                                f"{mb(need)}; the rows rotate from check to check)")
            rows, need = (block[0], block[1]), block[2]
        else:
            assert smaller is not None
            whole_need = need
            (args, kwargs), children, need, what, constants = smaller
            on = "the window" if in_window else "the whole batch"
            report.notes.append(f"module form: {unit.label} checked on "
                                f"{what.replace(' the batch', ' the window') if in_window else what} (on {on} its "
                                f"float64 check needs about {mb(whole_need)})")
    estimate = max(estimate, need)
    with view(unit, rows) if view is not None else contextlib.nullcontext((unit, 0)) as (local_unit, offset), \
            _one_rank(view, local_unit):  # one rank alone: none may communicate
        result, probed = _check_piece(local_unit, rows, args, kwargs, children, opts, dtype, canonical, objective.loss,
                                      constants, faithful_room=float("inf") if room is None else max(0, room - need),
                                      offset=offset, screen=screen)
    del args, kwargs, children
    if result.inconclusive is not None and result.inconclusive.endswith(OVER_ROOM):
        report.unfit.append(str(piece))
    if room is not None and need >= TRIM_BYTES:
        release_freed()  # what this piece's check freed, before the next one allocates (smaller frees are reused)
    report.pieces.append(str(Piece(unit.name, rows)))
    report.spent(unit.name, time.perf_counter() - began, 0 if rows is None else rows[1] - rows[0])
    return estimate, unused + _file(report, unit, result, probed)


def _file(report: CheckReport, unit: Unit, result: ModuleCheck, probed: List[Tuple[str, Any]]) -> int:
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


def _fewer_samples(model: nn.Module, loss_fn: Any, batch: Any, unit: Unit, need: int, room: int, seed: int,
                   dtype: torch.dtype, rows: Optional[Tuple[int, int]] = None
                   ) -> Optional[Tuple[Tuple[Any, Any], Dict[str, List[Any]], int, str, Set[int]]]:
    """For a unit (or its ``rows``) too big for the room on the whole batch: its inputs (and stubs' outputs) captured
    on a cut of the batch that fits (:func:`cuts_to_try`): its first samples, or one sample's first positions (a
    token batch), as ``((args, kwargs), children, bytes, what was kept, constants)``; None when no cut fits (or the
    model refuses the cut batch).

    A cut shrinks what depends on the batch only: the piece's share of the parameters (:func:`piece_params_bytes`)
    stays. Where that share alone fills the room no forward is run; otherwise the cuts are sized on the rest.
    """
    fixed = piece_params_bytes(unit, rows)
    if fixed >= room:
        return None  # no cut of the batch fits: the parameters' copies alone fill the room
    size, seq = batch_dims(batch)
    cuts = cuts_to_try(size, seq, max(1, need - fixed), room - fixed)
    if (isinstance(unit.module, WINDOWED) and unit.kind == "module" or unit.kind == "own" and seq == 1) and (1, None) not in cuts:
        cuts = [c for c in cuts if c[1] is None] + [(1, None)]  # one sample, to window its positions (own code: images)
    retried = False
    one: Optional[Tuple[Tuple[Any, Any], Dict[str, List[Any]], int, Set[int]]] = None  # one sample's capture
    while cuts:
        kept, length = cuts.pop(0)
        part, _, _ = sub_batch(batch, kept, length)
        try:
            got = capture(model, loss_fn, part, [unit], seed, budget=room // 3)
        except Exception:  # noqa: BLE001 - a model that refuses this cut (of positions): the next; none, named
            continue
        if unit.name not in got.inputs:
            continue
        inputs, children, _, cost, constants = _cast_capture(got, unit, rows, dtype)  # costed as on the whole batch
        if cost <= room:
            what = f"{kept} of the batch's {size} samples" + ("" if length is None else f", its first {length} of {seq} positions")
            return inputs, children, cost, what, constants
        if kept == 1 and length is None:
            one = (inputs, children, cost, constants)
        if length is None and not retried and cost > fixed:  # once: as many samples as this cut's cost says fit
            retried = True
            fit = int(kept * (room - fixed) / (cost - fixed))
            if 1 <= fit < kept:
                cuts.insert(0, (fit, None))
    return windowed_piece(unit, one, fixed, room, seed, size)


def _cast_capture(got: Captured, unit: Unit, rows: Optional[Tuple[int, int]], dtype: torch.dtype
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
            + (piece_params_bytes(unit, rows) if rows is not None else 0) + float_entries(children) * _per_stub_entry(unit) \
            + (conv_workspace_bytes(unit.module, out_bytes) if unit.kind == "module" else 0) \
            + int(MODULE_SAVED_COPIES * unit.saved_ratio * float_bytes(inputs))
    else:
        fixed, per_row = rows_cost(unit, inputs, out_bytes)
        need = fixed + int(per_row * (rows[1] - rows[0]))
    return inputs, children, out_bytes, need, constants


def _per_stub_entry(unit: Unit) -> int:
    """Bytes a piece's check holds per float64 entry of what it is given: the model's output under ``loss_fn``'s own
    code at ``LOSS_CODE_BYTES_PER_ENTRY`` (its intermediates have that size), any other at ``MODULE_BYTES_PER_ENTRY``."""
    return LOSS_CODE_BYTES_PER_ENTRY if unit.kind == "loss_fn" else MODULE_BYTES_PER_ENTRY


def _check_piece(unit: Unit, rows: Optional[Tuple[int, int]], args: Any, kwargs: Any, children: Dict[str, List[Any]],
                 opts: CheckOptions, dtype: torch.dtype, canonical: Dict[int, str],
                 loss_fn: Any = None, constants: Optional[Set[int]] = None,
                 faithful_room: float = float("inf"), offset: int = 0,
                 screen: bool = False) -> Tuple[ModuleCheck, List[Tuple[str, Any]]]:
    """One piece alone: a ``dtype`` copy of the unit (its own code with stubs, its rows, or whole), checked on
    its captured inputs, then dropped; and what it probed (parameter name, rows).

    ``offset``: the unit's weight holds rows ``offset:`` of the model's (one rank's shard); ``rows`` and what
    is reported stay the model's rows."""
    kind = type(unit.module).__name__
    probed: List[Tuple[str, Any]] = []
    names = {k: canonical.get(id(p), k) for k, p in unit.params.items()}
    prefix = f"{unit.name}." if unit.name else ""
    try:
        local: nn.Module
        if unit.kind == "loss_fn":
            stub = ModelStub(unit.module, children.get("", ()))
            local = OwnCode(LossCode(loss_fn, stub), [stub])
            several = len(stub.outputs) > 1 or any(len(leaves) > 1 for leaves in stub.outputs)
            params = {(f"<model>:output[{k}][{i}]" if several else "<model>:output"): leaf
                      for k, leaves in enumerate(stub.outputs) for i, leaf in enumerate(leaves)}
            kind = "loss_fn"
            probed = [(LOSS_FN, "code")]
        elif rows is not None and block_rows(unit):
            local, params, probed, what = _block_piece(unit, rows, children, dtype, names)
            kind += f"{', own code' if unit.kind == 'own' else ''}, {what} {rows[0]}:{rows[1]} (in place)"
        elif unit.kind == "own":
            inner, stubs, params = _unit_copy(unit, children, dtype)
            local = OwnCode(inner, stubs)
            kind += ", own code"
            probed = [(names[k], None) for k in unit.params] + [(unit.name, "code")]
        elif rows is not None and not faithful_rows(unit.module) and (full := in_place_weight_bytes(unit.module, dtype)) > faithful_room:
            return ModuleCheck(name=unit.name, type=f"{kind} rows {rows[0]}:{rows[1]}", calls=unit.calls, inconclusive=(
                f"its own forward is checked at its full size (a slice of its rows would run another computation), "
                f"which needs about {mb(full)}, {OVER_ROOM}")), []
        elif rows is not None and isinstance(unit.module, nn.Linear) and not faithful_rows(unit.module):
            # A Linear subclass with its own forward (quantized, fused, adapter linears): checked at its full size,
            # only this block's rows moved, so a kernel that treats some rows apart runs as it did in training.
            kind += f" rows {rows[0]}:{rows[1]} (in place)"
            local = RowsInPlace(unit.module, torch.arange(rows[0] - offset, rows[1] - offset), dtype)
            params = {"weight": local.block}
            if local.bias_base is not None:
                params["bias"] = local.bias_block
            probed.extend((names.get(prefix + k, prefix + k), rows) for k in params)
        elif rows is not None and isinstance(unit.module, nn.Embedding) and not faithful_rows(unit.module):
            # An Embedding subclass (its own forward, maybe a custom backward): checked at its full size, only the
            # rows of this block moved, so a backward that treats some token ids apart sees them at their index.
            ids = first_ids(args, kwargs)
            reached = torch.unique(ids.reshape(-1)) if ids is not None else torch.zeros(0, dtype=torch.long)
            probed.append((names.get(prefix + "weight", prefix + "weight"), ("reached", reached)))
            block = reached[(reached >= rows[0]) & (reached < rows[1])]
            if not block.numel():
                return ModuleCheck(name=unit.name, type=f"{kind} rows {rows[0]}:{rows[1]}", calls=unit.calls,
                                   inconclusive=NO_TOKEN), probed
            kind += f" rows {rows[0]}:{rows[1]} ({block.numel()} used, in place)"
            local = RowsInPlace(unit.module, block, dtype)
            params = {"weight": local.block}
            if local.bias_base is not None:
                params["bias"] = local.bias_block
            probed.extend((names.get(prefix + k, prefix + k), block) for k in params)
        elif rows is not None and isinstance(unit.module, nn.Embedding):
            ids = first_ids(args, kwargs)
            made = None if ids is None else embedding_rows_copy(unit.module, ids - offset, rows[0] - offset,
                                                                rows[1] - offset, dtype)
            if ids is not None:
                probed.append((names.get(prefix + "weight", prefix + "weight"), ("reached", torch.unique(ids.reshape(-1)))))
            if made is None:
                return ModuleCheck(name=unit.name, type=f"{kind} rows {rows[0]}:{rows[1]}", calls=unit.calls,
                                   inconclusive=NO_TOKEN), probed
            local, local_ids, used = made
            used = used + offset
            args, kwargs = (local_ids,), {}
            params = {k: p for k, p in local.named_parameters(recurse=False) if p.requires_grad}
            kind += f" rows {rows[0]}:{rows[1]} ({used.numel()} used)"
            probed.append((names.get(prefix + "weight", prefix + "weight"), used))
        elif rows is not None:
            local = rows_copy(unit.module, rows[0] - offset, rows[1] - offset, dtype)
            params = {k: p for k, p in local.named_parameters(recurse=False) if p.requires_grad}
            kind += f" rows {rows[0]}:{rows[1]}"
            probed = [(names.get(prefix + k, prefix + k), rows) for k in params]
        else:
            local, _, params = _unit_copy(unit, children, dtype)
            probed = [(names[k], None) for k in unit.params] + [(unit.name, "code")]
    except (TypeError, RuntimeError) as err:
        said = str(err) if str(err).startswith("cannot copy module") else why_not_alone(err, own=unit.kind == "own")
        return ModuleCheck(name=unit.name, type=kind, calls=unit.calls, inconclusive=said, error=repr(err)), []
    result = _checked_copy(unit.name, local, args, kwargs, params, opts, unit.calls, dtype, constants, screen)
    if rows is None and whole_instead(unit, result.error, children, faithful_room, dtype):
        # its own code cannot run apart from the modules it calls: checked whole, with them, on the same inputs
        whole = float64_copy(unit.module, dtype)
        again = _checked_copy(unit.name, whole, args, kwargs, whole_params(whole, unit), opts, unit.calls, dtype,
                              constants, screen) if stateless(whole, args, kwargs) else None
        if again is not None and again.error is None:
            result, kind = again, f"{type(unit.module).__name__}, whole: {result.inconclusive}"
    result.type = kind
    return result, probed


def _checked_copy(name: str, local: nn.Module, args: Any, kwargs: Any, params: Dict[str, Any], opts: CheckOptions,
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


def _unit_copy(unit: Unit, children: Dict[str, List[Any]], dtype: torch.dtype
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
    inner, stubs, params = _unit_copy(unit, children, dtype)
    block, params = expert_block(inner, params, [k[len(prefix):] for k in fused], rows) if split else \
        row_blocks(inner, params, fused[0][len(prefix):], [rows])
    probed: List[Tuple[str, Any]] = [(names[k], rows) for k in fused]
    if not rows[0]:
        probed += [(names[k], None) for k in unit.params if k not in fused] + [(unit.name, "code")]
    return (OwnCode(block, stubs) if unit.kind == "own" else block), params, probed, "experts" if split else f"{fused[0]} rows"


def _alone(unit: Unit, rows: Optional[Tuple[int, int]], need: int, dtype: torch.dtype, room: int, alone: int) -> bool:
    """Whether a piece is better checked alone, with only its own captures beside it (``alone`` bytes of room), than
    now (``room``): a whole piece, or a Linear or Embedding subclass's block (checked in place at its full size: two
    ``dtype`` copies of its weight more, :func:`_check_piece`), that fits only there."""
    if rows is not None:
        if not isinstance(unit.module, (nn.Linear, nn.Embedding)) or faithful_rows(unit.module):
            return False
        need += in_place_weight_bytes(unit.module, dtype)
    return room < need <= alone


def units_signature(model: nn.Module) -> Tuple:
    """When this changes, the units must be found again: parameters and buffers (names, shapes,
    devices), and every module and parameter by identity (a replaced layer of the same shape too)."""
    return (param_signature(model), tuple((n, id(m)) for n, m in model.named_modules()),
            tuple(id(p) for p in model.parameters()))
