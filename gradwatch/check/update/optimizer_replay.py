"""torch's own optimizers' step replayed in float64 on sampled coordinates, and the update training applied judged.

For SGD, Adam, AdamW, RMSprop and Adagrad (their ``foreach`` and ``fused`` forms compute the same), :func:`replay`
computes each sampled coordinate's new value from what the optimizer starts from: the parameter and its state before
the step (``exp_avg``, ``momentum_buffer``, ``step``, ...), the gradient it steps with and the parameter group's
hyperparameters at the step (the learning rate the scheduler set). The optimizer's algorithm is chosen by its class
(a subclass is replayed as its base: a ``step`` that departs from the algorithm is what is caught).
:func:`judge_update` compares the update training applied with the replay's, to within what the optimizer's own
precision can round (a few units in the last place of each operand).

Pure math: no model, no hook.

Example:
    >>> p = torch.tensor([1.0, 2.0], dtype=torch.float64)
    >>> g = torch.tensor([0.5, -0.5], dtype=torch.float64)
    >>> group = {"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False}
    >>> replay(torch.optim.SGD, group, p, g, {}).tolist()
    [0.95, 2.05]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

import torch

from gradwatch.bands import DEFAULT_BANDS, Verdict

#: The optimizers replayed, most derived first (AdamW is an Adam).
REPLAYED = ("AdamW", "Adam", "SGD", "RMSprop", "Adagrad")
#: Units in the last place an optimizer's arithmetic may round each coordinate's update by (a handful of operations).
ULPS = 16.0


def algorithm(optimizer: Any) -> Optional[str]:
    """The name of the built-in algorithm ``optimizer`` (an instance or a class) runs: its class's or its nearest
    built-in base's among :data:`REPLAYED`; None for any other optimizer.

    Example:
        >>> class Mine(torch.optim.AdamW): pass
        >>> algorithm(Mine), algorithm(torch.optim.SGD), algorithm(object)
        ('AdamW', 'SGD', None)
    """
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for base in cls.__mro__:
        if base.__module__.startswith("torch.optim") and base.__name__ in REPLAYED:
            return base.__name__
    return None


def _f(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def replay(optimizer: Any, group: Mapping[str, Any], p: torch.Tensor, g: torch.Tensor,
           state: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """The parameter's sampled coordinates after one step of ``optimizer``'s algorithm, in float64; None for an
    algorithm not replayed (:func:`algorithm`) or an option it does not replay (``capturable`` is read as plain).

    Args:
        optimizer: The optimizer (or its class).
        group: Its parameter group's hyperparameters at the step.
        p: The coordinates before the step; ``g``: the gradient the step takes there.
        state: The optimizer's state for the parameter before the step: each tensor's values at the coordinates
            (``exp_avg``, ``momentum_buffer``, ...), and ``step`` (empty before the first step).
    """
    name = algorithm(optimizer)
    p, g = p.to(torch.float64), g.to(torch.float64)
    if group.get("maximize", False):
        g = -g
    lr = _f(group["lr"])
    wd = _f(group.get("weight_decay", 0.0))
    if name in ("Adam", "AdamW"):
        return _adam(group, p, g, state, lr, wd, decoupled=name == "AdamW" or bool(group.get("decoupled_weight_decay")))
    if name == "SGD":
        if wd:
            g = g + wd * p
        momentum = _f(group.get("momentum", 0.0))
        if momentum:
            buf = state.get("momentum_buffer")
            buf = g if buf is None else momentum * buf.to(torch.float64) + (1.0 - _f(group.get("dampening", 0.0))) * g
            g = g + momentum * buf if group.get("nesterov", False) else buf
        return p - lr * g
    if name == "RMSprop":
        if wd:
            g = g + wd * p
        alpha, eps = _f(group["alpha"]), _f(group["eps"])
        square = state.get("square_avg")
        square = alpha * (torch.zeros_like(p) if square is None else square.to(torch.float64)) + (1 - alpha) * g * g
        if group.get("centered", False):
            avg = state.get("grad_avg")
            avg = alpha * (torch.zeros_like(p) if avg is None else avg.to(torch.float64)) + (1 - alpha) * g
            denom = (square - avg * avg).sqrt() + eps
        else:
            denom = square.sqrt() + eps
        momentum = _f(group.get("momentum", 0.0))
        if momentum:
            buf = state.get("momentum_buffer")
            buf = momentum * (torch.zeros_like(p) if buf is None else buf.to(torch.float64)) + g / denom
            return p - lr * buf
        return p - lr * g / denom
    if name == "Adagrad":
        step = _f(state.get("step", 0.0)) + 1
        if wd:
            g = g + wd * p
        clr = lr / (1 + (step - 1) * _f(group.get("lr_decay", 0.0)))
        total = state.get("sum")
        total = (torch.full_like(p, _f(group.get("initial_accumulator_value", 0.0))) if total is None
                 else total.to(torch.float64)) + g * g
        return p - clr * g / (total.sqrt() + _f(group["eps"]))
    return None


def _adam(group: Mapping[str, Any], p: torch.Tensor, g: torch.Tensor, state: Mapping[str, Any], lr: float, wd: float,
          decoupled: bool) -> torch.Tensor:
    beta1, beta2 = (_f(b) for b in group["betas"])
    step = _f(state.get("step", 0.0)) + 1
    if wd:
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    m = (1 - beta1) * g + beta1 * (torch.zeros_like(p) if m is None else m.to(torch.float64))
    v = (1 - beta2) * g * g + beta2 * (torch.zeros_like(p) if v is None else v.to(torch.float64))
    if group.get("amsgrad", False):
        top = state.get("max_exp_avg_sq")
        v = torch.maximum(v, torch.zeros_like(p) if top is None else top.to(torch.float64))
    denom = v.sqrt() / math.sqrt(1 - beta2 ** step) + _f(group["eps"])
    return p - (lr / (1 - beta1 ** step)) * m / denom


@dataclass
class UpdateCheck:
    """The update training applied to one tensor's sampled coordinates, against its optimizer's replayed in float64.

    Attributes:
        name: The tensor.
        rel_diff: ``‖applied - replayed‖ / (‖applied‖ + ‖replayed‖)`` of the updates (new value minus old).
        judged_rel_diff: ``rel_diff``, or 0 where every coordinate is within what the optimizer's precision rounds.
        verdict: Band of ``judged_rel_diff``.
        ratio: Training's update over the replay's (a least-squares factor) where it departs.
        moved: Whether the step changed any sampled coordinate.
    """

    name: str
    rel_diff: float
    judged_rel_diff: float
    verdict: Verdict
    ratio: Optional[float] = None
    moved: bool = True

    def record(self) -> Dict[str, Any]:
        """Plain data for a check record."""
        return {"rel_diff": self.rel_diff, "judged_rel_diff": self.judged_rel_diff, "verdict": self.verdict.value,
                "ratio": self.ratio, "moved": self.moved}


def judge_update(name: str, before: torch.Tensor, after: torch.Tensor, replayed: torch.Tensor, dtype: torch.dtype,
                 bands: Any = DEFAULT_BANDS) -> UpdateCheck:
    """The update ``after - before`` training applied against the replay's ``replayed - before``.

    A coordinate within :data:`ULPS` units in the last place (of ``dtype``) of its operands counts as exact: the
    optimizer computed in ``dtype`` and stored the result there.

    Example:
        >>> b = torch.tensor([1.0, 2.0]); r = torch.tensor([0.9, 2.1], dtype=torch.float64)
        >>> judge_update("w", b, r.float(), r, torch.float32).verdict.value
        'excellent'
        >>> c = judge_update("w", b, (b + 0.5 * (r - b)).float(), r, torch.float32)
        >>> c.verdict.value, round(c.ratio, 3)
        ('wrong', 0.5)
    """
    b, a, r = before.to(torch.float64), after.to(torch.float64), replayed.to(torch.float64)
    applied, wanted = a - b, r - b
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    room = ULPS * eps * (b.abs() + a.abs() + wanted.abs())
    error = (applied - wanted).abs()
    scale = float(torch.linalg.vector_norm(applied) + torch.linalg.vector_norm(wanted))
    rel = float(torch.linalg.vector_norm(applied - wanted)) / scale if scale else 0.0
    judged = 0.0 if bool((error <= room).all()) else rel
    ratio = None
    ww = float(wanted @ wanted) if wanted.dim() == 1 else float((wanted * wanted).sum())
    if judged and ww:
        ratio = float((applied * wanted).sum()) / ww
    return UpdateCheck(name, rel, judged, Verdict.from_value(judged, bands), ratio, bool((a != b).any()))


__all__ = ["REPLAYED", "UpdateCheck", "algorithm", "judge_update", "replay"]
