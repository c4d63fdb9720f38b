"""Chainer-style :func:`check_backward` for custom ops on torch tensors and numpy arrays."""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from gradwatch.bands import Verdict
from gradwatch.check.judging.judge import Slope, ToleranceRule, judge
from gradwatch.check.judging.report import CheckReport, TensorCheck
from gradwatch.check.numerics.sampling import choose_coords, generator, tensor_seed
from gradwatch.check.objective.rng import preserved_rng, seed_everything
from gradwatch.check.probes.outputs import Line, OutputProbe
from gradwatch.errors import GradientCheckError
from gradwatch.options import parse_dtype, torch_dtype_of_numpy

#: Arrays up to this size are checked at every element; larger ones at a sample.
EXHAUSTIVE_LIMIT = 2048
#: Coordinates checked one by one in a larger array (half the largest gradients, half random).
SAMPLED_COORDS = 256
#: A larger array is also cut into this many random blocks, each checked along a random direction
#: inside the block: every element is in one block, so one wrong element changes one block's slope.
BLOCKS = 512


def to_tuple(x: Any) -> Tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def to_tensor(x: Any, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (np.ndarray, np.generic, float, int)):
        return torch.as_tensor(np.array(x))
    raise TypeError(f"{what} must be a torch tensor or numpy array, got {type(x).__name__}")


def check_dtype(dtype: Any) -> Optional[torch.dtype]:
    """``dtype=`` as Chainer takes it: a torch dtype, a numpy dtype or type (``numpy.float64``), a name, or None."""
    if dtype is None or isinstance(dtype, (torch.dtype, str)):
        return parse_dtype(dtype)
    converted = torch_dtype_of_numpy(dtype)
    if converted is None:
        raise TypeError(f"dtype must be a floating dtype (torch.float64, numpy.float64, 'float64') or None, "
                        f"got {dtype!r}")
    if not converted.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (float16, float32, float64) or None, got {dtype!r}")
    return converted


def params_tuple(params: Any) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, nn.Module):
        return [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    out = []
    for i, p in enumerate(to_tuple(params)):
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
    with two-sided differences of the outputs, ``sum(<y_k(x+h) - y_k(x-h),
    y_grad_k>) / 2h``, taken element by element before summing, so that
    outputs a perturbation leaves unchanged add no rounding. Arrays up to 2048
    elements are checked at every element; a larger one at 256 elements (the
    largest gradients and random ones) plus one random direction in each of
    512 random blocks that together hold every element. An entry passes when
    ``|numeric - analytic| <= atol + rtol * |analytic|``. An entry that fails
    at ``eps`` but passes at ``eps/10``, ``eps/100`` or ``eps/1000`` (where
    rounding still allows) was not smooth within ``eps``; one whose one-sided
    slopes do not converge sits on a kink or jump, and passes when the analytic
    value lies between them. Both are excluded and counted as kinks, as are
    entries non-finite on both sides (numpy's ``equal_nan``, as Chainer).
    An input with no elements has nothing to check and is left out of the report.

    Args:
        func: The function or module under test (a lambda works).
        x_data: One array or a tuple of arrays (torch or numpy); integer arrays get no gradient.
        y_grad: Gradient of each output (one array or a tuple); ``None`` when ``func``
            returns a scalar loss. A ``None`` entry skips that output.
        params: Parameters whose gradients are checked too (tensors, or an ``nn.Module``).
        eps: Finite-difference step.
        atol: Absolute tolerance.
        rtol: Relative tolerance.
        no_grads: One flag per input; True skips that input.
        dtype: Cast inputs and params to this dtype for the numerical side: a torch dtype,
            a numpy dtype or type (``numpy.float64``) or a name (``'float64'``); None keeps their dtype.

    Returns:
        The :class:`CheckReport` (also attached to the error).

    Raises:
        GradientCheckError: Naming the input or parameter, numeric vs analytic values,
            eps/atol/rtol and a diagnosis.

    Example:
        >>> x = np.random.randn(3, 4)
        >>> gy = np.random.randn(3, 4)
        >>> _ = check_backward(torch.tanh, x, gy, dtype=np.float64)
    """
    return run_check_backward(func, x_data, y_grad, params, eps, atol, rtol, no_grads, dtype)


def run_check_backward(func: Callable[..., Any], x_data: Any, y_grad: Any, params: Any = (), eps: float = 1e-3,
                       atol: float = 1e-5, rtol: float = 1e-4, no_grads: Optional[Sequence[bool]] = None,
                       dtype: Any = None, limits: Optional[Tuple[int, int, int]] = None) -> CheckReport:
    """:func:`check_backward` with ``limits``: ``(exhaustive up to, sampled coordinates, random blocks)`` per array
    (default: every element up to 2,048, else 256 coordinates and 512 blocks; a watch checks fewer)."""
    if not 0 < eps < float("inf"):
        raise ValueError(f"eps must be > 0 and finite, got {eps!r}")
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol!r}, rtol={rtol!r}")
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")
    num_dtype = check_dtype(dtype)
    xs = [to_tensor(x, f"x_data[{i}]") for i, x in enumerate(to_tuple(x_data))]
    if no_grads is not None and len(no_grads) != len(xs):
        raise ValueError(f"no_grads must have one flag per input: got {len(no_grads)} flags for {len(xs)} inputs")
    gys = None if y_grad is None else [None if g is None else to_tensor(g, f"y_grad[{i}]") for i, g in enumerate(to_tuple(y_grad))]
    plist = params_tuple(params)
    checked_x = [
        i for i, x in enumerate(xs)
        if (x.is_floating_point() or x.is_complex()) and not (no_grads is not None and no_grads[i])
    ]
    for i in checked_x:
        xs[i].requires_grad_(True)
    start = time.perf_counter()

    # Analytic side, in the inputs' own dtype.
    with preserved_rng():
        seed_everything(0)
        ys = to_tuple(func(*xs))
        loss = _weighted(ys, gys)
        wrt = [xs[i] for i in checked_x] + [p for _, p in plist]
        raw: Sequence[Optional[torch.Tensor]]
        if loss.requires_grad and wrt:
            raw = torch.autograd.grad(loss, wrt, allow_unused=True)
        else:
            raw = [None] * len(wrt)
    grads = [torch.zeros_like(t) if g is None else g.detach() for g, t in zip(raw, wrt)]
    names = [f"x[{i}]" for i in checked_x] + [n for n, _ in plist]
    out_dtypes = [_real_dtype(y.dtype) for y, g in zip(ys, gys if gys is not None else [None]) if gys is None or g is not None]

    # Numeric side: contiguous copies of the inputs and of the params' data (cast to dtype), the
    # params' own data put back afterwards. Nothing the caller holds is written to.
    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if num_dtype is not None and t.is_floating_point():
            t = t.to(num_dtype)
        elif num_dtype is not None and t.is_complex():  # float64 asked: complex128 (the same precision per part)
            t = t.to(_complex_dtype(num_dtype))
        return t.resolve_conj().contiguous().clone()

    nxs = [cast(x) for x in xs]
    saved_param_data = [p.data for _, p in plist]
    for _, p in plist:
        p.data = cast(p.data)
    # A complex array is checked as its real and imaginary parts (torch's convention: the gradient of a real
    # objective is d/dRe + i d/dIm, the conjugate Wirtinger derivative times 2), perturbed through a real view.
    targets = [_as_real(nxs[i]) for i in checked_x] + [_as_real(p.data) for _, p in plist]
    grads = [_as_real(g) for g in grads]

    def outputs() -> Tuple[torch.Tensor, ...]:
        seed_everything(0)
        with torch.no_grad():
            return tuple(_as_real(y) if isinstance(y, torch.Tensor) else y for y in to_tuple(func(*nxs)))

    if gys is not None:
        gys = [None if g is None else _as_real(g.to(y.dtype)) if y.is_complex() else g for g, y in zip(gys, ys)]

    report = CheckReport(tensors={}, fail_at=Verdict.SUSPICIOUS, seed=0)
    failures: List[str] = []
    try:
        with preserved_rng():
            probe = OutputProbe(outputs, gys, out_dtypes, inputs=targets)
            report.objective = probe.objective
            report.terms = {"loss": probe.objective}
            report.dtype = str(([nxs[i] for i in checked_x] + [p.data for _, p in plist] or [loss])[0].dtype).replace("torch.", "")
            complex_ = [xs[i].is_complex() for i in checked_x] + [p.is_complex() for _, p in plist]
            for name, target, g, parts in zip(names, targets, grads, complex_):
                if target.numel() == 0:
                    continue  # nothing to check (Chainer compares two empty arrays)
                check, message = _check_array(name, target, g, probe, eps, atol, rtol, limits)
                if message and parts:
                    message = message.replace(" checked entries", " checked entries (complex: checked as its real and "
                                                                  "imaginary parts, the last index 0 = real, 1 = imaginary)", 1)
                report.tensors[name] = check
                if message:
                    failures.append(message)
    finally:
        for (_, p), data in zip(plist, saved_param_data):
            p.data = data
    report.evaluations = probe.count
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
        if ys[0].is_complex():
            raise ValueError(f"y_grad=None needs a real loss, got a {ys[0].dtype} scalar: give y_grad (the gradient "
                             f"of the complex output, as torch's backward takes it) or return a real loss")
        return ys[0].reshape(())
    if len(gys) != len(ys):
        raise ValueError(f"y_grad has {len(gys)} arrays but func returned {len(ys)} outputs")
    acc = None
    for k, (y, gy) in enumerate(zip(ys, gys)):
        if gy is None:
            continue
        if tuple(gy.shape) != tuple(y.shape):
            raise ValueError(f"y_grad[{k}] has shape {tuple(gy.shape)} but output {k} has shape {tuple(y.shape)}")
        if gy.is_complex() and not y.is_complex():
            raise ValueError(f"y_grad[{k}] is complex ({gy.dtype}) but output {k} is real ({y.dtype}): the gradient "
                             f"of a real output is real")
        if y.is_complex():  # torch's backward(y, gy) is the gradient of the real Re(sum(conj(gy) * y))
            term = (torch.view_as_real(y.resolve_conj()) * _as_real(gy.to(y.dtype))).sum()
        else:
            term = (y * gy.to(y.dtype)).sum()
        acc = term if acc is None else acc + term
    if acc is None:
        raise ValueError("every y_grad is None: nothing to differentiate")
    return acc


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as a real one with a last dimension of 2 (real, imaginary), sharing its storage where it
    can (a contiguous complex tensor); a real tensor unchanged.

    Example:
        >>> _as_real(torch.tensor([1 + 2j])).tolist()
        [[1.0, 2.0]]
    """
    if not t.is_complex():
        return t
    t = t.resolve_conj()
    return torch.view_as_real(t if t.is_contiguous() else t.contiguous())


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)


def _complex_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.float16: torch.complex32, torch.float32: torch.complex64}.get(dtype, torch.complex128)


def _lines(name: str, target: torch.Tensor, g: torch.Tensor, limits: Optional[Tuple[int, int, int]] = None) -> List[Line]:
    """Every element of a small array; sampled coordinates plus random blocks of a large one.

    ``limits``: ``(exhaustive up to, sampled coordinates, blocks)``; default the module's constants.
    """
    exhaustive, coords, blocks = limits or (EXHAUSTIVE_LIMIT, SAMPLED_COORDS, BLOCKS)
    n, shape = target.numel(), tuple(target.shape)

    def coord(f: int) -> Line:
        pos = tuple(int(i) for i in np.unravel_index(f, shape)) if shape else ()
        return Line(label=pos, index=f, coordinate=True)

    if n <= exhaustive:
        return [coord(f) for f in range(n)]
    gen = generator(tensor_seed(0, name))
    lines = [coord(f) for f in choose_coords(g, coords, gen).tolist()]
    perm = torch.randperm(n, generator=gen)
    for j, block in enumerate(torch.tensor_split(perm, blocks)):
        signs = torch.randint(0, 2, (block.numel(),), generator=gen).to(torch.float64) * 2 - 1
        lines.append(Line(label=("block", j, block.numel()), index=block, unit=signs / block.numel() ** 0.5))
    return lines


def _check_array(name: str, target: torch.Tensor, g: torch.Tensor, probe: OutputProbe,
                 eps: float, atol: float, rtol: float,
                 limits: Optional[Tuple[int, int, int]] = None) -> Tuple[TensorCheck, Optional[str]]:
    shape = tuple(target.shape)
    lines = _lines(name, target, g, limits)
    g64 = g.detach().reshape(-1).to(torch.float64)
    flat = target.view(-1)
    slopes: List[Slope] = []
    for k, line in enumerate(lines):
        verdict = probe.judge(flat, g64, line, eps, atol, rtol, noise=k == 0)  # noise: measured once, and where failing
        slopes.append(Slope(analytic=verdict.analytic, numeric=verdict.numeric, floor=verdict.noise,
                            coordinate=line.coordinate, label=line.label, excluded=verdict.excluded,
                            failed=not verdict.ok))
    check = judge(name, shape, slopes, ToleranceRule(atol=atol, rtol=rtol), step=eps)
    bad = [i for i, s in enumerate(slopes) if s.failed]
    if not bad:
        return check, None
    a_arr = np.array([s.analytic for s in slopes], dtype=np.float64)
    n_arr = np.array([s.numeric for s in slopes], dtype=np.float64)
    n_blocks = sum(not line.coordinate for line in lines)
    lines_out = [f"  {name} (shape {shape}): {len(bad)} of {len(lines)} checked entries out of tolerance"
                 + (f" ({n_blocks} of them random blocks)" if n_blocks else "")
                 + (f", {check.kinks} kinks excluded" if check.kinks else "")]
    if target.numel() <= 16 and not n_blocks:
        lines_out.append(f"    numeric:  {np.array2string(n_arr.reshape(shape), precision=6)}")
        lines_out.append(f"    analytic: {np.array2string(a_arr.reshape(shape), precision=6)}")
    for i in sorted(bad, key=lambda i: -_gap(float(a_arr[i]), float(n_arr[i])))[:5]:
        label = lines[i].label
        where = f"block {label[1]} ({label[2]} elements, random direction)" if not lines[i].coordinate else str(label)
        lines_out.append(f"    at {where}: numeric {n_arr[i]:.6g} vs analytic {a_arr[i]:.6g} "
                         f"(|diff| {abs(n_arr[i] - a_arr[i]):.3g} > atol + rtol*|analytic| = {atol + rtol * abs(a_arr[i]):.3g})")
    if check.diagnosis:
        lines_out.append(f"    diagnosis: {check.diagnosis}")
    return check, "\n".join(lines_out)


def _gap(a: float, n: float) -> float:
    d = abs(a - n)
    return d if np.isfinite(d) else float("inf")
