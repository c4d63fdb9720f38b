"""The term that is weighted wrong, named: a fit of training's gradient on the step's terms, micro-batch by micro-batch.

The step's objective weighs micro-batch ``i`` by ``u_i`` (its share of the step's items,
:mod:`gradwatch.check.replay.items`), and every term of its loss with it: the data loss, each loss the model's output
reports beside ``loss`` (a router's ``aux_loss``, inside the model's loss times a coefficient) and each regularizer.
Training can weigh one term otherwise: transformers' Trainer divides the data loss by the step's token count but
adds an MoE model's aux loss whole on each micro-batch, so the aux loss is summed over the ``k`` micro-batches where
the data loss is averaged. :func:`fit_terms` fits training's gradient, sketched
(:mod:`gradwatch.check.numerics.sketch`), as

``live ~ sum_i x_i grad L_i + sum_{i,a} y_ia grad a_i + sum_r z_r grad R_r``

(``L_i``: micro-batch ``i``'s objective, loss and regularizers; ``a_i``: an output's loss as it reports it;
``R_r``: a regularizer), reads each term's weight in each micro-batch off the fit (the data loss ``x_i``; an output's
loss ``x_i + y_ia / c_a`` where the model's loss holds it times ``c_a``; a regularizer ``sum x + z_r``), and names the
terms whose weights depart from the objective's, with the factor. Pure math and words: no model, no I/O.

Example:
    >>> g = torch.eye(8, dtype=torch.float64)  # sketches: 2 micro-batches' objectives, then their aux losses
    >>> rows = TermRows(g[:2], {"aux_loss": g[2:4]}, {})
    >>> u = [0.25, 0.75]  # the step's objective: each micro-batch's share of the step's tokens
    >>> live = 0.25 * g[0] + 0.75 * g[1] + 0.5 * (1 - 0.25) * g[2] + 0.5 * (1 - 0.75) * g[3]  # aux summed, times 0.5
    >>> found = fit_terms(rows, live, u, {"aux_loss": ("router_aux_loss_coef", 0.5)})
    >>> found.text.split(" (")[0], round(found.terms[0].factor, 6)
    ("the router's aux loss", 2.0)
    >>> found.text.split(": it")[0].split(") ")[1]
    'is summed over the 2 micro-batches where the data loss is averaged'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from gradwatch.check.replay.cut import EXPLAINED

#: A term's weight within this of the objective's (relative to the largest micro-batch weight) is the objective's.
WEIGHT_TOLERANCE = 2e-2
#: Columns whose smallest singular value (unit columns) is under this times the largest cannot be told apart.
CONDITION = 1e-6
DATA = "the data loss"


@dataclass
class TermRows:
    """Sketches of one step's gradients, term by term (all of ``m`` coordinates).

    Attributes:
        loss: ``(k, m)``: each micro-batch's own objective (``loss_fn`` and the regularizers), unweighted.
        outputs: ``{name: (k, m)}``: each loss the model's output reports beside ``loss``, per micro-batch.
        regularizers: ``{name: (m,)}``: each regularizer's gradient (the same in every micro-batch).
    """

    loss: torch.Tensor
    outputs: Dict[str, torch.Tensor] = field(default_factory=dict)
    regularizers: Dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class TermWeight:
    """One term weighted otherwise by training than by the step's objective.

    Attributes:
        name: ``"loss"`` (the data loss), an output's field (``"aux_loss"``) or a regularizer's name.
        label: The term for people (``"the router's aux loss"``).
        factor: Training's weight of the term over the objective's, over the step (``inf``: the objective has none).
        weights: Training's weight of the term in each micro-batch (a regularizer: one for the step).
        expected: The objective's.
        words: How it is weighted (``"is summed over the 2 micro-batches where the data loss is averaged"``).
    """

    name: str
    label: str
    factor: float
    weights: List[float]
    expected: List[float]
    words: str


@dataclass
class TermFit:
    """What :func:`fit_terms` found: the terms weighted otherwise, the words, and how well the fit explains."""

    terms: List[TermWeight]
    text: str
    misfit: float
    coordinates: int
    #: Training's gradient minus the objective's, as the fit's coefficients: ``{"loss": [x_i - u_i], name: [y_ia],
    #: "reg:" + name: [z_r]}`` (the correction a replay computes in full).
    delta: Dict[str, List[float]] = field(default_factory=dict)

    def record(self) -> Dict[str, object]:
        """The finding as plain data (a check record's, an alert's)."""
        return {"terms": [{"name": t.name, "factor": t.factor, "weights": t.weights, "expected": t.expected}
                          for t in self.terms], "misfit": self.misfit, "coordinates": self.coordinates}


def _num(x: float) -> str:
    return f"{x:.3g}"


def _series(values: Sequence[str]) -> str:
    values = list(values)
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " and " + values[-1]


def _close(a: Sequence[float], b: Sequence[float], scale: float) -> bool:
    return all(abs(x - y) <= WEIGHT_TOLERANCE * scale for x, y in zip(a, b))


def _solve(columns: List[torch.Tensor], live: torch.Tensor) -> Optional[Tuple[torch.Tensor, float]]:
    """Least squares ``live ~ B x`` over unit-scaled columns: ``(x, misfit)``, None where columns cannot be told apart."""
    basis = torch.stack(columns, 1)
    norms = torch.linalg.vector_norm(basis, dim=0)
    if not bool(torch.isfinite(basis).all()) or bool((norms == 0).any()):  # a term with no gradient: nothing to tell
        return None
    unit = basis / norms
    sv = torch.linalg.svdvals(unit)
    if basis.shape[0] < 2 * basis.shape[1] or float(sv[-1]) < CONDITION * float(sv[0]):
        return None
    x = torch.linalg.lstsq(unit, live.unsqueeze(1)).solution.squeeze(1) / norms
    misfit = float(torch.linalg.vector_norm(live - basis @ x)) / float(torch.linalg.vector_norm(live))
    return x, misfit


def _label(name: str, source: Optional[str]) -> str:
    """``the router's aux loss`` for ``aux_loss`` under ``router_aux_loss_coef``; else ``the model's <name>``."""
    if "router" in name or (source is not None and "router" in source):
        words = [w for w in name.split("_") if w not in ("router", "loss")]
        return f"the router's {' '.join(words)} loss" if words else "the router's loss"
    return f"the model's {name}"


def _output_label(name: str, coef: Optional[Tuple[str, float]], in_loss: bool) -> str:
    label = _label(name, coef[0] if coef else None)
    said = [] if name in label else [f"the output's {name}"]
    if coef is not None and in_loss:
        said.append(f"times {coef[0]} = {coef[1]:g} in the model's loss")
    return f"{label} ({', '.join(said)})" if said else label


def _words(weights: Sequence[float], expected: Sequence[float], data_ok: bool, k: int) -> Tuple[float, str]:
    """``(factor, how)`` of one term's weights against the objective's."""
    total, want = sum(weights), sum(expected)
    factor = total / want if want else float("inf")
    top = max([abs(e) for e in expected] + [1e-300])
    where = " where the data loss is averaged" if data_ok else ""
    if not want:
        return factor, "is in training's loss but not in loss_fn's: the step's objective has none of it"
    if abs(factor) <= WEIGHT_TOLERANCE:
        return 0.0, "is in the step's objective but not in training's gradient: it weighs 0x"
    if k > 1 and all(abs(w - 1.0) <= WEIGHT_TOLERANCE for w in weights) and not _close(weights, expected, top):
        return factor, f"is summed over the {k} micro-batches{where}: it weighs {_num(factor)}x"
    if k > 1 and all(abs(w - 1.0 / k) <= WEIGHT_TOLERANCE / k for w in weights):
        return factor, (f"is averaged over the {k} micro-batches (1/{k} each){where} by their items "
                        f"({_series([_num(e) for e in expected])}): it weighs {_num(factor)}x over the step")
    if _close(weights, [factor * e for e in expected], top * max(1.0, abs(factor))):
        return factor, f"weighs {_num(factor)}x what the step's objective gives it"
    return factor, (f"weighs {_series([_num(w) for w in weights])} in the {k} micro-batches where the step's objective "
                    f"gives it {_series([_num(e) for e in expected])}: {_num(factor)}x over the step")


def _snapped(weights: Sequence[float], expected: Sequence[float]) -> List[float]:
    """A term's fitted weights as the pattern its words name: the objective's, a whole multiple of them, 1 each
    (summed) or ``1/k`` each (averaged), exactly (each weight within :data:`WEIGHT_TOLERANCE` of it); else as fitted.
    The correction replayed from them is then exact up to rounding, not up to the least squares' few parts in 1e5
    (which, on a tensor the term moves a lot, read as a drift of its own)."""
    k, want = len(weights), sum(expected)
    times = round(sum(weights) / want) if want else 0
    patterns = [list(expected)] + ([[times * e for e in expected]] if times > 1 else []) + [[1.0] * k, [1.0 / k] * k]

    def off(pattern: Sequence[float]) -> float:  # the worst weight's distance from the pattern, relative
        return max((abs(w - p) / max(abs(p), 1e-300) for w, p in zip(weights, pattern)), default=0.0)

    # The nearest pattern within the tolerance: micro-batches of nearly equal items make "twice the objective's" and
    # "1 each" both near, and the farther one, replayed, leaves a residual of its own (a router judged WRONG).
    near = [p for p in patterns if off(p) <= WEIGHT_TOLERANCE]
    if near:
        return [float(p) for p in min(near, key=off)]
    return [float(w) for w in weights]


def fit_terms(rows: TermRows, live: torch.Tensor, weights: Sequence[float],
              coefficients: Mapping[str, Optional[Tuple[str, float]]], in_loss: bool = True) -> Optional[TermFit]:
    """Name the terms training weighs otherwise than the step's objective, when a fit on them explains its gradient.

    Args:
        rows: The step's gradients term by term, sketched (:class:`TermRows`).
        live: Training's ``.grad``, sketched alike.
        weights: The objective's weight of each micro-batch (``u_i``).
        coefficients: ``{output field: (attribute, value)}``: what the model's loss multiplies each output's loss by
            (None: not known).
        in_loss: ``loss_fn``'s value is the model's ``loss`` (which holds each output's loss times its coefficient).

    Returns:
        A :class:`TermFit`, or None when no fit explains training's gradient to within
        :data:`~gradwatch.check.replay.cut.EXPLAINED`, when every term is weighted as the objective weighs it, or when
        all are off by one factor (a scaled loss: the judge's own diagnosis says it).
    """
    k = rows.loss.shape[0]
    live = live.to(torch.float64)
    if k == 0 or float(torch.linalg.vector_norm(live)) == 0.0:
        return None
    columns = [rows.loss[i].to(torch.float64) for i in range(k)]
    outputs = {n: r.to(torch.float64) for n, r in rows.outputs.items() if float(torch.linalg.vector_norm(r)) > 0}
    regs = {n: g.to(torch.float64) for n, g in rows.regularizers.items() if float(torch.linalg.vector_norm(g)) > 0}
    for r in outputs.values():
        columns.extend(r[i] for i in range(k))
    columns.extend(regs.values())
    solved = _solve(columns, live)
    if solved is None or solved[1] > EXPLAINED:
        return None
    x, misfit = solved
    u = [float(w) for w in weights]
    xs = [float(v) for v in x[:k]]
    ys = {n: [float(v) for v in x[k * (j + 1):k * (j + 2)]] for j, n in enumerate(outputs)}
    zs = {n: float(x[k * (len(outputs) + 1) + j]) for j, n in enumerate(regs)}
    top = max(abs(w) for w in u)
    data_ok = _close(xs, u, top)
    # Each term's weights in each micro-batch, against the objective's: (name, label, weights, expected)
    terms: List[Tuple[str, str, List[float], List[float]]] = [("loss", DATA, xs, u)]
    for n, y in ys.items():
        coef = coefficients.get(n)
        label = _output_label(n, coef, in_loss)
        if coef is not None and coef[1]:
            inside = xs if in_loss else [0.0] * k
            terms.append((n, label, [a + b / coef[1] for a, b in zip(inside, y)], u if in_loss else [0.0] * k))
        else:  # no coefficient: the output's loss in training beyond the objective's, as it reports it
            terms.append((n, label, y, [0.0] * k))
    for n, z in zs.items():
        terms.append((f"reg:{n}", f"the regularizer {n!r}", [sum(xs) + z], [sum(u)]))
    off = [t for t in terms if not _close(t[2], t[3], max(top, max((abs(e) for e in t[3]), default=0.0)))]
    if not off or (off[0][0] == "loss" and len(terms) == 1):
        return None  # the whole loss weighted otherwise, no term apart: explain_cut's and the judge's words say it
    scales = [sum(w) / sum(e) for _, _, w, e in terms if sum(e)]
    if len(off) == len(terms) and len(scales) == len(terms) and max(scales) - min(scales) <= WEIGHT_TOLERANCE * max(map(abs, scales)):
        return None  # every term off by one factor: a scaled loss, not a term
    found = []
    for n, label, w, e in off:
        factor, how = _words(w, e, data_ok and n != "loss", k)
        if n.startswith("reg:") and k > 1 and abs(factor - k) <= WEIGHT_TOLERANCE * k:
            where = " where the data loss is averaged" if data_ok else ""
            how = f"is added whole to each of the {k} micro-batches' losses{where}: it weighs {_num(factor)}x"
        if e == [0.0] * len(e) and n in ys and coefficients.get(n) is None:
            how = (f"is in training's gradient beyond the step's objective, at {_series([_num(v) for v in w])} times "
                   f"its gradient in the {k} micro-batch{'es' if k > 1 else ''} (no coefficient of it found in the "
                   "model or its config to weigh it by)")
        found.append(TermWeight(n, label, factor, w, e, how))
    text = "; ".join(f"{t.label} {t.words}" for t in found)
    return TermFit(found, text, misfit, int(live.numel()), _delta(terms, u, coefficients, in_loss, ys, zs))


def _delta(terms: Sequence[Tuple[str, str, List[float], List[float]]], u: Sequence[float],
           coefficients: Mapping[str, Optional[Tuple[str, float]]], in_loss: bool, ys: Mapping[str, List[float]],
           zs: Mapping[str, float]) -> Dict[str, List[float]]:
    """:attr:`TermFit.delta` from each term's weights snapped to the pattern they name (:func:`_snapped`); the
    coefficients of a term without one (an output's loss of unknown coefficient) as fitted."""
    k = len(u)
    weights = {n: _snapped(w, e) for n, _, w, e in terms}
    xs = weights["loss"]
    delta: Dict[str, List[float]] = {"loss": [a - b for a, b in zip(xs, u)]}
    for n, y in ys.items():
        coef = coefficients.get(n)
        if coef is not None and coef[1]:
            inside = xs if in_loss else [0.0] * k
            delta[n] = [(w - a) * coef[1] for w, a in zip(weights[n], inside)]
        else:
            delta[n] = list(y)
    for n in zs:
        delta[f"reg:{n}"] = [weights[f"reg:{n}"][0] - sum(xs)]
    return delta


__all__ = ["DATA", "TermFit", "TermRows", "TermWeight", "fit_terms"]
