"""The float64 shadow copy of a model, casting of inputs, and exact parameter snapshots."""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import threading
import types
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from gradwatch.trees import whole_shape

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
        # Fast path (runs for every module on every evaluation): tensor arguments already in dtype. (Plain tensors'
        # properties read without the torch function modes of the check's first forward: each read would go through
        # every mode's __torch_function__, for the same answer.)
        if not kwargs:
            with torch._C.DisableTorchFunction():
                plain = all(type(a) is torch.Tensor and (a.dtype == dtype or not a.is_floating_point()) for a in args)
            if plain:
                return None
        if not (_needs_cast(args, dtype) or _needs_cast(kwargs, dtype)):
            return None
        if needed is not None:
            needed.add(id(module))
        return cast_floats(args, dtype), cast_floats(kwargs, dtype)

    hook._gradwatch_hook = True  # type: ignore[attr-defined]  # a marker: suspended_hooks keeps this hook
    return hook


#: Complex dtype a shadow gives complex tensors, per real shadow dtype.
_COMPLEX_OF = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def param_signature(model: nn.Module) -> Tuple:
    """Names, whole shapes (:func:`~gradwatch.trees.whole_shape`: a ZeRO-3 parameter's is the same whether ZeRO holds
    it gathered or not) and devices of parameters and buffers (non-persistent ones too): when it changes, a shadow must
    be rebuilt."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    return tuple((n, whole_shape(t), str(t.device)) for n, t in tensors if isinstance(t, torch.Tensor))


def drop_autocast_forward(module: nn.Module) -> bool:
    """Give a copy the forward it had before ``accelerate`` wrapped it in autocast; True when it had one.

    ``Accelerator.prepare`` (and so the Hugging Face ``Trainer`` under ``bf16``/``fp16``) replaces a model's
    ``forward`` by one that runs the original under autocast and casts the outputs to float32, keeping the
    original as ``_original_forward``. A float64 copy computes without autocast: float64 tensors are outside
    autocast anyway, but code that reads the autocast dtype itself (TRL's chunked log-prob kernel allocates its
    buffers in it) would compute in bfloat16 inside the check.

    Example:
        >>> m = nn.Linear(2, 1)
        >>> m._original_forward = m.forward
        >>> m.forward = torch.autocast("cpu", dtype=torch.bfloat16)(m.forward)
        >>> drop_autocast_forward(m), m(torch.ones(1, 2, dtype=torch.float64).float()).dtype
        (True, torch.float32)
    """
    original = module.__dict__.pop("_original_forward", None)
    if original is None or "forward" not in module.__dict__:
        return False
    module.forward = original
    return True


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
        #: The model's :func:`fingerprint` when copied (None: never reused by :func:`kept_shadow`).
        self.source = fingerprint(model)
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
        drop_autocast_forward(self.module)
        # Gradient checkpointing (a Hugging Face model's switch) only trades memory for recomputation: the copy
        # computes the same function without it, and its backward needs no recomputation to match the forward.
        # (transformers 5 renamed the switch "activation checkpointing"; the old names warn there.)
        # Every module is asked, not only the root: a PEFT model forwards the switch to the model it wraps by
        # __getattr__, which its class does not declare.
        for module in self.module.modules():
            for flag, off in (("is_activation_checkpointing", "activation_checkpointing_disable"),
                              ("is_gradient_checkpointing", "gradient_checkpointing_disable")):
                if hasattr(type(module), flag):
                    disable = getattr(module, off, None)
                    if getattr(module, flag, False) and callable(disable):
                        disable()
                    break
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
        """Copy live parameters, buffers and train/eval flags into the shadow, in place (a flag set only where it
        differs: most checks find every one as it was)."""
        for dst, src in zip(self.module.parameters(), model.parameters()):
            dst.copy_(src.detach())
            if dst.requires_grad != src.requires_grad:
                dst.requires_grad_(src.requires_grad)
        for dbuf, sbuf in zip(self.module.buffers(), model.buffers()):  # (None buffers are not listed)
            dbuf.copy_(sbuf.detach())
        for dmod, smod in zip(self.module.modules(), model.modules()):
            if dmod.training is not smod.training:
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


#: The largest shadow kept between one-shot checks (its parameters and buffers in its dtype), and how many are kept:
#: at most ``KEEP_SHADOWS * KEEP_SHADOW_BYTES`` held for models a test may check again.
KEEP_SHADOW_BYTES = 16 * 2**20
KEEP_SHADOWS = 4
#: ``id(model) -> (weak reference to it, its shadow, the model's fingerprint when the shadow was copied)``.
_KEPT: "collections.OrderedDict[int, Tuple[weakref.ref, Shadow, Tuple]]" = collections.OrderedDict()
_KEPT_LOCK = threading.Lock()
#: Attribute types whose values a deep copy shares with the model or copies whole: compared as they are (by value,
#: or by identity for functions, methods and classes).
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                    torch.memory_format, type, types.FunctionType, types.BuiltinFunctionType, types.BuiltinMethodType})
#: A module's own entries that the signature and :meth:`Shadow.refresh` stand for (children: by identity, below).
_REFRESHED = frozenset({"training", "_parameters", "_buffers", "_modules"})
#: Module entries torch keeps, left out of a fingerprint while empty (no hooks: most modules).
_INTERNAL = frozenset(k for k, v in nn.Module().__dict__.items() if isinstance(v, (dict, set)))


def _frozen(value: Any, depth: int = 0) -> Any:
    """``value`` as a deep copy of it was made: itself where it cannot change unseen, a snapshot of a container of
    such values. Raises ``TypeError`` for a value whose copy could go stale unseen (an object of another kind, a
    tensor attribute that is no parameter or buffer)."""
    kind = type(value)
    if kind in _PLAIN or isinstance(value, type) or (kind is types.MethodType and isinstance(value.__self__, nn.Module)):
        return value  # (a module's method: the copy's is rebound to the copy of that module)
    if depth < 3 and kind in (tuple, list, torch.Size, set, frozenset):
        items = tuple(_frozen(v, depth + 1) for v in value)
        return (kind, frozenset(items) if kind in (set, frozenset) else items)
    if depth < 3 and isinstance(value, dict) and kind.__module__ in ("builtins", "collections"):
        # (A hook dictionary's callables are compared by identity: the same hooks.)
        return (kind, tuple((k, v if callable(v) else _frozen(v, depth + 1)) for k, v in value.items()))
    raise TypeError(kind.__name__)


def fingerprint(model: nn.Module) -> Optional[Tuple]:
    """Everything a deep copy of ``model`` takes that :meth:`Shadow.refresh` does not bring over: each module (the
    same object, its class), its children, hooks and attributes. None where some attribute is an object whose
    changes it could not see (a kept shadow is then never reused)."""
    plain, skip, internal = _PLAIN, _REFRESHED, _INTERNAL
    out: List[Tuple[Any, ...]] = []
    try:
        for m in model.modules():
            out.append((id(m), type(m), tuple(map(id, m._modules.values()))))
            out.extend((k, v if type(v) in plain else _frozen(v)) for k, v in m.__dict__.items()
                       if k not in skip and not (k in internal and not v))
    except (TypeError, AttributeError):
        return None
    return tuple(out)


def kept_shadow(model: nn.Module, dtype: torch.dtype) -> Optional[Shadow]:
    """The shadow :func:`keep_shadow` kept from the model's last one-shot check, taken out of the keep, where the
    model has changed nothing since but what :meth:`Shadow.refresh` brings over; else None.

    A unit test checking one small model several times pays its deep copy (a good share of a small model's check)
    once.
    """
    with _KEPT_LOCK:
        entry = _KEPT.pop(id(model), None)
    if entry is None:
        return None
    ref, shadow, seen = entry
    if ref() is not model or shadow.dtype != dtype or fingerprint(model) != seen:
        return None
    return shadow  # (its caller asks whether the parameters' layout still matches: Shadow.matches)


def keep_shadow(model: nn.Module, shadow: Shadow) -> None:
    """Keep a small model's shadow (the last :data:`KEEP_SHADOWS` models) for its next one-shot check, once the check
    that used it ended normally (:func:`kept_shadow`)."""
    seen = getattr(shadow, "source", None)
    size = sum(t.numel() * t.element_size() for t in itertools.chain(shadow.module.parameters(), shadow.module.buffers()))
    if seen is None or size > KEEP_SHADOW_BYTES:
        return
    with _KEPT_LOCK:
        for key in [k for k, (r, _, _) in _KEPT.items() if r() is None]:
            del _KEPT[key]
        _KEPT[id(model)] = (weakref.ref(model), shadow, seen)
        while len(_KEPT) > KEEP_SHADOWS:
            _KEPT.popitem(last=False)
