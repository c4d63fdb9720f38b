"""Agreement points for a check whose collectives run inside the user's code (FSDP2, tensor parallel, shard by shard).

Checked shard by shard, a check runs the live sharded model: its forwards all-gather and the replayed
backward reduce-scatters, on the model's own process group, inside ``loss_fn``. A rank whose
``loss_fn`` raised there would leave the others in the next collective until that group's timeout
(with gloo, mismatched collectives can abort them). :class:`Lockstep` puts an agreement point before
each of those collectives: a one-element all-reduce on gradwatch's own group, bounded by
``distributed_timeout`` (:meth:`~gradwatch.parallel.coordinator.DistributedCoordinator.agree`), or where every rank
is on one host the same through shared memory (:mod:`gradwatch.parallel.host_points`, far quicker than gloo).
There, a check's collectives of CPU tensors over every rank are made with their point, through the same shared
memory (:mod:`gradwatch.parallel.host_collectives`): DTensor's functional collectives, the ``torch.distributed``
functions FSDP2 calls (``all_gather_single``, ``reduce_scatter_single``) and DeepSpeed's all-gather (ZeRO-3's
gathers), wrapped for the region only.

- **DTensor's collectives** (tensor and sequence parallel, a ``full_tensor()``, whatever module or hook makes
  them): each functional collective's operator (``torch.ops._c10d_functional.all_reduce``, ...) is wrapped for the
  region, so each call of one, in the forward and in the backward, makes a point just before it, and only there (far
  fewer points than one at every such module's entry, exit and gradients: docs/guides/parallel.md).
- **FSDP2's** (``c10d`` calls; a module sharded over one rank, a 1x2 ``dp x tp`` mesh's, makes none with another
  rank): a point before each FSDP2 module's forward (before its all-gather) and, by
  tensor hooks, where each module's output gradient arrives (before FSDP2's pre-backward all-gather), where its
  input gradient leaves (before its reduce-scatter) and at the backward's end (before the root's
  reduce-scatter).
- **DeepSpeed ZeRO-3's** (``c10d`` calls of its hooks, on every module): a point before each module's forward
  (before ZeRO's hook gathers its parameters and prefetches the next ones) and, by a tensor hook on the output
  ZeRO's hook hands back, where its gradient arrives (before ZeRO's pre-backward gather). A check's backward is
  ``torch.autograd.grad``, which never runs ZeRO's reduce-scatter hooks (they run on accumulation). The engine
  itself may not run inside the region (its forward keeps ZeRO's counters): it raises, before any collective.

A rank whose check raised joins the next point saying so; every other rank stops at that same point
(:class:`PeerFailed`) before any further collective, so every rank has made the same collectives.
FSDP2's per-iteration state is then reset (``reset_iter_state``), what ZeRO-3 holds gathered is released
(:func:`~gradwatch.parallel.zero.reset_zero`), and training goes on. A rank that
stalls past ``distributed_timeout`` at a point breaks the coordinator on every rank (the check is an
error record and checks stop), with the same collectives made everywhere. What a point cannot cover:
a rank that fails *inside* a collective (out of memory in FSDP2's own buffers) leaves the others in
it until the model's process group times out.

Example:
    >>> from torch import nn
    >>> class Agreeing:  # a coordinator whose ranks always agree (alone: its value is the smallest)
    ...     def agree(self, ok, value=None):
    ...         return True, value
    >>> with Lockstep(Agreeing(), nn.Linear(2, 2)) as step:
    ...     step.point()
    >>> step.points, step.failed
    (2, False)
"""

from __future__ import annotations

import inspect
import sys
import time
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from gradwatch.check.objective.dtensor import checked_alone, functional_collectives, is_dtensor
from gradwatch.parallel.coordinator import DistributedCheckError, PeerFailed
from gradwatch.parallel.host_collectives import FUNCTIONS, function_through_host, through_host
from gradwatch.parallel.host_points import HostPoints
from gradwatch.parallel.shard_check import reshard
from gradwatch.parallel.sharded import fsdp_communicates, fsdp_loaded, is_fsdp, live_forward_refused
from gradwatch.parallel.zero import engine_of, release_leftovers, reset_zero, zero3
from gradwatch.trees import tensor_leaves

__all__ = ["Lockstep", "PeerFailed", "reset_fsdp"]


#: The regions open now, innermost last: a wrapped collective makes its point at the innermost one.
_OPEN: List["Lockstep"] = []
#: While a region is open: each wrapped operator's namespace, name and own packet (put back when the last closes).
_WRAPPED: List[Tuple[Any, str, Any]] = []


def _pointing() -> Optional["Lockstep"]:
    """The region whose point a collective called now makes: the innermost open one; none where one rank checks a
    piece alone (:func:`~gradwatch.check.objective.dtensor.no_collectives`: the collective raises, with no point)."""
    return _OPEN[-1] if _OPEN and not checked_alone() else None


def _before_backward_collective(grad: Any) -> None:
    """A tensor hook on an autograd collective's output: its gradient arrives, its backward's collective comes next."""
    step = _pointing()
    if step is not None:
        step.point()


class _Pointing:
    """A functional collective's operator (``torch.ops._c10d_functional.all_reduce``, ...) while a region is open:
    a point at the innermost region, then the operator itself. Anything else (its overloads, ``.default``) is the
    operator's own.

    An autograd collective (``_c10d_functional_autograd``) issues its backward's collective from autograd's own
    code, where no Python call is made: a tensor hook on its output makes that point, when the output's gradient
    arrives.
    """

    __slots__ = ("packet", "autograd", "name")

    def __init__(self, packet: Any, autograd: bool, name: str) -> None:
        self.packet = packet
        self.autograd = autograd
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        step = _pointing()
        if step is not None and not self.autograd:  # ranks on one host: made with the point, in shared memory
            out = through_host(step.host(), self.name, args, kwargs, step.point)
            if out is not None:
                return out
        if step is not None:
            step.point()
        out = self.packet(*args, **kwargs)
        if step is not None and self.autograd:
            for t in _needing_grad(out):
                t.register_hook(_before_backward_collective)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.packet, name)


def _functions() -> List[Tuple[Any, str, str]]:
    """``(where, attribute, which function)`` of the collective functions a region wraps: ``torch.distributed``'s,
    and DeepSpeed's backend's all-gather where DeepSpeed is loaded (it keeps torch's function from its start)."""
    found: List[Tuple[Any, str, str]] = [(dist, name, name) for name in FUNCTIONS]
    comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(comm, "cdb", None)
    if backend is not None and callable(getattr(backend, "all_gather_function", None)):
        found.append((backend, "all_gather_function", "all_gather_into_tensor"))
    return found


class _Sharing:
    """A ``torch.distributed`` collective function (FSDP2's ``all_gather_single``, ...) while a region is open: where
    every rank is on one host, made through shared memory with a point per round
    (:func:`~gradwatch.parallel.host_collectives.function_through_host`); otherwise the function itself (FSDP2's
    points are its modules' hooks)."""

    __slots__ = ("function", "name", "signature")

    def __init__(self, function: Any, name: str) -> None:
        self.function = function
        self.name = name
        self.signature = inspect.signature(function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        step = _pointing()
        host = step.host() if step is not None else None
        if host is None:
            return self.function(*args, **kwargs)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:  # the function's own error, from the function
            return self.function(*args, **kwargs)
        bound.apply_defaults()
        done = function_through_host(host, self.name, dict(bound.arguments), cast(Lockstep, step).point)
        return self.function(*args, **kwargs) if done is None else done[0]


def _open(step: "Lockstep", operators: bool = True) -> None:
    """Open ``step``'s region of points before collectives; the first open region wraps the operators (with
    ``operators``) and the collective functions.

    DTensor's redistributions and ``torch.distributed._functional_collectives`` look each functional collective up in
    ``torch.ops`` at every call (``torch.ops._c10d_functional.all_reduce(...)``): wrapped there for the region, each
    call makes its point first, in the forward and in the backward (DTensor's backward redistributes in Python), with
    nothing added to any other operator. A dispatch mode did this before, and sent every operator of the region
    through Python, which cost more than the wrapped operators do (docs/guides/parallel.md).

    The ``torch.distributed`` functions FSDP2 calls, and the all-gather DeepSpeed's communication backend keeps
    (``cdb.all_gather_function``, ZeRO-3's gathers), are wrapped too: where every rank is on one host they go through
    shared memory (:class:`_Sharing`).
    """
    if not _OPEN:
        for namespace, name in functional_collectives() if operators else ():
            space = getattr(torch.ops, namespace)
            try:
                packet = getattr(space, name)
            except (AttributeError, RuntimeError):  # pragma: no cover - listed but not loadable in this build
                continue
            if isinstance(packet, _Pointing):  # pragma: no cover - left by a region that could not close
                continue
            _WRAPPED.append((space, name, packet))
            setattr(space, name, _Pointing(packet, namespace == "_c10d_functional_autograd", name))
        for space, name, kind in _functions():
            function = getattr(space, name, None)
            if callable(function) and not isinstance(function, _Sharing):
                _WRAPPED.append((space, name, function))
                setattr(space, name, _Sharing(function, kind))
    _OPEN.append(step)


def _close(step: "Lockstep") -> None:
    """Close ``step``'s region; the last open region puts every operator back."""
    _OPEN.remove(step)
    if not _OPEN:
        for space, name, packet in _WRAPPED:
            setattr(space, name, packet)
        _WRAPPED.clear()


def _needing_grad(value: Any) -> List[torch.Tensor]:
    """The tensors that require a gradient in a module's arguments or output."""
    return [t for t in tensor_leaves(value) if t.requires_grad]


def reset_fsdp(model: nn.Module) -> None:
    """FSDP2's per-iteration state reset after a forward or backward stopped midway (``reset_iter_state`` on the
    root, where torch has it; otherwise every module resharded)."""
    if not fsdp_loaded():
        return
    for m in model.modules():
        if is_fsdp(m):
            reset = getattr(m, "reset_iter_state", None)
            try:
                if reset is not None:
                    reset()  # the root's: every state of the tree
                    return
            except RuntimeError:  # not the root
                continue
    reshard(model)


class Lockstep:
    """``with Lockstep(coord, model) as step:`` a region of a check whose collectives must stay in step.

    Inside, every FSDP2 module's forward first calls :meth:`point`; the caller calls it where else a
    collective follows user code (before the replayed backward). Leaving the region normally is a last
    point; leaving it by an exception of this rank tells the others at their next point.

    Args:
        coord: The :class:`~gradwatch.parallel.coordinator.DistributedCoordinator` (its ``agree``).
        model: The live sharded model.

    Attributes:
        failed: Some rank's check raised in the region (seen at a point).
        points: Agreement points made.
        waited: Seconds spent at them (waiting for the other ranks).
    """

    def __init__(self, coord: Any, model: nn.Module) -> None:
        self.coord = coord
        self.model = model
        self.failed = False
        self.points = 0
        self.waited = 0.0
        self._handles: List[Any] = []
        self._queued = False  # the end-of-backward point is queued for the backward running now
        self._plain: Dict[int, Tuple[Any, Any]] = {}
        self._wraps = False  # its region wraps the collectives (opened by __enter__, closed by __exit__)
        self._engine: Optional[nn.Module] = None  # DeepSpeed's engine around a ZeRO-3 model

    def _agree(self, ok: bool, value: Optional[int] = None) -> Tuple[bool, Optional[int]]:
        start = time.perf_counter()
        try:
            return self.coord.agree(ok, value)
        finally:
            self.waited += time.perf_counter() - start

    def host(self) -> Optional[HostPoints]:
        """Where the points meet in shared memory (every rank on one host, opened at the first point), else None."""
        host = getattr(self.coord, "host", None)
        return host() if callable(host) else None

    def point(self, value: Optional[int] = None) -> Optional[int]:
        """Return when every rank reached this point fine (with the smallest of the ranks' ``value``, a byte count);
        raise :class:`PeerFailed` when another rank's check raised.

        Raises:
            PeerFailed: Another rank failed (then every later point raises at once, with no collective).
            DistributedCheckError: A rank did not arrive within ``distributed_timeout``.
        """
        if self.failed:
            raise PeerFailed("another rank's check raised; this rank stopped at the same point")
        self.points += 1
        ok, smallest = self._agree(True, value)
        if not ok:
            self.failed = True
            raise PeerFailed("another rank's check raised; this rank stopped at the same point, before any further "
                             "collective")
        return smallest

    def _in_backward(self, grad: Any) -> None:
        """A tensor hook: a point inside a backward (the first also queues one at the backward's end)."""
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._at_end)  # before FSDP2's own end-of-backward callback
        self.point()

    def _at_end(self) -> None:
        self._queued = False
        if self._engine is not None:
            release_leftovers(self._engine)  # ZeRO-3's backward epilogue (a check's autograd.grad has none)
        self.point()  # before FSDP2's reduce-scatter of the modules whose inputs need no gradient (the root's)

    def __enter__(self) -> "Lockstep":
        """Points in the forward (before each FSDP2 module's all-gather) and, by tensor hooks, in the backward:
        where a module's output gradient arrives (before FSDP2's pre-backward all-gather) and where its input
        gradient leaves (before FSDP2's reduce-scatter of the module)."""

        def before_forward(module: nn.Module, args: Any) -> None:
            self.point()

        def outputs(module: nn.Module, args: Any, output: Any) -> None:  # runs before FSDP2's post-forward
            for t in _needing_grad(output):
                t.register_hook(self._in_backward)  # before the hook FSDP2 registers next on the same tensor

        def inputs(module: nn.Module, args: Any, kwargs: Any) -> None:  # runs after FSDP2's pre-forward
            for t in _needing_grad((args, kwargs)):
                t.register_hook(self._in_backward)  # before FSDP2's post-backward node of the module

        for hook in (before_forward, outputs, inputs):
            setattr(hook, "_gradwatch_hook", True)  # noqa: B010 - gradwatch's own: kept when user hooks are suspended
        self._queued = False
        # Plain parameters as training left them (FSDP2's are DTensors now; these are the ones it does not manage)
        self._plain = {id(p): (p, p.grad) for p in self.model.parameters() if not is_dtensor(p)}
        for m in self.model.modules():
            if is_fsdp(m) and fsdp_communicates(m):  # one over a single rank (a 1x2 mesh's) waits for no other
                self._handles += [m.register_forward_pre_hook(before_forward, prepend=True),
                                  m.register_forward_hook(outputs, prepend=True),
                                  m.register_forward_pre_hook(inputs, with_kwargs=True)]
        zero = zero3(self.model)
        self._engine = engine_of(self.model) if zero else None
        if zero:
            self._zero_hooks(before_forward)
        # (a ZeRO-3 model's collectives are its hooks' c10d calls: no functional one to make a point before)
        _open(self, operators=not zero or any(is_dtensor(p) for p in self.model.parameters()))
        self._wraps = True
        return self

    def _zero_hooks(self, before_forward: Any) -> None:
        """ZeRO-3: a point before every module's forward (ZeRO's pre-forward hook gathers, on every module), a tensor
        hook on the output ZeRO's forward hook hands back (its gradient arrives before ZeRO's pre-backward gather),
        and the engine's own forward refused (see the module docstring).

        ZeRO-3 counts one backward per forward: a module's pre-backward gather runs while its count of forwards
        (``applied_pre_backward_ref_cnt``) is positive, and its post-backward release when its inputs' gradients
        (``ds_grads_remaining``) are all in. A check that backpropagates one forward again (``retain_graph``: the
        independence part's probes) would find the parameters released: the same tensor hook arms both again, as
        the forward left them, before each backward reaches the module (a first backward finds them as they are).
        """

        def zero_outputs(module: nn.Module, args: Any, output: Any) -> None:  # runs after ZeRO's: its wrapped output
            remaining = module.__dict__.get("ds_grads_remaining")

            def again(grad: Any) -> None:
                if module.__dict__.get("applied_pre_backward_ref_cnt", 1) < 1:
                    module.__dict__["applied_pre_backward_ref_cnt"] = 1
                if remaining is not None:
                    module.__dict__["ds_grads_remaining"] = remaining
                self._in_backward(grad)

            for t in _needing_grad(output):
                t.register_hook(again)

        setattr(zero_outputs, "_gradwatch_hook", True)  # noqa: B010 - gradwatch's own
        for m in self.model.modules():
            self._handles += [m.register_forward_pre_hook(before_forward, prepend=True),
                              m.register_forward_hook(zero_outputs)]
        if self._engine is not None:
            self._handles.append(self._engine.register_forward_pre_hook(live_forward_refused(
                "DeepSpeed engine", "the engine from its closure (its forward keeps ZeRO's counters)",
                "the live ZeRO-3 model itself"), prepend=True))

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if self._wraps:
            self._wraps = False
            _close(self)
        for h in self._handles:
            h.remove()
        self._handles = []
        plain, self._plain = self._plain, {}  # the region holds no gradient once it ends
        if kind is None:
            if not self.failed:
                self.points += 1
                self.failed = not self._agree(True)[0]  # this rank's own work stands; the merge names the failure
            return
        if not isinstance(exc, DistributedCheckError) and not self.failed:
            self.failed = True
            try:
                self._agree(False)  # the others stop at their next point
            except DistributedCheckError:
                pass  # the coordinator is broken: every rank gives up checking
        # A backward stopped midway left gradients on the unsharded parameters of the modules whose reduce-scatter
        # did not run: FSDP2 would add them into training's next gradient.
        for p in self.model.parameters():
            if not is_dtensor(p) and id(p) not in plain:
                p.grad = None
        for p, grad in plain.values():
            p.grad = grad
        reset_fsdp(self.model)
        if self._engine is not None:
            reset_zero(self.model, self._engine)
