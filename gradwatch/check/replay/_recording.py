"""Record what each training forward started from, for :mod:`gradwatch.check.replay.reference` to replay it.

A :class:`ForwardRecorder` sits on the live model: a forward pre-hook on the root module records, for every forward
run with grad enabled, torch's RNG state, the autocast state and references to the tensors the forward received (no
copy); :meth:`ForwardRecorder.mark` remembers every generator's state where a micro-batch starts.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np
import torch
from torch import nn

from gradwatch.check.objective.precision import AUTOCAST_DEVICES, any_autocast

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


def forward_tensors(args: tuple, kwargs: Mapping[str, Any]) -> List[torch.Tensor]:
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
    """The keywords of a call whose values are tensors (not scalars: as :func:`forward_tensors` compares them)."""
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
        """The states now; ``full=False`` keeps torch's alone (numpy's and ``random``'s are slow to read)."""
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
        #: The running replay's probe (:func:`~gradwatch.check.replay.reference.replay_step`), called from this hook
        #: in the place training's forwards were recorded.
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
        self._records.append(ForwardRecord(torch.get_rng_state(), _cuda_states(), autocast_state(), forward_tensors(args, kwargs),
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
