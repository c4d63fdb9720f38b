"""The training part of a check: judge the live ``.grad`` against the objective's gradient.

Pure math on tensors: no model, no hook, no I/O. The reference gradient comes
from :mod:`gradwatch.check.replay.reference` (the objective recomputed as training computed
it); this module compares it with the gradient training applied, over every
element of the tensor, and says in words what differs.

The comparison is exact up to rounding: a faithful replay of a deterministic
computation gives the very same bits, and what remains for a correct run is
the rounding of the same gradient computed another way (a loss term written
differently, DDP's averaging, a float16 GradScaler the watch was not given).
:data:`TOLERANCE` is that rounding, per compute dtype, measured on correct runs
(``benchmarks/training_tolerance.py``); a relative difference within it counts as 0.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from gradwatch.bands import DEFAULT_BANDS, Verdict
from gradwatch.check.judging.report import TrainingCheck
from gradwatch.trees import dense, real_view

#: Relative difference ``||live - ref|| / (||live|| + ||ref||)`` that rounding alone can cause, per compute dtype.
#: A faithful replay of the same ops gives the same bits (measured: 0 on an MLP, a CNN with BatchNorm and a
#: transformer layer, with dropout, in float32 and under bfloat16/float16 autocast, with and without gradient
#: accumulation; ``benchmarks/training_tolerance.py``). What is left for a correct run is a term written another
#: way in training than in the objective (largest seen: 3.7e-8, an L2 term computed as a norm) and, in float16,
#: a GradScaler the watch was not given (``grad_scaler=``): its scaled backward rounds differently (4.2e-3).
TOLERANCE = {
    torch.float64: 1e-13,
    torch.float32: 1e-6,
    torch.float16: 1e-2,
    torch.bfloat16: 4e-3,
}
#: Misfit of a least-squares explanation (ratio, or ratio plus a multiple of the parameter) that still counts as exact.
FIT_TOLERANCE = 1e-2
#: Entries a diagnosis reads at a time in float64.
CHUNK = 1 << 20


def tolerance_for(dtype: torch.dtype) -> float:
    """The training tolerance of a compute dtype (float32's for an unknown one).

    Example:
        >>> tolerance_for(torch.bfloat16) > tolerance_for(torch.float32)
        True
    """
    return TOLERANCE.get(dtype, TOLERANCE[torch.float32])


def compute_dtype(param_dtype: torch.dtype, autocast: Sequence[Tuple[str, bool, torch.dtype]] = ()) -> torch.dtype:
    """The precision training computed in: the autocast dtype when autocast was on, else the parameter's.

    Example:
        >>> compute_dtype(torch.float32, [("cpu", True, torch.bfloat16)])
        torch.bfloat16
    """
    low = [dtype for _, enabled, dtype in autocast if enabled]
    if low:
        return max(low, key=tolerance_for)
    return param_dtype


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _load_memcmp() -> Optional[Callable[[int, int, int], int]]:
    """The C library's ``memcmp`` (None where ctypes cannot find it: numpy compares then)."""
    try:
        import ctypes
        import ctypes.util

        lib = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = lib.memcmp
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        return fn
    except (OSError, AttributeError, TypeError):  # no C library reachable (some Windows/embedded builds)
        return None


_MEMCMP = _load_memcmp()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two dense tensors hold the very same bits (NaN included; ``-0.0`` differs from ``0.0``).

    On the CPU the bytes of contiguous tensors are compared with the C library's ``memcmp`` (faster than
    ``torch.equal``, most of all on small tensors), or in numpy over integer views.

    Example:
        >>> x = torch.tensor([1.0, float("nan")])
        >>> same_bits(x, x.clone()), same_bits(x, torch.tensor([1.0, 2.0]))
        (True, False)
    """
    # Cheapest tests first (this runs for every watched tensor of every check): is_cpu, not device.type.
    if a.dtype != b.dtype or a.shape != b.shape or a.layout != torch.strided or b.layout != torch.strided:
        return False
    if a.is_cpu and b.is_cpu:
        if a.is_contiguous() and b.is_contiguous():
            if _MEMCMP is not None:
                size = a.nbytes
                return size == 0 or a.data_ptr() == b.data_ptr() or _MEMCMP(a.data_ptr(), b.data_ptr(), size) == 0
            if a.element_size() in _INT_OF_SIZE and not a.is_complex():
                as_int = _INT_OF_SIZE[a.element_size()]
                return bool(np.array_equal(a.detach().view(as_int).numpy(), b.detach().view(as_int).numpy()))
    elif a.device != b.device:
        return False
    return bool(torch.equal(a, b))


def gradient_scale(grads: Sequence[torch.Tensor]) -> float:
    """Root-mean-square entry over several gradients (the ``scale`` of :func:`judge_training`).

    Example:
        >>> round(gradient_scale([torch.ones(3), torch.zeros(1)]), 6)
        0.866025
    """
    grads = [real_view(dense(g)) for g in grads]
    n = sum(g.numel() for g in grads)
    if n == 0:
        return 0.0
    total = sum(float(torch.linalg.vector_norm(g.detach() if g.dtype in (torch.float32, torch.float64) else g.detach().float()))
                ** 2 for g in grads)
    return math.sqrt(total / n)


def fitted_scale(lives: Mapping[str, Optional[torch.Tensor]], refs: Mapping[str, torch.Tensor]) -> float:
    """Training's gradient over the objective's: one least-squares scale over every tensor given (nan: none).

    Example:
        >>> fitted_scale({"w": torch.tensor([1.0, 2.0]), "b": None}, {"w": torch.tensor([2.0, 4.0]), "b": torch.ones(1)})
        0.5
    """
    gr = rr = 0.0
    for name, ref in refs.items():
        live = lives.get(name)
        if live is not None:
            g, r = real_view(dense(live)).reshape(-1).double(), real_view(dense(ref)).reshape(-1).double().to(live.device)
            gr += float(g @ r)
            rr += float(r @ r)
    return gr / rr if rr > 0.0 else float("nan")


_DTYPE_NAMES: dict = {}  # torch.float32 -> "float32", filled as dtypes are met


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b))


def judge_training(
    name: str,
    live: Optional[torch.Tensor],
    ref: torch.Tensor,
    param: torch.Tensor,
    dtype: torch.dtype,
    bands: Sequence[float] = DEFAULT_BANDS,
    fail_at: Verdict = Verdict.SUSPICIOUS,
    scale: Union[float, Callable[[], float]] = 0.0,
) -> TrainingCheck:
    """Compare the gradient training applied (``live``) with the objective's (``ref``), element by element.

    Args:
        name: Parameter name.
        live: The parameter's ``.grad`` (None when training left none).
        ref: The objective's gradient, recomputed as training computed it.
        param: The parameter (for the "proportional to the parameter" diagnosis).
        dtype: The compute dtype training ran in (sets the tolerance).
        bands: Verdict bands for the judged relative difference.
        fail_at: Verdict from which the tensor fails.
        scale: Root-mean-square entry of the objective's gradient over every checked tensor (or a
            function returning it, called only when the two gradients are not the same bits). A
            difference within ``tolerance * (||live|| + ||ref|| + scale * sqrt(n))`` is rounding:
            a tensor whose gradient nearly cancels (a bias before a norm layer) carries rounding
            of the size of the model's gradients, not of its own.

    Returns:
        A :class:`~gradwatch.check.judging.report.TrainingCheck`.

    Example:
        >>> p = torch.tensor([1.0, -2.0, 3.0])
        >>> ref = torch.tensor([0.5, 0.1, -0.3])
        >>> judge_training("w", ref * 3, ref, p, torch.float32).diagnosis.split(":")[0]
        "training's gradient is 3.00x the objective's (constant ratio)"
        >>> judge_training("w", ref + 0.1 * p, ref, p, torch.float32).diagnosis.split(":")[0]
        "training's gradient has an extra 0.1 * p"
    """
    tol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    dtype_name = _DTYPE_NAMES.get(dtype) or _DTYPE_NAMES.setdefault(dtype, str(dtype).replace("torch.", ""))
    if live is not None and same_bits(live, ref):
        # The same bits (a faithful replay of a correct step): nothing more to measure. (A NaN or inf the
        # replay reproduces is training's own: gradwatch.watch.nonfinite_grads alerts it.) The common case: one call.
        return TrainingCheck(name, tuple(param.shape), dtype_name, tol, 0.0, 0.0, 0.0, Verdict.EXCELLENT,
                             fail_at is Verdict.EXCELLENT)  # EXCELLENT fails only where fail_at is EXCELLENT
    check = TrainingCheck(name=name, shape=tuple(param.shape), dtype=dtype_name, tolerance=tol)
    ref, param = real_view(dense(ref)), real_view(dense(param))
    live = real_view(dense(live)) if live is not None else None
    r = ref.detach().reshape(-1).to(torch.float64)
    if live is None:
        return _no_live_grad(check, r, bands, fail_at)
    # Compared in the gradients' own precision (float32 or float64; lower ones in float32): the norms' rounding is
    # far below any tolerance, and a cut step's gradients, never the same bits, are compared without a copy in float64.
    work = ref.dtype if ref.dtype in (torch.float32, torch.float64) and live.dtype == ref.dtype else torch.float32
    r = ref.detach().reshape(-1).to(work)
    g = live.detach().reshape(-1).to(device=r.device, dtype=work)
    return _compared(check, g, r, param, tol, bands, fail_at, scale)


def _no_live_grad(check: TrainingCheck, r: torch.Tensor, bands: Sequence[float], fail_at: Verdict) -> TrainingCheck:
    """:func:`judge_training` where training left no ``.grad``: a failure unless the objective's gradient ``r`` (flat,
    float64) is zero."""
    check.live_grad = False
    if not bool(torch.isfinite(r).all()):
        check.inconclusive = "the objective's gradient is not finite (NaN or inf): no training verdict"
        return check
    norm = float(torch.linalg.vector_norm(r))
    check.rel_diff = check.judged_rel_diff = 0.0 if norm == 0.0 else 1.0
    check.max_rel_error = check.rel_diff
    if norm > 0.0:
        check.diagnosis = (
            "training left no .grad where the objective's gradient is not zero: the parameter is detached "
            "(.detach(), .data, torch.no_grad) or unused in training's forward, or .grad was cleared before "
            "watch.step"
        )
    return _verdict(check, bands, fail_at)


def _compared(check: TrainingCheck, g: torch.Tensor, r: torch.Tensor, param: torch.Tensor, tol: float,
              bands: Sequence[float], fail_at: Verdict, scale: Union[float, Callable[[], float]]) -> TrainingCheck:
    """:func:`judge_training` of training's gradient ``g`` against the objective's ``r`` (flat, in one dtype and
    device): the relative differences, the verdict, and where they differ beyond rounding, the diagnosis."""
    diff = g - r
    ng, nr, nd = (float(torch.linalg.vector_norm(v)) for v in (g, r, diff))
    if not math.isfinite(ng + nr + nd):  # one finiteness test in the common case; the culprit only when it fails
        if not bool(torch.isfinite(g).all()):
            check.inconclusive = (
                "training's .grad has NaN or inf entries (a GradScaler step that overflowed, which the scaler skips, "
                "or an overflow in training): no training verdict"
            )
            return check
        if not bool(torch.isfinite(r).all()):
            check.inconclusive = "the objective's gradient recomputed on the live model is not finite: no training verdict"
            return check
        ng, nr, nd = (float(torch.linalg.vector_norm(v.double())) for v in (g, r, diff))  # finite, past float32's range
    check.rel_diff = 0.0 if nd == 0.0 else min(1.0, nd / (ng + nr))
    check.max_rel_error = 0.0 if nd == 0.0 else _max_rel_error(g, r, diff)
    rms = scale() if callable(scale) else scale
    allowed = tol * (ng + nr + rms * math.sqrt(g.numel()))
    check.judged_rel_diff = check.rel_diff if nd > allowed else 0.0
    _verdict(check, bands, fail_at)
    if check.judged_rel_diff > 0.0:
        p = param.detach().reshape(-1).to(device=r.device)
        check.ratio, check.param_coef, check.diagnosis = diagnose_training(g, r, p, tol)
    return check


def _max_rel_error(g: torch.Tensor, r: torch.Tensor, diff: torch.Tensor) -> float:
    """``max |g - r| / max(|g| + |r|)`` from ``diff = g - r``, in four passes and no new tensor: entry by entry
    ``|g| + |r| = max(|g + r|, |g - r|)`` (exactly, rounding included), and ``diff``'s memory then holds ``g + r``.

    Example:
        >>> g, r = torch.tensor([1.0, -2.0]), torch.tensor([1.5, -2.0])
        >>> _max_rel_error(g, r, g - r)
        0.125
    """
    if not g.numel():
        return 0.0
    low, high = torch.aminmax(diff)
    worst = max(-float(low), float(high))
    low2, high2 = torch.aminmax(torch.add(g, r, out=diff))
    return worst / max(worst, -float(low2), float(high2), 1e-8)


def _verdict(check: TrainingCheck, bands: Sequence[float], fail_at: Verdict) -> TrainingCheck:
    check.verdict = Verdict.from_value(check.judged_rel_diff, bands)
    check.failed = check.verdict.is_failure(fail_at)
    return check


def _float64_chunks(*tensors: torch.Tensor) -> Iterator[Tuple[torch.Tensor, ...]]:
    """The flat ``tensors``' entries :data:`CHUNK` at a time, in float64 (the only copies a diagnosis makes)."""
    for chunks in zip(*(t.split(CHUNK) for t in tensors)):
        yield tuple(c.to(torch.float64) for c in chunks)


def _residual(g: torch.Tensor, r: torch.Tensor, p: torch.Tensor, a: float, b: float) -> float:
    """``||g - a*r - b*p||``, a chunk at a time in float64."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(gc - a * rc - b * pc)) ** 2
                         for gc, rc, pc in _float64_chunks(g, r, p)))


def _fit(g: torch.Tensor, r: torch.Tensor, p: torch.Tensor) -> Tuple[float, float, float, float, float]:
    """Least squares ``g ~ a*r`` and ``g ~ a2*r + b*p``: ``(a, misfit, a2, b, misfit2)`` (misfits relative to ||g||),
    from the six products summed a chunk at a time in float64."""
    gg = rr = pp = rg = pg = rp = 0.0
    for gc, rc, pc in _float64_chunks(g, r, p):
        gg, rr, pp = gg + _dot(gc, gc), rr + _dot(rc, rc), pp + _dot(pc, pc)
        rg, pg, rp = rg + _dot(rc, gc), pg + _dot(pc, gc), rp + _dot(rc, pc)
    ng = math.sqrt(gg) if gg > 0 else 1e-300
    a = rg / rr if rr > 0 else 0.0
    mis = math.sqrt(max(gg - 2 * a * rg + a * a * rr, 0.0)) / ng
    det = rr * pp - rp * rp
    if rr > 0 and pp > 0 and det > 1e-12 * rr * pp:
        a2 = (rg * pp - pg * rp) / det
        b = (pg * rr - rg * rp) / det
        res = gg - 2 * a2 * rg - 2 * b * pg + a2 * a2 * rr + 2 * a2 * b * rp + b * b * pp
        mis2 = math.sqrt(max(res, 0.0)) / ng
    else:
        a2, b, mis2 = a, 0.0, mis
    # Cancellation in the expanded residuals: recompute the chosen one directly when it looks small.
    if mis < 1e-3:
        mis = _residual(g, r, p, a, 0.0) / ng
    if mis2 < 1e-3:
        mis2 = _residual(g, r, p, a2, b) / ng
    return a, mis, a2, b, mis2


#: Largest micro-batch count a ratio is read as (gradient accumulation): beyond, a ratio is just a factor.
MAX_ACCUMULATION = 64


def ratio_text(a: float) -> str:
    """A ratio for people: two decimals in the usual range, three significant digits outside it.

    Example:
        >>> ratio_text(3.0), ratio_text(0.0024853), ratio_text(65536.0)
        ('3.00', '0.00249', '6.55e+04')
    """
    return f"{a:.2f}" if 0.1 <= abs(a) < 1000 else f"{a:.3g}"


def _ratio_words(a: float) -> str:
    """What a constant ratio between training's gradient and the objective's usually means."""
    if a > 0:
        k = round(a)
        if a >= 128 and abs(math.log2(a) - round(math.log2(a))) < 1e-6:
            return (f"the GradScaler scale ({a:.0f} = 2**{round(math.log2(a))}); call scaler.unscale_(optimizer) "
                    "before watch.step")
        inv = round(1 / a)
        if 2 <= k <= MAX_ACCUMULATION and abs(a - k) <= 1e-2 * k:
            return (f"a loss multiplied by {k}: gradient accumulation over {k} micro-batches without dividing each "
                    f"loss by {k}? (or a .grad edit / gradient hook scaling it)")
        if 2 <= inv <= MAX_ACCUMULATION and abs(1 / a - inv) <= 1e-2 * inv:
            return (f"a loss divided by {inv} once too often: gradient accumulation dividing by {inv} where the "
                    f"objective already averages, or over {inv} micro-batches the watch did not see (call "
                    "watch.accumulate for each)? Gradient clipping before watch.step also shrinks it")
        if a < 1:
            return ("gradient clipping before watch.step (call it before clip_grad_norm_), a loss scaled down, or a "
                    ".grad edit / gradient hook")
        return "a factor in the training loss, a .grad edit or a gradient hook"
    if abs(a + 1) <= 1e-2:
        return "a sign flip in the training loss or a gradient hook"
    return "a negative factor in the training loss or a gradient hook"


def diagnose_training(g: torch.Tensor, r: torch.Tensor, p: torch.Tensor, tol: float) -> Tuple[Optional[float], Optional[float], str]:
    """Explain a training mismatch: ``(ratio, coefficient of p, words)``.

    Args:
        g: Training's gradient (flat).
        r: The objective's gradient (flat).
        p: The parameter (flat).
        tol: The dtype's tolerance (fits within it count as exact).

    Each is read in float64 a chunk at a time (:data:`CHUNK` entries): a diagnosis of a big embedding holds no
    float64 copy of the whole tensor.

    Example:
        >>> r = torch.tensor([0.5, 0.1, -0.3], dtype=torch.float64)
        >>> p = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
        >>> diagnose_training(r + 0.1 * p, r, p, 1e-6)[2].split(";")[0]
        "training's gradient has an extra 0.1 * p: training's loss has an L2 term of about 0.05 * ||p||^2 that the objective lacks"
    """
    fit_tol = max(FIT_TOLERANCE, 10 * tol)
    n = g.numel()
    zero_g = not bool(g.ne(0).any())
    zero_r = not bool(r.ne(0).any())
    if zero_g and not zero_r:
        return 0.0, None, (
            "training's gradient is zero where the objective's is not: a detach (.detach(), .data, torch.no_grad) or "
            "a frozen path in training's forward, or a hook or .grad edit zeroing it"
        )
    if zero_r and not zero_g:
        return None, None, (
            "training has a gradient where the objective's is zero: the training loss has a term the objective lacks "
            "(pass it as regularizers=), or a hook or .grad edit adds to it"
        )
    a, mis, a2, b, mis2 = _fit(g, r, p)
    if mis <= fit_tol and abs(a - 1.0) <= fit_tol:
        return a, 0.0, (
            f"training's gradient is within {fit_tol:.0%} of the objective's but beyond the tolerance of the compute "
            "dtype: training computed in lower precision than the replay (an autocast region the watch did not see?), "
            "or a small term only one of them has"
        )
    if mis <= fit_tol:
        return a, 0.0, f"training's gradient is {ratio_text(a)}x the objective's (constant ratio): {_ratio_words(a)}"
    if mis2 <= fit_tol and b != 0.0:
        coef = b / 2.0
        if abs(a2 - 1.0) <= fit_tol:
            if coef > 0:
                words = (f"training's gradient has an extra {b:.3g} * p: training's loss has an L2 term of about "
                         f"{coef:.3g} * ||p||^2 that the objective lacks; add it to the objective: "
                         f"regularizers={{'l2': {coef:.3g}}}")
            else:
                words = (f"training's gradient lacks {-b:.3g} * p: the objective has an L2 term of about {-coef:.3g} * "
                         "||p||^2 (a regularizer, or coupled weight decay) that training's loss does not; remove it "
                         "from regularizers, or add it to the training loss")
            return 1.0, b, words
        return a2, b, (f"training's gradient is {ratio_text(a2)}x the objective's plus {b:.3g} * p: a factor of {ratio_text(a2)} "
                       "(a scaled loss, a .grad edit or a gradient hook) and an L2 term of about "
                       f"{coef / a2:.3g} * ||p||^2 that the objective lacks")
    k, worst, at = 0, -1.0, (0.0, 0.0)
    for gc, rc in _float64_chunks(g, r):
        d = (gc - rc).abs()
        k += int((d > fit_tol * (gc.abs() + rc.abs())).sum())
        i = int(torch.argmax(d))
        if float(d[i]) > worst:
            worst, at = float(d[i]), (float(gc[i]), float(rc[i]))
    return None, None, (
        f"training's gradient differs from the objective's at {k} of {n} entries, neither by a constant factor nor "
        f"by a multiple of the parameter (worst: training {at[0]:.6g} vs objective {at[1]:.6g}): a .grad "
        "edit or gradient hook, a term only the training loss has, or a training forward that differs from "
        "loss_fn (.detach()/.data, another kernel or compiled graph)"
    )
