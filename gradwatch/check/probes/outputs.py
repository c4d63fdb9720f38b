"""Central differences of a function's outputs along lines in one input (for ``check_backward``).

The slope of ``J(x) = sum_k <y_k(x), w_k>`` along a unit line ``u`` is taken as
``sum_k <y_k(x + t u) - y_k(x - t u), w_k> / 2t``, the outputs differenced
element by element before the sum: outputs the perturbation leaves unchanged
add nothing, so a large output elsewhere (``erfcx(-4) ~ 1e7``) does not bury a
small change in rounding. The rounding that remains is measured from the
outputs that did change (``noise``). A disagreement is then re-examined at
smaller steps and from both sides, to tell a wrong gradient from a function
that is not smooth within the step (a kink, a jump, strong curvature).

The same differences also give *isolating rows* beside that weighted one (the
``y_grad`` row): the outputs, flattened and concatenated (a complex one as its
real and imaginary parts), are split into groups (:class:`Groups`): each
element its own group when there are at most :data:`ISOLATING_ROWS` of them,
else that many random groups with random signs. A group's signed sum of
differences is compared with the vector-Jacobian product of its cotangent, so
a wrong Jacobian element shows in one row beside at most a group's worth of
others, whatever weight ``y_grad`` gives its output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

import numpy as np
import torch

from gradwatch.check.numerics.differences import machine_eps
from gradwatch.check.numerics.sampling import generator

#: Rounding of one output element, in units of its dtype's eps times its magnitude (allows a few ulps
#: accumulated inside the function).
NOISE_FACTOR = 16.0
#: Smaller steps tried, as fractions of ``eps``, before a disagreement counts.
REFINE_SCALES = (0.1, 0.01, 0.001)
#: Isolating rows: one per output element up to this many output elements, else this many random groups.
ISOLATING_ROWS = 128
#: Entries allowed in the analytic side of the isolating rows (rows x checked elements, rows x output
#: elements): fewer rows past it, none when not one row fits.
ISOLATING_BUDGET = 2**24


@dataclass
class Line:
    """A line through one array: one element (``index`` an int, ``coordinate=True``), or flat indices
    ``index`` (long tensor) with a unit direction ``unit`` (float64) on them.

    Example:
        >>> Line(label=(0,), index=0, coordinate=True).coordinate
        True
    """

    label: tuple
    index: Union[int, torch.Tensor]
    unit: Optional[torch.Tensor] = None
    coordinate: bool = False


@dataclass
class Groups:
    """Isolating cotangents on a function's outputs, flattened and concatenated (a complex output as its real
    and imaginary parts): element ``e`` belongs to row ``group[e]`` with sign ``sign[e]``; ``group[e] == rows``
    leaves it out (an output that is not floating).

    Example:
        >>> groups = isolating_groups([(2,), (3,)], [True, True])
        >>> groups.rows, groups.one_hot, groups.describe(3)
        (5, True, 'output 1 element (1,)')
        >>> groups.cotangents()[3].tolist()
        [0.0, 0.0, 0.0, 1.0, 0.0]
    """

    group: torch.Tensor
    sign: torch.Tensor
    rows: int
    one_hot: bool
    shapes: List[Tuple[int, ...]]
    complex_: List[bool]

    def cotangents(self) -> torch.Tensor:
        """The cotangents, one per row: a ``(rows, output elements)`` float64 matrix."""
        n = self.group.numel()
        dense = torch.zeros(self.rows + 1, n, dtype=torch.float64)
        dense[self.group, torch.arange(n)] = self.sign
        return dense[: self.rows]

    def describe(self, row: int) -> str:
        """Row ``row`` in words: the output element it isolates, or its group's size."""
        members = torch.nonzero(self.group == row).reshape(-1)
        if not self.one_hot:
            return f"output group {row} ({members.numel()} output elements with random signs)"
        flat, k = int(members[0]), 0
        while flat >= math.prod(self.shapes[k]):
            flat -= math.prod(self.shapes[k])
            k += 1
        shape = self.shapes[k]
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if shape else ()
        part = ""
        if self.complex_[k]:
            index, part = index[:-1], (" (real part)", " (imaginary part)")[index[-1]]
        return f"{'output element' if len(self.shapes) == 1 else f'output {k} element'} {index}{part}"


def isolating_groups(shapes: Sequence[Tuple[int, ...]], floating: Sequence[bool], rows: int = ISOLATING_ROWS,
                     complex_: Optional[Sequence[bool]] = None, seed: int = 0) -> Optional[Groups]:
    """Split the elements of outputs of ``shapes`` (real views: a complex output's shape ends in 2) into rows.

    Every floating element is a row of its own when there are at most ``rows`` of them; otherwise a seeded
    random permutation is cut into ``rows`` groups of (nearly) equal size, each element with a random sign.
    None when there is no row to make.

    Example:
        >>> groups = isolating_groups([(300,)], [True], rows=128)
        >>> groups.rows, groups.one_hot, int(groups.sign.abs().sum())
        (128, False, 300)
    """
    sizes = [math.prod(s) for s in shapes]
    mask = torch.cat([torch.full((n,), bool(f)) for n, f in zip(sizes, floating)] or [torch.zeros(0, dtype=torch.bool)])
    n = int(mask.sum())
    if rows < 1 or n == 0:
        return None
    one_hot = n <= rows
    if one_hot:
        ids, signs, rows = torch.arange(n), torch.ones(n, dtype=torch.float64), n
    else:
        gen = generator(seed)
        ids = torch.empty(n, dtype=torch.long)
        ids[torch.randperm(n, generator=gen)] = torch.arange(n) * rows // n
        signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
    group = torch.full((mask.numel(),), rows, dtype=torch.long)
    sign = torch.zeros(mask.numel(), dtype=torch.float64)
    group[mask], sign[mask] = ids, signs
    return Groups(group=group, sign=sign, rows=rows, one_hot=one_hot, shapes=[tuple(s) for s in shapes],
                  complex_=list(complex_) if complex_ is not None else [False] * len(shapes))


@dataclass
class Slopes:
    """Slopes along a line at one step, one entry per row (row 0 the ``y_grad`` row, then the isolating
    rows): analytic, central numeric, its rounding noise, one-sided numeric (float64 numpy vectors)."""

    analytic: np.ndarray
    numeric: np.ndarray
    noise: np.ndarray
    right: np.ndarray
    left: np.ndarray
    #: Some output was NaN on both sides: the function is undefined there, whether or not it depends on this line.
    undefined: bool = False

    def finite(self) -> np.ndarray:
        """Per row: every value finite."""
        return np.isfinite(np.stack([self.analytic, self.numeric, self.noise, self.right, self.left])).all(0)


@dataclass
class LineVerdict:
    """Outcome on one line: the ``y_grad`` row's values at ``eps``, whether it passes, whether it was excluded
    (a kink), and on a failing line the row that fails (0: the ``y_grad`` row) with its values."""

    analytic: float
    numeric: float
    noise: float
    ok: bool
    excluded: bool = False
    row: int = 0
    row_analytic: float = math.nan
    row_numeric: float = math.nan


def _outside(analytic: np.ndarray, numeric: np.ndarray, atol: float, rtol: float,
             noise: Union[float, np.ndarray] = 0.0) -> np.ndarray:
    """Per row: out of ``atol + rtol * |analytic| (+ noise)``; an isolating row with a non-finite value is not
    judged (0 * inf in an autograd product; row 0 judges what is not finite)."""
    with np.errstate(invalid="ignore"):
        out = ~(np.abs(numeric - analytic) <= atol + rtol * np.abs(analytic) + noise)
    out[1:] &= np.isfinite(analytic[1:]) & np.isfinite(numeric[1:])
    return out


def _matrix(g: Union[torch.Tensor, np.ndarray]) -> np.ndarray:
    """Analytic rows as a float64 ``(elements, rows)`` numpy array (a 1-D gradient: one row)."""
    if isinstance(g, torch.Tensor):
        g = g.detach().to(torch.float64).cpu().numpy()
    return g if g.ndim == 2 else g.reshape(-1, 1)


class OutputProbe:
    """Evaluates ``outputs()`` around the current point and judges lines with Chainer's ``atol``/``rtol``.

    Args:
        outputs: Evaluates the function at the current inputs (which the probe perturbs in place).
        weights: One weight array per output (``y_grad``; a ``None`` entry skips that output),
            or None for a function returning one scalar.
        out_dtypes: Dtypes of the outputs in the caller's precision (they set the rounding noise).
        inputs: The arrays the probe perturbs (an output sharing their storage is copied).
        groups: Isolating rows on the kept outputs (:func:`isolating_groups`), or None for the ``y_grad`` row alone.

    Example:
        >>> x = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> probe = OutputProbe(lambda: (x * x,), [torch.ones(2)], [torch.float64])
        >>> line = Line(label=(1,), index=1, coordinate=True)
        >>> v = probe.judge(x.view(-1), torch.tensor([2.0, 4.0], dtype=torch.float64), line, 1e-3, 1e-5, 1e-4)
        >>> v.ok, round(v.numeric, 6)
        (True, 4.0)
    """

    def __init__(self, outputs: Callable[[], Sequence[torch.Tensor]], weights: Optional[Sequence[Optional[torch.Tensor]]],
                 out_dtypes: Sequence[torch.dtype], inputs: Sequence[torch.Tensor] = (),
                 groups: Optional[Groups] = None) -> None:
        self._outputs = outputs
        self._input_storages = {t.untyped_storage().data_ptr() for t in inputs}
        self.count = 0
        self._keep = [0] if weights is None else [k for k, w in enumerate(weights) if w is not None]
        self.y0 = self._eval()
        if weights is None:
            self._w = [np.ones_like(self.y0[0])]
        else:
            self._w = [cast(torch.Tensor, weights[k]).detach().to(torch.float64).cpu().numpy() for k in self._keep]
        self._w = [np.ascontiguousarray(np.broadcast_to(w.reshape(-1), y.shape)) for w, y in zip(self._w, self.y0)]
        self._w_abs = [np.abs(w) for w in self._w]
        floating = [d for d in out_dtypes if d.is_floating_point]
        self.eps_out = max([machine_eps(d) for d in floating] or [machine_eps(torch.float64)])
        self.objective = float(sum(float(w @ y) for w, y in zip(self._w, self.y0)))
        #: Rows: the ``y_grad`` row, then one per isolating group.
        self.rows = 1 + (groups.rows if groups is not None else 0)
        self._gid: List[Optional[np.ndarray]] = [None] * len(self.y0)
        self._gsign: List[Optional[np.ndarray]] = [None] * len(self.y0)
        if groups is not None:
            sizes = [y.size for y in self.y0]
            if sum(sizes) != groups.group.numel():
                raise ValueError(f"the isolating groups cover {groups.group.numel()} output elements, "
                                 f"but the outputs have {sum(sizes)}")
            # Row r + 1 of the sums is group r; row rows + 1 collects the elements of no group.
            cuts = np.cumsum(sizes)[:-1]
            self._gid = list(np.split((groups.group + 1).numpy(), cuts))
            self._gsign = list(np.split(groups.sign.numpy(), cuts))

    def _eval(self) -> List[np.ndarray]:
        self.count += 1
        ys: Any = self._outputs()
        if not isinstance(ys, (tuple, list)):
            ys = (ys,)
        return [self._own(ys[k].detach()) for k in self._keep]

    def _own(self, y: torch.Tensor) -> np.ndarray:
        """``y`` as a flat float64 numpy array on the host that perturbing the inputs cannot change (copied only
        when it could): the differences are small-vector arithmetic, cheaper in numpy."""
        if y._is_zerotensor():  # an efficient zero tensor (a backward that is 0 by definition, e.g. sgn's): no storage
            return np.zeros(y.numel())
        if y.dtype != torch.float64 or y._is_view() or y.untyped_storage().data_ptr() in self._input_storages:
            y = y.to(torch.float64, copy=True)
        return y.reshape(-1).cpu().numpy()

    def _diff(self, ya: Sequence[np.ndarray], yb: Sequence[np.ndarray],
              noise: bool = True) -> Tuple[np.ndarray, np.ndarray, bool]:
        """Per row, over the elements that differ: ``sum <ya - yb, w>`` (row 0) and each group's
        ``sum sign (ya - yb)``; the magnitudes ``sum |w| (|ya| + |yb|)`` and ``sum |ya| + |yb|`` (``nan`` unless
        ``noise``); and whether an output is NaN on both sides (left out of the sums: it says nothing about a slope)."""
        bins = self.rows + 1  # row ``rows`` collects the elements of no group
        sums, sizes = np.zeros(bins), np.zeros(bins)
        total, magnitude, undefined = 0.0, 0.0, False
        with np.errstate(all="ignore"):  # inf - inf, 0 * inf: handled below
            for w, w_abs, gid, sign, a, b in zip(self._w, self._w_abs, self._gid, self._gsign, ya, yb):
                d = a - b
                part = float(w @ d)
                grouped = None if gid is None else np.bincount(gid, sign * d, bins)
                if math.isfinite(part) and (grouped is None or np.isfinite(grouped).all()):
                    # the common case: unchanged elements add exact zeros
                    total += part
                    if grouped is not None:
                        sums += grouped
                    if noise:
                        size = (np.abs(a) + np.abs(b)) * (d != 0)
                        magnitude += float(w_abs @ size)
                        if gid is not None:
                            sizes += np.bincount(gid, size, bins)
                    continue
                both_nan = np.isnan(a) & np.isnan(b)
                changed = (a != b) & ~both_nan  # equal infinities are unchanged too
                undefined = undefined or bool(both_nan.any())
                total += float(np.where(changed, w * d, 0.0).sum())
                magnitude += float(np.where(changed, w_abs * (np.abs(a) + np.abs(b)), 0.0).sum())
                if gid is not None:
                    sums += np.bincount(gid, np.where(changed, sign * d, 0.0), bins)
                    sizes += np.bincount(gid, np.where(changed, np.abs(a) + np.abs(b), 0.0), bins)
        sums[0], sizes[0] = total, magnitude
        return sums[:-1], sizes[:-1] if noise else _nans(self.rows), undefined

    def _perturbed(self, flat: torch.Tensor, line: Line, t: float):
        """Outputs at ``x + t u`` and ``x - t u``, with the displacements actually stored (rounded to the dtype):
        floats on a coordinate, float64 tensors on a direction."""
        if line.coordinate:
            view = flat[line.index]  # a 0-d view: cheaper than index tensors for one element
            saved = view.clone()
            s = float(saved)
            try:
                view.fill_(s + t)
                fp = float(view) - s
                yp = self._eval()
                view.fill_(s - t)
                fm = float(view) - s
                ym = self._eval()
            finally:
                view.copy_(saved)
            fp, fm = (0.0 if math.isnan(fp) else fp), (0.0 if math.isnan(fm) else fm)  # inf - inf: it did not move
            return yp, ym, fp, fm
        idx, u = line.index, cast(torch.Tensor, line.unit)
        saved = flat[idx].clone()
        s64 = saved.to(torch.float64)
        try:
            flat[idx] = (s64 + t * u).to(flat.dtype)
            dp = torch.nan_to_num(flat[idx].to(torch.float64) - s64, nan=0.0)
            yp = self._eval()
            flat[idx] = (s64 - t * u).to(flat.dtype)
            dm = torch.nan_to_num(flat[idx].to(torch.float64) - s64, nan=0.0)
            ym = self._eval()
        finally:
            flat[idx] = saved
        return yp, ym, dp, dm

    def slopes(self, flat: torch.Tensor, g: Union[torch.Tensor, np.ndarray], line: Line, t: float,
               one_sided: bool = False, noise: bool = True) -> Slopes:
        """Analytic and numeric slopes along ``line`` at step ``t``, per row; ``flat`` is written and restored
        exactly. ``g`` holds the analytic rows: ``(elements, rows)`` float64, column 0 the ``y_grad`` gradient
        (or that gradient alone, 1-D: the ``y_grad`` row alone).

        The one-sided slopes are computed only when asked for, the noise only unless told not to
        (``nan`` otherwise): each costs passes over the outputs.
        """
        g2 = _matrix(g)
        rows = g2.shape[1]
        with torch.no_grad():
            yp, ym, dp, dm = self._perturbed(flat, line, t)
        central, magnitude, undefined = self._diff(yp, ym, noise)
        # The steps actually taken (rounded to the array's dtype), not the nominal ones.
        if line.coordinate:
            analytic = g2[line.index] * ((dp - dm) / (2 * t))
            tp, tm = dp, -dm
        else:
            index = cast(torch.Tensor, line.index).cpu().numpy()
            analytic = g2[index].T @ (dp - dm).cpu().numpy() / (2 * t)
            unit = cast(torch.Tensor, line.unit)
            tp, tm = float(torch.dot(dp, unit)), -float(torch.dot(dm, unit))
        right = left = _nans(rows)
        if one_sided:
            if tp > 0:
                right = self._diff(yp, self.y0, False)[0][:rows] / tp
            if tm > 0:
                left = self._diff(self.y0, ym, False)[0][:rows] / tm
        return Slopes(
            analytic=analytic,
            numeric=central[:rows] / (2 * t),
            noise=NOISE_FACTOR * self.eps_out * magnitude[:rows] / (2 * t),
            right=right,
            left=left,
            undefined=undefined,
        )

    def judge(self, flat: torch.Tensor, g: Union[torch.Tensor, np.ndarray], line: Line, eps: float, atol: float, rtol: float,
              noise: bool = False) -> LineVerdict:
        """Pass when every row has ``|numeric - analytic| <= atol + rtol * |analytic|``, or when the rows that do
        not are explained by a function not smooth at ``eps``.

        The rounding noise is measured on a failing line, or when ``noise`` asks for it. The smaller steps
        of the re-examination are evaluated once for every failing row.
        """
        base = self.slopes(flat, g, line, eps, noise=noise)
        a, n = float(base.analytic[0]), float(base.numeric[0])
        if not (math.isfinite(a) and math.isfinite(n)):
            # Undefined here on both sides (numpy's equal_nan, as Chainer): a non-finite analytic slope
            # where the numeric one is non-finite too, or where the function has NaN outputs.
            both = not math.isfinite(a) and (not math.isfinite(n) or base.undefined)
            return LineVerdict(a, n, float(base.noise[0]), ok=both, excluded=both)
        bad = _outside(base.analytic, base.numeric, atol, rtol)
        if not bool(bad.any()):
            return LineVerdict(a, n, float(base.noise[0]), ok=True)
        again = self.slopes(flat, g, line, eps, one_sided=True)  # the same point again, with noise and both sides
        left = self._unexplained(flat, g, line, again, bad, eps, atol, rtol)
        if not left:
            return LineVerdict(a, n, float(again.noise[0]), ok=True, excluded=True)
        gaps = np.abs(base.numeric - base.analytic) / (atol + rtol * np.abs(base.analytic) + 1e-300)
        row = 0 if 0 in left else max(left, key=lambda r: float(gaps[r]))
        return LineVerdict(a, n, float(again.noise[0]), ok=False, row=row,
                           row_analytic=float(base.analytic[row]), row_numeric=float(base.numeric[row]))

    def _unexplained(self, flat: torch.Tensor, g: Union[torch.Tensor, np.ndarray], line: Line, base: Slopes,
                     bad: np.ndarray, eps: float, atol: float, rtol: float) -> List[int]:
        """The failing rows whose disagreement at ``eps`` does not come from the function (empty: the line is
        not smooth there).

        (1) At a smaller step the slopes agree: the function was not smooth
        within ``eps`` (strong curvature, or a kink or jump crossed), and the
        analytic value is right here. Steps whose rounding noise exceeds half
        the disagreement are not used (they cannot tell). (2) Otherwise the
        one-sided slopes ``(J(x+t)-J(x))/t`` and ``(J(x)-J(x-t))/t`` are
        compared at the smallest usable step: for a smooth function their gap
        shrinks with ``t``; if it does not (a kink) or grows (a jump), ``x``
        sits on one. On a coordinate the analytic value must then lie between
        the one-sided slopes (extrapolated to ``t -> 0`` so curvature does not
        count): a valid subgradient. On a direction it is excluded. Each
        smaller step is evaluated once, for every row still in question.
        """
        gap_at_eps = np.abs(base.numeric - base.analytic)
        open_, alive = bad.copy(), bad.copy()
        seen = np.zeros(bad.shape, dtype=np.int64)  # per row: how many of ``steps`` it was judged at
        steps: List[Tuple[float, Slopes]] = []
        for scale in REFINE_SCALES:
            if not bool(alive.any()):
                break
            t = eps * scale
            s = self.slopes(flat, g, line, t, one_sided=True)
            with np.errstate(invalid="ignore"):
                alive &= s.finite() & (s.noise <= 0.5 * gap_at_eps)
            agree = alive & ~_outside(s.analytic, s.numeric, atol, rtol, s.noise)
            open_ &= ~agree
            alive &= ~agree
            seen += alive
            steps.append((t, s))
        return [r for r in np.flatnonzero(open_).tolist()
                if not self._kink(line, base, steps[: int(seen[r])], r, atol, rtol)]

    @staticmethod
    def _kink(line: Line, base: Slopes, seen: List[Tuple[float, Slopes]], r: int, atol: float, rtol: float) -> bool:
        """Test (2) of :meth:`_unexplained` on row ``r``, at the steps it was judged at."""
        if not seen or not math.isfinite(float(base.right[r] - base.left[r])):
            return False
        t, s = seen[-1]
        gap, gap0 = float(s.right[r] - s.left[r]), float(base.right[r] - base.left[r])
        noise, analytic = float(s.noise[r]), float(s.analytic[r])
        if not (abs(gap) > 4 * noise and abs(gap) > 0.3 * abs(gap0)):
            return False
        if not line.coordinate:
            return True
        right, left, tol = float(s.right[r]), float(s.left[r]), 2 * noise
        if len(seen) >= 2:
            # One-sided slopes of a function smooth on each side are linear in t: extrapolate to t = 0.
            t1, s1 = seen[-2]
            right = right - (float(s1.right[r]) - right) * t / (t1 - t)
            left = left - (float(s1.left[r]) - left) * t / (t1 - t)
            tol = 2 * noise + 2 * float(s1.noise[r]) * t / (t1 - t)
        tol += atol + rtol * abs(analytic)
        return min(left, right) - tol <= analytic <= max(left, right) + tol


_NANS: Dict[int, np.ndarray] = {}


def _nans(n: int) -> np.ndarray:
    """A shared read-only vector of ``n`` NaNs (the values not measured on a line)."""
    if n not in _NANS:
        _NANS[n] = np.full(n, math.nan)
        _NANS[n].flags.writeable = False
    return _NANS[n]
