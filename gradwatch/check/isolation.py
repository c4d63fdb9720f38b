"""Make the check objective deterministic and free of side effects.

- RNG: torch (CPU and every initialized CUDA device), numpy and ``random``
  states are saved before a check and restored after it; every evaluation
  starts from the same seed.
- Dropout: all ``nn.Dropout*``/``AlphaDropout``/``FeatureAlphaDropout``
  modules are switched to eval, the ``dropout`` probability of
  ``nn.MultiheadAttention`` and RNN modules is set to 0, and functional dropout
  (``F.dropout``, ``scaled_dot_product_attention(dropout_p=...)``, ...) runs with
  training off, for the check only (:mod:`gradwatch.check.dropout`).
- ``parametrizations.spectral_norm``: the power iteration is off during a check
  (``u``, ``v`` constant, as torch defines the gradient).
- BatchNorm stays in train mode (the function training differentiates);
  any buffer an evaluation changes (running stats, ``num_batches_tracked``,
  power-iteration vectors) is put back after that evaluation.
- The float64 shadow is a deep copy refreshed in place from the live model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import operator
import random
import threading
import types
from typing import TYPE_CHECKING, Any, ContextManager, Dict, Iterator, List, Mapping, Optional, Set, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.utils.parametrizations import _SpectralNorm

if TYPE_CHECKING:
    from .dropout import DropoutRecord


_RNG_GUARD = threading.local()


def preserved_rng() -> ContextManager[None]:
    """Restore torch (CPU, CUDA), numpy and ``random`` RNG states on exit.

    Nested uses cost nothing: the outermost one restores every generator when it exits (a check
    wraps both of its parts in one, as reading and writing numpy's state alone costs ~0.2 ms).

    Example:
        >>> with preserved_rng():
        ...     _ = torch.rand(3)
    """
    if getattr(_RNG_GUARD, "depth", 0):
        return contextlib.nullcontext()  # inside the outermost one, which restores everything
    return _outermost_rng()


@contextlib.contextmanager
def _outermost_rng() -> Iterator[None]:
    _RNG_GUARD.depth = 1
    try:
        with _restoring_rng():
            yield
    finally:
        _RNG_GUARD.depth = 0


@contextlib.contextmanager
def _restoring_rng() -> Iterator[None]:
    torch_state = torch.get_rng_state()
    cuda_states = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_states = torch.cuda.get_rng_state_all()
    np_state = np.random.get_state()
    py_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        np.random.set_state(np_state)
        random.setstate(py_state)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every initialized CUDA device), numpy and ``random``.

    Used inside :func:`preserved_rng`. CUDA generators are seeded only once
    CUDA is initialized (a model on the GPU initializes it): seeding them
    lazily would queue a callback with a stack trace on every evaluation.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    np.random.seed(seed % (2**32))
    random.seed(seed)


class Reseeder:
    """:func:`seed_everything` for every evaluation of a check, at a third of its cost.

    The generator states right after seeding are captured once and put back on
    each call (``torch.set_rng_state`` and ``random.setstate`` are cheaper than
    re-seeding; numpy's ``seed`` is cheaper than its ``set_state``). Generators held by the
    model or the loss (:class:`~gradwatch.check.generators.HeldGenerators`, ``held``) are put back in
    their saved state on each call. ``random``
    and ``numpy.random`` are reseeded only if one of the first :attr:`WATCH`
    evaluations drew from them (most objectives use torch's generator alone).

    Example:
        >>> with preserved_rng():
        ...     reseed = Reseeder(3)
        ...     a = torch.rand(2); reseed(); b = torch.rand(2)
        >>> bool((a == b).all())
        True
    """

    #: Evaluations watched for use of ``random`` and ``numpy.random`` before an unused one stops being reseeded.
    WATCH = 2

    def __init__(self, seed: int, held: Any = None) -> None:
        self.seed = int(seed)
        self._held = held if held else None  # HeldGenerators: reset before every evaluation too
        seed_everything(self.seed)
        self._torch = torch.get_rng_state()
        self._py = random.getstate()
        self._np = np.random.get_state()
        self._calls = 0
        self._used_py = False
        self._used_np = False

    def __call__(self) -> None:
        torch.set_rng_state(self._torch)
        if self._held is not None:
            self._held.reset()
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(self.seed)
        if 0 < self._calls <= self.WATCH:
            self._watch()
        undecided = self._calls < self.WATCH  # before the last watched evaluation, reseed everything
        self._calls += 1
        if undecided or self._used_np:
            np.random.seed(self.seed % (2**32))
        if undecided or self._used_py:
            random.setstate(self._py)

    def _watch(self) -> None:
        """After one of the first evaluations: did it draw from ``random`` or ``numpy.random``?

        Checking costs more than reseeding, so only the first :attr:`WATCH` evaluations are
        watched. A generator none of them drew from is not reseeded again (its state is still
        the seeded one); one they drew from is reseeded before every evaluation. torch's own
        generator is cheap to reset and always is.
        """
        self._used_py = self._used_py or random.getstate() != self._py
        self._used_np = self._used_np or not _same_np_state(np.random.get_state(), self._np)


def _same_np_state(a: Any, b: Any) -> bool:
    return a[0] == b[0] and a[2:] == b[2:] and bool(np.array_equal(a[1], b[1]))


def _has_dropout_prob(module: nn.Module) -> bool:
    return isinstance(module, (nn.MultiheadAttention, nn.RNNBase)) and float(getattr(module, "dropout", 0.0)) > 0


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _layerdrop(name: str, module: nn.Module, configs: set) -> List[str]:
    """Layerdrop a module in train mode applies: its ``layerdrop`` attribute, or its (transformers) config's
    ``*layerdrop`` fields (each config once)."""
    where = name or type(module).__name__
    found = []
    if _positive(getattr(module, "layerdrop", None)):
        found.append(f"layerdrop {module.layerdrop:g} in `{where}`")
    config = module.__dict__.get("config")
    if config is not None and id(config) not in configs:
        configs.add(id(config))
        fields = getattr(config, "__dict__", {})
        found.extend(f"layerdrop {v:g} (config.{k} of `{where}`)" for k, v in fields.items()
                     if k.endswith("layerdrop") and _positive(v))
    return found


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator["DropoutRecord"]:
    """Switch every dropout off for the duration, restoring flags and probabilities after.

    Dropout modules go to eval, ``MultiheadAttention``/RNN ``dropout`` probabilities to 0, and
    functional dropout calls made meanwhile in this thread run with training off
    (:class:`gradwatch.check.dropout.FunctionalDropoutOff`). Yields a
    :class:`gradwatch.check.dropout.DropoutRecord` of what was switched off; call its ``settle()``
    after the first forward (the counts are per forward). Layerdrop (a module attribute
    ``layerdrop`` > 0, or a transformers config's ``layerdrop``/``encoder_layerdrop``/... fields)
    is recorded as staying on.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)).train()
        >>> with dropout_off(m) as record:
        ...     m[1].training
        False
        >>> m[1].training, record.modules
        (True, 1)
    """
    from .dropout import DropoutRecord, FunctionalDropoutOff

    record = DropoutRecord()
    configs: set = set()
    flags: List[Tuple[nn.Module, bool]] = []
    probs: List[Tuple[Any, float]] = []  # modules with a float `dropout` attribute
    for name, module in model.named_modules():
        if isinstance(module, _DropoutNd):
            if module.training and float(module.p) > 0:
                record.modules += 1
            flags.append((module, module.training))
            module.training = False
        elif _has_dropout_prob(module):
            record.probabilities += 1
            probs.append((module, module.dropout))
            module.dropout = 0.0
        if module.training:
            record.stays_on.extend(_layerdrop(name, module, configs))
    mode = FunctionalDropoutOff(record)
    try:
        with mode:
            yield record
    finally:
        for module, flag in flags:
            module.training = flag
        for module, p in probs:
            module.dropout = p


class BufferGuard:
    """Puts back any buffer an evaluation changed in place.

    A change is detected by the version counter *or* by value: the native
    batch-norm kernel updates ``running_mean``/``running_var`` in place
    without bumping their version counters. Buffers that did not change are
    not written, so a buffer saved for backward (an eval-mode BatchNorm's
    running stats) keeps its version. Call :meth:`restore_changed` only after
    any pending backward of the evaluation: a train-mode BatchNorm saves its
    running stats for backward too, and restoring them bumps their version.

    Example:
        >>> bn = nn.BatchNorm1d(2)
        >>> guard = BufferGuard(bn)
        >>> _ = bn(torch.randn(4, 2))
        >>> guard.restore_changed(); int(bn.num_batches_tracked), float(bn.running_mean.abs().sum())
        (0, 0.0)
    """

    #: Value comparisons in a row that found a buffer unchanged before :meth:`restore_fast` trusts its version counter.
    TRUST_AFTER = 2

    def __init__(self, model: nn.Module, attributes: bool = False, modules: Optional[List[nn.Module]] = None,
                 owners: Optional[List[Tuple[nn.Module, str, torch.Tensor]]] = None) -> None:
        if owners is None:
            modules = list(model.modules()) if modules is None else modules  # one walk for buffers, owners, attributes
            owners = [(m, k, b) for m in modules for k, b in m._buffers.items() if b is not None]
        self._owners = owners
        seen: Set[int] = set()
        unique = []
        for _, _, b in self._owners:  # a shared buffer once
            if id(b) not in seen:
                seen.add(id(b))
                unique.append(b)
        self._buffers = [(b, b.detach().clone(), b._version) for b in unique]
        self._clean = [0] * len(self._buffers)
        #: With ``attributes``, plain attributes a forward changes (counters) are put back too (:class:`AttributeGuard`).
        self._attrs = AttributeGuard(model, modules) if attributes else None

    def restore_changed(self) -> None:
        """Copy the saved value back into every buffer whose version or value moved.

        A buffer the forward replaced by another tensor (``self.cache = torch.zeros(n)``, a
        shape that follows the batch) is put back too: the module holds the original again.
        """
        for m, key, buf in self._owners:
            if m._buffers.get(key) is not buf:
                m._buffers[key] = buf
        if self._attrs is not None:
            self._attrs.restore()
        for i, (buf, saved, version) in enumerate(self._buffers):
            if buf._version != version or not torch.equal(buf, saved):
                with torch.no_grad():
                    buf.copy_(saved)
                self._buffers[i] = (buf, saved, buf._version)
                self._clean[i] = 0
            else:
                self._clean[i] += 1

    def restore_fast(self) -> None:
        """:meth:`restore_changed` between evaluations, without a value comparison (a device sync) per buffer.

        Version counters are always compared (free). Values are compared only for buffers
        that changed without a version bump recently (fewer than :attr:`TRUST_AFTER` clean
        comparisons in a row): with :func:`frozen_batchnorm_stats` in effect, no buffer of a
        standard module does. Call :meth:`restore_changed` once at the end for an exact restore.
        """
        if self._attrs is not None:
            self._attrs.restore()
        for i, (buf, saved, version) in enumerate(self._buffers):
            if buf._version != version or (self._clean[i] < self.TRUST_AFTER and not torch.equal(buf, saved)):
                with torch.no_grad():
                    buf.copy_(saved)
                self._buffers[i] = (buf, saved, buf._version)
                self._clean[i] = 0
            elif self._clean[i] < self.TRUST_AFTER:
                self._clean[i] += 1


#: Hook dicts of a module, with the words a note uses for them.
_HOOK_KINDS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
               "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}
#: Top-level packages whose hooks are part of the function a module computes (weight_norm, pruning, ...).
_LIBRARY_HOOKS = ("torch",)


def _library_hook(hook: Any) -> bool:
    if getattr(hook, "_gradwatch_hook", False):  # gradwatch's own (the shadow's input casting)
        return True
    fn = hook.func if isinstance(hook, functools.partial) else hook
    fn = getattr(fn, "__func__", fn)  # a bound method: where its function is defined
    where = fn.__module__ if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)) else type(fn).__module__
    return isinstance(where, str) and where.split(".")[0] in _LIBRARY_HOOKS


def _hook_name(hook: Any) -> str:
    fn = hook.func if isinstance(hook, functools.partial) else hook
    return getattr(fn, "__name__", None) or type(fn).__name__


def _has_hooks(m: nn.Module) -> bool:
    # Attribute reads, not a loop over _HOOK_KINDS: this runs for every module of every replay.
    return bool(m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks)


@contextlib.contextmanager
def suspended_hooks(model: nn.Module, modules: Optional[List[nn.Module]] = None) -> Iterator[List[str]]:
    """Module hooks registered by user code do not run for the duration; yields what was suspended.

    A hook on the live model (or its deep copy, whose hooks are the same functions) would run
    at every evaluation of a check: a recorder of activations would fill up, a counter rise,
    by dozens per check. Hooks defined by torch (``weight_norm``, pruning, ``spectral_norm``)
    and gradwatch's own are part of what a module computes and keep running. Global module
    hooks (``register_module_forward_hook``) are suspended by the same rule. Each hook is put
    back in its place afterwards.

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> seen = []
        >>> _ = lin.register_forward_hook(lambda m, i, o: seen.append(1))
        >>> with suspended_hooks(lin) as names:
        ...     _ = lin(torch.ones(2))
        >>> len(seen), names, len(lin._forward_hooks)
        (0, ['forward hook <lambda> on the model'], 1)
    """
    places: List[Tuple[Any, Dict[str, Any]]] = [
        (m, m.__dict__) for m in (model.modules() if modules is None else modules) if _has_hooks(m)]
    places.append(("every module (global)", _global_hooks()))
    removed: List[_Removed] = []
    names: List[str] = []
    module_names: Dict[int, str] = {}  # built once, only when a user hook needs naming
    for where, attrs in places:
        for key, kind in _HOOK_KINDS.items():
            user = _take_user_hooks(attrs.get(key), removed)
            if user:
                if isinstance(where, nn.Module):
                    if not module_names:
                        module_names = {id(m): name or "the model" for name, m in model.named_modules()}
                    where = module_names.get(id(where), "the model")
                names.extend(f"{kind} {_hook_name(h)} on {where}" for h in user.values())
    try:
        yield names
    finally:
        _put_back_hooks(removed)


#: A hook dict whose user hooks were taken out: (the dict, its keys in order, the hooks taken out by key).
_Removed = Tuple[Dict[Any, Any], List[Any], Dict[Any, Any]]


def _global_hooks() -> Dict[str, Any]:
    """The global module hook dicts (``register_module_forward_hook`` ...), by the per-module attribute name."""
    return {k: getattr(torch_module, "_global" + k, None) for k in _HOOK_KINDS}


def _take_user_hooks(hooks: Optional[Dict[Any, Any]], removed: List[_Removed]) -> Optional[Dict[Any, Any]]:
    """Take the hooks user code registered out of ``hooks`` (noted in ``removed``); returns them (None: none)."""
    if not hooks:
        return None
    user = {k: h for k, h in hooks.items() if not _library_hook(h)}
    if not user:
        return None
    removed.append((hooks, list(hooks), user))
    for k in user:
        del hooks[k]
    return user


def _put_back_hooks(removed: List[_Removed]) -> None:
    """Put every hook :func:`_take_user_hooks` took out back in its place."""
    for hooks, order, user in removed:
        current = dict(hooks)  # hooks gradwatch added or removed meanwhile (its casting hooks) stay as they are
        merged = [(k, user.get(k, current.get(k))) for k in order if k in user or k in current]
        known = set(order)
        merged += [(k, v) for k, v in current.items() if k not in known]
        hooks.clear()
        hooks.update(merged)


#: Attributes every ``nn.Module`` has (``training``, parameter, buffer and hook dicts).
MODULE_KEYS = frozenset(vars(nn.Module()))
_SCALARS = (int, float, bool, str, complex, type(None))


class AttributeGuard:
    """Puts back plain attributes of modules that a forward changes: a call counter, a flag.

    Attributes holding a number, string, boolean or None (not those every ``nn.Module`` has)
    are saved at construction. The first :meth:`restore` (after the check's first, analytic
    evaluation) finds those the forward changed and puts them back; later calls put back only
    those, so gradwatch's own switches between evaluations (BatchNorm's
    ``track_running_stats`` during a check) are left alone. Lists, dicts and other objects a
    forward mutates are not guarded.

    Example:
        >>> class Counting(nn.Linear):
        ...     calls = 0
        ...     def forward(self, x):
        ...         self.calls += 1
        ...         return super().forward(x)
        >>> m = Counting(2, 1); m.calls = 0
        >>> guard = AttributeGuard(m)
        >>> _ = m(torch.ones(2)); guard.restore(); m.calls
        0
    """

    def __init__(self, model: nn.Module, modules: Optional[List[nn.Module]] = None) -> None:
        self._saved: List[Tuple[Dict[str, Any], str, Any]] = []
        for m in (model.modules() if modules is None else modules):
            attrs = m.__dict__
            if _stateless(type(m)) and "forward" not in attrs:  # torch's forward, which changes no plain attribute
                continue
            _save_scalars(attrs, self._saved)
        self._changed: Optional[list] = None

    def restore(self) -> None:
        """Put back the attributes the forward changed (found on the first call)."""
        if self._changed is None:
            self._changed = [(attrs, k, v) for attrs, k, v in self._saved
                             if not (attrs.get(k, _MISSING) is v or (type(attrs.get(k)) is type(v) and attrs.get(k) == v))]
        for attrs, k, v in self._changed:
            attrs[k] = v


_MISSING = object()


def _save_scalars(attrs: Dict[str, Any], saved: List[Tuple[Dict[str, Any], str, Any]]) -> None:
    """Append ``(attrs, key, value)`` for each plain scalar attribute (not one every module has)."""
    saved.extend((attrs, k, v) for k, v in attrs.items() if type(v) in _SCALARS and k not in MODULE_KEYS)


def _restore_scalars(attrs: Dict[str, Any], saved: Dict[str, Any]) -> None:
    """Put back in ``attrs`` every plain scalar attribute ``saved`` (an earlier copy of it) holds with another value."""
    kept: List[Tuple[Dict[str, Any], str, Any]] = []
    _save_scalars(saved, kept)
    for _, k, v in kept:
        if attrs.get(k, _MISSING) is not v:
            attrs[k] = v

#: Module classes whose forward is torch's own (``torch.nn.modules``): it changes buffers at most, never a
#: plain attribute, so :class:`AttributeGuard` skips their instances (a replay guards every module of the model).
_STATELESS: Dict[type, bool] = {}


def _stateless(cls: type) -> bool:
    known = _STATELESS.get(cls)
    if known is None:
        where = getattr(getattr(cls, "forward", None), "__module__", None) or ""
        known = _STATELESS[cls] = where.startswith("torch.nn.modules.") and cls.__module__.startswith("torch.nn.modules.")
    return known


class LiveIsolation:
    """The live model as a replay of training's forward runs it, set up in one walk of its modules.

    What :func:`suspended_hooks`, :func:`frozen_power_iteration` and :class:`BufferGuard` (with
    attributes) do together, plus the gradient hooks of ``params`` detached (``p.register_hook``):
    hooks user code registered on modules (and global module hooks) do not run, the power iteration
    of ``spectral_norm`` is off, and on exit every buffer, plain scalar attribute and hook is back as
    it was. A replay runs on every check, right after training's backward has evicted the caches, so
    this is one pass over ``modules`` and does nothing for what the model does not have. RNG states
    are not its job (:func:`preserved_rng`).

    Args:
        modules: ``list(root.modules())`` (current: the caller walks the tree when it changes).
        params: Tensors whose gradient hooks are detached for the duration.

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> seen = []
        >>> _ = lin.register_forward_hook(lambda m, i, o: seen.append(1))
        >>> with LiveIsolation(list(lin.modules()), list(lin.parameters())):
        ...     _ = lin(torch.ones(2))
        >>> len(seen), len(lin._forward_hooks)
        (0, 1)
    """

    def __init__(self, modules: List[nn.Module], params: List[torch.Tensor] = ()) -> None:  # type: ignore[assignment]
        self.modules = modules
        self.params = params
        self._spectral: List[nn.Module] = []
        self._hooks: List[_Removed] = []
        self._attrs: List[Tuple[Dict[str, Any], Dict[str, Any]]] = []  # (a module's __dict__, its copy on entry)
        self._tensor_hooks: List[Tuple[Dict[Any, Any], Dict[Any, Any]]] = []
        self._buffers: Optional[BufferGuard] = None

    def __enter__(self) -> "LiveIsolation":
        owners: List[Tuple[nn.Module, str, torch.Tensor]] = []
        for m in self.modules:
            d = m.__dict__
            if _has_hooks(m):
                for key in _HOOK_KINDS:
                    _take_user_hooks(d[key], self._hooks)
            buffers = d["_buffers"]
            if buffers:
                owners.extend((m, k, b) for k, b in buffers.items() if b is not None)
            if isinstance(m, _SpectralNorm) and m.training:  # before the copy below: the copy holds the flag as set
                m.training = False
                self._spectral.append(m)
            if not _stateless(type(m)) or "forward" in d:  # a forward of user code may change a plain attribute
                self._attrs.append((d, d.copy()))  # compared on exit
        for hooks in _global_hooks().values():
            _take_user_hooks(hooks, self._hooks)
        for p in self.params:
            hooks = p._backward_hooks
            if hooks:
                self._tensor_hooks.append((hooks, dict(hooks)))
                hooks.clear()
        if owners:
            self._buffers = BufferGuard(self.modules[0], owners=owners)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._buffers is not None:
                self._buffers.restore_changed()
            for attrs, saved in self._attrs:
                if len(attrs) != len(saved) or not all(map(operator.is_, attrs.values(), saved.values())):
                    _restore_scalars(attrs, saved)
        finally:
            for hooks, items in self._tensor_hooks:
                hooks.update(items)
            _put_back_hooks(self._hooks)
            for m in self._spectral:
                m.training = True


@contextlib.contextmanager
def frozen_batchnorm_stats(model: nn.Module) -> Iterator[None]:
    """Train-mode BatchNorm keeps normalizing with batch statistics but stops updating running stats.

    Setting ``track_running_stats = False`` on a BatchNorm in train mode leaves
    its output unchanged (it normalizes with the batch statistics either way)
    and skips the in-place update of ``running_mean``/``running_var``/
    ``num_batches_tracked``: evaluations then write no buffer at all, and
    ``torch.vmap`` can batch them. Eval-mode BatchNorm is left alone.

    Example:
        >>> bn = nn.BatchNorm1d(2)
        >>> with frozen_batchnorm_stats(bn):
        ...     _ = bn(torch.randn(4, 2))
        >>> int(bn.num_batches_tracked), bn.track_running_stats
        (0, True)
    """
    frozen = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats]
    for m in frozen:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in frozen:
            m.track_running_stats = True


@contextlib.contextmanager
def frozen_power_iteration(model: nn.Module, modules: Optional[List[nn.Module]] = None) -> Iterator[None]:
    """``parametrizations.spectral_norm`` in train mode: ``u``, ``v`` held constant, as torch differentiates.

    In train mode each forward runs a power-iteration step that moves ``u``, ``v`` with the
    weight, but backprop treats them as constants. Finite differences would see them move and
    disagree (a false SUSPICIOUS or WRONG); with the power iteration off for the check (the
    ``_SpectralNorm`` parametrizations in eval mode), the check objective keeps the ``u``, ``v``
    the last training forward left, the ones training's gradient used. Flags are restored after.

    Example:
        >>> lin = nn.utils.parametrizations.spectral_norm(nn.Linear(3, 2))
        >>> u = lin.parametrizations.weight[0]._u.clone()
        >>> with frozen_power_iteration(lin):
        ...     _ = lin(torch.randn(4, 3))
        >>> bool(torch.equal(u, lin.parametrizations.weight[0]._u)), lin.parametrizations.weight[0].training
        (True, True)
    """
    frozen = [m for m in (model.modules() if modules is None else modules) if isinstance(m, _SpectralNorm) and m.training]
    for m in frozen:
        m.training = False
    try:
        yield
    finally:
        for m in frozen:
            m.training = True


_COMPLEX_OF = {torch.float64: torch.complex128, torch.float32: torch.complex64, torch.float16: torch.complex32}


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Cast floating tensors inside standard containers to ``dtype`` (complex ones to the complex dtype of its
    precision), keeping container types.

    Tensors, lists, tuples, namedtuples, dicts and dataclass instances are
    walked; any other object is returned as it is (the user's ``loss_fn``
    receives it untouched).

    Example:
        >>> cast_floats({"x": torch.ones(1), "y": torch.tensor([1])}, torch.float64)["x"].dtype
        torch.float64
    """
    if isinstance(obj, torch.Tensor):
        if obj.is_complex():  # complex data beside complex parameters: the complex dtype of the same precision
            wanted = _COMPLEX_OF.get(dtype, obj.dtype)
            return obj.to(wanted) if obj.dtype != wanted else obj
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_floats(v, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floats(v, dtype) for v in obj)
    if isinstance(obj, dict):
        try:
            return type(obj)((k, cast_floats(v, dtype)) for k, v in obj.items())
        except TypeError:
            return {k: cast_floats(v, dtype) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: cast_floats(getattr(obj, f.name), dtype) for f in dataclasses.fields(obj) if f.init}
        try:
            return dataclasses.replace(obj, **changes)
        except (TypeError, ValueError):
            return obj
    return obj


def _needs_cast(obj: Any, dtype: torch.dtype) -> bool:
    """True when :func:`cast_floats` would change something in ``obj``."""
    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point() and obj.dtype != dtype
    if isinstance(obj, (list, tuple)):
        return any(_needs_cast(v, dtype) for v in obj)
    if isinstance(obj, dict):
        return any(_needs_cast(v, dtype) for v in obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(_needs_cast(getattr(obj, f.name), dtype) for f in dataclasses.fields(obj) if f.init)
    return False


def _cast_inputs_hook(dtype: torch.dtype, needed: Optional[set] = None):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        # Fast path (runs for every module on every evaluation): tensor arguments already in dtype.
        if not kwargs and all(type(a) is torch.Tensor and (a.dtype == dtype or not a.is_floating_point()) for a in args):
            return None
        if not (_needs_cast(args, dtype) or _needs_cast(kwargs, dtype)):
            return None
        if needed is not None:
            needed.add(id(module))
        return cast_floats(args, dtype), cast_floats(kwargs, dtype)

    hook._gradwatch_hook = True  # type: ignore[attr-defined]  # a marker: suspended_hooks keeps this hook
    return hook


def is_dtensor(t: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (a sharded or replicated parameter or gradient).

    Example:
        >>> is_dtensor(torch.zeros(2))
        False
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` holds an FSDP2 module (``fully_shard``) or a DTensor parameter.

    Such a model cannot be deep-copied, and its forward makes collectives: it is checked only on a
    replica that every rank gathers together (:mod:`gradwatch.watch.sharded`).

    Example:
        >>> is_sharded(nn.Sequential(nn.Linear(2, 2)))
        False
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6 or built without distributed
        return any(is_dtensor(p) for p in model.parameters())
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return True
    return any(is_dtensor(p) for p in model.parameters())


#: Complex dtype a shadow gives complex tensors, per real shadow dtype.
_COMPLEX_OF = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def param_signature(model: nn.Module) -> Tuple:
    """Names, shapes and devices of parameters and buffers (non-persistent ones too): when it changes, a shadow must be rebuilt."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    return tuple((n, tuple(t.shape), str(t.device)) for n, t in tensors if isinstance(t, torch.Tensor))


class Shadow:
    """A deep copy of the model in ``dtype``, refreshed in place from the live model.

    Floating inputs of every module of the copy are cast to ``dtype`` by
    forward pre-hooks, so a float32 batch reaching the model directly is
    evaluated in ``dtype`` too. The copy never receives ``.grad``.

    Example:
        >>> live = nn.Linear(3, 1)
        >>> shadow = Shadow(live, torch.float64)
        >>> shadow.module.weight.dtype
        torch.float64
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.signature = param_signature(model)
        try:
            self.module = copy.deepcopy(model)
        except Exception as err:  # noqa: BLE001 - report what failed and the way out
            raise TypeError(
                f"cannot make a {dtype} shadow copy of {type(model).__name__} (copy.deepcopy failed: {err}); "
                "pass dtype=None to check in place in the model's own dtype"
            ) from err
        complex_dtype = _COMPLEX_OF.get(dtype)
        # module.to(dtype) would cast complex tensors to real ones too, discarding their imaginary part.
        self.module._apply(lambda t: t.to(dtype) if t.is_floating_point()
                           else (t.to(complex_dtype) if t.is_complex() and complex_dtype else t))
        for p in self.module.parameters():
            p.grad = None
        self._needed: set = set()
        self._hooks: Dict[int, Any] = {}
        self.restore_cast_hooks()

    def restore_cast_hooks(self) -> bool:
        """Give every module of the copy its input-casting hook again; True when some were missing."""
        missing = False
        for m in self.module.modules():
            if id(m) not in self._hooks:
                self._hooks[id(m)] = m.register_forward_pre_hook(_cast_inputs_hook(self.dtype, self._needed), with_kwargs=True)
                missing = True
        return missing

    def casts(self) -> int:
        """How many modules of the copy have needed an input cast since it was built."""
        return len(self._needed)

    def trim_cast_hooks(self) -> None:
        """Remove the casting hooks of modules that have needed no cast so far (until the next refresh).

        Called after the check's first evaluation: the remaining evaluations of a check run
        the same code on the same batch, and a module hook costs microseconds per call.
        """
        for key in [k for k in self._hooks if k not in self._needed]:
            self._hooks.pop(key).remove()

    def matches(self, model: nn.Module) -> bool:
        """True when the live model still has the same parameter and buffer layout."""
        return param_signature(model) == self.signature

    @torch.no_grad()
    def refresh(self, model: nn.Module) -> None:
        """Copy live parameters, buffers and train/eval flags into the shadow, in place."""
        for (_, dst), (_, src) in zip(self.module.named_parameters(), model.named_parameters()):
            dst.copy_(src.detach())
            dst.requires_grad_(src.requires_grad)
        for (_, dbuf), (_, sbuf) in zip(self.module.named_buffers(), model.named_buffers()):
            if dbuf is not None and sbuf is not None:
                dbuf.copy_(sbuf.detach())
        for dmod, smod in zip(self.module.modules(), model.modules()):
            dmod.training = smod.training
        self.restore_cast_hooks()


def snapshot_params(params: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Exact copies of parameter values, to restore after perturbing in place."""
    return {n: p.detach().clone() for n, p in params.items()}


@torch.no_grad()
def restore_params(params: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]) -> None:
    """Copy saved values back bit for bit."""
    for n, p in params.items():
        p.copy_(saved[n])
