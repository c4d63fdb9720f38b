"""The planner: what one check of the backward part covers, and what the run has covered so far.

:class:`GradWatch` asks the planner before each check and runs what it says:

1. the **form**: the whole objective on a float64 copy where it fits the room ``memory_budget``
   leaves, else the module form (:mod:`gradwatch.check.modules.module_form`);
2. in the module form, the **units** (:mod:`gradwatch.plan.units`: every module's own code, and the
   modules that call no other) and this check's **pieces** from the **cycle**
   (:mod:`gradwatch.plan.cycle`): after ``K`` checks every unit and every row of every sliced
   parameter has been probed once;
3. after the check, the **coverage** (:mod:`gradwatch.plan.coverage`) from what the report probed.

Example:
    >>> import torch
    >>> from torch import nn
    >>> planner = Planner(form="module")
    >>> model = nn.Sequential(nn.Linear(2, 600), nn.Tanh(), nn.Linear(600, 1))
    >>> watched = [n for n, _ in model.named_parameters()]
    >>> units, pieces = planner.module_pieces(model, lambda m, b: m(b).sum(), torch.ones(3, 2), watched)
    >>> planner.cycle_length, [str(p) for p in pieces]
    (3, ['<loss_fn>', '0[400:600]'])
"""

from __future__ import annotations

import math
import re
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch import nn

from gradwatch.check.judging.report import CheckReport
from gradwatch.check.objective.surrogate import find_surrogates, inside
from gradwatch.check.probes.experts import NOT_REACHED, expert_of
from gradwatch.plan.coverage import Coverage
from gradwatch.plan.cycle import PACE_SHARE, PACED_SECONDS, PACED_STEP_SECONDS, PIECE_STEPS, ROWS_PER_SLICE, Cycle, Piece, fewest_whole
from gradwatch.plan.memory import MODULE_BYTES_PER_ENTRY, SAFETY, mb, numel_of, objective_bytes
from gradwatch.plan.units import Unit, block_bytes, block_rows, expert_rows, in_place_param, plan_units, sliceable_rows
from gradwatch.trees import param_names, whole_shape

#: The module form, measured cheaper than the whole objective, is left only where a pass of it takes this many times a
#: pass of the whole objective: the two are timed at different checks (the whole objective once), and a loaded machine
#: moves either by that much (a LoRA GPT-2's trial under a test run on 2 cores was slowed past it, and the watch
#: went back to the whole objective at its third check).
KEEP_MODULES = 2.0


def slice_rows(module: nn.Module, room: Optional[int]) -> int:
    """Rows of ``module``'s weight whose float64 check fits in half of ``room`` (all when unbounded).

    Example:
        >>> slice_rows(nn.Linear(1000, 4000), 10 * 2**20)
        109
    """
    weight = getattr(module, "weight", None)
    shape = whole_shape(weight) if isinstance(weight, torch.Tensor) else ()
    if room is None or not shape:
        return ROWS_PER_SLICE
    # from the whole shape: a DTensor row is a collective, a ZeRO-3 placeholder is empty
    per_row = (math.prod(shape[1:]) + 1) * MODULE_BYTES_PER_ENTRY
    return max(1, (room // 2) // per_row)


def slice_blocks(unit: Unit, room: int) -> int:
    """Experts (or rows) of a block checked in place (:func:`~gradwatch.plan.units.block_rows`), at least one: of a
    unit holding fused expert tensors, as many as fit in half of ``room`` with the whole unit's float64 copy
    (:func:`~gradwatch.plan.units.expert_bytes`); of an own code's big parameter
    (:func:`~gradwatch.plan.units.in_place_param`), whose whole copy may itself take over half the room, half of what
    that copy leaves.

    Example:
        >>> class Experts(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.zeros(8, 256, 256))
        >>> m = Experts()
        >>> slice_blocks(Unit("experts", m, {"experts.w": m.w}), 40 * 2**20)
        5
    """
    fixed, per_row = block_bytes(unit)
    return max(1, ((room // 2 - fixed) if expert_rows(unit) else (room - fixed) // 2) // max(per_row, 1))


def own_rows(unit: Unit, room: Optional[int]) -> Optional[int]:
    """Rows an own code's check is cut by in place (:func:`~gradwatch.plan.units.in_place_param`) where, whole, it
    would hold over half of ``room``; None where it fits, or holds no such parameter, or the room is unbounded.

    Example:
        >>> m = nn.Linear(100, 5000)
        >>> unit = Unit("", m, {"weight": m.weight}, kind="own")
        >>> own_rows(unit, 10 * 2**20), own_rows(unit, 100 * 2**20), own_rows(unit, None)
        (5000, None, None)
    """
    if room is None or in_place_param(unit) is None or numel_of(unit.params.values()) * MODULE_BYTES_PER_ENTRY <= room // 2:
        return None
    return block_rows(unit)


def frozen_only(model: nn.Module, watched: Any) -> bool:
    """Whether the watch is narrower than the model only because the rest is frozen (adapters: LoRA over a frozen
    base), not because ``tensors`` narrows it.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)); _ = m[0].requires_grad_(False)
        >>> frozen_only(m, {"1.weight", "1.bias"}), frozen_only(m, {"1.weight"})
        (True, False)
    """
    return {n for n, p in model.named_parameters() if p.requires_grad} <= set(watched)


def between(unit: Unit) -> bool:
    """A unit of the frozen code between adapters and the loss that is checked for what it passes back to them: code
    with no parameter (own code, ``loss_fn``, activations) and modules whose frozen parameters are all 1-D (norms).

    Example:
        >>> between(Unit("ln", nn.LayerNorm(4), dict(nn.LayerNorm(4).named_parameters())))
        True
        >>> between(Unit("fc", nn.Linear(2, 2), dict(nn.Linear(2, 2).named_parameters())))
        False
    """
    if unit.kind == "loss_fn":
        return True
    held = unit.module.parameters(recurse=unit.kind == "module")  # own code: the module's own, not its children's
    return all(p.dim() <= 1 for p in list(held) + list(unit.params.values()))


def adapter_bases(units: Sequence[Unit], watched: Set[int]) -> Set[str]:
    """The frozen layers adapters wrap (peft's ``base_layer``): module units with no watched parameter that an own
    code calls beside a unit holding a watched tensor (``id`` in ``watched``). Their frozen weights are not checked,
    but the gradient they pass back to their input is: a wrong backward there reaches the adapters below it, and no
    other unit sees it (the wrapper's own code stands a stub for the base layer).

    Example:
        >>> base, a = Unit("l.base", nn.Linear(2, 2)), Unit("l.a", nn.Linear(2, 1))
        >>> a.params = dict(a.module.named_parameters())
        >>> wrapper = Unit("l", nn.Module(), kind="own", stubbed=("l.base", "l.a"))
        >>> sorted(adapter_bases([wrapper, base, a], {id(p) for p in a.params.values()}))
        ['l.base']
    """
    holds = {u.name for u in units if any(id(p) in watched for p in u.params.values())}
    kinds = {u.name: u.kind for u in units}
    return {c for u in units if u.kind == "own" and holds.intersection(u.stubbed)
            for c in u.stubbed if c not in holds and kinds.get(c) == "module"}


def _probe(cov: Coverage, part: str, name: str, check: Any, rows: Any) -> None:
    """``part`` probed tensor ``name``'s ``rows`` (None: all); an expert's key its expert's row, unless not reached."""
    found = expert_of(name)
    if found is None:
        cov.probe(part, name, rows)
    elif check.inconclusive != NOT_REACHED:
        cov.probe(part, found[0], (found[1], found[1] + 1))


def _rows(p: torch.Tensor) -> int:
    """Rows of a parameter's whole shape (a DeepSpeed ZeRO-3 placeholder's ``ds_shape``, not its empty one)."""
    shape = tuple(getattr(p, "ds_shape", None) or p.shape)
    return int(shape[0]) if shape else 1


#: Seconds a check of the whole objective may take before ``form="auto"`` times the module form against it: below
#: this, the whole objective's fuller view stays (a tiny Llama under TRL's SFTTrainer took over a second on a
#: loaded 2-core machine); a LoRA GPT-2 with its large vocabulary is many times faster in modules
#: (docs/guides/big-models.md).
TRIAL_SECONDS = 5.0


class Planner:
    """Chooses the form and the pieces of each check, and keeps the coverage.

    Args:
        form: ``"auto"``, ``"objective"`` or ``"module"`` (the ``form`` option).
        tensors_per_check: Tensors (objective form) or whole units (module form) per check; 0: all.
        seed: The watch's seed (the order of slices in each pass follows it).
        memory_budget: For messages only (the room is measured by the watch).
        pace: Training steps a module-form check's pieces may take (the ``pace`` option; None: no pace).
    """

    def __init__(self, form: str = "auto", tensors_per_check: int = 0, seed: int = 0,
                 memory_budget: Optional[float] = None, pace: Optional[float] = PIECE_STEPS) -> None:
        self.form = form
        self.pace_steps = pace
        self.tensors_per_check = tensors_per_check
        self.seed = seed
        self.memory_budget = memory_budget
        self.coverage = Coverage({})
        self._key: Optional[Tuple] = None
        self._units: List[Unit] = []
        self._cycle: Optional[Cycle] = None
        self._checks = 0  # module-form checks planned on this cycle
        self._resume_at = 0  # from a resumed run's state: where the cycle goes on once the units are found
        self._handed: List[Piece] = []  # the last check's pieces
        self._rows: Dict[str, Optional[int]] = {}  # the cycle's units, and the rows each is sliced by
        self._per_slice: Dict[str, int] = {}
        self._owed: List[Piece] = []  # of those, the ones that did not fit its room: the next check takes them first
        self.announced: Optional[str] = None  # the line said once when the cycle is known
        self._said: set = set()  # what was not checked, said once each
        self._seconds: Dict[str, float] = {}  # the last check's seconds in each form (what the form's choice weighs)
        self._done: Dict[str, int] = {}  # whole unit -> the last module-form check that checked it (a paced cycle's order)
        self._recorded = 0  # module-form checks recorded
        self._pace_scale = 1.0  # a check's whole pace over what its pieces were given of it (the rest: its planning)
        self._held: Deque[float] = deque(maxlen=4)  # pieces the last paced checks held (as if given the whole pace)

    # ------------------------------------------------------------------ the form
    def choose_form(self, model: nn.Module, names: Sequence[str], room: Optional[int], dtype: Optional[torch.dtype],
                    held: bool, transient: int, hand_written: bool, plain: bool = False
                    ) -> Tuple[str, Optional[int], Optional[str]]:
        """``(form, estimate in bytes, a note or None)``: the whole objective where it fits the room, else modules.

        ``held``: the float64 copy of the model is held already (counted in what is in use now);
        ``transient``: training's activations; ``hand_written``: a ``grad_fn`` gives the whole gradient.
        ``plain``: the objective is the loss alone (no regularizer, coupled weight decay or derivative inside: what
        only the whole objective checks), so where it fits, ``form="auto"`` also weighs the forms' measured cost
        (:meth:`timed`, :meth:`cheaper_in_modules`).
        """
        estimate = objective_bytes(model, names, dtype, activations=transient)
        if held:
            estimate -= objective_bytes(model, [], dtype)
        fits = room is None or estimate <= SAFETY * room
        if self.form == "auto" and fits and plain and not hand_written and dtype is not None:
            cheaper = self.cheaper_in_modules(len(names))
            if cheaper is not None:
                return "module", None, cheaper
        if self.form == "objective" or (self.form == "auto" and fits):
            note = None
            if room is not None and estimate > SAFETY * room:
                note = (f"form: objective (forced): about {mb(estimate)} above what training holds, over the room "
                        f"memory_budget={self.memory_budget} leaves ({mb(room)})")
            return "objective", estimate, note
        if hand_written or dtype is None:
            why = "grad_fn= (hand-written backprop of the whole objective)" if hand_written else "dtype=None (in place)"
            return "objective", estimate, (f"form: objective: the module form cannot check {why}; it needs about "
                                           f"{mb(estimate)}, over the room memory_budget leaves ({mb(room)})")
        if self.form == "module":
            return "module", None, None
        return "module", None, (f"form: module: the whole objective in {str(dtype).replace('torch.', '')} needs about "
                                f"{mb(estimate)}, over the room memory_budget={self.memory_budget} leaves "
                                f"({mb(room)}); each unit is checked alone")

    def timed(self, form: str, seconds: float) -> None:
        """A check in ``form`` (``"objective"`` or ``"module"``) took ``seconds``, every part of it."""
        self._seconds[form] = float(seconds)

    def cheaper_in_modules(self, tensors: int) -> Optional[str]:
        """Why the module form is taken where the whole objective fits (None: it is not): a check of the whole
        objective took over :data:`TRIAL_SECONDS` and the module form was never timed (it is, once), or checking
        every unit in modules takes less than :data:`KEEP_MODULES` times checking every tensor in the whole objective
        (each form's last check times its K).

        Example:
            >>> p = Planner()
            >>> p.timed("objective", 3.0); p.cheaper_in_modules(4) is None
            True
            >>> p.timed("objective", 13.7); p.cheaper_in_modules(4)[:40]
            'form: module: a check of the whole objec'
            >>> p.timed("module", 0.75); p.cheaper_in_modules(4)[:40]
            'form: module: every unit in 1 check of 0'
            >>> p.timed("module", 20.0); p.cheaper_in_modules(4)[:40]  # within KEEP_MODULES of it: kept
            'form: module: every unit in 1 check of 2'
            >>> p.timed("module", 30.0); p.cheaper_in_modules(4) is None
            True
        """
        whole, modules = self._seconds.get("objective"), self._seconds.get("module")
        if whole is None or whole < TRIAL_SECONDS:
            return None
        if modules is None:
            return (f"form: module: a check of the whole objective took {whole:.1f} s; the module form is timed "
                    "against it once (form='objective' keeps the whole objective)")
        k, k_whole = self.cycle_length or 1, self.objective_cycle(tensors)
        if modules * k >= KEEP_MODULES * whole * k_whole:
            return None
        return (f"form: module: every unit in {k} check{'s' if k != 1 else ''} of {modules:.2f} s, against "
                f"{whole:.1f} s a check of the whole objective (form='objective' keeps the whole objective)")

    # ------------------------------------------------------------------ the module form
    def mark(self) -> Tuple[Any, ...]:
        """Where the module form's plan stands (units, cycle and position), for :meth:`rewind`."""
        return self._cycle, self._key, self._units, self._checks, self._resume_at, self.announced

    def rewind(self, mark: Tuple[Any, ...]) -> None:
        """Back to ``mark``: sharded, a check that failed on some rank is undone on every rank, so that all plan
        the same pieces (and make the same gathers) at the next one."""
        self._cycle, self._key, self._units, self._checks, self._resume_at, self.announced = mark

    def module_pieces(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any,
                      watched: Sequence[str], key: Optional[Tuple] = None, seed: int = 0,
                      room: Optional[int] = None, surrogates: Any = None) -> Tuple[List[Unit], List[Piece]]:
        """The units of ``model`` and the pieces of this check; the units are found again when ``key`` changes.

        ``room`` (bytes a piece may hold, at the first check of a plan): a row slice holds at most half of it.
        ``surrogates`` (the option): those modules and what is inside them are no units.
        """
        if self._cycle is None or key is None or key != self._key:
            found = find_surrogates(model, surrogates)
            units = [u for u in plan_units(model, loss_fn, batch, seed) if not inside(u.name, found)]
            chosen = set(watched)
            names = param_names(model)
            if len(chosen) < len(names):  # a narrower watch: the units that hold a watched tensor
                adapters = frozen_only(model, chosen)  # and, over a frozen base, the code between them and the loss
                bases = adapter_bases(units, {i for i, n in names.items() if n in chosen}) if adapters else set()
                units = [u for u in units if any(names.get(id(p)) in chosen for p in u.params.values())
                         or (adapters and (between(u) or u.name in bases))]
            self._units, self._key = units, key
            rows = {u.name: (sliceable_rows(u.module) if u.kind == "module" else None) or expert_rows(u) or own_rows(u, room)
                    for u in units}
            per_slice = {u.name: slice_blocks(u, room) if u.kind == "own" or expert_rows(u) else slice_rows(u.module, room)
                         for u in units if rows[u.name] and room is not None}
            self._rows, self._per_slice = rows, per_slice
            self._cycle = Cycle(rows, self.tensors_per_check, self.seed, per_slice)
            self._checks, self._resume_at = self._resume_at, 0
            self.announced = None
        pieces = self._cycle.pieces(self._checks)
        pieces = self._owed + [p for p in pieces if p not in self._owed]
        self._checks, self._owed, self._handed = self._checks + 1, [], pieces
        return self._units, pieces

    def owe(self, unfit: Sequence[str]) -> None:
        """The pieces of the last check that did not fit its room (``str`` of each): the next check takes them first,
        before its own turn of the cycle (a room that changes from check to check delays a piece, never skips it
        for a whole pass)."""
        names = set(unfit)
        self._owed = [p for p in self._handed if str(p) in names]

    def pace_seconds(self, step_seconds: Optional[float], spent: float = 0.0) -> Optional[float]:
        """Seconds this check's pieces may take (one process, the module form): the ``pace`` option's training steps of
        ``step_seconds`` less the ``spent`` seconds the check's planning took (finding the units, counting the
        activations: a first check's forwards), at least half of it and :data:`PACED_SECONDS`; None (no bound)
        where the ``pace`` option is None, where the step is not known or shorter than :data:`PACED_STEP_SECONDS`,
        or where a cycle without row slices already spreads its whole units over
        :data:`~gradwatch.plan.cycle.CHECKS_PER_PASS` checks (a cycle with slices is paced by making K longer:
        :meth:`pace`).

        Example:
            >>> p = Planner()
            >>> p.pace_seconds(0.5) is None  # before a plan
            True

        :meth:`pace` weighs what the pieces held in the time given them as if they had had the whole pace.
        """
        cycle = self._cycle
        if self.pace_steps is None or step_seconds is None or step_seconds < PACED_STEP_SECONDS or cycle is None or \
                self.tensors_per_check > 0 or (not cycle.slices and cycle.per_check <= fewest_whole(len(cycle.whole))):
            return None
        whole = max(PACED_SECONDS, self.pace_steps * step_seconds)
        given = max(PACED_SECONDS, whole - max(0.0, spent), whole / 2)  # (the pieces keep half of it at least)
        self._pace_scale = whole / given
        return given

    def pace(self, later: Sequence[str]) -> Optional[str]:
        """The pieces a check's :meth:`pace_seconds` could not hold (``str`` of each): the cycle is planned again with
        as many whole units a check as that check held (at least a :data:`~gradwatch.plan.cycle.CHECKS_PER_PASS`-th
        of them), the units never checked first, then the least recently checked (those left among them first); row
        slices left are owed (:meth:`owe`). Returns the line that says it (None
        where nothing changed).

        Example:
            >>> from torch import nn
            >>> model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(16)])
            >>> p = Planner()
            >>> names = [n for n, _ in model.named_parameters()]
            >>> def plan():
            ...     return p.module_pieces(model, lambda m, b: m(b).sum(), torch.randn(1, 2), names, key=("k",))[1]
            >>> pieces = plan()
            >>> p.cycle_length, [str(q) for q in pieces[:5]]
            (1, ['<loss_fn>', '0', '1', '2', '3'])
            >>> p.pace([str(q) for q in pieces[4:]])  # 4 of its 17 units fitted a check's time
            'the pieces of a check took its pace: 4 whole units a check now, within K = 5 checks'
            >>> [str(q) for q in plan()]
            ['3', '4', '5', '6']
        """
        cycle = self._cycle
        if cycle is None or not later:
            return None
        names = set(later)
        if cycle.slices:
            return self._pace_slices(names)
        left = [n for n in cycle.whole if n in names]
        self._owed = [p for p in self._handed if str(p) in names and p.rows is not None] + self._owed
        handed = [p.unit for p in self._handed if p.rows is None and p.unit in cycle.whole]
        done = len(handed) - len(left) - sum(1 for p in self._owed if p.rows is None)
        per = max(math.floor(done * self._pace_scale), fewest_whole(len(cycle.whole)))
        if not left or per >= cycle.per_check:
            self._owed += [p for p in self._handed if str(p) in names and p.rows is None]
            return None
        order = left + [n for n in cycle.whole if n not in names]
        self._cycle = Cycle(self._order(order), per, self.seed, self._per_slice)
        self._checks = 0
        return (f"the pieces of a check took its pace: {per} whole unit{'s' if per != 1 else ''} a check now, within "
                f"K = {self._cycle.length} checks")

    def _order(self, first: Sequence[str]) -> Dict[str, Optional[int]]:
        """The units to plan a paced cycle again with (name -> rows): the whole units of ``first`` ordered least
        recently checked first (never checked before all), then the rest."""
        # a check whose pieces took its pace replans the cycle again, and the units the last plan had not reached yet
        # would otherwise wait behind those it had checked (the UNet's 117 units: every tensor judged in 9 checks of a
        # K of 8, replanned after checks 1 and 2)
        order = sorted(first, key=lambda n: self._done.get(n, -1))
        rows = {n: self._rows[n] for n in order}
        rows.update((n, r) for n, r in self._rows.items() if n not in rows)
        return rows

    def _pace_slices(self, names: Set[str]) -> Optional[str]:
        """:meth:`pace` for a cycle with row slices: every piece left is owed to the next check, and where half a
        check's turn (a K-th of a pass) is owed, K is made long enough that a turn is :data:`PACE_SHARE` of what the
        paced checks held on average (the rest of their time drains what is owed), counted as if the pieces had had
        the whole pace (not what the check's planning left them). K only grows; a pass then starts again."""
        cycle = cast(Cycle, self._cycle)
        left = [p for p in self._handed if str(p) in names]
        self._owed = left + [p for p in self._owed if p not in left]
        self._held.append(self._pace_scale * (len(self._handed) - len(left)))
        if len(self._owed) < cycle.pass_size / cycle.length / 2:
            return None  # less than half a check's turn owed: the checks that follow drain it
        per = max(1, math.floor(PACE_SHARE * sum(self._held) / len(self._held)))
        checks = min(cycle.pass_size, math.ceil(cycle.pass_size / per))
        if checks <= cycle.length:
            return None
        self._cycle = Cycle(self._order(cycle.whole), 0, self.seed, self._per_slice, checks=checks)
        self._checks = 0
        return (f"the pieces of a check took its pace: about {per} piece{'s' if per != 1 else ''} a check now, "
                f"within K = {self._cycle.length} checks")

    @property
    def cycle_length(self) -> Optional[int]:
        """K: the module form's checks in which every unit and every row is probed once (None before a plan)."""
        return None if self._cycle is None else self._cycle.length

    def objective_cycle(self, tensors: int) -> int:
        """K of the objective form: checks in which every watched tensor is checked once."""
        per = self.tensors_per_check
        return 1 if per <= 0 or per >= tensors else math.ceil(tensors / per)

    def describe(self, form: str, tensors: int, every: Any) -> str:
        """The line said once per plan: what is checked within how many checks."""
        k = (self.cycle_length if form == "module" else None) or self.objective_cycle(tensors)
        steps = f"about {k * every} step{'s' if k * every != 1 else ''}" if isinstance(every, int) \
            else "at the interval every='auto' chooses"
        if form == "module" and self._cycle is not None:
            what = f"module form: {self._cycle.describe()}"
        else:
            what = f"objective form: {tensors} tensors, {self.tensors_per_check or 'all'} per check"
        return f"every op and parameter row checked within K = {k} check{'s' if k != 1 else ''} ({steps}); {what}"

    # ------------------------------------------------------------------ coverage
    def attach(self, model: nn.Module, watched: Sequence[str]) -> None:
        """Start counting coverage for the watched tensors of ``model`` (kept when they stay the same)."""
        params = dict(model.named_parameters())
        rows = {n: _rows(params[n]) for n in watched if n in params}
        if rows != self.coverage.rows:
            old = self.coverage
            self.coverage = Coverage(rows)
            self.coverage.load_state_dict(old.state_dict())

    def record(self, report: CheckReport) -> None:
        """What a check probed, into the coverage."""
        cov = self.coverage
        if report.form == "module":
            self._recorded += 1
            self._done.update((p, self._recorded) for p in map(str, report.pieces) if p in self._rows)
            for name, rows in report.probed:
                if rows == "code":
                    cov.module_checked(name)
                elif isinstance(rows, tuple) and rows and rows[0] == "reached":
                    cov.reach(name, rows[1])
                else:
                    cov.probe("backward", name, rows)
        else:
            for name, tc in report.tensors.items():
                _probe(cov, "backward", name, tc, None)
        for name, judged in report.training.items():
            _probe(cov, "training", name, judged, report.training_rows.get(name))  # None: the whole tensor

    def unchecked_news(self, report: CheckReport) -> List[str]:
        """The notes of ``report`` that name something not checked, each said for the first time in the run
        (the same piece over the room at every check is said once; its figures may change).

        Example:
            >>> planner, report = Planner(), CheckReport(tensors={}, notes=["module form: `x` not checked: it raised"])
            >>> planner.unchecked_news(report), planner.unchecked_news(report)
            (['module form: `x` not checked: it raised'], [])
        """
        out = []
        for note in report.notes:
            if "not checked" not in note:
                continue
            key = re.sub(r"[\d.]+ ?MB|\d+", "#", note)
            if key not in self._said:
                self._said.add(key)
                out.append(note)
        return out

    def state_dict(self) -> Dict[str, Any]:
        """The coverage and the position in the cycle."""
        return {"coverage": self.coverage.state_dict(), "checks": self._checks}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Undo :meth:`state_dict` (the cycle goes on where it was once the units are found again)."""
        self.coverage.load_state_dict(state.get("coverage", {}))
        self._resume_at = int(state.get("checks", 0))
