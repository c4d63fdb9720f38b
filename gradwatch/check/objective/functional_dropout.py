"""Dropout of every form off during the backward check, and a count of what was switched off.

Dropout modules are switched to eval by :func:`gradwatch.check.objective.dropout_off.dropout_off`. Many models apply
dropout functionally instead (``F.dropout(x, p, training=self.training)``,
``scaled_dot_product_attention(..., dropout_p=...)``, ``F.multi_head_attention_forward``):
:class:`FunctionalDropoutOff`, a ``TorchFunctionMode`` (thread-local: a training loop in another
thread is not touched), calls those with training off or probability 0 while a check evaluates,
and counts the calls that would have dropped something. Randomness that is not dropout in a
function's name (layerdrop: ``if self.training and torch.rand([]) < self.layerdrop``, noise
injection) cannot be switched off without changing what the model computes: it stays on,
reseeded (every evaluation of a check draws the same values), and the record says so.

The training part of a check (:mod:`gradwatch.check.replay.reference`) runs outside this: it keeps dropout on,
with training's masks.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> record = DropoutRecord()
    >>> with FunctionalDropoutOff(record):
    ...     y = F.dropout(torch.ones(4), p=0.5, training=True)
    >>> y.tolist(), record.functional
    ([1.0, 1.0, 1.0, 1.0], {'F.dropout': 1})
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _get_current_function_mode_stack

#: (position, keyword, default) of an argument.
_Arg = Tuple[int, str, Any]


@dataclass(frozen=True)
class _Spec:
    label: str
    p: _Arg
    flag: Optional[_Arg]  # the training flag set to False; None: the probability is set to 0


def _family(label: str, train_kw: str) -> _Spec:
    return _Spec(label, (1, "p", 0.5), (2, train_kw, True))


#: Dropout functions switched off during a check, by the function object a TorchFunctionMode receives.
_SPECS: Dict[Any, _Spec] = {
    F.dropout: _family("F.dropout", "training"),
    F.dropout1d: _family("F.dropout1d", "training"),
    F.dropout2d: _family("F.dropout2d", "training"),
    F.dropout3d: _family("F.dropout3d", "training"),
    F.alpha_dropout: _Spec("F.alpha_dropout", (1, "p", 0.5), (2, "training", False)),
    F.feature_alpha_dropout: _Spec("F.feature_alpha_dropout", (1, "p", 0.5), (2, "training", False)),
    torch.dropout: _family("torch.dropout", "train"),
    torch.dropout_: _family("torch.dropout_", "train"),
    torch.alpha_dropout: _family("torch.alpha_dropout", "train"),
    torch.alpha_dropout_: _family("torch.alpha_dropout_", "train"),
    torch.feature_dropout: _family("torch.feature_dropout", "train"),
    torch.feature_dropout_: _family("torch.feature_dropout_", "train"),
    torch.feature_alpha_dropout: _family("torch.feature_alpha_dropout", "train"),
    torch.feature_alpha_dropout_: _family("torch.feature_alpha_dropout_", "train"),
    torch.native_dropout: _family("torch.native_dropout", "train"),
    F.scaled_dot_product_attention: _Spec("scaled_dot_product_attention(dropout_p)", (4, "dropout_p", 0.0), None),
    F.multi_head_attention_forward: _Spec("F.multi_head_attention_forward(dropout_p)", (10, "dropout_p", 0.0), (13, "training", True)),
}

#: Random draws that stay on (reseeded): counted so the record can say what else is random.
_RANDOM = {
    torch.rand: "torch.rand", torch.rand_like: "torch.rand_like", torch.randn: "torch.randn",
    torch.randn_like: "torch.randn_like", torch.randint: "torch.randint", torch.randperm: "torch.randperm",
    torch.bernoulli: "torch.bernoulli", torch.multinomial: "torch.multinomial", torch.normal: "torch.normal",
    torch.Tensor.bernoulli_: "Tensor.bernoulli_", torch.Tensor.uniform_: "Tensor.uniform_",
    torch.Tensor.normal_: "Tensor.normal_", torch.Tensor.random_: "Tensor.random_",
    torch.Tensor.exponential_: "Tensor.exponential_",
}


def _get(args: tuple, kwargs: dict, arg: _Arg) -> Any:
    pos, kw, default = arg
    if kw in kwargs:
        return kwargs[kw]
    return args[pos] if len(args) > pos else default


def _set(args: list, kwargs: dict, arg: _Arg, value: Any) -> None:
    pos, kw, _ = arg
    if kw not in kwargs and len(args) > pos:
        args[pos] = value
    else:
        kwargs[kw] = value


@dataclass
class DropoutRecord:
    """What a check switched off, and what randomness stayed on, in one forward of the objective.

    Attributes:
        modules: ``nn.Dropout*`` modules (in train mode, ``p > 0``) switched to eval.
        probabilities: ``dropout`` probabilities of ``nn.MultiheadAttention`` and RNN modules set to 0.
        functional: Functional dropout calls switched off in one forward, per function.
        stays_on: Randomness that stays on (reseeded: the same at every evaluation), in words.
        random_draws: Other random draws in one forward, per function (reseeded).

    Example:
        >>> DropoutRecord(modules=2, functional={"F.dropout": 3}).summary()
        'dropout off: 2 nn.Dropout modules, 3 functional dropout calls (F.dropout x3)'
    """

    modules: int = 0
    probabilities: int = 0
    functional: Dict[str, int] = field(default_factory=dict)
    stays_on: List[str] = field(default_factory=list)
    random_draws: Dict[str, int] = field(default_factory=dict)
    _mode: Optional["FunctionalDropoutOff"] = field(default=None, repr=False, compare=False)

    def settle(self) -> None:
        """After the first forward: stop counting (see :meth:`FunctionalDropoutOff.settle`)."""
        if self._mode is not None:
            self._mode.settle()

    @property
    def functional_calls(self) -> int:
        """Functional dropout calls switched off in one forward."""
        return sum(self.functional.values())

    def summary(self) -> str:
        """One line: what was switched off, then what stays on."""
        parts = []
        if self.modules:
            parts.append(f"{self.modules} nn.Dropout module{'s' if self.modules != 1 else ''}")
        if self.probabilities:
            parts.append(f"{self.probabilities} MultiheadAttention/RNN dropout probabilit{'ies' if self.probabilities != 1 else 'y'}")
        if self.functional:
            detail = ", ".join(f"{k} x{v}" for k, v in self.functional.items())
            n = self.functional_calls
            parts.append(f"{n} functional dropout call{'s' if n != 1 else ''} ({detail})")
        text = "dropout off: " + (", ".join(parts) if parts else "none found")
        on = list(self.stays_on)
        if self.random_draws:
            on.append("random draws " + ", ".join(f"{k} x{v}" for k, v in self.random_draws.items()))
        if on:
            text += "; stays on, reseeded so every evaluation draws the same values: " + "; ".join(on)
        return text

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serializable dict."""
        return {"modules": self.modules, "probabilities": self.probabilities, "functional": dict(self.functional),
                "stays_on": list(self.stays_on), "random_draws": dict(self.random_draws)}


class FunctionalDropoutOff(TorchFunctionMode):
    """Calls dropout functions with training off (probability 0), counting what would have dropped.

    Counting stops at :meth:`settle` (called after the check's first forward: the counts are per
    forward); interception goes on until the mode exits, unless that forward met no dropout
    call that would have dropped something (``nn.Dropout`` modules switched to eval call
    ``F.dropout`` with training off), in which case :meth:`settle` takes the mode off: a mode
    costs a Python call per torch function.

    Args:
        record: Where counts go.

    Example:
        >>> q = torch.randn(1, 2, 3, 4)
        >>> with FunctionalDropoutOff(DropoutRecord()) as mode:
        ...     out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        >>> torch.equal(out, F.scaled_dot_product_attention(q, q, q)), mode.record.functional_calls
        (True, 1)
    """

    def __init__(self, record: DropoutRecord) -> None:
        super().__init__()
        self.record = record
        record._mode = self
        self.counting = True
        self.active = False
        self.needed = False

    def __enter__(self) -> "FunctionalDropoutOff":
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            self.active = False
            super().__exit__(*exc)

    def settle(self) -> None:
        """Stop counting; take the mode off when the forward called no dropout function."""
        self.counting = False
        if not self.needed and self.active and _get_current_function_mode() is self:
            self.__exit__(None, None, None)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        spec = _SPECS.get(func)
        if spec is None:  # nearly every call: no copy of the arguments (the mode sees every torch function)
            if self.counting and func in _RANDOM:
                label = _RANDOM[func]
                self.record.random_draws[label] = self.record.random_draws.get(label, 0) + 1
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = dict(kwargs or {})
        p = _get(args, kwargs, spec.p)
        on = spec.flag is None or _get(args, kwargs, spec.flag) in (True, None)
        try:
            dropping = on and float(p) > 0
        except (TypeError, ValueError):
            dropping = on
        if dropping:
            self.needed = True
            args = _switch_off(spec, args, kwargs)
            if self.counting:
                self.record.functional[spec.label] = self.record.functional.get(spec.label, 0) + 1
        return func(*args, **kwargs)


#: Where code looks the dropout functions of :data:`_SPECS` up when it calls them: ``(namespace, attribute)``.
_LOOKED_UP = [(space, name) for fn in _SPECS for name in [getattr(fn, "__name__", "")] for space in (F, torch)
              if getattr(space, name, None) is fn]


def _switch_off(spec: _Spec, args: tuple, kwargs: dict) -> tuple:
    """``args`` with the call's training flag False (or its probability 0, for those without one); ``kwargs``
    is changed in place."""
    listed = list(args)
    if spec.flag is not None:
        _set(listed, kwargs, spec.flag, False)
    else:
        _set(listed, kwargs, spec.p, 0.0)
    return tuple(listed)


def _switched_off(fn: Any, spec: _Spec) -> Any:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        kw = dict(kwargs)
        return fn(*_switch_off(spec, args, kw), **kw)

    return call


def active_record() -> Optional[DropoutRecord]:
    """The record of the :class:`FunctionalDropoutOff` active in this thread (None where none is): what code that runs
    inside :func:`~gradwatch.check.objective.dropout_off.dropout_off` without its record hands :func:`recomputed_alike`.

    Example:
        >>> record = DropoutRecord()
        >>> with FunctionalDropoutOff(record):
        ...     active_record() is record
        True
        >>> active_record() is None
        True
    """
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, FunctionalDropoutOff):
            return mode.record
    return None


@contextlib.contextmanager
def recomputed_alike(record: Optional[DropoutRecord]) -> Iterator[None]:
    """While a check's backward runs: the dropout functions themselves switched off, as the forward had them.

    ``torch.utils.checkpoint`` (``use_reentrant=False``) recomputes its forward during backward, and torch runs
    that recomputation without Python torch function modes: :class:`FunctionalDropoutOff` does not see it, the
    recomputation would drop what the forward kept, and torch refuses values that differ from the forward's. So
    for the duration of the backward, the functions code looks up (``F.dropout``, ``torch.dropout``,
    ``F.scaled_dot_product_attention``'s ``dropout_p``, ...) are replaced by ones that switch dropout off, and
    put back after. Only when the forward met dropout that would have dropped; the check runs in the training
    loop's own thread (another thread calling these functions meanwhile would get them switched off too).

    Example:
        >>> record, dropout = DropoutRecord(), F.dropout
        >>> with FunctionalDropoutOff(record):
        ...     _ = F.dropout(torch.ones(4), p=0.5, training=True)
        ...     with recomputed_alike(record):
        ...         kept = F.dropout(torch.ones(4), p=0.5, training=True)
        >>> kept.tolist(), F.dropout is dropout
        ([1.0, 1.0, 1.0, 1.0], True)
    """
    mode = getattr(record, "_mode", None)
    if mode is None or not mode.needed:
        yield
        return
    saved = []
    try:
        for space, name in _LOOKED_UP:
            fn = getattr(space, name, None)
            spec = _SPECS.get(fn)
            if spec is not None:
                saved.append((space, name, fn))
                setattr(space, name, _switched_off(fn, spec))
        yield
    finally:
        for space, name, fn in saved:
            setattr(space, name, fn)
