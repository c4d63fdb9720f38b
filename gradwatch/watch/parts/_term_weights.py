"""The training part's diagnosis of a term weighted wrong: found where the verdict failed, said once for the run.

Where training's ``.grad`` departs from the step's objective and neither a cut of the step
(:mod:`gradwatch.check.replay.cut`) nor a partial window (:mod:`gradwatch.watch.parts._accumulation`) explains it,
:class:`TermWeights` replays the step again term by term (each micro-batch's objective, each loss the model's output
reports beside ``loss``, each regularizer; sketched, :mod:`gradwatch.check.numerics.sketch`) and fits training's
gradient on them (:func:`gradwatch.check.replay.term_fit.fit_terms`). Where one term is weighted otherwise (an MoE
model's aux loss summed over the micro-batches where the data loss is averaged, as transformers' Trainer does at
``gradient_accumulation_steps > 1``), the step's gradient with that weighting is replayed in full and each failing
tensor judged again against it: the tensors it explains take that verdict, with the finding as their diagnosis, and
one ``term_weight`` alert names the term and its weight for the run, with the count of tensors and the first ones;
a tensor wrong beyond it keeps its own verdict and alert. Only a failed check pays for it (two more replays).

Example:
    >>> terms = TermWeights()
    >>> terms.alerts(3), terms.state_dict()
    ([], {'said': []})
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from gradwatch.bands import Verdict
from gradwatch.check.judging.report import TrainingCheck
from gradwatch.check.numerics.sketch import Sketch
from gradwatch.check.objective.output_terms import loss_coefficient, output_loss, output_losses
from gradwatch.check.objective.terms import Objective
from gradwatch.check.replay.reference import Each, Evaluate, GradOf, Replay
from gradwatch.check.replay.rows import Differentiated
from gradwatch.check.replay.term_fit import TermFit, TermRows, fit_terms
from gradwatch.watch.trend import WHOLE_CHECK, Alert

#: ``again(evaluate, grad_of, weights, each)``: the step replayed as the training part replays it, another objective.
Again = Callable[[Evaluate, GradOf, Sequence[float], Optional[Each]], Replay]
#: ``grads(value, retain)``: ``{name: value's gradient}`` of the judged tensors (a weight's rows where it was judged by
#: rows: :class:`~gradwatch.check.replay.rows.Differentiated`); without ``retain``, the graph freed.
Grads = Callable[[torch.Tensor, bool], Dict[str, torch.Tensor]]
#: Failing tensors named in the alert, at most.
NAMED = 3


class _Outputs:
    """A forward hook (gradwatch's own: it runs inside a check) that keeps the model's last output."""

    _gradwatch_hook = True

    def __init__(self) -> None:
        self.output: Any = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.output = output


@dataclass
class Found:
    """A check's finding: the fit, the tensors it explains, and the worst verdict they had."""

    fit: TermFit
    explained: List[str]
    worst: TrainingCheck
    hint: str

    def key(self) -> str:
        """What makes a finding the same cause at another check: each term, how it is weighted, and the factor."""
        return "; ".join(f"{t.name}:{t.factor:.3g}" for t in self.fit.terms)


class _Terms:
    """One replay's sketches of each micro-batch's terms (its ``evaluate``, ``grad_of`` and ``each``)."""

    def __init__(self, objective: Objective, hook: _Outputs, sketch: Sketch, grads: Grads) -> None:
        self.objective, self.hook, self.sketch, self.grads = objective, hook, sketch, grads
        self.rows: Dict[int, Dict[str, torch.Tensor]] = {}
        self.values: Dict[int, Tuple[float, Optional[float]]] = {}  # loss_fn's value and the output's loss
        self._outputs: Dict[str, torch.Tensor] = {}
        self._loss: Tuple[float, Optional[float]] = (math.nan, None)

    def evaluate(self, model: nn.Module, batch: Any) -> torch.Tensor:
        self.hook.output = None
        loss = self.objective.loss(model, batch)
        self._outputs = output_losses(self.hook.output)
        said = output_loss(self.hook.output)
        self._loss = (float(loss.detach()), None if said is None else float(said.detach()))
        return loss + sum(self.objective.regularizer_terms(model).values(), torch.zeros((), dtype=loss.dtype))

    def grad_of(self, total: torch.Tensor, batch: Any) -> Dict[str, torch.Tensor]:
        # The outputs' losses first, keeping the graph (an MoE's aux loss reaches no logits: a small backward), the
        # objective last, freeing its activations as it goes, as training's backward does: kept through it, the
        # logits of a big vocabulary and their gradient raised the check's peak over training's.
        out = {name: self._sketched(value, retain=True) for name, value in self._outputs.items()}
        return {"": self._sketched(total, retain=False), **out}

    def each(self, i: int, grads: Dict[str, torch.Tensor], weight: float) -> None:
        self.rows[i] = {n: g.clone() for n, g in grads.items()}
        self.values[i] = self._loss

    def _sketched(self, value: torch.Tensor, retain: bool) -> torch.Tensor:
        return self.sketch(self.grads(value, retain))


class TermWeights:
    """The training part's term-weight diagnosis (module docstring): run where its verdict failed, alerted once.

    Example:
        See the module's example.
    """

    def __init__(self) -> None:
        #: The causes already alerted (:meth:`Found.key`), for the run.
        self.said: List[str] = []
        #: This check's finding (None: none), until :meth:`alerts` says it.
        self.found: Optional[Found] = None

    def state_dict(self) -> Dict[str, Any]:
        return {"said": list(self.said)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.said = [str(k) for k in state.get("said", [])]

    def diagnose(self, again: Again, model: nn.Module, objective: Objective, params: Dict[str, torch.Tensor],
                 weights: Sequence[float], training: Dict[str, TrainingCheck], lives: Mapping[str, Optional[torch.Tensor]],
                 refs: Mapping[str, torch.Tensor], rejudge: Callable[[str, torch.Tensor], TrainingCheck],
                 seed: int = 0, grads: Optional[Grads] = None) -> Optional[str]:
        """Fit training's gradient on the step's terms; where a term weighted otherwise explains most failing tensors,
        judge them again against the step's gradient with that weighting (in ``training``) and return the words.

        Args:
            again: The step replayed with another objective (:data:`Again`).
            model: The module the objective is evaluated on (its output's losses are read by a forward hook).
            objective: The check's objective (``loss_fn`` and the regularizers).
            params: The watched tensors judged (their gradients are fitted and corrected): whole, or the rows judged.
            weights: The step objective's weight of each micro-batch.
            training: The training verdicts; the failing ones it explains are replaced.
            lives: ``{name: training's gradient}``; ``refs``: ``{name: the step objective's gradient}``.
            rejudge: ``rejudge(name, reference)``: the tensor judged against another reference gradient.
            seed: Draws the sketch's coordinates.
            grads: ``params``' gradients of a value (default: of each tensor, whole).
        """
        failing = [n for n, tc in training.items() if tc.failed and n in params]
        if not failing or not params:
            return None
        grads = grads or Differentiated(params)
        fit = self._fit(again, model, objective, params, weights, lives, seed, grads)
        if fit is None:
            return None
        delta = self._correction(again, model, objective, params, fit, grads)
        if delta is None:
            return None
        judged = {n: rejudge(n, refs[n] + delta[n].to(refs[n].dtype)) for n in failing}
        explained = [n for n in failing if not judged[n].failed]
        if 2 * len(explained) <= len(failing):
            return None  # the weighting explains too few: the tensors are wrong each in its own way
        worst = max((training[n] for n in explained), key=lambda tc: (tc.verdict.rank if tc.verdict else -1,
                                                                      tc.judged_rel_diff))
        text = f"{fit.text} (training's .grad is the step objective's gradient with that weighting)"
        # The weighting moves passing tensors too, less: judged against the objective they sit above rounding (an
        # ACCEPTABLE 8e-5 of a q_proj two layers before the router), a drift of their own at the next check that
        # fails. Each judged closer with the weighting takes that verdict too.
        closer = [n for n, tc in training.items() if n in params and n not in judged and tc.verdict is not None
                  and tc.judged_rel_diff > 0]
        judged.update({n: rejudge(n, refs[n] + delta[n].to(refs[n].dtype)) for n in closer})
        explained += [n for n in closer if judged[n].judged_rel_diff < training[n].judged_rel_diff]
        for n in explained:
            judged[n].diagnosis = text
            training[n] = judged[n]
        self.found = Found(fit, explained, worst, _hint(model, fit))
        return text

    def _fit(self, again: Again, model: nn.Module, objective: Objective, params: Dict[str, torch.Tensor],
             weights: Sequence[float], lives: Mapping[str, Optional[torch.Tensor]], seed: int, grads: Grads
             ) -> Optional[TermFit]:
        """The step's terms sketched (a replay: each micro-batch's objective and output losses; the regularizers on the
        parameters), and the fit of training's sketched gradient on them."""
        sketch = Sketch({n: tuple(p.shape) for n, p in params.items()}, seed=seed)
        hook = _Outputs()
        terms = _Terms(objective, hook, sketch, grads)
        handle = model.register_forward_hook(hook)
        try:
            replay = again(terms.evaluate, terms.grad_of, [1.0] * len(weights), terms.each)
        finally:
            handle.remove()
        k = len(weights)
        if replay.grads is None or sorted(terms.rows) != list(range(k)):
            return None
        names = set(terms.rows[0])
        if any(set(r) != names for r in terms.rows.values()):
            return None  # the output reports other losses in other micro-batches: no common terms to fit
        regs = self._regularizers(model, objective, params, sketch)
        rows = TermRows(torch.stack([terms.rows[i][""] for i in range(k)]),
                        {n: torch.stack([terms.rows[i][n] for i in range(k)]) for n in sorted(names - {""})}, regs)
        said = [terms.values[i] for i in range(k)]
        in_loss = all(out is not None and abs(v - out) <= 1e-6 * max(abs(v), abs(out), 1e-30) for v, out in said)
        coefficients = {n: loss_coefficient(model, n) for n in rows.outputs}
        live = sketch({n: _or_zeros(lives.get(n), p) for n, p in params.items()})
        return fit_terms(rows, live, weights, coefficients, in_loss)

    @staticmethod
    def _regularizers(model: nn.Module, objective: Objective, params: Dict[str, torch.Tensor],
                      sketch: Optional[Sketch]) -> Dict[str, Any]:
        """Each regularizer's gradient (read only the parameters: the same in every micro-batch), sketched or whole."""
        out: Dict[str, Any] = {}
        plist = tuple(params.values())
        with torch.enable_grad():
            for name, value in objective.regularizer_terms(model).items():
                gs = torch.autograd.grad(value, plist, allow_unused=True) if value.requires_grad else (None,) * len(plist)
                whole = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), gs)}
                out[name] = sketch(whole) if sketch is not None else whole
        return out

    def _correction(self, again: Again, model: nn.Module, objective: Objective, params: Dict[str, torch.Tensor],
                    fit: TermFit, grads: Grads) -> Optional[Dict[str, torch.Tensor]]:
        """Training's gradient minus the objective's as the fit reads it, in full: a replay of each micro-batch's
        ``(x_i - u_i) L_i + sum_a y_ia a_i``, and each regularizer's gradient times ``z_r``."""
        hook = _Outputs()
        index: Dict[int, int] = {}
        state = {"i": 0}

        def evaluate(m: nn.Module, batch: Any) -> torch.Tensor:
            i = index.setdefault(id(batch), len(index))
            state["i"] = i
            hook.output = None
            loss = objective.loss(m, batch)
            total = loss + sum(objective.regularizer_terms(m).values(), torch.zeros((), dtype=loss.dtype))
            # A term weighted as the objective weighs it (0 here) is left out: its backward (the logits', for the data
            # loss) would only add zeros, at training's peak and beyond.
            terms = [total * fit.delta["loss"][i]] if fit.delta["loss"][i] else []
            for name, value in output_losses(hook.output).items():
                if name in fit.delta and fit.delta[name][i]:
                    terms.append(value * fit.delta[name][i])
            return sum(terms[1:], terms[0]) if terms else total * 0.0

        def grad_of(total: torch.Tensor, batch: Any) -> Dict[str, torch.Tensor]:
            return {n: g.detach() for n, g in grads(total, False).items()}

        handle = model.register_forward_hook(hook)
        try:
            replay = again(evaluate, grad_of, [1.0] * len(fit.delta["loss"]), None)
        finally:
            handle.remove()
        if replay.grads is None or len(index) != len(fit.delta["loss"]):
            return None
        delta = {n: replay.grads[n] for n in params}
        for name, whole in self._regularizers(model, objective, params, None).items():
            z = fit.delta.get(f"reg:{name}", [0.0])[0]
            for n in params:
                delta[n] = delta[n] + z * whole[n]
        return delta

    def alerts(self, step: int) -> List[Alert]:
        """This check's ``term_weight`` alert, the first time its cause is found in the run (an error where the tensors
        it explains were WRONG, else a warning)."""
        found, self.found = self.found, None
        if found is None or found.key() in self.said:
            return []
        self.said.append(found.key())
        n = len(found.explained)
        first = ", ".join(found.explained[:NAMED]) + (f" and {n - NAMED} more" if n > NAMED else "")
        worst = found.worst
        verdict = worst.verdict.value.upper() if worst.verdict is not None else "failed"
        message = (f"step {step} (training): {found.fit.text}. The live .grad of {n} tensor{'s' if n > 1 else ''} "
                   f"({first}) is the step objective's gradient with that weighting (fitted to within "
                   f"{found.fit.misfit:.1e} on {found.fit.coordinates} sketched coordinates; against the objective "
                   f"itself up to {verdict} {worst.judged_rel_diff:.1e}, at {worst.name}); they are judged against it — "
                   f"{found.hint} Said once for the run")
        severity = "error" if worst.verdict is Verdict.WRONG else "warning"
        return [Alert(int(step), WHOLE_CHECK, "term_weight", severity, float(worst.judged_rel_diff), None, message,
                      "training")]


def _or_zeros(grad: Optional[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(param) if grad is None else grad


def _hint(model: nn.Module, fit: TermFit) -> str:
    """What to do: make training weigh the term like the data loss, or loss_fn weigh it as training does."""
    summed = [t for t in fit.terms if "is summed over" in t.words and t.name != "loss"]
    if summed and type(model).__module__.startswith("transformers."):
        return ("transformers' Trainer divides the data loss by the step's item count (num_items_in_batch) and adds "
                "the model's aux loss whole on each micro-batch, so its coefficient grows with "
                "gradient_accumulation_steps. To weigh it like the data loss, scale each micro-batch's aux term by its "
                "share of the step's items (a compute_loss that returns the micro-batch's own loss, aux term included, "
                "times its items over num_items_in_batch); if training means this weighting, give loss_fn the same "
                "and the check judges against it.")
    if all(t.name.startswith("reg:") for t in fit.terms):
        return ("Add a regularizer to the step's loss once (divide it by the micro-batches where it goes into each "
                "micro-batch's loss), or, if training means this weighting, give regularizers= the weight training "
                "gives it.")
    return ("Weigh the term in training as the step's objective does (each micro-batch by its share of the step's "
            "items), or, if training means this weighting, give loss_fn the same.")


__all__ = ["Again", "Found", "Grads", "TermWeights"]
