"""The check objective ``J = loss_fn(model, batch) + regularizers (+ coupled weight decay)``.

Every term is kept apart so each can be checked on its own.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn

from gradwatch.check.objective.dtensor import is_dtensor
from gradwatch.errors import blame
from gradwatch.trees import param_names

Regularizer = Callable[[nn.Module], torch.Tensor]
RegularizerSpec = Union[None, Mapping[str, Union[float, Regularizer]], Sequence[Regularizer]]

#: Names accepted for built-in regularizers, with the formula applied to every trainable parameter.
BUILTIN_REGULARIZERS = {"l1": "coef * sum(|p|)", "l2": "coef * sum(p**2)"}


def _l1(coef: float) -> Regularizer:
    def l1(model: nn.Module) -> torch.Tensor:
        return cast(torch.Tensor, coef * sum(p.abs().sum() for p in model.parameters() if p.requires_grad))

    return l1


def _l2(coef: float) -> Regularizer:
    def l2(model: nn.Module) -> torch.Tensor:
        return cast(torch.Tensor, coef * sum(p.pow(2).sum() for p in model.parameters() if p.requires_grad))

    return l2


def parse_regularizers(spec: RegularizerSpec) -> Dict[str, Regularizer]:
    """Normalize ``regularizers`` to ``{name: reg(model) -> scalar}``.

    Accepts ``None``, a mapping of name to a coefficient (built-ins ``"l1"``,
    ``"l2"``) or to a callable, or a sequence of callables (named after
    ``__name__``).

    Example:
        >>> regs = parse_regularizers({"l2": 1e-4})
        >>> float(regs["l2"](nn.Linear(1, 1, bias=False).requires_grad_(False))) == 0.0
        True
    """
    if spec is None:
        return {}
    out: Dict[str, Regularizer] = {}
    if isinstance(spec, Mapping):
        for name, value in spec.items():
            if callable(value):
                out[str(name)] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                key = str(name).lower()
                if key not in BUILTIN_REGULARIZERS:
                    known = ", ".join(sorted(BUILTIN_REGULARIZERS))
                    raise ValueError(
                        f"regularizers: unknown built-in {name!r} with coefficient {value!r}; "
                        f"built-ins are {known}, or give a callable reg(model) -> scalar"
                    )
                if value < 0:
                    raise ValueError(f"regularizers: {name!r} coefficient must be >= 0, got {value!r}")
                out[key] = _l1(float(value)) if key == "l1" else _l2(float(value))
            else:
                raise TypeError(
                    f"regularizers: {name!r} must map to a coefficient (for l1/l2) or a callable reg(model), "
                    f"got {type(value).__name__}"
                )
        return out
    if isinstance(spec, (list, tuple)):
        for i, reg in enumerate(spec):
            if not callable(reg):
                raise TypeError(f"regularizers[{i}] must be callable reg(model) -> scalar, got {type(reg).__name__}")
            name = getattr(reg, "__name__", None) or f"reg{i}"
            if name == "<lambda>" or name in out:
                name = f"reg{i}"
            out[name] = reg
        return out
    raise TypeError(
        f"regularizers must be a mapping (e.g. {{'l2': 1e-4}}) or a list of callables, got {type(spec).__name__}"
    )


def coupled_weight_decay(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Tuple[Dict[str, float], List[str]]:
    """Per-parameter coupled weight decay read from an optimizer's ``param_groups``.

    SGD/Adam-style ``weight_decay`` adds ``wd * p`` to the gradient: the
    gradient of ``0.5 * wd * ||p||^2``, which the check objective then includes.
    Decoupled decay (AdamW, ``decoupled_weight_decay=True``) is not the
    gradient of any loss: it is left out, with a note saying so.

    Returns:
        ``({param name: wd}, notes)``.

    Example:
        >>> m = nn.Linear(2, 1)
        >>> wd, notes = coupled_weight_decay(m, torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.01))
        >>> wd
        {'weight': 0.01, 'bias': 0.01}
    """
    if optimizer is None:
        return {}, []
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    names = param_names(model)
    decoupled_cls = isinstance(optimizer, torch.optim.AdamW)
    out: Dict[str, float] = {}
    notes: List[str] = []
    for group in optimizer.param_groups:
        wd = float(group.get("weight_decay", 0.0) or 0.0)
        if wd == 0.0:
            continue
        if decoupled_cls or group.get("decoupled_weight_decay", False):
            note = (
                f"{type(optimizer).__name__} applies decoupled weight decay ({wd:g}); it is not the gradient "
                "of any loss, so the check objective leaves it out"
            )
            if note not in notes:
                notes.append(note)
                warnings.warn(note, stacklevel=3)
            continue
        for p in group["params"]:
            if id(p) in names:
                out[names[id(p)]] = wd
    return out, notes


class Objective:
    """The terms of the check objective, evaluated on a model and a batch.

    Args:
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        regularizers: See :func:`parse_regularizers`.
        weight_decay: ``{param name: wd}`` from :func:`coupled_weight_decay`.

    Example:
        >>> m = nn.Linear(2, 1)
        >>> obj = Objective(lambda mod, b: mod(b).pow(2).mean(), {"l2": 0.1})
        >>> sorted(obj.terms(m, torch.ones(3, 2)))
        ['l2', 'loss']
    """

    def __init__(
        self,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        regularizers: RegularizerSpec = None,
        weight_decay: Optional[Mapping[str, float]] = None,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable loss_fn(model, batch) -> scalar tensor, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        #: Whether ``loss_fn`` differentiates inside (None until an evaluation without grad has told).
        self.differentiates: Optional[bool] = None
        self.regularizers = parse_regularizers(regularizers)
        self.weight_decay = dict(weight_decay or {})

    def terms(self, model: nn.Module, batch: Any) -> Dict[str, torch.Tensor]:
        """Evaluate each term: ``"loss"``, each regularizer, and ``"weight_decay"`` when present."""
        out = {"loss": self._loss(model, batch)}
        if self.regularizers or self.weight_decay:
            out.update(self.param_terms(model))
        return out

    def training_total(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss and every regularizer, summed: what training's ``.grad`` is the gradient of.

        Coupled weight decay is left out: the optimizer adds it inside ``step()``, after ``.grad``.

        Example:
            >>> m = nn.Linear(2, 1)
            >>> obj = Objective(lambda mod, b: mod(b).sum(), {"l2": 0.1}, weight_decay={"weight": 0.5})
            >>> bool(obj.training_total(m, torch.ones(1, 2)) == obj.terms(m, torch.ones(1, 2))["loss"]
            ...      + obj.terms(m, torch.ones(1, 2))["l2"])
            True
        """
        total = self._loss(model, batch)
        for name, reg in self.regularizers.items():
            total = total + _regularizer(name, reg, model)
        return total

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """``loss_fn(model, batch)`` as the check evaluates it (see :meth:`_loss`).

        Example:
            >>> obj = Objective(lambda m, b: m(b).sum())
            >>> with torch.no_grad():
            ...     float(obj.loss(nn.Identity(), torch.ones(2)))
            2.0
        """
        return self._loss(model, batch)

    def _loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """``loss_fn(model, batch)``, checked to be a scalar; an exception is marked as raised in ``loss_fn``.

        A ``loss_fn`` that differentiates inside (a gradient penalty, a physics-informed residual:
        ``torch.autograd.grad(..., create_graph=True)``) cannot run where the check disabled autograd.
        The first time it refuses to (autograd's "does not require grad"), it is run again with autograd
        enabled, the random state put back as it was before the first try, and from then on every
        evaluation without grad runs it so (:attr:`differentiates`); its value is detached, so no graph
        outlives the evaluation.
        """
        if not torch.is_grad_enabled() and self.differentiates is not False:
            return self._loss_with_grad(model, batch)
        try:
            return as_scalar("loss_fn", self.loss_fn(model, batch))
        except Exception as exc:
            blame(exc, "loss_fn")
            raise

    def _loss_with_grad(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.differentiates:
            with torch.enable_grad():
                return self._guarded(model, batch).detach()
        state = _rng_state()
        try:
            loss = self._guarded(model, batch)
            self.differentiates = False
            return loss
        except RuntimeError as exc:
            if not _refused_without_grad(exc):
                raise
        _set_rng_state(state)
        self.differentiates = True
        with torch.enable_grad():
            return self._guarded(model, batch).detach()

    def _guarded(self, model: nn.Module, batch: Any) -> torch.Tensor:
        try:
            return as_scalar("loss_fn", self.loss_fn(model, batch))
        except Exception as exc:
            blame(exc, "loss_fn")
            raise

    def regularizer_terms(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """Each regularizer's value: the terms of :meth:`training_total` beside the loss.

        Example:
            >>> obj = Objective(lambda m, b: m(b).sum(), {"l2": 0.5})
            >>> {k: float(v) for k, v in obj.regularizer_terms(nn.Linear(1, 1, bias=False).requires_grad_(False)).items()}
            {'l2': 0.0}
        """
        return {name: _regularizer(name, reg, model) for name, reg in self.regularizers.items()}

    def param_terms(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The terms that read only the parameters: each regularizer, and ``"weight_decay"`` when present."""
        out = self.regularizer_terms(model)
        if self.weight_decay:
            params = dict(model.named_parameters())
            out["weight_decay"] = as_scalar("weight_decay", sum(0.5 * wd * params[n].pow(2).sum()
                                                                 for n, wd in self.weight_decay.items()))
        return out


def _regularizer(name: str, reg: Callable[[nn.Module], torch.Tensor], model: nn.Module) -> torch.Tensor:
    """``reg(model)``, checked to be a scalar; an exception is marked as raised in ``regularizer 'name'``."""
    try:
        return as_scalar(f"regularizer {name!r}", reg(model))
    except Exception as exc:
        blame(exc, f"regularizer {name!r}")
        raise


def as_scalar(what: str, value: Any) -> torch.Tensor:
    """``value`` as a real floating 0-d tensor, or an error naming ``what`` and what is accepted.

    A DTensor (a term summed over sharded parameters: a partial sum on each rank) is made whole, a collective
    that every rank makes where training makes it.

    Example:
        >>> as_scalar("loss_fn", torch.ones(1)).shape
        torch.Size([])
    """
    if is_dtensor(value):
        value = value.full_tensor()
    if type(value) is torch.Tensor and value.dim() == 0 and value.is_floating_point():
        return value
    if isinstance(value, torch.Tensor) and not value.is_floating_point():
        raise TypeError(
            f"{what} must return a real floating-point scalar tensor, got a {str(value.dtype).replace('torch.', '')} "
            "tensor: an integer or boolean value has no gradient, and a complex one is no loss to minimize "
            "(return a real floating-point loss: .float() a count, .abs() or .real a complex value)"
        )
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (int, float)):
            return torch.tensor(float(value), dtype=torch.float64)
        raise TypeError(f"{what} must return a scalar tensor, got {type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(
            f"{what} must return a scalar, got a tensor of shape {tuple(value.shape)}; "
            "reduce it (e.g. .mean() or .sum()) before returning"
        )
    return value.reshape(())


#: What autograd says when a tensor computed with autograd disabled is differentiated.
_WITHOUT_GRAD = ("does not require grad", "does not have a grad_fn")


def _refused_without_grad(exc: BaseException) -> bool:
    """True for autograd's refusal to differentiate what was computed without grad.

    Example:
        >>> _refused_without_grad(RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn"))
        True
    """
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _WITHOUT_GRAD)


def _rng_state() -> Tuple[torch.Tensor, Optional[List[torch.Tensor]]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: Tuple[torch.Tensor, Optional[List[torch.Tensor]]]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
