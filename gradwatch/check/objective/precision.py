"""What precision the check objective really computes in, measured on the shadow copy.

A float64 shadow copy is not float64 everywhere: models cast down inside
(a LayerNorm/RMSNorm computing its variance after ``.to(torch.float32)``, a
loss on ``logits.float()``, ``softmax(..., dtype=torch.float32)``), and some
ops have no float64 kernel (``torch._grouped_mm`` on the CPU). Judging such
an objective with the float64 step and noise floor raises false alarms on
float32 rounding noise; judging it with a float32 step hides 1% errors.

:class:`ShadowPrecision` is a ``TorchFunctionMode`` active while the check
evaluates the shadow. It

- keeps casts of shadow-dtype tensors to a lower-precision float in the
  shadow dtype (``Tensor.to/.float/.half/.bfloat16/.type`` and ``dtype=``
  arguments of ops such as ``softmax``): autograd's derivative of a cast is
  the identity, so the function its backward differentiates is the one
  without the rounding, and that is the one the check then evaluates;
- runs ops without a float64 kernel in float64 where it has an exact
  implementation (grouped matmul), else in float32 (cast in, cast back);
- runs an op that raised because it mixes shadow-dtype tensors with
  lower-precision ones (``scatter_add_`` of a float32 source into a buffer
  the shadow made in float64, ``index_add_``, ``index_put_``, ``mm``, ...)
  as the float32 program ran it: every operand in the shadow dtype, or, when
  the op writes into a lower-precision tensor, in that tensor's dtype;
- records, during the check's first (analytic) forward, every op whose
  output depends on the parameters and is still of lower precision than
  the shadow (an *island*), with the module it ran in.

The check then takes its step and noise floor from the coarsest precision
recorded (see :meth:`ShadowPrecision.eps`) and names the islands in the report.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class CastNorm(nn.Module):
    ...     def forward(self, x):
    ...         return (x.to(torch.float32) ** 2).mean().to(x.dtype)
    >>> model, x = CastNorm(), torch.randn(3, dtype=torch.float64, requires_grad=True)
    >>> mode = ShadowPrecision(torch.float64)
    >>> with mode.tracing(model):
    ...     y = model(x)
    >>> y.dtype, list(mode.upcasts), mode.islands
    (torch.float64, ['CastNorm: Tensor.to -> float32'], {})
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_CAST_METHODS = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
                 torch.Tensor.bfloat16: torch.bfloat16}
_TYPE_NAMES = {"torch.FloatTensor": torch.float32, "torch.HalfTensor": torch.float16,
               "torch.BFloat16Tensor": torch.bfloat16}
#: Factories whose ``dtype=`` argument makes a new tensor: a low float there is the precision the code computes in
#: (an accumulator such as TRL's chunked log-prob kernel's ``torch.zeros(n, dtype=torch.float32)``), so the shadow
#: makes it in its own dtype, outside autocast. Random factories are left alone (their draws depend on the dtype).
_FACTORIES = {f for f in (torch.zeros, torch.ones, torch.empty, torch.full, torch.zeros_like, torch.ones_like,
                          torch.empty_like, torch.full_like, torch.eye, torch.arange, torch.linspace, torch.tensor,
                          torch.as_tensor, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty,
                          torch.Tensor.new_full, torch.Tensor.new_tensor)}
#: torch's own test of every device's autocast at once (absent from old versions: then each device is asked).
_ANY_AUTOCAST: Optional[Callable[[], bool]] = getattr(torch._C, "_is_any_autocast_enabled", None)
#: The device types whose autocast state is read.
AUTOCAST_DEVICES = ("cpu", "cuda")


def any_autocast() -> bool:
    """Whether autocast is on for any device type now.

    Under autocast a low ``dtype=`` is autocast's own precision, asked for on purpose (a frozen reference model that
    training runs under autocast, as TRL's DPO does inside its loss): :class:`ShadowPrecision` leaves it alone.

    Example:
        >>> any_autocast()
        False
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     any_autocast()
        True
    """
    if _ANY_AUTOCAST is not None:
        return bool(_ANY_AUTOCAST())
    for dev in AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(dev):
                return True
        except (RuntimeError, TypeError, AttributeError):  # torch < 2.4 spells it per device
            continue
    return False


#: Casts whose target dtype may be positional; every other rewrite reads a ``dtype=`` keyword.
_POSITIONAL_CASTS = {torch.Tensor.to, torch.Tensor.type}
#: Ops whose ``dtype`` argument reinterprets bits instead of converting values: never touched.
_BIT_VIEWS = {torch.Tensor.view}
_GROUPED_MM = tuple(f for f in (getattr(torch, "_grouped_mm", None), getattr(nn.functional, "grouped_mm", None)) if f)
#: ``(grouped_mm function, dtype, device type)`` found to have no kernel in this process (every operand in that
#: dtype): their later calls go to the per-group loop at once, not through an error raised and caught at each call.
_NO_KERNEL: Set[Tuple[Any, torch.dtype, str]] = set()
#: How many islands / casts a report names at most.
SHOWN = 4


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    for prefix, owner in (("Tensor.", torch.Tensor), ("torch.", torch), ("F.", nn.functional)):
        if getattr(owner, name, None) is func:
            return prefix + name
    return name


class ShadowPrecision(TorchFunctionMode):
    """Keeps a shadow copy in its dtype inside, and records where it cannot (see the module docstring).

    Args:
        dtype: The shadow's dtype (float64 by default; float32 for a ``dtype=float32`` check).

    Attributes:
        upcasts: ``{where: count}`` of casts down that were kept in ``dtype`` (where: ``module: op -> dtype``).
        fallbacks: ``{where: how}`` for ops without a kernel in ``dtype``.
        mixed: ``{where: how}`` for ops that raised on operands of mixed dtypes and ran with them made one dtype.
        islands: ``{where: dtype}`` of parameter-dependent ops still computed in a lower precision.

    Example:
        >>> x = torch.ones(2, dtype=torch.float64)
        >>> with ShadowPrecision(torch.float64):
        ...     y = torch.softmax(x, 0, dtype=torch.float32) + x.float()
        >>> y.dtype
        torch.float64
    """

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.dtype = dtype
        self._eps = torch.finfo(dtype).eps
        self.upcasts: Dict[str, int] = {}
        self.fallbacks: Dict[str, str] = {}
        self.mixed: Dict[str, str] = {}
        self.islands: Dict[str, torch.dtype] = {}
        self._trace = False
        self._stack: List[str] = []

    # -- what was found -------------------------------------------------------------------------------------------

    @property
    def needed(self) -> bool:
        """True when an evaluation without the mode would compute something else (a cast or a fallback happened)."""
        return bool(self.upcasts or self.fallbacks or self.mixed)

    def eps(self) -> float:
        """Unit roundoff of the coarsest precision a parameter-dependent op ran in (the shadow's when none lower)."""
        return max([self._eps] + [torch.finfo(d).eps for d in self.islands.values()])

    def summary(self) -> Dict[str, Any]:
        """The findings, JSON-serializable (``report.precision``)."""
        return {
            "shadow": str(self.dtype).replace("torch.", ""),
            "eps": self.eps(),
            "kept_in_shadow_dtype": dict(self.upcasts),
            "fallbacks": dict(self.fallbacks),
            "mixed_dtypes": dict(self.mixed),
            "low_precision": {k: str(v).replace("torch.", "") for k, v in self.islands.items()},
        }

    def notes(self, step: float) -> List[str]:
        """Sentences for ``report.notes``: what was kept in the shadow dtype, what fell back, what stays coarse."""
        name = str(self.dtype).replace("torch.", "")
        out = []
        if self.upcasts:
            out.append(
                f"precision: the model casts {name} values down in {_listed(self.upcasts)}; the check kept them in {name} "
                "(a cast's derivative is 1, so backward differentiates the function without that rounding, and the "
                "check evaluates that function)"
            )
        if self.fallbacks:
            out.append(f"precision: ops without a {name} kernel: " + "; ".join(f"{k} ({v})" for k, v in self.fallbacks.items()))
        if self.mixed:
            out.append(f"precision: ops given {name} and lower-precision operands at once ran with them made one dtype, "
                       "as the lower-precision program ran them: " + "; ".join(f"{k} ({v})" for k, v in self.mixed.items()))
        if self.islands:
            coarse = str(max(self.islands.values(), key=lambda d: torch.finfo(d).eps)).replace("torch.", "")
            out.append(
                f"precision: the objective still computes in {coarse} in {_listed(self.islands)}; the step "
                f"({step:.1e}) and the noise floor follow {coarse} (eps {self.eps():.1e}), and a tensor whose "
                "disagreement only that rounding could explain is INCONCLUSIVE"
            )
        return out

    def island_text(self) -> str:
        """Names of the low-precision islands, for an INCONCLUSIVE reason."""
        return _listed(self.islands)

    # -- tracing (first forward) ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def tracing(self, model: nn.Module) -> Iterator["ShadowPrecision"]:
        """Be active and record islands, naming each by the innermost module of ``model`` it ran in."""
        names = {id(m): (n or type(m).__name__) for n, m in model.named_modules()}
        handles = []

        def enter(module, args):
            self._stack.append(names.get(id(module), type(module).__name__))

        def leave(module, args, out):
            if self._stack:
                self._stack.pop()

        for m in model.modules():
            handles.append(m.register_forward_pre_hook(enter))
            handles.append(m.register_forward_hook(leave, always_call=True))
        self._trace = True
        try:
            with self:
                yield self
        finally:
            self._trace = False
            self._stack.clear()
            for h in handles:
                h.remove()

    def _where(self, func: Any) -> str:
        op = _op_name(func)
        if not self._trace:  # a later evaluation: the module the first forward found it in
            known = [k for k in (*self.fallbacks, *self.mixed) if k.endswith(f": {op}")]
            return known[0] if known else f"an evaluation after the first: {op}"
        return f"{self._stack[-1] if self._stack else 'the loss function'}: {op}"

    # -- the mode -------------------------------------------------------------------------------------------------

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _CAST_METHODS and self._high(args[0]) and self._low(_CAST_METHODS[func]):
            self._note_upcast(func, _CAST_METHODS[func])
            return args[0]
        # Most calls have no keyword and are no cast (every evaluation of a check passes here: keep it short)
        changed = self._keep_dtype(func, args, kwargs) if kwargs or func in _POSITIONAL_CASTS else None
        if changed is not None:
            args, kwargs = changed
        if func in _GROUPED_MM and _grouped_shapes(args, kwargs) and (func, self.dtype, _device(args, kwargs)) in _NO_KERNEL \
                and self._all_high(args, kwargs):
            out = self._grouped(func, args, kwargs)  # known to have no kernel: not raised and caught at every call
        else:
            try:
                out = func(*args, **kwargs)
            except (RuntimeError, NotImplementedError, TypeError) as err:
                out = self._fallback(func, args, kwargs, err)
        if self._trace and torch.is_grad_enabled():
            self._record_islands(func, out)
        return out

    def _high(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype == self.dtype

    def _low(self, dtype: Any) -> bool:
        return isinstance(dtype, torch.dtype) and dtype.is_floating_point and torch.finfo(dtype).eps > self._eps

    def _note_upcast(self, func: Any, dtype: torch.dtype) -> None:
        if self._trace:
            key = f"{self._where(func)} -> {str(dtype).replace('torch.', '')}"
            self.upcasts[key] = self.upcasts.get(key, 0) + 1
        elif not self.upcasts:
            self.upcasts["a later evaluation"] = 1

    def _keep_dtype(self, func: Any, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
        """New ``(args, kwargs)`` with a cast of a shadow-dtype tensor down replaced by the shadow dtype; None if none."""
        if func in _BIT_VIEWS:
            return None
        if func is torch.Tensor.to and args and self._high(args[0]):
            new = list(args)
            for i, a in enumerate(args[1:], start=1):
                if self._low(a):
                    self._note_upcast(func, a)
                    new[i] = self.dtype
                elif isinstance(a, torch.Tensor) and self._low(a.dtype):
                    self._note_upcast(func, a.dtype)
                    new[i] = a.device
            kw = dict(kwargs)
            if self._low(kw.get("dtype")):
                self._note_upcast(func, kw["dtype"])
                kw["dtype"] = self.dtype
            return (tuple(new), kw) if (new != list(args) or kw != kwargs) else None
        if func is torch.Tensor.type and args and self._high(args[0]):
            target = args[1] if len(args) > 1 else kwargs.get("dtype")
            target = _TYPE_NAMES.get(target, target) if isinstance(target, str) else target
            if self._low(target):
                self._note_upcast(func, cast(torch.dtype, target))
                return (args[0], self.dtype), {}
            return None
        if func in _FACTORIES and self._low(kwargs.get("dtype")) and not any_autocast():
            self._note_upcast(func, kwargs["dtype"])
            return args, {**kwargs, "dtype": self.dtype}
        if self._low(kwargs.get("dtype")) and any(self._high(t) for t in tree_flatten(args)[0]):
            self._note_upcast(func, kwargs["dtype"])
            return args, {**kwargs, "dtype": self.dtype}
        return None

    def _fallback(self, func: Any, args: tuple, kwargs: dict, err: Exception) -> Any:
        """Run an op that raised in the shadow dtype: operands of mixed dtypes made one (:meth:`_one_dtype`); without
        a kernel in the shadow dtype, exactly where possible, else in float32."""
        flat = tree_flatten((args, kwargs))[0]
        if not any(self._high(t) for t in flat):
            raise err
        same = self._one_dtype(func, args, kwargs, flat)
        if same is not None:
            try:
                out = func(*same[0], **same[1])
            except (RuntimeError, NotImplementedError, TypeError) as again:  # no shadow-dtype kernel, or the program's
                return self._no_kernel(func, same[0], same[1], again, again)  # own error: the one float32 raises too
            self._note_mixed(func, same[2])
            return out
        return self._no_kernel(func, args, kwargs, err, err)

    def _grouped(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``grouped_mm`` in the shadow dtype, which has no kernel for it: an exact per-group matmul loop."""
        self.fallbacks.setdefault(self._where(func), f"no {_name(self.dtype)} kernel; evaluated by an exact per-group "
                                                     "matmul loop")
        return _grouped_mm(*args, **kwargs)

    def _all_high(self, args: tuple, kwargs: dict) -> bool:
        """Every floating tensor operand is in the shadow dtype (none another call would cast first)."""
        floats = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return bool(floats) and all(t.dtype == self.dtype for t in floats)

    def _one_dtype(self, func: Any, args: tuple, kwargs: dict, flat: List[Any]) -> Optional[Tuple[tuple, dict, str]]:
        """``(args, kwargs, how)`` with every floating operand in one dtype, for a call that mixes shadow-dtype tensors
        with lower-precision ones; None when it does not.

        The shadow makes some tensors in its dtype (factories with a ``dtype=``, casts kept) while others the program
        makes stay in a lower precision (an integer mask ``.to(torch.float32)``, ``torch.zeros(n)`` in the default
        dtype), and ops that require one dtype (``scatter_add_``, ``index_add_``, ``index_put_``, ``mm``, ``lerp``)
        raise on the mix, where the lower-precision program, all in one dtype, did not. The call is made again as that
        program made it: every floating operand in the shadow dtype, or, when the op writes into a lower-precision
        tensor (``out=``, an in-place method, ``__setitem__``), in that tensor's dtype (its result cannot be
        anything else; an op that depends on the parameters there is an island like any other).
        """
        lows = [t for t in flat if isinstance(t, torch.Tensor) and self._low(t.dtype)]
        if not lows:
            return None
        written = _written(func, args, kwargs)
        to = written.dtype if written is not None and self._low(written.dtype) else self.dtype
        if to == self.dtype:
            def change(t: Any) -> Any:
                return t.to(to) if isinstance(t, torch.Tensor) and self._low(t.dtype) and t is not written else t
            how = f"the {_name(lows[0].dtype)} operands cast to {_name(to)}"
        else:
            def change(t: Any) -> Any:
                return t.to(to) if self._high(t) else t
            how = f"it writes into a {_name(to)} tensor: the {_name(self.dtype)} operands cast to {_name(to)}"
        return tree_map(change, args), tree_map(change, kwargs), how

    def _note_mixed(self, func: Any, how: str) -> None:
        where = self._where(func)
        if where not in self.mixed:
            self.mixed[where] = how

    def _no_kernel(self, func: Any, args: tuple, kwargs: dict, err: Exception, original: Exception) -> Any:
        """Run an op that has no kernel in the shadow dtype: exactly where possible, else in float32; ``original``
        (the error of the call as the program made it) is raised when it cannot run."""
        message = str(err)
        flat = tree_flatten((args, kwargs))[0]
        if not any(self._high(t) for t in flat) or not any(s in message for s in ("Double", "double", "float64", "Float64")):
            raise original
        where = self._where(func)
        if func in _GROUPED_MM and _grouped_shapes(args, kwargs):
            if self._all_high(args, kwargs):
                _NO_KERNEL.add((func, self.dtype, _device(args, kwargs)))
            return self._grouped(func, args, kwargs)
        low = torch.float32

        def down(t: Any) -> Any:
            return t.to(low) if self._high(t) else t

        try:
            out = func(*tree_map(down, args), **tree_map(down, kwargs))
        except Exception:  # noqa: BLE001 - the float32 retry failed too: the original error is the one to show
            raise original from None
        if where not in self.fallbacks:
            self.fallbacks[where] = f"no {_name(self.dtype)} kernel ({message.splitlines()[0][:80]}); evaluated in float32"
            warnings.warn(f"gradwatch: {where} has no {_name(self.dtype)} kernel; the check evaluates it in float32",
                          RuntimeWarning, stacklevel=2)
        if self._trace:
            self.islands.setdefault(where, low)
        return tree_map(lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.dtype == low else t, out)

    def _record_islands(self, func: Any, out: Any) -> None:
        if type(out) is torch.Tensor:  # nearly every op: one plain tensor, read without the modes (below)
            with torch._C.DisableTorchFunction():
                low = out.requires_grad and self._low(out.dtype)
            if low:
                self.islands.setdefault(self._where(func), out.dtype)
            return
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad and self._low(t.dtype):
                self.islands.setdefault(self._where(func), t.dtype)
                return


#: Dunder methods that write into their first argument (``x += y``, ``x[i] = y``).
_WRITING_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__imatmul__"})


def _written(func: Any, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The tensor a call writes its result into: ``out=``, or the first argument of an in-place method; None if none."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    name = getattr(func, "__name__", "") or ""
    inplace = name in _WRITING_DUNDERS or (name.endswith("_") and not name.startswith("_"))
    return args[0] if inplace and args and isinstance(args[0], torch.Tensor) else None


def _listed(found: Dict[str, Any]) -> str:
    keys = list(found)
    shown = ", ".join(keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def _device(args: tuple, kwargs: dict) -> str:
    """The device type of ``grouped_mm``'s first operand (:func:`_grouped_shapes` found it a tensor)."""
    return (args[0] if args else kwargs["mat_a"]).device.type


def _grouped_shapes(args: tuple, kwargs: dict) -> bool:
    a = args[0] if args else kwargs.get("mat_a")
    b = args[1] if len(args) > 1 else kwargs.get("mat_b")
    offs = kwargs.get("offs")
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 3
            and isinstance(offs, torch.Tensor) and offs.dim() == 1 and offs.numel() == b.shape[0])


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: torch.Tensor, bias: Optional[torch.Tensor] = None,
                out_dtype: Any = None) -> torch.Tensor:
    """``grouped_mm`` of a 2D ``mat_a`` (rows grouped by ``offs``, cumulative ends) and a 3D ``mat_b``, differentiably."""
    parts, start = [], 0
    for i, end in enumerate(offs.tolist()):
        part = mat_a[start:end] @ mat_b[i]
        parts.append(part + bias[i] if bias is not None else part)
        start = end
    if start < mat_a.shape[0]:
        parts.append(mat_a.new_zeros(mat_a.shape[0] - start, mat_b.shape[-1]))
    return torch.cat(parts)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
