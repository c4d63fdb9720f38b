"""Guards that keep an evaluation free of side effects: buffers, user hooks, scalar attributes,
BatchNorm statistics and spectral-norm power iterations."""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.utils.parametrizations import _SpectralNorm

from gradwatch.check.objective.library_code import library_of


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


#: Libraries whose hooks are part of what any module computes, whoever made the module: torch's (weight_norm,
#: pruning, spectral_norm) and DeepSpeed's (ZeRO-3's gather their module's parameters, and its engine's cast the
#: inputs under fp16). Named, so that a source checkout of either (outside site-packages) counts too.
_ANY_MODULE = ("torch", "deepspeed")


def _function_of(hook: Any) -> Any:
    """The function a hook runs (a ``functools.partial``'s own)."""
    return hook.func if isinstance(hook, functools.partial) else hook


#: Hooks a library registers that only mark outputs as requiring grad (Hugging Face's
#: ``enable_input_require_grads``, which reentrant checkpointing and PEFT use): suspended like the user's, but
#: not named as the user's (they change no value, and the check takes its gradients itself).
_SILENT_HOOKS = {("transformers", "make_inputs_require_grads")}


def _silent_hook(hook: Any) -> bool:
    fn = _function_of(hook)
    where = getattr(fn, "__module__", None)
    return isinstance(where, str) and (where.split(".")[0], getattr(fn, "__name__", None)) in _SILENT_HOOKS


@contextlib.contextmanager
def grad_marks_kept(model: nn.Module) -> Iterator[int]:
    """The library hooks that only mark a module's outputs as requiring grad (:data:`_SILENT_HOOKS`) run for the
    duration, even inside :func:`suspended_hooks` (enter this one first, around it); yields how many.

    A reentrant checkpoint differentiates the parameters inside it only when one of its inputs requires grad: with a
    frozen embedding (PEFT) that is what transformers' ``enable_input_require_grads`` hook gives, as in training.
    Evaluations on the live model that differentiate through its checkpoints keep it; the float64 copy, which
    checkpoints nothing, does not need it. Each hook runs through a wrapper marked as gradwatch's, removed after.

    Example:
        >>> emb = nn.Embedding(3, 2).requires_grad_(False)
        >>> def make_inputs_require_grads(module, input, output):
        ...     output.requires_grad_(True)
        >>> make_inputs_require_grads.__module__ = "transformers.modeling_utils"  # as transformers defines it
        >>> _ = emb.register_forward_hook(make_inputs_require_grads)
        >>> with grad_marks_kept(emb) as kept, suspended_hooks(emb):
        ...     kept, emb(torch.tensor([1])).requires_grad
        (1, True)
        >>> len(emb._forward_hooks)
        1
    """
    handles = []
    for module in model.modules():
        for hook in list(module._forward_hooks.values()) if module._forward_hooks else ():
            if _silent_hook(hook):
                handles.append(module.register_forward_hook(_marking(hook)))
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()


def _marking(hook: Callable[..., Any]) -> Callable[..., Any]:
    def mark(module: nn.Module, args: Any, output: Any) -> Any:
        return hook(module, args, output)

    mark._gradwatch_hook = True  # type: ignore[attr-defined]
    return mark


def _hook_name(hook: Any) -> str:
    fn = _function_of(hook)
    return getattr(fn, "__name__", None) or type(fn).__name__


#: Top-level packages of the classes a module type derives from (its own and its bases'), by type.
_PACKAGES_OF_TYPE: Dict[type, FrozenSet[str]] = {}


def _packages_of(cls: type) -> FrozenSet[str]:
    known = _PACKAGES_OF_TYPE.get(cls)
    if known is None:
        known = _PACKAGES_OF_TYPE[cls] = frozenset(
            c.__module__.split(".")[0] for c in cls.__mro__ if isinstance(getattr(c, "__module__", None), str))
    return known


class HookRule:
    """Which module hooks are part of the model (they run in a check) and which are the user's (suspended).

    A hook runs in every evaluation of a check when it is gradwatch's own (marked ``_gradwatch_hook``), or its
    function is the code of an installed library (:func:`~gradwatch.check.objective.library_code.library_of`:
    site-packages, the standard library) that is part of the model: torch or DeepSpeed (their hooks are part of what
    any module computes), or a library that defines the class of one of ``modules`` or of one of its bases
    (transformers' output-capturing hooks on a transformers model, PEFT's on its layers). Every other hook is
    suspended: the user's (a script, a test file, the user's project, an editable install of it), and an installed
    library's on a model it did not make (an observer such as a logger's ``watch``, whose counters and logs a check
    must not move). A hook that only marks outputs as requiring grad (:data:`_SILENT_HOOKS`) is suspended too.

    Args:
        modules: The modules whose hooks are decided (the model's, or a part of it).
        marks: Keep the hooks that only mark outputs as requiring grad (:data:`_SILENT_HOOKS`): a replay of the live
            model differentiates through training's reentrant checkpoints, which need them as training did.

    Example:
        >>> from torch.nn.utils import prune
        >>> lin = prune.l1_unstructured(nn.Linear(2, 1), "weight", amount=0.5)  # torch's pre-hook
        >>> rule = HookRule(list(lin.modules()))
        >>> [rule.keeps(h) for h in lin._forward_pre_hooks.values()], rule.keeps(lambda m, i, o: None)
        ([True], False)
    """

    def __init__(self, modules: Iterable[nn.Module], marks: bool = False) -> None:
        self._modules = modules
        self._marks = marks
        self._packages: Optional[Set[str]] = None

    def keeps(self, hook: Any) -> bool:
        """True when ``hook`` runs in a check (it is part of the model)."""
        if getattr(hook, "_gradwatch_hook", False):  # gradwatch's own (the shadow's input casting)
            return True
        if _silent_hook(hook):
            return self._marks
        library = library_of(_function_of(hook))
        return library is not None and (library in _ANY_MODULE or library in self.packages())

    def library(self, hook: Any) -> Optional[str]:
        """The installed library ``hook`` comes from (None: the user's code), for a note naming it."""
        return library_of(_function_of(hook))

    def packages(self) -> Set[str]:
        """Top-level packages defining the classes of the modules (and their bases); computed at the first need."""
        if self._packages is None:
            self._packages = set()
            for cls in {type(m) for m in self._modules}:
                self._packages |= _packages_of(cls)
        return self._packages


def _has_hooks(m: nn.Module) -> bool:
    # Attribute reads, not a loop over _HOOK_KINDS: this runs for every module of every replay.
    return bool(m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks)


@contextlib.contextmanager
def suspended_hooks(model: nn.Module, modules: Optional[List[nn.Module]] = None) -> Iterator[List[str]]:
    """Module hooks registered by user code do not run for the duration; yields what was suspended.

    A hook on the live model (or its deep copy, whose hooks are the same functions) would run
    at every evaluation of a check: a recorder of activations would fill up, a counter rise,
    by dozens per check. Hooks that are part of the model keep running (:class:`HookRule`): torch's
    (``weight_norm``, pruning, ``spectral_norm``), DeepSpeed's (ZeRO-3 gathers a module's parameters in its
    hooks), gradwatch's own, and those of the installed library that makes the model (transformers collects
    router logits and hidden states with forward hooks, into a collector of its own for each call). Global module
    hooks (``register_module_forward_hook``) are suspended by the same rule. Each hook is put
    back in its place afterwards. A library hook that only marks outputs as requiring grad (Hugging Face's
    ``make_inputs_require_grads``) is suspended too, but not named: it is not the user's, and changes no value.

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> seen = []
        >>> _ = lin.register_forward_hook(lambda m, i, o: seen.append(1))
        >>> with suspended_hooks(lin) as names:
        ...     _ = lin(torch.ones(2))
        >>> len(seen), names, len(lin._forward_hooks)
        (0, ['forward hook <lambda> on the model'], 1)
    """
    walked = list(model.modules()) if modules is None else modules
    rule = HookRule(walked)
    places: List[Tuple[Any, Dict[str, Any]]] = [(m, m.__dict__) for m in walked if _has_hooks(m)]
    places.append(("every module (global)", _global_hooks()))
    removed: List[_Removed] = []
    names: List[str] = []
    module_names: Dict[int, str] = {}  # built once, only when a user hook needs naming
    for where, attrs in places:
        for key, kind in _HOOK_KINDS.items():
            user = _take_user_hooks(attrs.get(key), removed, rule)
            if user:
                if isinstance(where, nn.Module):
                    if not module_names:
                        module_names = {id(m): name or "the model" for name, m in model.named_modules()}
                    where = module_names.get(id(where), "the model")
                names.extend(f"{kind} {_named(h, rule)} on {where}" for h in user.values() if not _silent_hook(h))
    try:
        yield names
    finally:
        _put_back_hooks(removed)


#: A hook dict whose user hooks were taken out: (the dict, its keys in order, the hooks taken out by key).
_Removed = Tuple[Dict[Any, Any], List[Any], Dict[Any, Any]]


def _global_hooks() -> Dict[str, Any]:
    """The global module hook dicts (``register_module_forward_hook`` ...), by the per-module attribute name."""
    return {k: getattr(torch_module, "_global" + k, None) for k in _HOOK_KINDS}


def _named(hook: Any, rule: HookRule) -> str:
    """A suspended hook's name in a note, with the installed library it comes from (``parameter_log_hook (wandb)``)."""
    library = rule.library(hook)
    return _hook_name(hook) + (f" ({library})" if library is not None else "")


def _take_user_hooks(hooks: Optional[Dict[Any, Any]], removed: List[_Removed], rule: HookRule) -> Optional[Dict[Any, Any]]:
    """Take the hooks ``rule`` does not keep out of ``hooks`` (noted in ``removed``); returns them (None: none)."""
    if not hooks:
        return None
    user = {k: h for k, h in hooks.items() if not rule.keeps(h)}
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
    hooks user code registered on modules (and global module hooks) do not run (those that only mark outputs as
    requiring grad do, as in training: ``HookRule(marks=True)``), the power iteration of ``spectral_norm`` is off,
    and on exit every buffer, plain scalar attribute and hook is back as it was. A replay runs on every check,
    right after training's backward has evicted the caches, so this is one pass over ``modules`` and does nothing
    for what the model does not have. RNG states are not its job (:func:`preserved_rng`).

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
        rule = HookRule(self.modules, marks=True)
        for m in self.modules:
            d = m.__dict__
            if _has_hooks(m):
                for key in _HOOK_KINDS:
                    _take_user_hooks(d[key], self._hooks, rule)
            buffers = d["_buffers"]
            if buffers:
                owners.extend((m, k, b) for k, b in buffers.items() if b is not None)
            if isinstance(m, _SpectralNorm) and m.training:  # before the copy below: the copy holds the flag as set
                m.training = False
                self._spectral.append(m)
            if not _stateless(type(m)) or "forward" in d:  # a forward of user code may change a plain attribute
                self._attrs.append((d, d.copy()))  # compared on exit
        for hooks in _global_hooks().values():
            _take_user_hooks(hooks, self._hooks, rule)
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


_NO_FORWARD = object()


@contextlib.contextmanager
def instance_forwards(patches: Iterable[Tuple[nn.Module, Callable[..., Any]]]) -> Iterator[None]:
    """For the duration, each module's ``forward`` is the one given (an instance attribute); on exit each is put back
    exactly as it was: the instance's own ``forward`` where it had one, else none (its class's again).

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> with instance_forwards([(lin, lambda x: x * 0)]):
        ...     zero = lin(torch.ones(1, 2))
        >>> zero.abs().sum().item(), "forward" in vars(lin)
        (0.0, False)
    """
    saved: List[Tuple[nn.Module, Any]] = []
    try:
        for module, forward in patches:
            saved.append((module, vars(module).get("forward", _NO_FORWARD)))
            module.forward = forward  # per instance, removed after
        yield
    finally:
        for module, previous in reversed(saved):
            if previous is _NO_FORWARD:
                vars(module).pop("forward", None)
            else:
                module.forward = previous  # the instance's own forward, put back
