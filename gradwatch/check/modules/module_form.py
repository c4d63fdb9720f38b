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
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from gradwatch.check.judging.report import OVER_ROOM, CheckReport
from gradwatch.check.modules._piece_check import (
    cast_capture,
    check_piece,
    checked_copy,
    file_check,
    float64_copy,
    per_stub_entry,
    unit_copy,
)
from gradwatch.check.modules._sample_cut import fewer_samples
from gradwatch.check.modules.batch_cut import capture_window, forward_cut, positions
from gradwatch.check.modules.capture import Captured, Forward, capture, live_bytes
from gradwatch.check.modules.own_rows import own_group, own_rows_cost
from gradwatch.check.modules.piece_cuts import cut_samples, in_place_weight_bytes, row_block, rows_cost, rows_of, rows_of_one_sample
from gradwatch.check.modules.row_groups import check_group, chunks, groupable, grouped, positions_kept
from gradwatch.check.objective.dtensor import no_collectives
from gradwatch.check.objective.shadow import param_signature
from gradwatch.check.objective.surrogate import find_surrogates, inside, surrogate_note
from gradwatch.options import CheckOptions
from gradwatch.plan.cycle import Piece
from gradwatch.plan.memory import MEASURE_FLOOR, TRIM_BYTES, in_use_bytes, mb, model_device, release_freed
from gradwatch.plan.units import LOSS_FN, Unit, block_rows, faithful_rows, plan_units
from gradwatch.trees import param_names

__all__ = ["PieceView", "Sharded", "float64_copy", "module_units", "run_module_check", "units_signature"]

#: ``view(unit, rows)``: a context giving ``(unit with plain parameters, offset of its rows)`` (sharded models).
PieceView = Callable[[Unit, Optional[Tuple[int, int]]], ContextManager[Tuple[Unit, int]]]


@dataclass
class Sharded:
    """What a check of a sharded model (:mod:`gradwatch.parallel.shard_check`) adds to one process's.

    Attributes:
        view: ``view(unit, rows)`` is a context giving the unit with plain parameters (this rank's rows, or the
            gathered whole) and the offset of its rows. Then exactly one forward of the live model runs (its
            collectives are the same on every rank, whatever this rank's pieces): no capture is deferred to another
            forward, and a piece over the room is cut to the first samples of what that forward captured instead of
            captured again. Its ``ready()``, where it has one, is called on every rank after the first capture (the
            whole pieces gathered then).
        everyone: The names of the units some rank checks in this check, the same on every rank (None: every unit);
            the capture gathers the DTensor inputs of those only.
        forward_bytes: With a room: what a forward of the live model on the batch holds beyond its captures (its
            output and what the loss makes of it, :func:`~gradwatch.check.modules.batch_cut.forward_transient`).
            Where that is over the captures' share of the room (a third) and the check's forwards run to the model's
            output (not ``early``, or the root's or ``loss_fn``'s own code in ``everyone``), they run on the batch's
            first samples, as many as fit, the same count on every rank (an agreement point): its pieces are then cut
            from those.
    """

    view: PieceView
    everyone: Optional[Sequence[str]] = None
    forward_bytes: int = 0


def module_units(model: nn.Module, loss_fn: Any, batch: Any, seed: int = 0) -> List[Unit]:
    """The modules that called no other module, in model order (one counting forward of the live model);
    :func:`gradwatch.plan.units.plan_units` adds the own code of the others.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> [(u.name, sorted(u.params)) for u in module_units(model, lambda m, b: m(b).sum(), torch.ones(1, 2))]
        [('0', ['0.bias', '0.weight']), ('1', [])]
    """
    return plan_units(model, loss_fn, batch, seed, own_code=False)


def run_module_check(
    model: nn.Module,
    objective: Any,
    batch: Any,
    opts: CheckOptions,
    *,
    units: Optional[Sequence[Unit]] = None,
    pieces: Optional[Sequence[Piece]] = None,
    room: Optional[int] = None,
    screen: bool = False,
    early: bool = False,
    replay: Optional[Forward] = None,
    replay_budget: Optional[int] = None,
    seconds: Optional[float] = None,
    sharded: Optional[Sharded] = None,
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
        screen: Detection first in each piece (see :func:`gradwatch.localize.check_module`).
        early: Stop each capture forward once every unit it was run for is captured (one process; sharded, once every
            unit of ``sharded.everyone`` has made its first call, the same point on every rank): the loss is then not
            known here (``report.objective`` stays NaN, for the caller to fill).
        replay: The first capture's forward (:data:`~gradwatch.check.modules.capture.Forward`): the training part's
            replay of the step, run with the capture's hooks (where the batch is cut, without them, before the
            capture). Its ``usable`` attribute, set by the call, says whether the replay's forward computed what the
            isolated forward would (no random draw, no autocast), alike on every rank; where it did not, the capture
            runs again on an isolated forward.
        replay_budget: With ``replay`` and a ``room``: bytes its captures may hold (through the replay's backward);
            the units over it are captured by the next forward, as units over a forward's budget are.
        seconds: One process: no piece begins once the check has run this long; the pieces not begun are in
            ``report.later`` (a paced cycle gives them to the next checks: :meth:`gradwatch.plan.planner.Planner.pace`).
        sharded: A sharded model (:class:`Sharded`); None: one process.

    Returns:
        A :class:`CheckReport` with ``form == "module"``: parameters under their names, a unit's input
        gradient under ``"<module>:input"``, the gradient an own-code unit passes back to a module it called
        under ``"<module>:output"``, and one :class:`~gradwatch.localize.ModuleCheck` per piece in ``localized``.
    """
    run = _Run(model, objective, batch, opts, room, sharded, screen, early, seconds)
    chosen = run.choose(units, pieces)
    part, first = run.plan_room(replay)
    run.capture_rounds(chosen, part, first, replay_budget)
    run.check_solo()
    return run.finish()


class _Run:
    """One module-form check (:func:`run_module_check`) through its stages: the units and pieces chosen, the room
    planned, forwards that capture the units (as many as the captures' share of the room holds each) with the
    pieces of what each captured checked after it, then the pieces that fit only alone, and the report's notes."""

    def __init__(self, model: nn.Module, objective: Any, batch: Any, opts: CheckOptions, room: Optional[int],
                 sharded: Optional[Sharded], screen: bool, early: bool, seconds: Optional[float]) -> None:
        self.start = time.perf_counter()
        self.model, self.objective, self.batch, self.opts = model, objective, batch, opts
        self.room, self.sharded, self.screen, self.early, self.seconds = room, sharded, screen, early, seconds
        self.view = None if sharded is None else sharded.view
        self.dtype = opts.torch_dtype or torch.float64
        self.skipped: List[str] = []
        self.estimate = 0
        self.unused = 0
        self.ran = 0  # groups of pieces run (the pace never leaves a check without one)
        self.per_position = 0.0  # bytes of the model's output per position of the batch, as a forward to its end saw them
        # pieces that fit the room only without the other captures beside them (and the batch they were captured on)
        self.solo: List[Tuple[Piece, Any]] = []

    def choose(self, units: Optional[Sequence[Unit]], pieces: Optional[Sequence[Piece]]) -> List[Unit]:
        """The units and pieces of the check and the report it fills (the units under a declared surrogate left out,
        and ``loss_fn``'s own code where it cannot run without the model); returns the units to capture."""
        model, objective, opts = self.model, self.objective, self.opts
        if units is None:
            units = plan_units(model, objective.loss, self.batch, opts.seed)
        surrogates = find_surrogates(model, opts.surrogates)
        units = [u for u in units if not inside(u.name, surrogates)]  # their gradient is a surrogate by design
        self.units, self.by_name = units, {u.name: u for u in units}
        if pieces is None:
            pieces = [Piece(u.name) for u in units]
        report = self.report = CheckReport(tensors={}, fail_at=opts.fail_verdict, seed=opts.seed, dtype="float64")
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
        self.pieces = pieces
        return list({p.unit: self.by_name[p.unit] for p in pieces if p.unit in self.by_name}.values())

    def plan_room(self, replay: Optional[Forward]) -> Tuple[Any, Optional[Forward]]:
        """The captures' budget and the process's limit; returns the batch the forwards run on and the forward the
        first capture runs (``replay``, or None where the batch is cut: the replay then ran on its own)."""
        self.canonical = param_names(self.model)
        view, sharded, room = self.view, self.sharded, self.room
        self.agree = getattr(view, "agree", None)
        checked = None if sharded is None or sharded.everyone is None else set(sharded.everyone)
        self.shared = () if view is None else self.units if checked is None else [u for u in self.units if u.name in checked]
        # Captures take a third of the room at most; units that do not fit together are captured by later forwards
        # (sharded: as many on every rank, agreed after each; without a way to agree, one forward holding them all).
        self.budget = None if room is None or (view is not None and self.agree is None) else room // 3
        # What the pieces leave in the process's heap (freed, not given back) is measured too: the pieces of a check
        # never hold more than the room above what the process held when they began (at least MEASURE_FLOOR above
        # it: what a process's first float64 evaluations take once).
        self.device = model_device(self.model)
        self.limit = None if room is None else in_use_bytes(self.device) + max(room, MEASURE_FLOOR)
        part = self.batch
        # Only forwards that run to the model's output are cut (FSDP2's and ZeRO-3's always do; under tensor and
        # sequence parallel, those of a check where some rank checks the root's or loss_fn's own code): the others
        # stop before it.
        to_the_end = not self.early or any(u.name in (LOSS_FN, "") for u in self.shared)
        if self.budget is not None and self.agree is not None and to_the_end:  # alike on every rank: room, plan, engine and view
            assert sharded is not None
            part = forward_cut(self.batch, sharded.forward_bytes, self.budget, self.agree, self.report)
        if replay is not None and part is not self.batch:  # the batch cut (alike on every rank): the replay runs on its own
            replay({}, {})
            replay = None
        return part, replay

    def capture_rounds(self, remaining: List[Unit], part: Any, first: Optional[Forward],
                       replay_budget: Optional[int]) -> None:
        """Forwards that capture the ``remaining`` units, each followed by the pieces of what it captured."""
        once = self.view is not None  # sharded: one forward on every rank, even with no piece of its own
        # one process: once, where the whole batch's captures leave units or pieces over the room, the rest is captured
        # on a window of the batch's samples (said once its capture ran)
        windowing = self.view is None and self.budget is not None
        window: Optional[str] = None
        began = False
        while remaining or once:
            once = False
            if began and self.limit is not None and in_use_bytes(self.device) > self.limit - (self.budget or 0):
                release_freed()  # what the pieces freed, before another forward captures
            got = self.capture(part, remaining, first, replay_budget, window)
            if got is None:  # a model that refuses a window of its batch: the rest on the whole batch
                part, window = self.batch, None
                continue
            window = None
            self.settle(got, part, first, began)
            first, began = None, True
            held = _held(got)
            # one process, the whole batch: whole pieces over the room (or only alone in it) are captured again by one
            # forward, with the deferred units, on a window of the batch that fits them all (unit name -> need)
            later: Optional[Dict[str, int]] = {} if windowing else None
            self.check_captured(got, part, held, later)
            progress = len(got.inputs) + len(got.big)
            remaining = [self.by_name[n] for n in got.deferred + list(later or ()) if n in self.by_name] if progress else []
            if later is not None and remaining and self.room is not None and self.budget is not None:
                windowing = False
                part, window = capture_window(self.batch, held, live_bytes(got.inputs), got.deferred_bytes, self.budget,
                                              self.opts.seed, list(later.values()), self.room - self.budget)
            if remaining and self.ran and _late(self.start, self.seconds):  # not captured: their pieces wait for the next checks
                names = {u.name for u in remaining}
                self.report.later.extend(str(p) for p in self.pieces if p.unit in names)
                remaining = []
            if not progress and got.deferred:
                self.skipped.extend(f"{self.by_name[n].label} (its inputs do not fit in the room)" for n in got.deferred)
            del got
            if self.view is not None and self.budget is not None and self.agree is not None:
                once = self.agree(0 if remaining else 1) == 0  # another forward on every rank while any rank needs one

    def capture(self, part: Any, remaining: List[Unit], first: Optional[Forward], replay_budget: Optional[int],
                window: Optional[str]) -> Optional[Captured]:
        """One capture's forward on ``part`` (``first``, where given, runs it); None where the model refused ``part``, a
        window of the batch. A replay whose forward did not compute the isolated forward's values is captured again."""
        budget = self.budget
        try:
            got = capture(self.model, self.objective.loss, part, remaining, self.opts.seed,
                          budget=budget if first is None or replay_budget is None or budget is None
                          else min(budget, replay_budget),
                          everyone=self.shared, agree=self.agree, alone=self.view is not None, early=self.early,
                          forward=first)
        except Exception:  # noqa: BLE001 - a model that refuses a window of its batch: the rest on the whole batch
            if part is self.batch:
                raise
            return None
        if window is not None:
            self.report.notes.append(
                f"module form: {len(remaining)} unit(s) captured and checked on {window} (a new window each check): on "
                "the whole batch their inputs are over the captures' share of the room "
                f"({mb(budget)}), which would take a forward of the model per share")
        if first is not None and (got.stale or not getattr(first, "usable", False)):  # not the isolated forward's values
            got = capture(self.model, self.objective.loss, part, remaining, self.opts.seed, budget=budget,
                          everyone=self.shared, agree=self.agree, alone=self.view is not None, early=self.early)
        return got

    def settle(self, got: Captured, part: Any, first: Optional[Forward], began: bool) -> None:
        """After a capture: the sharded view made ready, the limit taken where the pieces begin, the first forward's
        loss and output size kept."""
        ready = getattr(self.view, "ready", None)
        if ready is not None:  # on every rank, after its first capture: the whole pieces' parameters gathered now
            ready()
        if self.limit is not None and self.room is not None and not began and (first is not None or ready is not None):
            # what the process holds now, but the captures, is where the pieces begin: the whole pieces' parameters
            # just gathered, and what a replay run as this capture left (it ran after the limit was first taken)
            self.limit = in_use_bytes(self.device) - _held(got) + max(self.room, MEASURE_FLOOR)
        self.per_position = self.per_position or got.model_bytes / positions(part)
        report = self.report
        if report.objective != report.objective and got.loss is not None and part is self.batch:  # the first forward's loss
            report.objective = got.loss
            report.terms = {"loss": got.loss}
            report.nonfinite = report.nonfinite or not math.isfinite(got.loss)  # said once, for the whole check

    def check_captured(self, got: Captured, part: Any, held: int, later: Optional[Dict[str, int]]) -> None:
        """The pieces of the units ``got`` captured (on ``part``; ``held``: bytes the captures hold), in order, a
        group of row blocks together; the pace's late pieces left to the next checks."""
        for item in grouped(self.pieces, self.by_name):
            unit = self.by_name.get(item[0].unit)
            if unit is None or (unit.name not in got.inputs and unit.name not in got.big):
                continue
            if self.ran and _late(self.start, self.seconds):  # (a check runs one piece at least: never all overhead)
                self.report.later.extend(str(p) for p in item)
                continue
            self.ran += 1
            left = self.left(held)
            # shard by shard, a rank's one block of a unit too (it holds fewer rows: often one block a check), on the
            # group's positions, as the blocks of a group are
            if (len(item) > 1 or ((self.view is not None or unit.kind == "own") and groupable(item[0], unit))) \
                    and unit.name in got.inputs:
                item = self.run_group(unit, [p.rows for p in item if p.rows], got, left)
            for piece in item:
                self.run_piece(unit, piece, got, part, left,
                               solo=self.solo if len(got.inputs) > 1 and self.view is None else None, later=later)

    def left(self, held: int) -> Optional[int]:
        """The room a piece has beside captures holding ``held`` bytes, within what the process may still add."""
        left = None if self.room is None else max(0, self.room - held)
        if self.limit is not None and left is not None:
            left = _measured(left, self.limit, self.device)
        return left

    def check_solo(self) -> None:
        """The pieces that fit the room only alone: each captured again, its own captures only beside its check."""
        for piece, on in self.solo:
            unit = self.by_name[piece.unit]
            if self.ran and _late(self.start, self.seconds):
                self.report.later.append(str(piece))
                continue
            self.ran += 1
            if self.limit is not None:
                release_freed()  # what the pieces before freed, before this capture's forward
            got = capture(self.model, self.objective.loss, on, [unit], self.opts.seed,
                          budget=None if self.room is None else self.room // 3, early=self.early)
            if unit.name in got.inputs or unit.name in got.big:
                self.run_piece(unit, piece, got, on, self.left(_held(got)))
            del got

    def finish(self) -> CheckReport:
        """The report, with its notes on the pieces left to later checks, not reached, or over the room."""
        report, seconds, skipped = self.report, self.seconds, self.skipped
        if report.later:
            report.notes.append(f"module form: {len(report.later)} piece(s) left to the next checks, this check's pieces "
                                f"having taken the {seconds:.2f} s its pace gives them: "
                                f"{', '.join(p or '<model>' for p in report.later[:4])}{', ...' if len(report.later) > 4 else ''}")
        if self.unused:
            report.notes.append(f"module form: {self.unused} embedding slice(s) held no token of this batch (their rows "
                                "count as unreached until a batch uses them)")
        if skipped:
            report.notes.append(
                f"module form: {len(skipped)} piece(s) not checked, over the room the memory budget leaves "
                f"({mb(self.room)}): {'; '.join(skipped[:4])}{'; ...' if len(skipped) > 4 else ''}")
        report.memory = {"estimate_bytes": self.estimate, "output_per_position": self.per_position}
        report.seconds = time.perf_counter() - self.start
        return report

    def run_group(self, unit: Unit, blocks: List[Tuple[int, int]], got: Captured, room: Optional[int]) -> List[Piece]:
        """The row blocks of a plain Linear or Embedding, or of an own code's big parameter (in place: own_rows.py), in
        one piece each run of them that fits the room; returns the blocks alone in their run (checked as any piece).
        With a ``view`` (sharded), the blocks are this rank's rows, checked on its shard (one offset for them all)."""
        own = unit.kind == "own"
        view, dtype, opts, report = self.view, self.dtype, self.opts, self.report
        (args, kwargs), children, _, _, constants = cast_capture(got, unit, None, dtype)
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
            self.estimate = max(self.estimate, need)
            began = time.perf_counter()
            with view(unit, run[0]) if view is not None else contextlib.nullcontext((unit, 0)) as (local_unit, offset), \
                    _one_rank(view, local_unit):  # one rank alone
                if own:
                    local, (a, k), leaves, kept, probed, kind = own_group(unit, run, (args, kwargs), children, set(constants),
                                                                          dtype, self.canonical, unit_copy)
                    result, empty = checked_copy(unit.name, local, a, k, leaves, opts, unit.calls, dtype, kept, self.screen), 0
                    result.type = kind
                else:
                    result, probed, empty = check_group(local_unit, run, args, kwargs, opts, dtype, self.canonical, constants,
                                                        self.screen, offset)
            report.spent(unit.name, time.perf_counter() - began, covered)
            report.pieces.extend(str(Piece(unit.name, b)) for b in run)
            self.unused += max(empty, file_check(report, unit, result, probed))
            if room is not None and need >= TRIM_BYTES:
                release_freed()
        return single

    def run_piece(self, unit: Unit, piece: Piece, got: Captured, batch: Any, room: Optional[int],
                  solo: Optional[List[Tuple[Piece, Any]]] = None, later: Optional[Dict[str, int]] = None) -> None:
        """One piece of a captured unit: fit it to ``room`` (rows, or fewer samples), check it, file the result.

        ``batch`` is the batch the piece was captured on (the check's, or a window of it: :func:`capture_window`).
        ``solo`` and ``later``: where a piece that fits only alone goes (:meth:`put_aside`); with ``later``, a whole
        piece over the room (no row block fits) goes there too, instead of a forward of its own."""
        opts, report, view = self.opts, self.report, self.view
        constants: Set[int] = set()
        rows = piece.rows
        began = time.perf_counter()
        if unit.name in got.inputs:
            (args, kwargs), children, out_bytes, need, constants = cast_capture(got, unit, rows, self.dtype)
        else:  # over the capture budget alone: its float64 check cannot fit the room on the whole batch
            args = kwargs = None
            children = {}
            out_bytes = 0
            need = got.big[unit.name] * 2 * per_stub_entry(unit) // 8  # float32 to float64, then its copies
        if self.put_aside(unit, piece, got, batch, room, need, args is None, solo, later):
            return
        if room is not None and (need > room or args is None):  # (not captured: cut, or said, never checked on nothing)
            block = None if args is None else row_block(unit, (args, kwargs), out_bytes, room // 2, opts.seed, rows)
            samples = ""  # the samples a row block is checked on, where not the whole batch
            if block is None and later is not None and rows is None:
                later[unit.name] = need
                return
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
                smaller = fewer_samples(self.model, self.objective.loss, batch, unit, need, room, opts.seed, self.dtype, rows)
            if block is None and smaller is None:
                self.skip(unit, piece, need, room)
                return
            if block is not None:
                self.note_cut(unit, f"output rows {block[0]}:{block[1]} of {rows_of(unit)}{samples} (its "
                              f"{'slice' if rows else 'whole'} float64 check needs about {mb(need)}; the rows rotate from "
                              "check to check)")
                rows, need = (block[0], block[1]), block[2]
            else:
                assert smaller is not None
                whole_need = need
                (args, kwargs), children, need, what, constants = smaller
                in_window = batch is not self.batch
                self.note_cut(unit, f"{what.replace(' the batch', ' the window') if in_window else what} (on "
                              f"{'the window' if in_window else 'the whole batch'} its float64 check needs about {mb(whole_need)})")
        self.estimate = max(self.estimate, need)
        with view(unit, rows) if view is not None else contextlib.nullcontext((unit, 0)) as (local_unit, offset), \
                _one_rank(view, local_unit):  # one rank alone: none may communicate
            result, probed = check_piece(local_unit, rows, args, kwargs, children, opts, self.dtype, self.canonical,
                                         self.objective.loss, constants, offset=offset, screen=self.screen,
                                         faithful_room=float("inf") if room is None else max(0, room - need))
        del args, kwargs, children
        if result.inconclusive is not None and result.inconclusive.endswith(OVER_ROOM):
            report.unfit.append(str(piece))
        if room is not None and need >= TRIM_BYTES:
            release_freed()  # what this piece's check freed, before the next one allocates (smaller frees are reused)
        report.pieces.append(str(Piece(unit.name, rows)))
        report.spent(unit.name, time.perf_counter() - began, 0 if rows is None else rows[1] - rows[0])
        self.unused += file_check(report, unit, result, probed)

    def put_aside(self, unit: Unit, piece: Piece, got: Captured, batch: Any, room: Optional[int], need: int,
                  uncaptured: bool, solo: Optional[List[Tuple[Piece, Any]]], later: Optional[Dict[str, int]]) -> bool:
        """Whether a piece that fits the check's room only without the other captures beside it (or that ``got`` did
        not capture: a forward of its own captures it) was put aside: a whole piece in ``later`` where given (to be
        captured by the next forward on a window of the batch's samples that fits it, its need on ``batch`` kept),
        else in ``solo`` (with ``batch``, to be checked again alone). Never without ``solo``."""
        if room is None or solo is None or self.room is None:
            return False
        if not uncaptured and not _alone(unit, piece.rows, need, self.dtype, room, self.room
                                         - live_bytes(got.inputs.get(unit.name)) - live_bytes(got.children.get(unit.name))):
            return False
        if later is not None and piece.rows is None:
            later[unit.name] = need
        else:
            solo.append((piece, batch))
        return True

    def skip(self, unit: Unit, piece: Piece, need: int, room: int) -> None:
        """A piece over the room that no cut fits: said (the check's whole room is said once, after every piece)."""
        rows = piece.rows
        self.skipped.append(f"{unit.label}{'' if rows is None else f' rows {rows[0]}:{rows[1]}'} needs about {mb(need)} "
                            f"with {mb(room)} left to it")
        self.report.unfit.append(str(piece))

    def note_cut(self, unit: Unit, what: str) -> None:
        """The report says what a piece over the room was checked on instead."""
        self.report.notes.append(f"module form: {unit.label} checked on {what}")


def _late(start: float, seconds: Optional[float]) -> bool:
    """Whether a check that began at ``start`` has run its ``seconds`` (None: never)."""
    return seconds is not None and time.perf_counter() - start > seconds


_TORCH_MODULES = "torch.nn.modules."


def _one_rank(view: Optional[PieceView], unit: Unit) -> ContextManager[Any]:
    """Around a piece checked by one rank alone (with a ``view``): collectives refused
    (:func:`~gradwatch.check.objective.dtensor.no_collectives`), unless the piece is torch's own modules only (a
    Linear, a LayerNorm, an Embedding: on the view's plain tensors they make none). The refusing mode sees every
    operator of the piece's evaluations, which costs time at every check, so only code of yours (a module's own code,
    a module of your class) and a module with a parameter left a DTensor run in it."""
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


def _alone(unit: Unit, rows: Optional[Tuple[int, int]], need: int, dtype: torch.dtype, room: int, alone: int) -> bool:
    """Whether a piece is better checked alone, with only its own captures beside it (``alone`` bytes of room), than
    now (``room``): a whole piece, or a Linear or Embedding subclass's block (checked in place at its full size: two
    ``dtype`` copies of its weight more, :func:`~gradwatch.check.modules._piece_check.check_piece`), that fits only
    there."""
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
