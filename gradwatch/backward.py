"""Chainer-style :func:`check_backward` for custom ops on torch tensors and numpy arrays."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from .context import preserved_rng, seed_everything
from .engine import EngineSettings, Evaluator, Sample, _central, _slopes, classify_kink, floor_at, total
from .errors import GradientCheckError
from .numeric import Verdict, machine_eps, max_rel_error, rel_diff
from .options import parse_dtype
from .report import CheckReport, TensorCheck, diagnose
from .sampling import choose_coords, generator, rademacher, tensor_seed

#: Arrays up to this size are checked at every element; larger ones at a sample.
EXHAUSTIVE_LIMIT = 2048
SAMPLED_COORDS = 256
SAMPLED_DIRECTIONS = 4


def _to_tuple(x: Any) -> Tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _to_tensor(x: Any, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (np.ndarray, np.generic, float, int)):
        return torch.as_tensor(np.array(x))
    raise TypeError(f"{what} must be a torch tensor or numpy array, got {type(x).__name__}")


def _params_tuple(params: Any) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, nn.Module):
        return [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    out = []
    for i, p in enumerate(_to_tuple(params)):
        if not isinstance(p, torch.Tensor) or not p.requires_grad:
            raise TypeError(f"params[{i}] must be a parameter (a tensor with requires_grad=True), got {type(p).__name__}")
        out.append((f"params[{i}]", p))
    return out


def check_backward(
    func: Callable[..., Any],
    x_data: Any,
    y_grad: Any,
    params: Any = (),
    eps: float = 1e-3,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    no_grads: Optional[Sequence[bool]] = None,
    dtype: Any = None,
) -> CheckReport:
    """Test the backward of ``func`` against numerical gradients (Chainer's ``check_backward``).

    ``func(*xs)`` is called with tensors made from ``x_data`` and must return
    one tensor or a tuple. The analytic gradient of ``sum(<y_k, y_grad_k>)``
    with respect to each floating input (and each of ``params``) is compared
    with two-sided differences: every element for arrays up to 2048 elements,
    otherwise 256 coordinates (the largest gradients and random ones) plus 4
    random directions. An element passes when
    ``|numeric - analytic| <= atol + rtol * |analytic|``; a failing element
    on a non-differentiable point is excluded and counted as a kink.

    Args:
        func: The function or module under test (a lambda works).
        x_data: One array or a tuple of arrays (torch or numpy); integer arrays get no gradient.
        y_grad: Gradient of each output (one array or a tuple); ``None`` when ``func``
            returns a scalar loss.
        params: Parameters whose gradients are checked too (tensors, or an ``nn.Module``).
        eps: Finite-difference step.
        atol: Absolute tolerance.
        rtol: Relative tolerance.
        no_grads: One flag per input; True skips that input.
        dtype: Cast inputs, ``y_grad`` and params to this dtype for the numerical side
            (e.g. ``torch.float64``); None keeps their dtype.

    Returns:
        The :class:`CheckReport` (also attached to the error).

    Raises:
        GradientCheckError: Naming the input or parameter, numeric vs analytic values,
            eps/atol/rtol and a diagnosis.

    Example:
        >>> x = np.random.randn(3, 4)
        >>> gy = np.random.randn(3, 4)
        >>> _ = check_backward(torch.tanh, x, gy, dtype=torch.float64)
    """
    if not 0 < eps < float("inf"):
        raise ValueError(f"eps must be > 0 and finite, got {eps!r}")
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol!r}, rtol={rtol!r}")
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")
    num_dtype = parse_dtype(dtype)
    xs = [_to_tensor(x, f"x_data[{i}]") for i, x in enumerate(_to_tuple(x_data))]
    if no_grads is not None and len(no_grads) != len(xs):
        raise ValueError(f"no_grads must have one flag per input: got {len(no_grads)} flags for {len(xs)} inputs")
    gys = None if y_grad is None else [None if g is None else _to_tensor(g, f"y_grad[{i}]") for i, g in enumerate(_to_tuple(y_grad))]
    plist = _params_tuple(params)
    checked_x = [
        i for i, x in enumerate(xs)
        if x.is_floating_point() and not (no_grads is not None and no_grads[i])
    ]
    for i in checked_x:
        xs[i].requires_grad_(True)
    start = time.perf_counter()

    # Analytic side, in the inputs' own dtype.
    with preserved_rng():
        seed_everything(0)
        ys = _to_tuple(func(*xs))
        loss = _weighted(ys, gys)
        wrt = [xs[i] for i in checked_x] + [p for _, p in plist]
        if loss.requires_grad and wrt:
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        else:
            grads = [None] * len(wrt)
    grads = [torch.zeros_like(t) if g is None else g.detach() for g, t in zip(grads, wrt)]
    names = [f"x[{i}]" for i in checked_x] + [n for n, _ in plist]

    # Numeric side: copies of the inputs (cast to dtype), params swapped to dtype.
    nxs = [x.detach().clone().to(num_dtype) if (num_dtype is not None and x.is_floating_point()) else x.detach().clone() for x in xs]
    ngys = None if gys is None else [None if g is None else (g.to(num_dtype) if num_dtype is not None and g.is_floating_point() else g) for g in gys]
    saved_param_data = [p.data for _, p in plist]
    if num_dtype is not None:
        for _, p in plist:
            p.data = p.data.to(num_dtype)
    targets = [nxs[i] for i in checked_x] + [p.data for _, p in plist]

    def evaluate() -> Dict[str, float]:
        seed_everything(0)
        with torch.no_grad():
            return {"loss": float(_weighted(_to_tuple(func(*nxs)), ngys))}

    evaluator = Evaluator(evaluate)
    report = CheckReport(tensors={}, fail_at=Verdict.SUSPICIOUS, seed=0)
    failures: List[str] = []
    try:
        with preserved_rng():
            j0 = evaluator()
            report.objective = total(j0)
            report.terms = dict(j0)
            report.dtype = str(targets[0].dtype if targets else loss.dtype).replace("torch.", "")
            eval_eps = max([machine_eps(t.dtype) for t in targets if t.is_floating_point()] or [machine_eps(loss.dtype)])
            settings = EngineSettings(coords=0, directions=0, eps=eps, bands=(1e-7, rtol if rtol > 0 else 1e-4, 1e-2),
                                      fail_at=Verdict.SUSPICIOUS, detect_kinks=True, eval_eps=eval_eps,
                                      magnitude=abs(report.objective))
            for name, target, g in zip(names, targets, grads):
                check, message = _check_array(name, target, g.to(target.dtype), evaluator, total(j0), settings, eps, atol, rtol)
                report.tensors[name] = check
                if message:
                    failures.append(message)
    finally:
        for (_, p), data in zip(plist, saved_param_data):
            p.data = data
    report.evaluations = evaluator.count
    report.seconds = time.perf_counter() - start
    if failures:
        raise GradientCheckError(
            f"check_backward: gradients disagree (eps={eps:g}, atol={atol:g}, rtol={rtol:g}):\n" + "\n".join(failures),
            report=report,
        )
    return report


def _weighted(ys: Sequence[torch.Tensor], gys: Optional[Sequence[Optional[torch.Tensor]]]) -> torch.Tensor:
    if not ys:
        raise ValueError("func returned no output")
    if gys is None:
        if len(ys) != 1 or ys[0].numel() != 1:
            shapes = [tuple(y.shape) for y in ys]
            raise ValueError(f"y_grad=None needs func to return one scalar (a loss), got outputs of shapes {shapes}")
        return ys[0].reshape(()).to(torch.float64) if ys[0].dtype == torch.float64 else ys[0].reshape(())
    if len(gys) != len(ys):
        raise ValueError(f"y_grad has {len(gys)} arrays but func returned {len(ys)} outputs")
    acc = None
    for k, (y, gy) in enumerate(zip(ys, gys)):
        if gy is None:
            continue
        if tuple(gy.shape) != tuple(y.shape):
            raise ValueError(f"y_grad[{k}] has shape {tuple(gy.shape)} but output {k} has shape {tuple(y.shape)}")
        term = (y * gy.to(y.dtype)).sum()
        acc = term if acc is None else acc + term
    if acc is None:
        raise ValueError("every y_grad is None: nothing to differentiate")
    return acc


def _check_array(name, target, g, evaluator, j0, settings, eps, atol, rtol) -> Tuple[TensorCheck, Optional[str]]:
    n = target.numel()
    gen = generator(tensor_seed(0, name))
    shape = tuple(target.shape)
    saved = target.detach().clone()
    grads = {"total": g}
    if n <= EXHAUSTIVE_LIMIT:
        flat_idx = list(range(n))
        dirs = None
    else:
        flat_idx = choose_coords(g, SAMPLED_COORDS, gen).tolist()
        dirs = rademacher(n, SAMPLED_DIRECTIONS, gen).to(target.device)
    samples = [Sample(label=pos, step=eps, index=pos)
               for pos in (tuple(int(i) for i in np.unravel_index(f, shape)) if shape else () for f in flat_idx)]
    if dirs is not None:
        samples += [Sample(label=("dir", j), step=eps, direction=dirs[j].reshape(shape)) for j in range(len(dirs))]
    analytic, numeric, kinked, bad = [], [], [], []
    try:
        for s in samples:
            base = _central(target, saved, grads, s, eps, evaluator)
            a, nm = _slopes(*base, eps)
            a_v, n_v = a["total"], nm["total"]
            ok = abs(n_v - a_v) <= atol + rtol * abs(a_v)
            kink = not ok and classify_kink(target, saved, grads, s, base, j0, evaluator, settings)
            ok = ok or kink
            kinked.append(kink)
            analytic.append(a_v)
            numeric.append(n_v)
            if not ok:
                bad.append(len(analytic) - 1)
    finally:
        with torch.no_grad():
            target.copy_(saved)
    a_arr, n_arr = np.array(analytic), np.array(numeric)
    kinks = int(sum(kinked))
    # Measures leave out the kinks (as check_model's do); the per-sample lists keep every sample.
    kept = ~np.array(kinked, dtype=bool)
    coord_mask = np.array([s.index is not None for s in samples])
    c_kept, d_kept = coord_mask & kept, ~coord_mask & kept
    check = TensorCheck(
        name=name, shape=shape,
        rel_diff=rel_diff(a_arr[c_kept], n_arr[c_kept]),
        max_rel_error=max_rel_error(a_arr[c_kept], n_arr[c_kept]),
        directional_rel_diff=rel_diff(a_arr[d_kept], n_arr[d_kept]) if (~coord_mask).any() else None,
        step=eps, kinks=kinks, noise_floor=floor_at(settings, eps),
        coords=[s.index for s in samples if s.index is not None],
        analytic=list(a_arr[coord_mask]), numeric=list(n_arr[coord_mask]),
        dir_analytic=list(a_arr[~coord_mask]), dir_numeric=list(n_arr[~coord_mask]),
    )
    check.judged_rel_diff = rel_diff(a_arr[kept], n_arr[kept])
    check.verdict = Verdict.WRONG if bad else Verdict.from_value(check.judged_rel_diff)
    if check.verdict in (Verdict.SUSPICIOUS, Verdict.WRONG) and not bad:
        check.verdict = Verdict.ACCEPTABLE  # within the caller's atol/rtol
    check.failed = bool(bad)
    if not bad:
        return check, None
    check.diagnosis = diagnose(a_arr, n_arr, atol)
    lines = [f"  {name} (shape {shape}): {len(bad)} of {len(samples)} checked entries out of tolerance"
             + (f", {kinks} kinks excluded" if kinks else "")]
    if n <= 16 and dirs is None:
        lines.append(f"    numeric:  {np.array2string(n_arr.reshape(shape), precision=6)}")
        lines.append(f"    analytic: {np.array2string(a_arr.reshape(shape), precision=6)}")
    for i in sorted(bad, key=lambda i: -abs(a_arr[i] - n_arr[i]))[:5]:
        label = samples[i].label
        lines.append(f"    at {label}: numeric {n_arr[i]:.6g} vs analytic {a_arr[i]:.6g} "
                     f"(|diff| {abs(n_arr[i] - a_arr[i]):.3g} > atol + rtol*|analytic| = {atol + rtol * abs(a_arr[i]):.3g})")
    if check.diagnosis:
        lines.append(f"    diagnosis: {check.diagnosis}")
    return check, "\n".join(lines)
