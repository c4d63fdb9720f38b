"""Central differences of a function's weighted outputs along lines in one input (for ``check_backward``).

The slope of ``J(x) = sum_k <y_k(x), w_k>`` along a unit line ``u`` is taken as
``sum_k <y_k(x + t u) - y_k(x - t u), w_k> / 2t``, the outputs differenced
element by element before the sum: outputs the perturbation leaves unchanged
add nothing, so a large output elsewhere (``erfcx(-4) ~ 1e7``) does not bury a
small change in rounding. The rounding that remains is measured from the
outputs that did change (``noise``). A disagreement is then re-examined at
smaller steps and from both sides, to tell a wrong gradient from a function
that is not smooth within the step (a kink, a jump, strong curvature).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union, cast

import torch

from gradwatch.check.judging.judge import within_tolerance
from gradwatch.check.numerics.differences import machine_eps

#: Rounding of one output element, in units of its dtype's eps times its magnitude (allows a few ulps
#: accumulated inside the function).
NOISE_FACTOR = 16.0
#: Smaller steps tried, as fractions of ``eps``, before a disagreement counts.
REFINE_SCALES = (0.1, 0.01, 0.001)


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
class Slopes:
    """Slopes along a line at one step: analytic, central numeric, its rounding noise, one-sided numeric."""

    analytic: float
    numeric: float
    noise: float
    right: float
    left: float
    #: Some output was NaN on both sides: the function is undefined there, whether or not it depends on this line.
    undefined: bool = False

    def finite(self) -> bool:
        return all(math.isfinite(v) for v in (self.analytic, self.numeric, self.noise, self.right, self.left))


@dataclass
class LineVerdict:
    """Outcome on one line: the values at ``eps``, whether it passes, and whether it was excluded (a kink)."""

    analytic: float
    numeric: float
    noise: float
    ok: bool
    excluded: bool = False


class OutputProbe:
    """Evaluates ``outputs()`` around the current point and judges lines with Chainer's ``atol``/``rtol``.

    Args:
        outputs: Evaluates the function at the current inputs (which the probe perturbs in place).
        weights: One weight array per output (``y_grad``; a ``None`` entry skips that output),
            or None for a function returning one scalar.
        out_dtypes: Dtypes of the outputs in the caller's precision (they set the rounding noise).

    Example:
        >>> x = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> probe = OutputProbe(lambda: (x * x,), [torch.ones(2)], [torch.float64])
        >>> line = Line(label=(1,), index=1, coordinate=True)
        >>> v = probe.judge(x.view(-1), torch.tensor([2.0, 4.0], dtype=torch.float64), line, 1e-3, 1e-5, 1e-4)
        >>> v.ok, round(v.numeric, 6)
        (True, 4.0)
    """

    def __init__(self, outputs: Callable[[], Sequence[torch.Tensor]], weights: Optional[Sequence[Optional[torch.Tensor]]],
                 out_dtypes: Sequence[torch.dtype], inputs: Sequence[torch.Tensor] = ()) -> None:
        self._outputs = outputs
        self._input_storages = {t.untyped_storage().data_ptr() for t in inputs}
        self.count = 0
        self._keep = [0] if weights is None else [k for k, w in enumerate(weights) if w is not None]
        self.y0 = self._eval()
        if weights is None:
            self._w = [torch.ones_like(self.y0[0])]
        else:
            self._w = [cast(torch.Tensor, weights[k]).detach().to(torch.float64) for k in self._keep]
        self._w = [w.reshape(-1).expand_as(y).contiguous() for w, y in zip(self._w, self.y0)]
        self._w_abs = [w.abs() for w in self._w]
        floating = [d for d in out_dtypes if d.is_floating_point]
        self.eps_out = max([machine_eps(d) for d in floating] or [machine_eps(torch.float64)])
        self.objective = float(sum(float(torch.dot(w, y)) for w, y in zip(self._w, self.y0)))

    def _eval(self) -> List[torch.Tensor]:
        self.count += 1
        ys: Any = self._outputs()
        if not isinstance(ys, (tuple, list)):
            ys = (ys,)
        return [self._own(ys[k].detach()) for k in self._keep]

    def _own(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` as a flat float64 tensor that perturbing the inputs cannot change (copied only when it could)."""
        if y._is_zerotensor():  # an efficient zero tensor (a backward that is 0 by definition, e.g. sgn's): no storage
            return torch.zeros(y.numel(), dtype=torch.float64, device=y.device)
        if y.dtype != torch.float64 or y._is_view() or y.untyped_storage().data_ptr() in self._input_storages:
            y = y.to(torch.float64, copy=True)
        return y.reshape(-1)

    def _diff(self, ya: Sequence[torch.Tensor], yb: Sequence[torch.Tensor], noise: bool = True) -> Tuple[float, float, bool]:
        """``sum <ya - yb, w>`` over the elements that differ, ``sum |w| (|ya| + |yb|)`` over them, and
        whether an output is NaN on both sides (left out of the sums: it says nothing about a slope)."""
        total, magnitude, undefined = 0.0, 0.0, False
        for w, w_abs, a, b in zip(self._w, self._w_abs, ya, yb):
            d = a - b
            part = float(torch.dot(w, d))
            if math.isfinite(part):  # the common case: unchanged elements add exact zeros
                total += part
                if noise:
                    magnitude += float(torch.dot(w_abs, (a.abs() + b.abs()) * (d != 0)))
                continue
            both_nan = torch.isnan(a) & torch.isnan(b)
            changed = (a != b) & ~both_nan  # equal infinities are unchanged too
            undefined = undefined or bool(both_nan.any())
            total += float(torch.where(changed, w * d, 0.0).sum())
            magnitude += float(torch.where(changed, w_abs * (a.abs() + b.abs()), 0.0).sum())
        return total, magnitude, undefined

    def _perturbed(self, flat: torch.Tensor, line: Line, t: float):
        """Outputs at ``x + t u`` and ``x - t u``, with the displacements actually stored (rounded to the dtype)."""
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
            return yp, ym, torch.tensor([fp], dtype=torch.float64), torch.tensor([fm], dtype=torch.float64)
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

    def slopes(self, flat: torch.Tensor, g: torch.Tensor, line: Line, t: float, one_sided: bool = False,
               noise: bool = True) -> Slopes:
        """Analytic and numeric slopes along ``line`` at step ``t``; ``flat`` is written and restored exactly.

        The one-sided slopes are computed only when asked for, the noise only unless told not to
        (``nan`` otherwise): each costs passes over the outputs.
        """
        with torch.no_grad():
            yp, ym, dp, dm = self._perturbed(flat, line, t)
        central, magnitude, undefined = self._diff(yp, ym, noise)
        # The steps actually taken (rounded to the array's dtype), not the nominal ones.
        if line.coordinate:
            analytic = float(g[line.index]) * float(dp[0] - dm[0]) / (2 * t)
            tp, tm = float(dp[0]), -float(dm[0])
        else:
            analytic = float(torch.dot(g[line.index], dp - dm)) / (2 * t)
            unit = cast(torch.Tensor, line.unit)
            tp, tm = float(torch.dot(dp, unit)), -float(torch.dot(dm, unit))
        right = left = math.nan
        if one_sided:
            right = self._diff(yp, self.y0, False)[0] / tp if tp > 0 else math.nan
            left = self._diff(self.y0, ym, False)[0] / tm if tm > 0 else math.nan
        return Slopes(
            analytic=analytic,
            numeric=central / (2 * t),
            noise=NOISE_FACTOR * self.eps_out * magnitude / (2 * t) if noise else math.nan,
            right=right,
            left=left,
            undefined=undefined,
        )

    def judge(self, flat: torch.Tensor, g: torch.Tensor, line: Line, eps: float, atol: float, rtol: float,
              noise: bool = False) -> LineVerdict:
        """Pass when ``|numeric - analytic| <= atol + rtol * |analytic|``, or when the line is not smooth at ``eps``.

        The rounding noise is measured on a failing line, or when ``noise`` asks for it.
        """
        base = self.slopes(flat, g, line, eps, noise=noise)
        a, n = base.analytic, base.numeric
        if not (math.isfinite(a) and math.isfinite(n)):
            # Undefined here on both sides (numpy's equal_nan, as Chainer): a non-finite analytic slope
            # where the numeric one is non-finite too, or where the function has NaN outputs.
            both = not math.isfinite(a) and (not math.isfinite(n) or base.undefined)
            return LineVerdict(a, n, base.noise, ok=both, excluded=both)
        if within_tolerance(a, n, atol, rtol):
            return LineVerdict(a, n, base.noise, ok=True)
        base = self.slopes(flat, g, line, eps, one_sided=True)  # the same point again, with noise and both sides
        if self._not_smooth(flat, g, line, base, eps, atol, rtol):
            return LineVerdict(a, n, base.noise, ok=True, excluded=True)
        return LineVerdict(a, n, base.noise, ok=False)

    def _not_smooth(self, flat: torch.Tensor, g: torch.Tensor, line: Line, base: Slopes, eps: float,
                    atol: float, rtol: float) -> bool:
        """True when the disagreement at ``eps`` comes from the function, not from the gradient.

        (1) At a smaller step the slopes agree: the function was not smooth
        within ``eps`` (strong curvature, or a kink or jump crossed), and the
        analytic value is right here. Steps whose rounding noise exceeds half
        the disagreement are not used (they cannot tell). (2) Otherwise the
        one-sided slopes ``(J(x+t)-J(x))/t`` and ``(J(x)-J(x-t))/t`` are
        compared at the smallest usable step: for a smooth function their gap
        shrinks with ``t``; if it does not (a kink) or grows (a jump), ``x``
        sits on one. On a coordinate the analytic value must then lie between
        the one-sided slopes (extrapolated to ``t -> 0`` so curvature does not
        count): a valid subgradient. On a direction it is excluded.
        """
        gap_at_eps = abs(base.numeric - base.analytic)
        seen: List[Tuple[float, Slopes]] = []
        for scale in REFINE_SCALES:
            t = eps * scale
            s = self.slopes(flat, g, line, t, one_sided=True)
            if not s.finite() or s.noise > 0.5 * gap_at_eps:
                break
            if within_tolerance(s.analytic, s.numeric, atol, rtol, noise=s.noise):
                return True
            seen.append((t, s))
        if not seen or not math.isfinite(base.right - base.left):
            return False
        t, s = seen[-1]
        gap, gap0 = s.right - s.left, base.right - base.left
        if not (abs(gap) > 4 * s.noise and abs(gap) > 0.3 * abs(gap0)):
            return False
        if not line.coordinate:
            return True
        right, left, tol = s.right, s.left, 2 * s.noise
        if len(seen) >= 2:
            # One-sided slopes of a function smooth on each side are linear in t: extrapolate to t = 0.
            t1, s1 = seen[-2]
            right = right - (s1.right - right) * t / (t1 - t)
            left = left - (s1.left - left) * t / (t1 - t)
            tol = 2 * s.noise + 2 * s1.noise * t / (t1 - t)
        tol += atol + rtol * abs(s.analytic)
        return min(left, right) - tol <= s.analytic <= max(left, right) + tol
