"""Pure numerics: agreement measures, steps, central differences.

Nothing here knows about models, hooks or logs.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence, Union, cast

import numpy as np
import torch

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence[float], float]


def _as_float64(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).reshape(-1).numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def rel_diff(a: ArrayLike, b: ArrayLike) -> float:
    """Relative difference ``||a - b||_2 / (||a||_2 + ||b||_2)`` (0 when both are 0).

    Symmetric, in ``[0, 1]``, and zero exactly when ``a == b``.

    Args:
        a: First vector (tensor, array, sequence or number).
        b: Second vector, same number of elements.

    Returns:
        The relative difference as a Python float (``nan`` if an input is not finite).

    Example:
        >>> rel_diff([1.0, 2.0], [1.0, 2.0])
        0.0
        >>> round(rel_diff([2.0], [1.0]), 4)
        0.3333
    """
    if _short_lists(a, b):
        return _rel_diff_short(cast(list, a), cast(list, b))
    x, y = _as_float64(a), _as_float64(b)
    if x.shape != y.shape:
        raise ValueError(f"rel_diff needs vectors of equal size, got {x.size} and {y.size} elements")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return float("nan")
    # Norms are taken of scaled vectors: squaring 1e-170 underflows to 0 (and 1e170 overflows), which
    # would make unequal tiny vectors look equal. The difference keeps its own scale for the same reason.
    scale = float(max(np.max(np.abs(x), initial=0.0), np.max(np.abs(y), initial=0.0)))
    if scale == 0.0:
        return 0.0
    with np.errstate(over="ignore"):
        diff, factor = x - y, 1.0
    if not np.all(np.isfinite(diff)):
        diff, factor = x / 2 - y / 2, 2.0  # exact for values this large
    dscale = float(np.max(np.abs(diff)))
    if dscale == 0.0:
        return 0.0
    denom = float(np.linalg.norm(x / scale) + np.linalg.norm(y / scale))
    value = min(1.0, factor * (dscale / scale) * float(np.linalg.norm(diff / dscale)) / denom)
    return value if value > 0.0 else float(np.nextafter(0.0, 1.0))  # unequal is never exactly 0


def max_rel_error(a: ArrayLike, b: ArrayLike, floor: float = 1e-8) -> float:
    """Element-wise worst case ``max |a-b| / max(|a|+|b|, floor)`` (the tutorial's ``rel_error``).

    Args:
        a: First array.
        b: Second array, same number of elements.
        floor: Lower bound of the denominator, so zero entries do not divide by zero.

    Returns:
        The largest element-wise relative error (0.0 for empty inputs).

    Example:
        >>> max_rel_error([1.0, 0.0], [1.0, 0.0])
        0.0
        >>> round(max_rel_error([2.0, 1.0], [1.0, 1.0]), 4)
        0.3333
    """
    if _short_lists(a, b):
        return _max_rel_error_short(cast(list, a), cast(list, b), floor)
    x, y = _as_float64(a), _as_float64(b)
    if x.shape != y.shape:
        raise ValueError(f"max_rel_error needs arrays of equal size, got {x.size} and {y.size} elements")
    if x.size == 0:
        return 0.0
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return float("nan")
    # Halve both sides first (exact for normal numbers): |x - y| and |x| + |y| cannot overflow.
    hx, hy = x / 2, y / 2
    return float(np.max(np.abs(hx - hy) / np.maximum(np.abs(hx) + np.abs(hy), floor / 2)))


#: Python lists up to this length are measured in pure Python (numpy's per-call cost dominates there).
SHORT = 64


def _short_lists(a: Any, b: Any) -> bool:
    return type(a) is list and type(b) is list and len(a) == len(b) and len(a) <= SHORT


def _rel_diff_short(x: list, y: list) -> float:
    """:func:`rel_diff` of two short lists of floats: the same scaled computation with ``math.hypot``."""
    if not (all(map(math.isfinite, x)) and all(map(math.isfinite, y))):
        return float("nan")
    scale = max(max(map(abs, x), default=0.0), max(map(abs, y), default=0.0))
    if scale == 0.0:
        return 0.0
    diff, factor = [a - b for a, b in zip(x, y)], 1.0
    if not all(map(math.isfinite, diff)):
        diff, factor = [a / 2 - b / 2 for a, b in zip(x, y)], 2.0
    dscale = max(map(abs, diff))
    if dscale == 0.0:
        return 0.0
    denom = math.hypot(*[a / scale for a in x]) + math.hypot(*[b / scale for b in y])
    value = min(1.0, factor * (dscale / scale) * math.hypot(*[d / dscale for d in diff]) / denom)
    return value if value > 0.0 else math.nextafter(0.0, 1.0)


def _max_rel_error_short(x: list, y: list, floor: float) -> float:
    """:func:`max_rel_error` of two short lists of floats."""
    if not x:
        return 0.0
    if not (all(map(math.isfinite, x)) and all(map(math.isfinite, y))):
        return float("nan")
    half = floor / 2
    return float(max(abs(a / 2 - b / 2) / max(abs(a / 2) + abs(b / 2), half) for a, b in zip(x, y)))


def machine_eps(dtype: Union[torch.dtype, np.dtype, type]) -> float:
    """Unit roundoff of a floating dtype (torch or numpy)."""
    if isinstance(dtype, torch.dtype):
        return float(torch.finfo(dtype).eps)
    return float(np.finfo(dtype).eps)


def default_step(dtype: Union[torch.dtype, np.dtype, type]) -> float:
    """Central-difference step balancing truncation (h^2) and rounding (eps/h): ``eps ** (1/3)``.

    Example:
        >>> f"{default_step(torch.float64):.1e}"
        '6.1e-06'
        >>> f"{default_step(torch.float32):.1e}"
        '4.9e-03'
    """
    return machine_eps(dtype) ** (1.0 / 3.0)


def noise_floor(dtype: Union[torch.dtype, np.dtype, type], magnitude: float, step: float, factor: float = 32.0) -> float:
    """Absolute error a central difference can carry from rounding alone.

    Evaluating the objective in ``dtype`` rounds each value by about
    ``eps * magnitude`` (``magnitude``: sum of the absolute values of the
    objective's terms, which bounds cancellation); the difference quotient
    divides that by ``step``. ``factor`` allows for rounding accumulated
    inside the objective.

    Example:
        >>> noise_floor(torch.float64, 1.0, 1e-5) < 1e-8
        True
    """
    return factor * machine_eps(dtype) * max(float(magnitude), 1e-30) / step


def central_difference(f_plus: float, f_minus: float, step: float) -> float:
    """``(f(x+h) - f(x-h)) / 2h``.

    Example:
        >>> f = lambda x: x * x + 3 * x
        >>> round(central_difference(f(2.001), f(1.999), 0.001), 9)
        7.0
    """
    return (f_plus - f_minus) / (2.0 * step)


def numerical_grad(
    f: Callable[[], Any],
    inputs: Any,
    grad_outputs: Any = None,
    eps: float | None = None,
) -> Any:
    """Two-sided numerical gradient of ``f()`` with respect to arrays it reads (Chainer's ``numerical_grad``).

    ``inputs`` (a tensor/array or a tuple of them) are perturbed in place one
    element at a time and restored exactly. ``f`` takes no arguments and
    returns a scalar, or outputs that are weighted by ``grad_outputs``
    (``sum(<y_k, gy_k>)``).

    Args:
        f: Callable reading ``inputs``; returns a scalar or a tuple of outputs.
        inputs: One array or a tuple of arrays (torch tensors or numpy arrays).
        grad_outputs: ``None`` for a scalar ``f``; else one array per output.
        eps: Step; ``None`` picks :func:`default_step` of each input's dtype.

    Returns:
        Gradients shaped like ``inputs`` (a single array when one was given).

    Example:
        >>> x = np.array([2.0])
        >>> g = numerical_grad(lambda: float(x[0] ** 2 + 3 * x[0]), x, eps=1e-3)
        >>> round(float(g[0]), 6)
        7.0
    """
    single = not isinstance(inputs, (tuple, list))
    arrays = (inputs,) if single else tuple(inputs)
    if eps is not None and not 0 < eps < math.inf:
        raise ValueError(f"eps must be > 0 and finite, got {eps!r}")

    def scalar() -> float:
        out = f()
        if grad_outputs is None:
            return _to_float(out)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        gys = grad_outputs if isinstance(grad_outputs, (tuple, list)) else (grad_outputs,)
        return float(sum(float((_as_float64(y) * _as_float64(g)).sum()) for y, g in zip(outs, gys) if g is not None))

    grads = []
    for arr in arrays:
        is_torch = isinstance(arr, torch.Tensor)
        flat = arr.detach().view(-1) if is_torch else arr.reshape(-1)
        if not is_torch and not np.shares_memory(flat, arr):
            raise ValueError("numerical_grad needs contiguous numpy arrays it can perturb in place")
        h = eps if eps is not None else default_step(arr.dtype)
        g = np.zeros(flat.shape[0], dtype=np.float64)
        with torch.no_grad():
            for i in range(flat.shape[0]):
                orig = flat[i].clone() if is_torch else flat[i].copy()
                flat[i] = orig + h
                fp = scalar()
                flat[i] = orig - h
                fm = scalar()
                flat[i] = orig
                g[i] = central_difference(fp, fm, h)
        g = g.reshape(tuple(arr.shape))
        grads.append(torch.from_numpy(g).to(arr.dtype) if is_torch else g.astype(arr.dtype, copy=False))
    return grads[0] if single else tuple(grads)


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"expected a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().double().item())
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"expected a scalar, got an array of shape {arr.shape}")
    return float(arr.reshape(()))
