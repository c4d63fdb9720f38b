"""The module form's capture: one forward of the live model that copies the chosen units' inputs.

A forward of the live model on the check batch (dropout off, BatchNorm's running stats untouched, no grad)
captures, in the live dtype, each chosen unit's inputs at its first call and, for own-code units, the outputs of
the modules it calls; additive masks (``-inf``, or the dtype's lowest value) are kept as constants. In one process
the forward stops once every chosen unit is captured: what follows (an LM head's product, the loss over a
vocabulary) is not computed for nothing.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch.plan.units import plan_units
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    >>> loss = lambda m, b: m(b).square().sum()
    >>> units = [u for u in plan_units(model, loss, torch.ones(2, 3)) if u.name == "0"]
    >>> got = capture(model, loss, torch.ones(2, 3), units, seed=0, early=True)
    >>> list(got.inputs), got.output_bytes, got.loss is None
    (['0'], {'0': 64}, True)
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch import nn

from gradwatch.check.modules._tensor_trees import copy_opaque, map_tensors
from gradwatch.check.objective.dtensor import is_dtensor, whole
from gradwatch.plan.memory import float_bytes
from gradwatch.plan.units import LOSS_FN, Enough, Unit, isolated_forward, known_first, output_shape, relative
from gradwatch.trees import rebuild, tensor_leaves


@dataclass
class Captured:
    """What one forward of the live model gave the module form, in the live dtype (cast per unit).

    Attributes:
        inputs: Unit name -> ``(args, kwargs)`` of its first call.
        output_bytes: Unit name -> float64 bytes of its first call's output.
        children: Own-code unit name -> called module (relative name) -> its output at each call
            that the unit's first call made.
        constants: ``id`` of the captured floating tensors that are additive masks (non-finite, or of magnitude
            :data:`MASK` or more): the check does not differentiate with respect to them. ``masks`` holds those
            tensors, so that no id is taken by another tensor while the capture lives (a unit's capture dropped
            for another forward frees its mask; a later capture could reuse its id and lose its input).
        deferred: Units not captured in this forward, the captures already holding the budget.
        deferred_bytes: Live bytes of the deferred units' inputs (where they were called in this forward).
        big: Unit name -> live bytes of what it needs captured, for units over the budget alone.
        loss: The loss of that forward (None where it stopped once every unit was captured).
        model_bytes: Bytes of the model's output (the root module's first call; 0 where the forward stopped before
            it): what a forward that runs to the loss holds is sized from it.
        stale: The replay's forward (``forward``) changed a tensor its captures share in place after they took it:
            nothing was kept, and the caller captures again with a forward of its own.
        dropout_only: After an isolated forward that ran to its end (None otherwise): whether all the randomness it
            met was dropout (switched off), no layerdrop, noise or other draw.
    """

    inputs: Dict[str, Tuple[Any, Any]] = field(default_factory=dict)
    output_bytes: Dict[str, int] = field(default_factory=dict)
    children: Dict[str, Dict[str, List[Any]]] = field(default_factory=dict)
    constants: Set[int] = field(default_factory=set)
    masks: List[torch.Tensor] = field(default_factory=list)
    stale: bool = False
    dropout_only: Optional[bool] = None
    deferred: List[str] = field(default_factory=list)
    deferred_bytes: int = 0
    big: Dict[str, int] = field(default_factory=dict)
    loss: Optional[float] = float("nan")
    model_bytes: int = 0


#: A captured floating tensor holding a value this large is an additive mask, not a differentiable input.
MASK = 1e30

#: A forward run for a capture: ``forward(pre, post)`` with the forward pre-hooks and forward hooks (module name ->
#: hook) attached; returns the loss (None where it stopped early).
Forward = Callable[[Dict[str, Callable[..., Any]], Dict[str, Callable[..., Any]]], Optional[float]]


def live_bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensor_leaves(obj) if t.is_floating_point())


def linear_output_bytes(module: nn.Module, args: Any) -> int:
    """Float64 bytes of the output of a plain Linear or Embedding (:func:`~gradwatch.plan.units.known_first`) called on
    ``args[0]``. Unlike :func:`~gradwatch.plan.units.output_shape`, an input of another width than ``in_features`` is
    taken as it is: under tensor parallel a row-parallel Linear is given this rank's shard of its input.

    Example:
        >>> linear_output_bytes(nn.Linear(8, 50), (torch.ones(4, 3, 8),)), linear_output_bytes(nn.Embedding(9, 5), (torch.ones(2, 7),))
        (4800, 560)
    """
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if x is None:
        return 0
    if isinstance(module, nn.Linear):
        return x.numel() // max(1, x.shape[-1]) * int(module.out_features) * 8 if x.dim() else 0
    return x.numel() * int(cast(nn.Embedding, module).embedding_dim) * 8


def capture(model: nn.Module, loss_fn: Any, batch: Any, units: Sequence[Unit], seed: int,
            budget: Optional[int] = None, everyone: Sequence[Unit] = (),
            agree: Optional[Callable[[], Any]] = None, alone: bool = False, early: bool = False,
            forward: Optional[Forward] = None) -> Captured:
    """The chosen units' inputs at their first call in one forward of the live model, and for own-code
    units the outputs of the modules their first call called (detached copies in the live dtype).

    Floating tensors that hold non-finite values or values of magnitude :data:`MASK` or more (additive
    attention masks) are known as constants: the check does not differentiate with respect to them.
    With ``budget`` (bytes), units are captured in
    forward order while their copies fit in it together; the others are ``deferred`` to another forward,
    and a unit over the budget alone is left out with its size (``big``); with ``alone`` it is captured instead,
    by a forward where nothing else is (a sharded model: its piece is cut from that capture, since another
    forward on one rank alone would leave the others' collectives unpaired).

    DTensors (tensor and sequence parallel) are captured whole (:func:`~gradwatch.check.objective.dtensor.whole`,
    a collective): at the first call of each unit of ``everyone`` (the units some rank captures, the same list on
    every rank) and at every call of a module such a unit calls, every rank gathers the DTensors it is given
    (and those the called module returns), whether it keeps them or not, so every rank makes the same collectives
    (the :mod:`gradwatch.watch.lockstep` region around the check makes an agreement point before each). ``agree``
    (such a point) tells the capture it runs on several ranks: it never stops early.

    ``forward(pre, post)`` runs the forward instead (the training part's replay, its forward's values those of the
    isolated forward: :class:`gradwatch.watch.replay_capture.ReplayCapture`), the hooks (module name -> hook) attached
    for it; it returns the loss. It runs whole: ``early`` is then ignored; what it holds stays within ``budget``,
    even for a unit alone (with ``alone``, such a unit is deferred to the next forward).
    """
    run = _Capture(units, budget, everyone, agree, alone, early, forward)
    if LOSS_FN in run.wanted:
        run.take_batch(batch)
    pre, post = run.hooks(model, units)
    return run.forward_once(model, loss_fn, batch, seed, pre, post)


class _Capture:
    """One capture's forward hooks and the state they share: what is captured so far (``got``), the bytes it holds
    per unit, the stack of the module calls in progress, and whether the forward may stop (:func:`capture`)."""

    def __init__(self, units: Sequence[Unit], budget: Optional[int], everyone: Sequence[Unit],
                 agree: Optional[Callable[[], Any]], alone: bool, early: bool, forward: Optional[Forward]) -> None:
        self.got = Captured()
        self.budget, self.alone, self.forward, self.agree = budget, alone, forward, agree
        self.whole_of: Dict[int, torch.Tensor] = {}  # id(DTensor) -> its gathered whole, during one hook
        self.wanted = {u.name: u for u in units}
        self.own = {u.name: {c: relative(u, c) for c in u.stubbed} for u in units if u.kind == "own"}
        self.sizes: Dict[str, int] = {}
        self.inputs_of: Dict[str, int] = {}  # bytes of a captured unit's inputs (its children's outputs not counted)
        self.stack: List[List[Any]] = []  # [module, is this the first call of a wanted unit being captured]
        # One process, the replay's forward (``forward``, no ranks): the captures share the tensors the forward made,
        # those with a ``grad_fn`` (most are saved for its backward anyway: copies would add to the replay's peak),
        # their versions taken; a tensor changed in place later in that forward makes its captures stale, and they
        # are taken again by another forward. (Set as that forward begins: ``loss_fn``'s batch, captured before it,
        # is copied.)
        self.referenced: Optional[List[Tuple["weakref.ref[torch.Tensor]", int]]] = None
        # One process: the forward stops once every chosen unit is captured (an LM head's product and the loss over
        # the vocabulary are not computed for nothing); its loss is then not known (``got.loss`` None). On several
        # ranks (``everyone``), once every unit of ``everyone`` has made its first call: a point of the forward that
        # is the same on every rank, whatever each rank captured, so every rank stops there, its collectives made
        # alike.
        self.shared = {u.name: u for u in everyone}
        early = early and forward is None
        if self.shared:
            early = early and LOSS_FN not in self.shared
        else:
            early = early and LOSS_FN not in self.wanted and agree is None and not alone
        self.early = early
        self.passed: Set[str] = set()  # units of ``everyone`` past their first call (or known before it ran)
        self.stopped = False
        self.gather_in = {u.name for u in everyone}
        self.gather_out = {c for u in everyone if u.kind != "module" for c in u.stubbed}
        self.seen: Set[str] = set()

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """What the capture keeps of ``t``: a detached copy (shared with the replay's forward, where it made ``t``)."""
        source = self.whole_of.get(id(t), t)
        if self.referenced is not None and source is t and t.grad_fn is not None:  # (not the batch, a parameter or
            # a buffer: what the forward made, freed with its graph but for the capture, whose bytes it counts)
            copy_ = t.detach()  # (its version counter is t's; a capture dropped for the budget is not kept alive)
            self.referenced.append((weakref.ref(copy_), copy_._version))
        else:
            copy_ = source.detach().clone()
        # one reduction: the largest magnitude is NaN or inf where any entry is, and MASK or more in an additive mask
        if t.is_floating_point() and t.numel() and not float(copy_.abs().max()) < MASK:
            self.got.constants.add(id(copy_))  # an additive mask (-inf, or the dtype's lowest): no step can move it
            self.got.masks.append(copy_)  # alive as long as its id is in constants
        return copy_

    def fits(self, extra: int) -> bool:
        return self.budget is None or sum(self.sizes.values()) + extra <= self.budget

    def drop(self, name: str, why: str) -> None:
        got = self.got
        got.inputs.pop(name, None)
        got.children.pop(name, None)
        size = self.sizes.pop(name, 0)
        if why == "big":
            got.big[name] = size
        else:
            got.deferred.append(name)
            got.deferred_bytes += self.inputs_of.get(name, 0)

    def settled(self) -> bool:
        if self.shared:
            return len(self.passed) == len(self.shared)
        got = self.got
        return all(n in got.big or n in got.deferred or n in got.output_bytes for n in self.wanted)

    def stop(self) -> None:
        """End the forward (:class:`~gradwatch.plan.units.Enough`) where it may stop and has given what it is for."""
        if self.early and (self.shared or not any(frame[1] for frame in self.stack)) and self.settled():
            self.stopped = True
            raise Enough

    def take_batch(self, batch: Any) -> None:
        """``loss_fn``'s own code's input: the batch, copied before the forward."""
        self.got.inputs[LOSS_FN] = copy_opaque(map_tensors(((batch,), {}), self.keep))
        self.got.children[LOSS_FN] = {}
        self.sizes[LOSS_FN] = self.inputs_of[LOSS_FN] = live_bytes(batch)

    def enter(self, name: str, args: tuple, kwargs: dict) -> None:
        """A forward pre-hook's work: a wanted unit's first call captured (or deferred, or left out as big)."""
        if self.stopped:
            return
        got = self.got
        first = name in self.wanted and name not in got.inputs and name not in got.big and name not in got.deferred
        if first:
            first = self.first_call(name, args, kwargs)
        if name in self.shared and name not in self.passed and known_first(self.shared[name]):
            self.passed.add(name)  # known alike on every rank (the unit's kind), whatever this rank captured
            if first:
                got.output_bytes[name] = linear_output_bytes(self.shared[name].module, args)
            self.stop()
            if first:
                del got.output_bytes[name]
        self.stack.append([name, first])

    def first_call(self, name: str, args: tuple, kwargs: dict) -> bool:
        """A wanted unit's first call: its inputs captured where they fit; whether they were."""
        got, budget, sizes = self.got, self.budget, self.sizes
        need = live_bytes((args, kwargs))
        if budget is not None and need > budget and not (self.alone and not sizes and self.forward is None):
            if self.alone:
                got.deferred.append(name)
                got.deferred_bytes += need
            else:
                got.big[name] = need
            return False
        if not self.fits(need) and sizes:
            got.deferred.append(name)
            got.deferred_bytes += need
            return False
        got.inputs[name] = copy_opaque(map_tensors((args, kwargs), self.keep))
        sizes[name] = self.inputs_of[name] = need
        if name in self.own:
            got.children[name] = {}
        shape = output_shape(self.wanted[name], args, kwargs)
        if shape is not None and not self.shared:  # a plain Linear or Embedding: its output is known before it runs
            got.output_bytes[name] = math.prod(shape) * 8
            self.stop()
            del got.output_bytes[name]
        return True

    def leave(self, name: str, args: tuple, out: Any) -> None:
        """A forward hook's work: a call's end (:meth:`left`), then the forward stopped where it may."""
        if self.stopped:
            return
        self.left(name, out)
        self.stop()

    def left(self, name: str, out: Any) -> None:
        """A call's end: a captured unit's output bytes, and the output of a module an own-code unit called kept."""
        stack, got = self.stack, self.got
        while stack and stack[-1][0] != name:  # a forward that raised inside left its frame behind
            stack.pop()
        frame = stack.pop() if stack else [name, False]
        if frame[1]:
            got.output_bytes[name] = float_bytes(out)
        if name in self.shared:  # its first call's end (a later call's changes nothing)
            self.passed.add(name)
        holder = stack[-1][0] if stack and stack[-1][1] and stack[-1][0] in self.own else None
        rel = self.own[holder].get(name) if holder is not None else None
        if holder is None and not stack and name == "" and LOSS_FN in got.children:
            holder, rel = LOSS_FN, ""  # a call of the model by loss_fn itself
        if holder is None or rel is None:
            return
        self.keep_child(holder, rel, out)

    def keep_child(self, holder: str, rel: str, out: Any) -> None:
        """The output of a module ``holder``'s own code called, kept where it fits; else ``holder`` deferred or big."""
        stack, got, sizes = self.stack, self.got, self.sizes
        need = live_bytes(out)
        if self.alone and not self.fits(need) and (self.forward is not None or not set(sizes) <= {holder}):
            self.drop(holder, "deferred")  # captured again by a forward where it is alone, whatever its size
            if stack and stack[-1][0] == holder:
                stack[-1][1] = False
        elif not self.alone and self.budget is not None and sizes.get(holder, 0) + need > self.budget:
            self.drop(holder, "big")
            got.big[holder] += need
            if stack and stack[-1][0] == holder:
                stack[-1][1] = False
        elif not self.alone and not self.fits(need):
            self.drop(holder, "deferred")
            if stack and stack[-1][0] == holder:
                stack[-1][1] = False
        else:
            got.children[holder].setdefault(rel, []).append(copy_opaque(rebuild(out, self.keep)))
            sizes[holder] = sizes.get(holder, 0) + need

    def hooks(self, model: nn.Module, units: Sequence[Unit]
              ) -> Tuple[Dict[str, Callable[..., None]], Dict[str, Callable[..., None]]]:
        """The forward pre-hooks and forward hooks (module name -> hook) the capture's forward runs with."""
        named = dict(model.named_modules())
        hooked = set(self.wanted) | {c for u in units for c in u.stubbed} | (set(self.shared) if self.early else set())
        pre = {n: self.gathering(n, n in hooked, True) for n in named if n in hooked | self.gather_in}
        post = {n: self.gathering(n, n in hooked, False) for n in named if n in hooked | self.gather_out | {""}}
        return pre, post

    def gathering(self, name: str, hooked: bool, pre: bool) -> Callable[..., None]:
        """A hook of ``name``: the DTensors it is given (``pre``) or returns gathered whole where some rank needs
        them, then, where ``hooked``, :meth:`enter` or :meth:`leave`."""
        def both(module: nn.Module, args: Any, extra: Any) -> None:
            got = self.got
            if not pre and name == "" and not got.model_bytes:
                got.model_bytes = live_bytes(extra)
            gather = name in self.gather_in and name not in self.seen if pre else name in self.gather_out
            if pre:
                self.seen.add(name)
            # (under a Lockstep region each gather's collective is preceded by an agreement point of its own)
            dtensors = [t for t in tensor_leaves((args, extra) if pre else extra) if is_dtensor(t)] if gather else []
            with torch.no_grad():  # a replay's forward (``forward``) records its graph: not the copies'
                if dtensors:
                    self.whole_of.update((id(t), whole(t)) for t in dtensors)
                try:
                    if hooked:
                        (self.enter if pre else self.leave)(name, args, extra)
                finally:
                    self.whole_of.clear()

        return both

    def forward_once(self, model: nn.Module, loss_fn: Any, batch: Any, seed: int,
                     pre: Dict[str, Callable[..., None]], post: Dict[str, Callable[..., None]]) -> Captured:
        """The forward (isolated, or ``forward``), the hooks attached; what it captured."""
        got, forward = self.got, self.forward
        if forward is not None and self.agree is None:
            self.referenced = []
        records: List[Any] = []
        got.loss = isolated_forward(model, loss_fn, batch, seed, pre=pre, post=post, randomness=records) \
            if forward is None else forward(pre, post)
        if records and got.loss is not None:
            got.dropout_only = not records[0].stays_on and not records[0].random_draws
        referenced = self.referenced
        if referenced and any(t is not None and t._version != v for t, v in ((r(), v) for r, v in referenced)):
            got.stale = True  # (the caller captures again with a forward of its own)
            got.inputs.clear()
            got.children.clear()
        return got
