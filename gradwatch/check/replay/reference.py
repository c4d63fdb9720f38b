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

import contextlib
import inspect
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np
import torch
from torch import nn

from gradwatch.check.objective.generators import HeldGenerators
from gradwatch.check.objective.guards import LiveIsolation
from gradwatch.check.objective.precision import AUTOCAST_DEVICES, any_autocast
from gradwatch.check.objective.rng import preserved_rng
from gradwatch.plan.memory import release_freed

#: Forwards recorded per micro-batch at most; beyond, the replay cannot be verified.
MAX_RECORDS = 64
_CUDA: List[bool] = []  # torch.cuda.is_available(), asked once (it costs microseconds on every forward)


def _cuda_states() -> Optional[List[torch.Tensor]]:
    if not _CUDA:
        _CUDA.append(torch.cuda.is_available())
    if _CUDA[0] and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state_all()
    return None


def autocast_state() -> Tuple[Tuple[str, bool, torch.dtype], ...]:
    """``(device, enabled, dtype)`` for each device type whose autocast is enabled now.

    Example:
        >>> autocast_state()
        ()
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_state()
        (('cpu', True, torch.bfloat16),)
    """
    if not any_autocast():  # one call where no device's autocast is on (the common case)
        return ()
    out = []
    for dev in AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(dev):
                out.append((dev, True, torch.get_autocast_dtype(dev)))
        except (RuntimeError, TypeError, AttributeError):  # torch < 2.4 spells it per device
            continue
    return tuple(out)


def autocast_as(state: Sequence[Tuple[str, bool, torch.dtype]]) -> ContextManager[Any]:
    """Enter the autocast regions recorded by :func:`autocast_state` (none: plain precision).

    Example:
        >>> with autocast_as((("cpu", True, torch.bfloat16),)):
        ...     autocast_state()
        (('cpu', True, torch.bfloat16),)
    """
    if not state:
        return contextlib.nullcontext()  # the common case, at no cost
    return _autocast_regions(state)


@contextlib.contextmanager
def _autocast_regions(state: Sequence[Tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for dev, enabled, dtype in state:
            stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
        yield


def _tensors(args: tuple, kwargs: Mapping[str, Any]) -> List[torch.Tensor]:
    """The tensors among a forward's positional and keyword arguments (one level deep), scalars left out: a
    0-dimensional count such as Hugging Face's ``num_items_in_batch`` tells no forward's inputs apart, and the
    step's objective evaluates the model without it."""
    out = [a for a in args if isinstance(a, torch.Tensor)]
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(v for v in a if isinstance(v, torch.Tensor))
        elif isinstance(a, Mapping):
            out.extend(v for v in a.values() if isinstance(v, torch.Tensor))
    out.extend(v for v in kwargs.values() if isinstance(v, torch.Tensor))
    return [t for t in out if t.dim()]


def same_inputs(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """True when two forwards received equal tensors (same object, or same shape, dtype and values).

    Example:
        >>> x = torch.ones(2)
        >>> same_inputs([x], [x.clone()]), same_inputs([x], [x + 1])
        (True, False)
    """
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device or not torch.equal(x, y):
            return False
    return True


@dataclass
class ForwardRecord:
    """What training's forward started from: torch RNG states, autocast state, its input tensors."""

    rng: torch.Tensor
    cuda: Optional[List[torch.Tensor]]
    autocast: Tuple[Tuple[str, bool, torch.dtype], ...]
    inputs: List[torch.Tensor]
    #: The buffers of the quantization observers the forward updates (their state before it), or None.
    observers: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
    #: How it was called: its positional arguments' count and its keywords that are tensors (:func:`call_difference`).
    call: Tuple[int, Tuple[str, ...]] = (0, ())


def _keywords(kwargs: Mapping[str, Any]) -> Tuple[str, ...]:
    """The keywords of a call whose values are tensors (not scalars: as :func:`_tensors` compares them)."""
    return tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim())


def _call_names(module: nn.Module, positional: int, keywords: Sequence[str]) -> List[str]:
    """The names of a call's arguments: the positional ones by ``module.forward``'s signature, then the keywords."""
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"argument {i + 1}" for i in range(positional)] + list(keywords)


def call_difference(module: nn.Module, training: Tuple[int, Tuple[str, ...]], args: tuple,
                    kwargs: Mapping[str, Any]) -> Optional[str]:
    """How the replay's call of ``module`` differs from training's, in the user's terms (None where the same arguments
    are given: their values differ, or nothing does).

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> call_difference(lin, (1, ()), (), {"input": torch.ones(2), "labels": torch.ones(2)})
        'your loss_fn calls the model with labels=..., training called it without'
        >>> call_difference(lin, (1, ()), (torch.ones(2),), {}) is None
        True
    """
    mine = _call_names(module, len(args), _keywords(kwargs))
    theirs = _call_names(module, *training)
    extra, missing = [n for n in mine if n not in theirs], [n for n in theirs if n not in mine]
    said = []
    if extra:
        said.append(f"your loss_fn calls the model with {', '.join(n + '=...' for n in extra)}, training called it "
                    "without")
    if missing:
        said.append(f"training called the model with {', '.join(n + '=...' for n in missing)}, your loss_fn calls "
                    "it without")
    return "; ".join(said) or None


def observer_buffers(root: nn.Module) -> List[torch.Tensor]:
    """The buffers of torch's quantization observers and fake quantizers in ``root``: a forward in training mode
    moves them (a moving-average observer is not idempotent), so a replay starts them where training's did.

    Example:
        >>> from torch.ao.quantization import FakeQuantize
        >>> len(observer_buffers(nn.Sequential(nn.Linear(2, 2), FakeQuantize()))) > 0
        True
    """
    try:
        from torch.ao.quantization import FakeQuantizeBase
        from torch.ao.quantization.observer import ObserverBase
    except ImportError:  # pragma: no cover - every supported torch has them
        return []
    out: List[torch.Tensor] = []
    for module in root.modules():
        if isinstance(module, (FakeQuantizeBase, ObserverBase)):
            out.extend(module.buffers(recurse=False))
    return out


@dataclass
class StartState:
    """Every generator's state where a micro-batch started (see :meth:`ForwardRecorder.mark`)."""

    rng: torch.Tensor
    cuda: Optional[List[torch.Tensor]]
    numpy: Any
    python: Any
    exact: bool = False

    @classmethod
    def now(cls, exact: bool = False, full: bool = True) -> "StartState":
        """The states now; ``full=False`` keeps torch's alone (numpy's and ``random``'s cost 60 us to read)."""
        if not full:
            return cls(torch.get_rng_state(), _cuda_states(), None, None, exact)
        return cls(torch.get_rng_state(), _cuda_states(), np.random.get_state(), random.getstate(), exact)

    def apply(self) -> None:
        torch.set_rng_state(self.rng)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.numpy is not None:
            np.random.set_state(self.numpy)
        if self.python is not None:
            random.setstate(self.python)


@dataclass
class MicroBatch:
    """One micro-batch of an optimizer step, as training saw it."""

    batch: Any
    loss: Optional[float]
    start: StartState
    records: List[ForwardRecord] = field(default_factory=list)
    overflow: bool = False


class _RecordHook:
    """The forward pre-hook: shared by deep copies (the check's shadow) and pickled as a no-op."""

    _gradwatch_hook = True  # gradwatch's own: checks leave it in place (it ignores what is not training)

    def __init__(self, recorder: "ForwardRecorder") -> None:
        self.recorder: Optional[ForwardRecorder] = recorder

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        rec = self.recorder
        if rec is None or module is not rec.root:
            return None
        if rec.probe is not None:  # a replay runs: its probe takes training's place
            rec.probe(module, args, kwargs)
        elif rec.active and not rec.paused and torch.is_grad_enabled():
            rec.record(args, kwargs)
        elif not rec.active and not rec.paused:
            rec.unhook()  # a forward no check will look at: off the model (torch's hook-free fast path) until mark()
        return None

    def __deepcopy__(self, memo: dict) -> "_RecordHook":
        return self  # a deep copy of the model (the check's shadow) keeps the same hook, which ignores it

    def __getstate__(self) -> dict:
        return {}  # torch.save(model) pickles an inert hook, never the recorded tensors

    def __setstate__(self, state: dict) -> None:
        self.recorder = None


class ForwardRecorder:
    """Records the state each training forward of ``root`` starts from (see the module docstring).

    Args:
        root: The live model (the module training calls).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
        >>> rec = ForwardRecorder(model)
        >>> _ = model(torch.ones(1, 2))
        >>> len(rec.take(batch=None).micro[0].records)
        1
        >>> rec.close()
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.paused = False
        #: The running replay's probe (:func:`replay_step`), called from this hook in the place training's forwards were recorded.
        self.probe: Optional[Callable[[nn.Module, tuple, dict], None]] = None
        #: Record forwards (True while the coming step may be checked; see :meth:`mark`).
        self.active = True
        self._hook = _RecordHook(self)
        self._handle: Optional[Any] = None
        self._hook_on()
        self._records: List[ForwardRecord] = []
        self._overflow = False
        self._start: Optional[StartState] = StartState.now()
        self._pending: List[MicroBatch] = []
        self._observers: Optional[List[torch.Tensor]] = None  # observer_buffers(root), found at the first record

    def hooked(self) -> bool:
        """True while the recording pre-hook is in place on the root (user code may have cleared hooks)."""
        return self._handle is not None and self._handle.id in self.root._forward_pre_hooks

    def _hook_on(self) -> None:
        """Put the recording pre-hook on the root, first of its pre-hooks (it sees the call's own inputs)."""
        if self._handle is None:
            self._handle = self.root.register_forward_pre_hook(self._hook, with_kwargs=True, prepend=True)

    def unhook(self) -> None:
        """Take the recording pre-hook off (a step no check will look at: forwards run hook-free)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def record(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        """Called by the pre-hook for every training forward of the root module."""
        if len(self._records) >= MAX_RECORDS:
            self._overflow = True
            return
        if self._observers is None:
            self._observers = observer_buffers(self.root)
        observers = [(b, b.detach().clone()) for b in self._observers] if self._observers else None
        self._records.append(ForwardRecord(torch.get_rng_state(), _cuda_states(), autocast_state(), _tensors(args, kwargs),
                                           observers, (len(args), _keywords(kwargs))))

    def mark(self, exact: bool = False, full: bool = True) -> None:
        """A micro-batch starts now: forget the forwards seen so far and remember every generator's state.

        Args:
            exact: The caller knows the forward follows with no other random draw in between
                (an integration's batch-start hook).
            full: The coming step may be checked: record its forwards and every generator's state.
                False: record nothing until the next mark (the first forward takes the hook off the
                model, so the forwards of a step without a check run hook-free).
        """
        self._records = []
        self._overflow = False
        self.active = full
        self._start = StartState.now(exact, full) if full else None
        if full:
            self._hook_on()
            self._observers = None  # the module tree may have changed: looked for again at the next record

    def close_micro_batch(self, batch: Any, loss: Optional[float]) -> None:
        """A micro-batch's backward is done (gradient accumulation): keep it for the coming step."""
        if not self.active:
            return
        self._pending.append(MicroBatch(batch, loss, cast(StartState, self._start), self._records, self._overflow))
        self.mark()

    def take(self, batch: Any = None, loss: Optional[float] = None) -> "Step":
        """Everything since the last step: the kept micro-batches plus this one; then start afresh.

        ``batch`` is the step's (last) micro-batch; None when every micro-batch was kept
        with :meth:`close_micro_batch` already.
        """
        micro = list(self._pending)
        if self._start is None:  # a check the recorder did not expect (GradWatch.check between scheduled steps)
            self._start = StartState.now(full=False)
        if batch is not None and not (micro and micro[-1].batch is batch):
            micro.append(MicroBatch(batch, loss, self._start, self._records, self._overflow))
        elif batch is None and not micro:
            micro.append(MicroBatch(None, loss, self._start, self._records, self._overflow))
        self._pending = []
        self.mark(full=False)  # until GradWatch.step says the next step is checked
        return Step(micro)

    def discard(self, full: bool = True) -> None:
        """A step without a check: drop what was recorded for it (``full``: see :meth:`mark`)."""
        self._pending = []
        self.mark(full=full)

    def close(self) -> None:
        """Remove the hook from the model."""
        self._hook.recorder = None
        self.unhook()
        self._records = []
        self._pending = []


@dataclass
class Step:
    """The micro-batches of one optimizer step."""

    micro: List[MicroBatch]


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
        if not same_inputs(rec.inputs, _tensors(args, kwargs)):
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
    override, a batched gradient) and builds the output gradient, which costs about 3% of the
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
    sums: Dict[str, torch.Tensor] = {}
    objective = 0.0
    count = len(step.micro)
    weights = [1.0 / count] * count if weights is None else [float(w) for w in weights]
    if len(weights) != count:
        raise ValueError(f"replay_step: {len(weights)} weights for {count} micro-batches")
    base = evaluate
    hows = []
    gaps = []
    forwards = (0, 0)
    seconds = 0.0
    failed: Optional[Replay] = None  # lockstep: the first failure, returned once every micro-batch ran
    for i, mb in enumerate(step.micro):
        mb.loss = as_float(mb.loss)
        if mb.batch is None:
            return Replay(None, None, None, "no batch was given for this step")
        weight = weights[i]
        if weight == 0.0 and not lockstep:
            continue  # no item of the step's objective in it: training's correct gradient has nothing of it
        evaluate = _weighed(base, weight, count)
        if mb.overflow:
            return Replay(None, None, None, f"training ran more than {MAX_RECORDS} forwards of the model in this step")
        done = None
        tried = []
        differs: Optional[str] = None
        spent: List[float] = []  # each mode's replay of this micro-batch, in seconds
        modes: Tuple[str, ...] = ("forward", "start") if mb.records else ("start",)
        if lockstep:
            modes = modes[:1]
        elif prefer is not None and prefer in modes:
            modes = (prefer,) + tuple(m for m in modes if m != prefer)
        for mode in modes:
            began = time.perf_counter()
            grads, value, probe, autocast = _one(root, recorder, evaluate, grad_of, mb, mode, params, context, generators,
                                                  modules, entry)
            took = time.perf_counter() - began
            spent.append(took)
            if probe.private:
                return Replay(None, None, None, "the model or loss_fn draws from a random generator of its own "
                              "(torch.Generator, numpy Generator, random.Random): the replay cannot reproduce training's "
                              "draws, so the training part is not judged", forwards=(len(mb.records), probe.count))
            forwards = (len(mb.records), probe.count)
            whole = value / weight if weight else value  # the micro-batch's own objective
            loss_agrees = mb.loss is not None and abs(whole - mb.loss) <= loss_tolerance * max(abs(whole), abs(mb.loss), 1e-30)
            if mb.records:
                ok = probe.faithful and probe.count == len(mb.records)
            else:
                ok = mb.start.exact or loss_agrees or (not lockstep and rng_free(root, recorder, evaluate, mb, modules, entry))
            if ok:
                done = (grads, value, mode, autocast)
                seconds += took
                break
            tried.append((mode, probe.count, probe.faithful))
            differs = differs or probe.differs
            if mode != modes[-1]:  # what this mode's replay freed, given back before the next one's forward (kept
                del grads, probe  # in the heap, the next forward's activations went on top of it)
                release_freed()
        if done is None:
            n_train = len(mb.records)
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
                elif differs is not None:
                    why = (f"the replay could not reproduce training's forward: {differs} (the model's inputs differ at "
                           "its forward): pass loss_fn the call training makes")
                else:
                    why = (f"the replay could not reproduce training's forward (training ran {n_train} forwards; the "
                           f"replays ran {', '.join(str(c) for _, c, _ in tried)}, with other inputs or another RNG "
                           "state): random augmentation drawing from torch's generator inside loss_fn after other draws "
                           "since the last step, or loss_fn is not the function training calls, or training calls a "
                           "wrapper of the watched module (give GradWatch the module training calls: Fabric's, a "
                           "compiled one)")
                failure = Replay(None, None, None, why, forwards=forwards)
            failure.seconds = min(spent)  # a replay in vain costs about a step too
            if not lockstep:
                return failure
            failed = failed or failure
            continue
        grads, value, mode, ran_in = done
        value = value / weight if weight else value  # the micro-batch's own objective (its gradient stays weighed)
        hows.append(mode)
        objective += value
        if mb.loss is not None and abs(value - mb.loss) > loss_tolerance * max(abs(value), abs(mb.loss), 1e-30):
            gaps.append((mb.loss, value))
        if each is not None:
            each(i, grads, weight)
        for n, g in grads.items():
            if n not in sums:
                sums[n] = g
            else:
                sums[n].add_(g)  # as autograd accumulates into .grad
    if failed is not None:
        return failed
    if not sums:
        return Replay(None, None, None, "not judged: every micro-batch of the step weighs 0 (no item to average over)")
    mean = sums
    gap = (sum(a for a, _ in gaps) / len(gaps), sum(b for _, b in gaps) / len(gaps)) if gaps else None
    return Replay(mean, objective / count, "+".join(sorted(set(hows))), loss_gap=gap, forwards=forwards, autocast=ran_in,
                  seconds=seconds)
