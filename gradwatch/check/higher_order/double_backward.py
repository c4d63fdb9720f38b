"""``check_double_backward``: the backward of a function's backward against finite differences (Chainer's).

A function's gradient can be right while the gradient of that gradient is wrong: a custom
``autograd.Function`` whose ``backward`` calls another custom Function, or a hand-written double
backward. Objectives that differentiate inside (gradient penalties, physics-informed residuals)
train on that second derivative. As Chainer's ``check_double_backward`` does, the first-order
gradient is itself treated as the function under test,

    first_order(x, y_grad) = d<func(x), y_grad>/d(x, params)   (with ``create_graph=True``),

and :func:`gradwatch.check_backward` checks its backward with ``x_grad_grad`` (and
``params_grad_grad``) as its output gradient, with respect to ``x``, ``y_grad`` and ``params``.

Example:
    >>> import numpy as np
    >>> x, gy, ggx = np.random.randn(3), np.random.randn(3), np.random.randn(3)
    >>> _ = check_double_backward(torch.tanh, x, gy, ggx, dtype=np.float64)
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from gradwatch.check.backward import FLOAT64_TOLERANCES, check_dtype, params_tuple, run_check_backward, to_tensor, to_tuple
from gradwatch.check.judging.report import CheckReport

#: ``(atol, rtol)`` otherwise: Chainer's ``check_double_backward`` defaults. In float64 both checks use
#: :data:`gradwatch.check.backward.FLOAT64_TOLERANCES` (as tight as torch's gradgradcheck needs to be).
TOLERANCES = (1e-4, 1e-3)


def check_double_backward(
    func: Callable[..., Any],
    x_data: Any,
    y_grad: Any,
    x_grad_grad: Any,
    params: Any = (),
    params_grad_grad: Any = (),
    eps: float = 1e-3,
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
    no_grads: Optional[Sequence[bool]] = None,
    dtype: Any = None,
    *,
    limits: Optional[Tuple[int, int, int]] = None,
) -> CheckReport:
    """Test the second-order gradient of ``func`` (Chainer's ``check_double_backward``).

    Args:
        func: The function or module under test; ``func(*xs)`` returns one tensor or a tuple.
        x_data: One array or a tuple of arrays (torch or numpy).
        y_grad: Gradient of each output (one array or a tuple).
        x_grad_grad: Gradient of the first-order gradient of each floating input of ``x_data``
            (one array or a tuple, in the order of the floating inputs; a ``None`` entry skips one).
        params: Parameters (tensors, or an ``nn.Module``): their first-order gradients are outputs too,
            and their second-order ones are checked.
        params_grad_grad: One array per parameter, the gradient of its first-order gradient.
        eps: As :func:`gradwatch.check_backward`.
        atol: As :func:`gradwatch.check_backward`; defaults to :data:`FLOAT64_TOLERANCES` (1e-6) when the
            check computes in float64 (``dtype``, or float64 inputs), else to Chainer's looser
            :data:`TOLERANCES` (1e-4). Chosen on torch's OpInfo samples with second derivatives
            (``benchmarks/opinfo_double.py``; its results are in the docs' OpInfo page).
        rtol: As ``atol``: 1e-4 in float64, else 1e-3.
        no_grads: One flag per input of the first-order function, ``x_data`` then ``y_grad``; True skips it.
        dtype: As :func:`gradwatch.check_backward`: ``float64`` for a sharp check of float32 code.
        limits: ``(exhaustive up to, sampled coordinates, random blocks)`` per array (default: as
            :func:`gradwatch.check_backward`; the watch checks fewer).

    Returns:
        The :class:`~gradwatch.check.judging.report.CheckReport` of the first-order function's check: the entries
        ``x[0] ...`` are the inputs ``x_data``, then ``y_grad`` (``x[len(x_data)] ...``), then ``params[i]``.

    Raises:
        GradientCheckError: Naming the input or parameter whose second-order gradient is wrong.
        ValueError: ``x_grad_grad`` or ``params_grad_grad`` does not have one entry per gradient.

    Example:
        >>> lin = torch.nn.Linear(3, 2, dtype=torch.float64)
        >>> x, gy = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        >>> act = lambda x: torch.tanh(lin(x))
        >>> ggx, ggp = torch.randn(4, 3, dtype=torch.float64), [torch.randn_like(p) for p in lin.parameters()]
        >>> report = check_double_backward(act, x, gy, ggx, params=lin, params_grad_grad=ggp)
        >>> sorted(report.tensors)
        ['params[0]', 'params[1]', 'x[0]', 'x[1]']
    """
    xs = [to_tensor(x, f"x_data[{i}]") for i, x in enumerate(to_tuple(x_data))]
    gys = [to_tensor(g, f"y_grad[{i}]") for i, g in enumerate(to_tuple(y_grad))]
    atol, rtol = _tolerances(xs, dtype, atol, rtol)
    plist = params_tuple(params)
    for what, t in [(f"x_data[{i}]", x) for i, x in enumerate(xs)] + [(n, p) for n, p in plist]:
        if t.is_complex():
            raise ValueError(f"check_double_backward does not check complex arrays yet: {what} is {t.dtype} "
                             f"(check_backward checks complex first-order gradients)")
    first_order = FirstOrder(func, len(xs), [i for i, x in enumerate(xs) if x.is_floating_point()], plist)
    ggx = list(to_tuple(x_grad_grad))
    ggp = list(to_tuple(params_grad_grad))
    if len(ggx) != len(first_order.floating):
        raise ValueError(f"x_grad_grad must have one entry per floating input of x_data ({len(first_order.floating)}), "
                         f"got {len(ggx)}")
    if len(ggp) != len(plist):
        raise ValueError(f"params_grad_grad must have one entry per parameter ({len(plist)}), got {len(ggp)}")
    return run_check_backward(first_order, tuple(xs + gys), tuple(ggx + ggp), params=[p for _, p in plist],
                              eps=eps, atol=atol, rtol=rtol, no_grads=no_grads, dtype=dtype, limits=limits)


def _tolerances(xs: Sequence[torch.Tensor], dtype: Any, atol: Optional[float], rtol: Optional[float]) -> Tuple[float, float]:
    """``(atol, rtol)``: the given ones, else :data:`~gradwatch.check.backward.FLOAT64_TOLERANCES` when the check
    computes in float64 (``dtype``, or every floating input float64), else :data:`TOLERANCES`."""
    computes = check_dtype(dtype)
    float64 = computes == torch.float64 if computes is not None else all(
        x.dtype == torch.float64 for x in xs if x.is_floating_point())
    default_atol, default_rtol = FLOAT64_TOLERANCES if float64 else TOLERANCES
    return (default_atol if atol is None else atol), (default_rtol if rtol is None else rtol)


class FirstOrder:
    """The first-order gradient as the function under test: ``first_order(*x, *y_grad) = d<func(x), y_grad>/d(x, params)``
    (``create_graph=True``), one array per floating input then per parameter."""

    def __init__(self, func: Callable[..., Any], n_x: int, floating: List[int], plist: List[Tuple[str, torch.Tensor]]) -> None:
        self.func, self.n_x, self.floating, self.plist = func, n_x, floating, plist

    def __call__(self, *inputs: torch.Tensor) -> List[torch.Tensor]:
        args, y_grads = list(inputs[:self.n_x]), inputs[self.n_x:]
        with torch.enable_grad():
            for i in self.floating:  # the numeric side passes plain tensors: each needs a gradient of its own
                if not args[i].requires_grad:
                    args[i] = args[i].detach().requires_grad_(True)
            ys = to_tuple(self.func(*args))
            total = sum(((y * g).sum() for y, g in zip(ys, y_grads)), torch.zeros((), dtype=ys[0].dtype))
            wrt = [args[i] for i in self.floating] + [p for _, p in self.plist]
            grads = torch.autograd.grad(total, wrt, create_graph=True, allow_unused=True)
        return [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
