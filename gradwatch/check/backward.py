"""Chainer-style :func:`check_backward` for custom ops on torch tensors and numpy arrays."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch
from torch import nn

from gradwatch.bands import Verdict
from gradwatch.check.judging.judge import Slope, ToleranceRule, judge
from gradwatch.check.judging.report import CheckReport, TensorCheck
from gradwatch.check.numerics.sampling import choose_coords, generator, tensor_seed
from gradwatch.check.objective.rng import preserved_rng, seed_everything
from gradwatch.check.probes.outputs import ISOLATING_BUDGET, ISOLATING_ROWS, Groups, Line, OutputProbe, isolating_groups
from gradwatch.errors import GradientCheckError
from gradwatch.options import parse_dtype, torch_dtype_of_numpy

#: Arrays up to this size are checked at every element; larger ones at a sample.
EXHAUSTIVE_LIMIT = 2048
#: Coordinates checked one by one in a larger array (half the largest gradients, half random).
SAMPLED_COORDS = 256
#: A larger array is also cut into this many random blocks, each checked along a random direction
#: inside the block: every element is in one block, so one wrong element changes one block's slope.
BLOCKS = 512
#: ``(atol, rtol)`` when the check computes in float64 (as :func:`gradwatch.check_double_backward`'s).
FLOAT64_TOLERANCES = (1e-6, 1e-4)
#: ``(atol, rtol)`` otherwise: Chainer's ``check_backward`` defaults.
TOLERANCES = (1e-5, 1e-4)


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
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
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
    512 random blocks that together hold every element.

    Each line is also judged on *isolating rows*, from the same evaluations: the
    outputs (concatenated, a complex one as its real and imaginary parts) are
    split into groups, each output element its own group when there are at most
    128 of them (one-hot cotangents: a Jacobian entry exactly), else 128 random
    groups with random signs; each group's signed output differences are
    compared with the backward of that group's cotangent (computed once, batched
    where autograd allows, else one backward per group). A 1% error in one
    Jacobian element is then caught even where ``y_grad`` weighs its output
    little. The analytic side holds ``groups x elements`` numbers per array: past
    2**24 entries (checked elements or output elements times groups) there are
    fewer groups, none when not one fits.

    An entry (every row) passes when
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
        atol: Absolute tolerance; None: ``1e-6`` when the check computes in float64 (``dtype`` float64, or
            every checked input and parameter float64 or complex128), as :func:`gradwatch.check_double_backward`,
            else Chainer's ``1e-5``. A given value always wins.
        rtol: Relative tolerance; None: ``1e-4`` (float64 or not).
        no_grads: One flag per input; True skips that input.
        dtype: Cast inputs and params to this dtype for the numerical side: a torch dtype,
            a numpy dtype or type (``numpy.float64``) or a name (``'float64'``); None keeps their dtype.

    Returns:
        The :class:`CheckReport` (also attached to the error).

    Raises:
        GradientCheckError: Naming the input or parameter, numeric vs analytic values (and, for an
            isolating row, the output element or group), eps/atol/rtol and a diagnosis.

    Example:
        >>> x = np.random.randn(3, 4)
        >>> gy = np.random.randn(3, 4)
        >>> _ = check_backward(torch.tanh, x, gy, dtype=np.float64)
    """
    return run_check_backward(func, x_data, y_grad, params, eps, atol, rtol, no_grads, dtype)


def run_check_backward(func: Callable[..., Any], x_data: Any, y_grad: Any, params: Any = (), eps: float = 1e-3,
                       atol: Optional[float] = None, rtol: Optional[float] = None,
                       no_grads: Optional[Sequence[bool]] = None, dtype: Any = None,
                       limits: Optional[Tuple[int, int, int]] = None) -> CheckReport:
    """:func:`check_backward` with ``limits``: ``(exhaustive up to, sampled coordinates, random blocks)`` per array
    (default: every element up to 2,048, else 256 coordinates and 512 blocks; a watch checks fewer)."""
    _validate_arguments(func, eps, atol, rtol)
    num_dtype = check_dtype(dtype)
    xs, gys, plist, checked_x = _inputs(x_data, y_grad, params, no_grads)
    wrt = [xs[i] for i in checked_x] + [p for _, p in plist]
    atol, rtol = default_tolerances(atol, rtol, num_dtype, wrt)
    start = time.perf_counter()
    ys, loss, groups, note, rows, grads = _analytic_side(func, xs, gys, wrt)
    names = [f"x[{i}]" for i in checked_x] + [n for n, _ in plist]
    out_dtypes = [_real_dtype(y.dtype) for y, g in zip(ys, gys if gys is not None else [None]) if gys is None or g is not None]

    # Numeric side: contiguous copies of the inputs and of the params' data (cast to dtype), the
    # params' own data put back afterwards. Nothing the caller holds is written to.
    nxs = [_numeric_copy(x, num_dtype) for x in xs]
    saved_param_data = [p.data for _, p in plist]
    for _, p in plist:
        p.data = _numeric_copy(p.data, num_dtype)
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

    report = CheckReport(tensors={}, fail_at=Verdict.SUSPICIOUS, seed=0, notes=[note] if note else [])
    try:
        with preserved_rng():
            probe = OutputProbe(outputs, gys, out_dtypes, inputs=targets, groups=groups)
            report.objective = probe.objective
            report.terms = {"loss": probe.objective}
            report.dtype = str(([nxs[i] for i in checked_x] + [p.data for _, p in plist] or [loss])[0].dtype).replace("torch.", "")
            complex_ = [xs[i].is_complex() for i in checked_x] + [p.is_complex() for _, p in plist]
            failures = _judge_arrays(report, probe, zip(names, targets, grads, rows, complex_), eps, atol, rtol, limits,
                                     groups)
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


def _validate_arguments(func: Any, eps: float, atol: Optional[float], rtol: Optional[float]) -> None:
    if not 0 < eps < float("inf"):
        raise ValueError(f"eps must be > 0 and finite, got {eps!r}")
    if (atol is not None and atol < 0) or (rtol is not None and rtol < 0):
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol!r}, rtol={rtol!r}")
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")


def _inputs(x_data: Any, y_grad: Any, params: Any, no_grads: Optional[Sequence[bool]],
            ) -> Tuple[List[torch.Tensor], Optional[List[Optional[torch.Tensor]]], List[Tuple[str, torch.Tensor]], List[int]]:
    """``(inputs, output gradients, named params, indices of the checked inputs)``; the checked inputs require grad."""
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
    return xs, gys, plist, checked_x


def _analytic_side(func: Callable[..., Any], xs: Sequence[torch.Tensor], gys: Optional[Sequence[Optional[torch.Tensor]]],
                   wrt: Sequence[torch.Tensor]) -> Tuple[Tuple, torch.Tensor, Optional[Groups], Optional[str], List[Any],
                                                         List[torch.Tensor]]:
    """In the inputs' own dtype: ``(outputs, the y_grad-weighted loss, isolating groups, a note on them, each array's
    isolating rows, each array's gradient)``."""
    with preserved_rng():
        seed_everything(0)
        ys = to_tuple(func(*xs))
        loss = _weighted(ys, gys)
        keep = [k for k, g in enumerate(gys or []) if g is not None]
        groups, note = _groups([ys[k] for k in keep], wrt) if gys is not None and wrt else (None, None)
        rows = _isolating_vjps([ys[k] for k in keep], wrt, groups) if groups is not None else [None] * len(wrt)
        raw: Sequence[Optional[torch.Tensor]]
        if loss.requires_grad and wrt:
            raw = torch.autograd.grad(loss, wrt, allow_unused=True)
        else:
            raw = [None] * len(wrt)
    grads = [torch.zeros_like(t) if g is None else g.detach() for g, t in zip(raw, wrt)]
    return ys, loss, groups, note, rows, grads


def _numeric_copy(t: torch.Tensor, num_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A contiguous copy of ``t`` for the numeric side, cast to ``num_dtype`` (complex: its complex counterpart)."""
    t = t.detach()
    if num_dtype is not None and t.is_floating_point():
        t = t.to(num_dtype)
    elif num_dtype is not None and t.is_complex():  # float64 asked: complex128 (the same precision per part)
        t = t.to(_complex_dtype(num_dtype))
    return t.resolve_conj().contiguous().clone()


def _judge_arrays(report: CheckReport, probe: OutputProbe, arrays: Iterable[Tuple[str, torch.Tensor, torch.Tensor, Any, bool]],
                  eps: float, atol: float, rtol: float, limits: Optional[Tuple[int, int, int]],
                  groups: Optional[Groups]) -> List[str]:
    """Each ``(name, target, gradient, isolating rows, complex)`` array judged into ``report``; the failure messages."""
    failures: List[str] = []
    for name, target, g, a_rows, parts in arrays:
        if target.numel() == 0:
            continue  # nothing to check (Chainer compares two empty arrays)
        check, message = _check_array(name, target, g, probe, eps, atol, rtol, limits, a_rows, groups)
        if message and parts:
            message = message.replace(" checked entries", " checked entries (complex: checked as its real and "
                                                          "imaginary parts, the last index 0 = real, 1 = imaginary)", 1)
        report.tensors[name] = check
        if message:
            failures.append(message)
    return failures


def default_tolerances(atol: Optional[float], rtol: Optional[float], num_dtype: Optional[torch.dtype],
                       checked: Sequence[torch.Tensor]) -> Tuple[float, float]:
    """``(atol, rtol)``: the given ones, else :data:`FLOAT64_TOLERANCES` when the check computes in float64
    (``num_dtype`` float64, or every ``checked`` array float64 or complex128), else :data:`TOLERANCES`.

    Example:
        >>> default_tolerances(None, None, None, [torch.zeros(2, dtype=torch.float64)])
        (1e-06, 0.0001)
        >>> default_tolerances(None, 1e-3, None, [torch.zeros(2)])
        (1e-05, 0.001)
    """
    if num_dtype is not None:
        float64 = num_dtype == torch.float64
    else:
        float64 = bool(checked) and all(t.dtype in (torch.float64, torch.complex128) for t in checked)
    default_atol, default_rtol = FLOAT64_TOLERANCES if float64 else TOLERANCES
    return (default_atol if atol is None else atol), (default_rtol if rtol is None else rtol)


def _real_shape(t: torch.Tensor) -> Tuple[int, ...]:
    return tuple(t.shape) + ((2,) if t.is_complex() else ())


def _groups(ys: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor]) -> Tuple[Optional[Groups], Optional[str]]:
    """The isolating rows on the weighted outputs ``ys``: as many as :data:`ISOLATING_BUDGET` allows; and a note
    for the report when it allows fewer than :data:`ISOLATING_ROWS` (or one per output element)."""
    floating = [y.is_floating_point() or y.is_complex() for y in ys]
    n_out = sum(math.prod(_real_shape(y)) for y, f in zip(ys, floating) if f)
    n_in = sum(math.prod(_real_shape(w)) for w in wrt)
    rows = min(ISOLATING_ROWS, ISOLATING_BUDGET // max(n_in, n_out, 1))
    groups = isolating_groups([_real_shape(y) for y in ys], floating, rows, [y.is_complex() for y in ys])
    wanted = min(ISOLATING_ROWS, n_out)
    if (groups.rows if groups is not None else 0) >= wanted:
        return groups, None
    return groups, (f"isolating rows: {groups.rows if groups is not None else 0} instead of {wanted} (the analytic "
                    f"side of {n_in:,} checked and {n_out:,} output elements is held to {ISOLATING_BUDGET:,} entries): "
                    f"an error in one Jacobian element is diluted in larger output groups")


def _isolating_vjps(ys: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor], groups: Groups) -> List[torch.Tensor]:
    """Per array of ``wrt``, the ``(rows, elements)`` float64 matrix of the isolating rows' vector-Jacobian
    products (real views), the graph of ``ys`` kept for the ``y_grad`` gradient after them."""
    cot = groups.cotangents()
    outs, cots, offset = [], [], 0
    for y, shape in zip(ys, groups.shapes):
        part = cot[:, offset:offset + math.prod(shape)]
        offset += math.prod(shape)
        if not (y.requires_grad and (y.is_floating_point() or y.is_complex())):
            continue  # an output that does not depend on the inputs for autograd: its rows are zero
        c = part.reshape((groups.rows,) + shape).to(device=y.device, dtype=_real_dtype(y.dtype)).contiguous()
        cots.append(torch.view_as_complex(c) if y.is_complex() else c)
        outs.append(y)
    sizes = [math.prod(_real_shape(w)) for w in wrt]
    raw = _batched_vjps(outs, wrt, cots) if outs else [None] * len(wrt)
    return [torch.zeros(groups.rows, n, dtype=torch.float64) if r is None
            else _as_real(r.detach()).reshape(groups.rows, -1).to(torch.float64) for r, n in zip(raw, sizes)]


def _batched_vjps(outs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor],
                  cots: Sequence[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
    """Every row's vector-Jacobian product at once (``is_grads_batched``), checked against the first and last rows
    computed alone; one backward per row where batching raises (a custom ``autograd.Function`` without batching
    support) or disagrees."""
    n_rows = cots[0].shape[0]

    def one(j: int) -> Sequence[Optional[torch.Tensor]]:
        return torch.autograd.grad(outs, wrt, [c[j] for c in cots], retain_graph=True, allow_unused=True)

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*performance drop.*")
            batched = torch.autograd.grad(outs, wrt, cots, retain_graph=True, allow_unused=True, is_grads_batched=True)
        if all(_same_row(batched, one(j), j) for j in {0, n_rows - 1}):
            return batched
    except Exception:  # noqa: BLE001 - any failure to batch falls back to one backward per row
        pass
    per_row = [one(j) for j in range(n_rows)]
    return [None if per_row[0][i] is None else torch.stack([cast(torch.Tensor, r[i]) for r in per_row])
            for i in range(len(wrt))]


def _same_row(batched: Sequence[Optional[torch.Tensor]], alone: Sequence[Optional[torch.Tensor]], j: int) -> bool:
    """Row ``j`` of the batched products agrees with the same product computed alone (up to rounding)."""
    for b, a in zip(batched, alone):
        if (b is None) != (a is None):
            return False
        if a is None or b is None:
            continue
        bj, a = b[j].detach(), a.detach()
        scale = float(a.abs().nan_to_num(0.0, 0.0, 0.0).max()) if a.numel() else 0.0
        if bj.shape != a.shape or not torch.allclose(bj, a, rtol=1e-4, atol=1e-6 * scale + 1e-300, equal_nan=True):
            return False
    return True


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
                 eps: float, atol: float, rtol: float, limits: Optional[Tuple[int, int, int]] = None,
                 rows: Optional[torch.Tensor] = None, groups: Optional[Groups] = None) -> Tuple[TensorCheck, Optional[str]]:
    """Judge every line of one array; ``rows``: its isolating rows' analytic ``(rows, elements)`` matrix."""
    shape = tuple(target.shape)
    lines = _lines(name, target, g, limits)
    g64 = g.detach().reshape(-1).to(torch.float64)
    # (elements, 1 + rows): column 0 the y_grad gradient, then the isolating rows
    columns = [g64.unsqueeze(1)] + ([] if rows is None else [rows.T.to(g64.device)])
    analytic = torch.cat(columns, dim=1).cpu().numpy()
    flat = target.view(-1)
    slopes: List[Slope] = []
    found = []  # (line, the row that fails, its analytic and numeric values)
    for k, line in enumerate(lines):
        verdict = probe.judge(flat, analytic, line, eps, atol, rtol, noise=k == 0)  # noise: measured once, and where failing
        slopes.append(Slope(analytic=verdict.analytic, numeric=verdict.numeric, floor=verdict.noise,
                            coordinate=line.coordinate, label=line.label, excluded=verdict.excluded,
                            failed=not verdict.ok))
        if not verdict.ok:
            found.append((k, verdict.row, verdict.row_analytic if verdict.row else verdict.analytic,
                          verdict.row_numeric if verdict.row else verdict.numeric))
    check = judge(name, shape, slopes, ToleranceRule(atol=atol, rtol=rtol), step=eps)
    if not found:
        return check, None
    if all(row for _, row, _, _ in found):
        check.diagnosis = ("the y_grad-weighted gradient is within tolerance, but the backward is wrong for single "
                           "output elements (or groups) y_grad weighs little: one-hot cotangents catch it")
    n_blocks = sum(not line.coordinate for line in lines)
    lines_out = [f"  {name} (shape {shape}): {len(found)} of {len(lines)} checked entries out of tolerance"
                 + (f" ({n_blocks} of them random blocks)" if n_blocks else "")
                 + (f", {check.kinks} kinks excluded" if check.kinks else "")]
    if target.numel() <= 16 and not n_blocks and not all(row for _, row, _, _ in found):
        for side, values in (("numeric: ", [s.numeric for s in slopes]), ("analytic:", [s.analytic for s in slopes])):
            lines_out.append(f"    {side} {np.array2string(np.array(values, dtype=np.float64).reshape(shape), precision=6)}")
    for k, row, a, n in sorted(found, key=lambda f: -_gap(f[2], f[3]))[:5]:
        label = lines[k].label
        where = f"block {label[1]} ({label[2]} elements, random direction)" if not lines[k].coordinate else str(label)
        if row and groups is not None:
            where += f" for {groups.describe(row - 1)}"
        lines_out.append(f"    at {where}: numeric {n:.6g} vs analytic {a:.6g} "
                         f"(|diff| {abs(n - a):.3g} > atol + rtol*|analytic| = {atol + rtol * abs(a):.3g})")
    if check.diagnosis:
        lines_out.append(f"    diagnosis: {check.diagnosis}")
    return check, "\n".join(lines_out)


def _gap(a: float, n: float) -> float:
    d = abs(a - n)
    return d if np.isfinite(d) else float("inf")
