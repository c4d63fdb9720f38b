"""Replay training's forward faithfully, to recompute the gradient training applied.

The *training* part of a check compares the live ``.grad`` with the
objective's gradient recomputed the way training computed it: on the live
model, in its own dtype and device, through the same (eager or compiled)
module, with the same dropout masks and the same autocast state. To make
that possible a :class:`ForwardRecorder` sits on the live model:

- a forward pre-hook on the root module records, for every forward run with
  grad enabled, torch's RNG state (CPU and initialized CUDA devices), the
  autocast state, and references to the tensors the forward received (no copy);
- :meth:`ForwardRecorder.mark` remembers where a micro-batch starts: the
  states of every generator (torch, CUDA, numpy, ``random``) at that moment.

A replay tries two ways to reproduce the RNG stream, and *verifies* each one
instead of trusting it:

1. ``"forward"``: at the k-th forward of the replay, torch's generator is set
   to the state training's k-th forward started from. Faithful when the
   replay makes as many forwards as training did and each receives equal
   inputs (dropout masks are then drawn from the same state).
2. ``"start"``: every generator is set to its state at the start of the
   micro-batch, and ``loss_fn`` draws from there (random augmentation inside
   ``loss_fn``). Faithful when each forward then receives equal inputs and
   starts from the same torch RNG state training's did.

When no forward of the root module was seen (the training code calls
submodules directly), ``"start"`` is trusted when the start was marked by an
integration right before the forward (``exact_start``), when training's loss
is known and equal to the replay's, or when the objective draws no random
numbers at all (two evaluations under different seeds agree).

Nothing of training is changed: the replay restores every generator, puts
back any buffer it changed (BatchNorm running stats), never writes ``.grad``
(``torch.autograd.grad``) and runs with the parameters' own gradient hooks
detached, so the reference is the objective's gradient, not a hooked one.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from gradwatch.check.objective.generators import HeldGenerators
from gradwatch.check.objective.guards import LiveIsolation
from gradwatch.check.objective.rng import preserved_rng
from gradwatch.check.replay._recording import (
    MAX_RECORDS,
    ForwardRecord,
    ForwardRecorder,
    MicroBatch,
    StartState,
    Step,
    autocast_as,
    autocast_state,
    call_difference,
    forward_tensors,
    same_inputs,
)
from gradwatch.plan.memory import release_freed


@dataclass
class Replay:
    """The objective's gradient recomputed as training computed it (or why it could not be)."""

    grads: Optional[Dict[str, torch.Tensor]]
    objective: Optional[float]
    how: Optional[str]
    reason: Optional[str] = None
    loss_gap: Optional[Tuple[float, float]] = None  # (training's loss, the replay's objective) when they differ
    forwards: Tuple[int, int] = (0, 0)  # (training's, the replay's) forwards of one micro-batch
    autocast: Tuple[Tuple[str, bool, torch.dtype], ...] = ()  # the autocast state training's forward ran in
    params: Optional[Dict[str, torch.Tensor]] = None  # the live parameters the gradients are of
    rows: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # weights whose gradients are of these rows only
    unran: List[str] = field(default_factory=list)  # of those, the weights whose module never ran in the replay
    plan: Any = None  # the step's objective the replay weighed its micro-batches by (gradwatch.watch.step_objective)
    accumulating: int = 0  # skipped: the micro-batches training's forwards tell of, where the watch was handed one
    seconds: float = 0.0  # what the replays that reproduced the step took (not those tried in vain): about a step


class _Probe:
    """Temporary pre-hook of one replay: sets or compares the RNG state and compares inputs per forward."""

    _gradwatch_hook = True

    def __init__(self, records: List[ForwardRecord], mode: str) -> None:
        self.records = records
        self.mode = mode
        self.count = 0
        self.faithful = True
        self.private = False  # the replay drew from a generator held by the model or the loss
        self.differs: Optional[str] = None  # how its first call unlike training's differs (call_difference)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        k = self.count
        self.count += 1
        if k >= len(self.records):
            self.faithful = False
            return None
        rec = self.records[k]
        if not same_inputs(rec.inputs, forward_tensors(args, kwargs)):
            self.faithful = False
            if self.differs is None:
                self.differs = call_difference(module, rec.call, args, kwargs)
        for buffer, before in rec.observers or ():  # observers start where training's forward found them
            with torch.no_grad():
                if buffer.shape != before.shape:  # a per-channel observer sizes its buffers at its first forward
                    buffer.resize_(before.shape)
                buffer.copy_(before)
        if self.mode == "forward":
            torch.set_rng_state(rec.rng)
            if rec.cuda is not None:
                torch.cuda.set_rng_state_all(rec.cuda)
        elif not torch.equal(torch.get_rng_state(), rec.rng):
            self.faithful = False
        return None


Evaluate = Callable[[nn.Module, Any], torch.Tensor]
GradOf = Callable[[torch.Tensor, Any], Dict[str, torch.Tensor]]
Each = Callable[[int, Dict[str, torch.Tensor], float], None]


def _weighed(evaluate: Evaluate, weight: float, count: int) -> Evaluate:
    """``evaluate`` times a micro-batch's weight; ``1 / k`` as a division by ``k`` (the bits of training's ``loss / k``)."""
    if weight == 1.0:
        return evaluate
    if count > 1 and weight == 1.0 / count:
        return lambda model, batch: evaluate(model, batch) / count
    return lambda model, batch: evaluate(model, batch) * weight


Context = Optional[Callable[[], Any]]


class _isolated:
    """The live model as a replay runs it: the recorder paused, hooks your code registered (on modules,
    and the gradient hooks of ``params``) and the ``spectral_norm`` power iteration off; generators,
    buffers and plain attributes put back after (:class:`~gradwatch.check.objective.guards.LiveIsolation`).

    ``modules``: ``list(root.modules())`` when the caller knows it is current (GradWatch keeps it
    while the module tree is unchanged), else one walk here. A class rather than a generator: every
    check enters it right after training's backward, where each frame costs a cache miss.
    """

    def __init__(self, root: nn.Module, recorder: ForwardRecorder, modules: Optional[List[nn.Module]] = None,
                 params: Iterable[torch.Tensor] = ()) -> None:
        self._recorder = recorder
        self._rng = preserved_rng()
        self._live = LiveIsolation(list(root.modules()) if modules is None else modules, list(params))

    def __enter__(self) -> None:
        self._rng.__enter__()
        try:
            self._live.__enter__()
        except BaseException:
            self._rng.__exit__(*sys.exc_info())
            raise
        self._recorder.paused = True

    def __exit__(self, *exc: Any) -> None:
        self._recorder.paused = False
        try:
            self._live.__exit__(*exc)
        finally:
            self._rng.__exit__(*exc)


def _one(root: nn.Module, recorder: ForwardRecorder, evaluate: Evaluate, grad_of: GradOf, mb: MicroBatch,
         mode: str, params: Dict[str, torch.Tensor], context: Context = None,
         generators: Sequence[Any] = (), modules: Optional[List[nn.Module]] = None, entry: Optional[nn.Module] = None,
         ) -> Tuple[Dict[str, torch.Tensor], float, _Probe, tuple]:
    """One replay of one micro-batch; restores generators, buffers and attributes, never writes ``.grad``.

    ``context`` (an integration's, e.g. Lightning's precision context around ``training_step``)
    wraps the forward; without one, the autocast state training's first forward ran in does.
    Hooks your code registered on the model do not run (as in the backward part), the power
    iteration of ``spectral_norm`` is off (training's forward already updated its vectors), and
    generators held by the model or the loss (``roots``) are put back; a replay that drew from
    one (``generators``, see :func:`gradwatch.check.objective.generators.find_generators`) cannot reproduce
    training's draws and is marked unfaithful.
    ``entry`` (default ``root``) is the module ``evaluate`` is given: the one training called, when it wraps ``root``.
    Returns the gradients, the objective, the probe and the autocast state the forward ran in (the region's; where
    the region has none, the one training's recorded forward ran in: a wrapper such as Fabric's opens it inside).
    """
    probe = _Probe(mb.records, mode)
    region = context() if context is not None else autocast_as(mb.records[0].autocast if mb.records else ())
    held = HeldGenerators.of(generators) if generators else None
    handle = None
    if root is recorder.root and recorder.hooked():
        recorder.probe = probe  # run by the recording hook, where training's forwards were recorded
    else:
        handle = root.register_forward_pre_hook(probe, with_kwargs=True, prepend=True)
    try:
        with _isolated(root, recorder, modules, params.values()):
            if mode == "start":
                mb.start.apply()
            with torch.enable_grad():
                with region:  # the forward in training's autocast region; backward outside it, as training's
                    autocast = autocast_state() or (mb.records[0].autocast if mb.records else ())
                    total = evaluate(root if entry is None else entry, mb.batch)
                grads = grad_of(total, mb.batch)
            value = float(total.item())
    finally:
        recorder.probe = None
        if handle is not None:
            handle.remove()
        if held is not None:
            if held.moved():
                probe.faithful = False
                probe.private = True
            held.reset()
    return grads, value, probe, autocast


def rng_free(root: nn.Module, recorder: ForwardRecorder, evaluate: Evaluate, mb: MicroBatch,
             modules: Optional[List[nn.Module]] = None, entry: Optional[nn.Module] = None) -> bool:
    """True when the objective on this batch does not depend on torch's generator (two seeds agree; ``evaluate`` is
    given ``entry``, default ``root``)."""
    values = []
    with _isolated(root, recorder, modules), torch.no_grad():
        for seed in (12345, 54321):
            torch.manual_seed(seed)
            values.append(float(evaluate(root if entry is None else entry, mb.batch).detach()))
    return values[0] == values[1]


try:  # what torch.autograd.grad calls once it has checked its arguments (private; absent from old versions)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - torch < 2.3
    _engine_run_backward = None  # type: ignore[assignment]


def scalar_grad(total: torch.Tensor, inputs: Tuple[torch.Tensor, ...]) -> Tuple[Optional[torch.Tensor], ...]:
    """``torch.autograd.grad(total, inputs, allow_unused=True)`` for a real scalar ``total``, at less cost.

    ``autograd.grad`` first checks every input in Python (is it a tensor, a ``__torch_function__``
    override, a batched gradient) and builds the output gradient, a visible share of the
    forward and backward of a small model, on every check. For the case a replay always has (one
    real floating-point scalar, plain tensors and parameters, no torch function mode) this runs
    torch's engine the way ``autograd.grad`` then does; anything else goes through
    ``autograd.grad`` itself. Either way ``.grad`` is not written.

    Example:
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> scalar_grad((w ** 2).sum(), (w,))
        (tensor([2., 4.]),)
    """
    if (_engine_run_backward is None or not total.is_floating_point() or total.numel() != 1
            or torch.overrides.has_torch_function((total, *inputs))):
        return torch.autograd.grad(total, inputs, allow_unused=True)
    ones = (torch.ones_like(total, memory_format=torch.preserve_format),)
    return _engine_run_backward((total,), ones, False, False, inputs, True, accumulate_grad=False)


def as_float(value: Any) -> Optional[float]:
    """A loss given as a tensor or number, as a float (read only when a check runs: no sync per step)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().reshape(-1)[0]) if value.numel() == 1 else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None




def replay_step(root: nn.Module, recorder: ForwardRecorder, step: Step, evaluate: Evaluate, grad_of: GradOf,
                params: Dict[str, torch.Tensor], loss_tolerance: float, context: Context = None,
                generators: Sequence[Any] = (), modules: Optional[List[nn.Module]] = None, lockstep: bool = False,
                weights: Optional[Sequence[float]] = None, each: Optional[Each] = None,
                entry: Optional[nn.Module] = None, prefer: Optional[str] = None) -> Replay:
    """Recompute the objective's gradient of a whole optimizer step: its micro-batches' objectives, weighed.

    The sum is formed as training forms it under gradient accumulation: the gradient of each
    micro-batch's objective times its weight (by default ``1 / k``: divided by their count),
    summed in order, so that a correct run gives the very same bits.

    Args:
        root: The live model.
        recorder: Its :class:`ForwardRecorder` (paused during the replay).
        step: The micro-batches of the step (:meth:`ForwardRecorder.take`).
        evaluate: ``evaluate(model, batch) -> scalar``: the training objective (loss and regularizers,
            not coupled weight decay, which the optimizer adds after ``.grad``).
        grad_of: ``grad_of(total, batch) -> {name: grad}`` of the live parameters.
        params: The live parameters the gradient is taken for.
        loss_tolerance: Relative difference under which training's loss and the replay's agree.
        context: Optional ``context() -> context manager`` training's loss ran in (an integration's
            precision context); the replay runs in it too.
        generators: Generators the model or the objective hold (put back after each replay).
        modules: ``list(root.modules())``, when the caller knows it is current (saves a walk per replay).
        lockstep: The replay's forward and backward are collectives (a sharded model): one replay per
            micro-batch on every rank, whatever its outcome here (no second mode, no extra forward), and a
            micro-batch that fails does not stop the others' replays.
        weights: Each micro-batch's weight in the step's objective (:func:`gradwatch.check.replay.items.step_weights`);
            None: ``1 / k`` each. A micro-batch of weight 0 is not replayed (unless ``lockstep``).
        each: ``each(i, grads, weight)`` after micro-batch ``i``'s replay, with its weighted gradients (before
            they are summed into the others'; a sketch of them explains a step cut wrongly, :mod:`gradwatch.check.replay.cut`).
        entry: The module ``evaluate`` is given, when training called a wrapper of ``root`` (a Lightning Fabric module:
            its precision converts the inputs and opens autocast around ``root``'s forward); default ``root``.
        prefer: The mode to try first (``"start"``: from the step's first RNG state, where an earlier replay of the
            same run needed it, its objective drawing before the model's forward: the ``"forward"`` mode then replays
            in vain, a whole forward and backward at each check). Each mode is verified as always.

    Returns:
        A :class:`Replay`; ``grads`` is None (with ``reason``) when no replay could be verified.
    """
    count = len(step.micro)
    weights = [1.0 / count] * count if weights is None else [float(w) for w in weights]
    if len(weights) != count:
        raise ValueError(f"replay_step: {len(weights)} weights for {count} micro-batches")
    replayer = _Replayer(root, recorder, grad_of, params, loss_tolerance, context, generators, modules, lockstep, entry)
    summed = _Summed(count, loss_tolerance, each)
    forwards = (0, 0)
    failed: Optional[Replay] = None  # lockstep: the first failure, returned once every micro-batch ran
    for i, mb in enumerate(step.micro):
        mb.loss = as_float(mb.loss)
        if mb.batch is None:
            return Replay(None, None, None, "no batch was given for this step")
        weight = weights[i]
        if weight == 0.0 and not lockstep:
            continue  # no item of the step's objective in it: training's correct gradient has nothing of it
        weighed = _weighed(evaluate, weight, count)
        if mb.overflow:
            return Replay(None, None, None, f"training ran more than {MAX_RECORDS} forwards of the model in this step")
        attempt = replayer.micro_batch(mb, weighed, weight, replayer.modes(mb, prefer))
        if attempt.private:
            return Replay(None, None, None, _PRIVATE_DRAWS, forwards=attempt.forwards)
        forwards = attempt.forwards
        if attempt.mode is None:
            failure = _failure(mb, attempt)
            if not lockstep:
                return failure
            failed = failed or failure
            continue
        summed.add(i, mb, attempt, weight, cast(Dict[str, torch.Tensor], replayer.grads))
    if failed is not None:
        return failed
    return summed.replay(forwards)


_PRIVATE_DRAWS = ("the model or loss_fn draws from a random generator of its own (torch.Generator, numpy Generator, "
                  "random.Random): the replay cannot reproduce training's draws, so the training part is not judged")


@dataclass
class _Attempt:
    """One micro-batch's replays: the one that reproduced training's forward (``mode``), or those tried in vain (its
    gradients are :attr:`_Replayer.grads`)."""

    value: float  # the reproducing replay's objective, weighed (else the last replay's)
    autocast: Tuple[Tuple[str, bool, torch.dtype], ...]  # the autocast state its forward ran in
    forwards: Tuple[int, int]  # (training's, the last replay's) forwards of the micro-batch
    mode: Optional[str] = None  # None: no mode reproduced training's forward
    took: float = 0.0  # the reproducing replay's seconds
    spent: List[float] = field(default_factory=list)  # each mode's replay, in seconds
    tried: List[Tuple[str, int, bool]] = field(default_factory=list)  # (mode, forwards, faithful) of those in vain
    differs: Optional[str] = None  # how the first call unlike training's differs (call_difference)
    private: bool = False  # a replay drew from a generator held by the model or the loss


class _Replayer:
    """What the replays of a step's micro-batches share: the model, how to differentiate, where to run (see
    :func:`replay_step` for the arguments)."""

    def __init__(self, root: nn.Module, recorder: ForwardRecorder, grad_of: GradOf, params: Dict[str, torch.Tensor],
                 loss_tolerance: float, context: Context, generators: Sequence[Any], modules: Optional[List[nn.Module]],
                 lockstep: bool, entry: Optional[nn.Module]) -> None:
        self.root, self.recorder, self.grad_of, self.params = root, recorder, grad_of, params
        self.loss_tolerance, self.context, self.generators = loss_tolerance, context, generators
        self.modules, self.lockstep, self.entry = modules, lockstep, entry
        #: The last replay's weighed gradients: a micro-batch's are given up once the next one's replay returns.
        self.grads: Optional[Dict[str, torch.Tensor]] = None

    def modes(self, mb: MicroBatch, prefer: Optional[str]) -> Tuple[str, ...]:
        """The modes to try on ``mb``, in order: one alone in lockstep, ``prefer`` first where it applies."""
        modes: Tuple[str, ...] = ("forward", "start") if mb.records else ("start",)
        if self.lockstep:
            modes = modes[:1]
        elif prefer is not None and prefer in modes:
            modes = (prefer,) + tuple(m for m in modes if m != prefer)
        return modes

    def micro_batch(self, mb: MicroBatch, evaluate: Evaluate, weight: float, modes: Tuple[str, ...]) -> _Attempt:
        """Replay ``mb`` in each of ``modes`` until one is verified to reproduce training's forward (its gradients in
        :attr:`grads`)."""
        spent: List[float] = []
        tried = []
        differs: Optional[str] = None
        for mode in modes:
            began = time.perf_counter()
            self.grads, value, probe, autocast = _one(self.root, self.recorder, evaluate, self.grad_of, mb, mode,
                                                      self.params, self.context, self.generators, self.modules, self.entry)
            took = time.perf_counter() - began
            spent.append(took)
            forwards = (len(mb.records), probe.count)
            if probe.private:
                return _Attempt(value, autocast, forwards, spent=spent, private=True)
            if self.reproduced(mb, evaluate, weight, value, probe):
                return _Attempt(value, autocast, forwards, mode, took, spent)
            tried.append((mode, probe.count, probe.faithful))
            differs = differs or probe.differs
            if mode != modes[-1]:  # what this mode's replay freed, given back before the next one's forward (kept
                self.grads = None  # in the heap, the next forward's activations went on top of it)
                del probe
                release_freed()
        return _Attempt(value, autocast, forwards, spent=spent, tried=tried, differs=differs)

    def reproduced(self, mb: MicroBatch, evaluate: Evaluate, weight: float, value: float, probe: _Probe) -> bool:
        """True when a replay of ``mb`` is verified to be training's: its forwards matched those recorded, or (none
        recorded) it started where training did, its loss is training's, or the objective draws no random number."""
        whole = value / weight if weight else value  # the micro-batch's own objective
        loss_agrees = mb.loss is not None and abs(whole - mb.loss) <= self.loss_tolerance * max(abs(whole), abs(mb.loss),
                                                                                              1e-30)
        if mb.records:
            return probe.faithful and probe.count == len(mb.records)
        return mb.start.exact or loss_agrees or (not self.lockstep and rng_free(self.root, self.recorder, evaluate, mb,
                                                                                 self.modules, self.entry))


def _failure(mb: MicroBatch, attempt: _Attempt) -> Replay:
    """Why no replay of ``mb`` reproduced training's forward, as a :class:`Replay` without gradients."""
    tried, n_train = attempt.tried, len(mb.records)
    if mb.records and all(count and n_train > count and n_train % count == 0 for _, count, _ in tried):
        k = n_train // tried[0][1]
        failure = Replay(None, None, None,
                         f"skipped: accumulating ({n_train} forwards of the model since the last step, while one "
                         f"replay of the step's batch makes {tried[0][1]}: {k} micro-batches?) — call "
                         "watch.accumulate(micro_batch) after each micro-batch's backward",
                         forwards=(n_train, tried[0][1]), accumulating=k)
    else:
        if not mb.records:
            why = ("no forward of the model was seen since the last step and the objective draws random "
                   "numbers; pass loss= to watch.step so the replay can be verified")
        elif attempt.differs is not None:
            why = (f"the replay could not reproduce training's forward: {attempt.differs} (the model's inputs differ "
                   "at its forward): pass loss_fn the call training makes")
        else:
            why = (f"the replay could not reproduce training's forward (training ran {n_train} forwards; the "
                   f"replays ran {', '.join(str(c) for _, c, _ in tried)}, with other inputs or another RNG "
                   "state): random augmentation drawing from torch's generator inside loss_fn after other draws "
                   "since the last step, or loss_fn is not the function training calls, or training calls a "
                   "wrapper of the watched module (give GradWatch the module training calls: Fabric's, a "
                   "compiled one)")
        failure = Replay(None, None, None, why, forwards=attempt.forwards)
    failure.seconds = min(attempt.spent)  # a replay in vain costs about a step too
    return failure


class _Summed:
    """The step's gradient and objective, summed micro-batch by micro-batch as training accumulates ``.grad``."""

    def __init__(self, count: int, loss_tolerance: float, each: Optional[Each]) -> None:
        self.count, self.loss_tolerance, self.each = count, loss_tolerance, each
        self.sums: Dict[str, torch.Tensor] = {}
        self.objective = 0.0
        self.hows: List[str] = []
        self.gaps: List[Tuple[float, float]] = []
        self.seconds = 0.0
        self.autocast: Tuple[Tuple[str, bool, torch.dtype], ...] = ()

    def add(self, i: int, mb: MicroBatch, attempt: _Attempt, weight: float, grads: Dict[str, torch.Tensor]) -> None:
        """Add micro-batch ``i``'s verified replay (``attempt``, its weighed gradients ``grads``), of weight ``weight``."""
        self.seconds += attempt.took
        value = attempt.value / weight if weight else attempt.value  # the micro-batch's own objective (its gradient stays weighed)
        self.hows.append(cast(str, attempt.mode))
        self.objective += value
        if mb.loss is not None and abs(value - mb.loss) > self.loss_tolerance * max(abs(value), abs(mb.loss), 1e-30):
            self.gaps.append((mb.loss, value))
        if self.each is not None:
            self.each(i, grads, weight)
        for n, g in grads.items():
            if n not in self.sums:
                self.sums[n] = g
            else:
                self.sums[n].add_(g)  # as autograd accumulates into .grad
        self.autocast = attempt.autocast

    def replay(self, forwards: Tuple[int, int]) -> Replay:
        """The step's :class:`Replay`, once every micro-batch was added (``forwards``: the last replay's)."""
        if not self.sums:
            return Replay(None, None, None, "not judged: every micro-batch of the step weighs 0 (no item to average over)")
        gaps = self.gaps
        gap = (sum(a for a, _ in gaps) / len(gaps), sum(b for _, b in gaps) / len(gaps)) if gaps else None
        return Replay(self.sums, self.objective / self.count, "+".join(sorted(set(self.hows))), loss_gap=gap,
                      forwards=forwards, autocast=self.autocast, seconds=self.seconds)


__all__ = ["Context", "Each", "Evaluate", "ForwardRecorder", "GradOf", "MicroBatch", "Replay", "StartState", "Step", "as_float",
           "autocast_state", "replay_step", "rng_free", "scalar_grad"]
