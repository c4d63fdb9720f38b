"""Surrogate gradients by design: modules whose backward is deliberately not their derivative.

A straight-through quantizer (``z + (zq - z).detach()``), torch's fake quantization, a spike with a
surrogate derivative: the gradient training uses is by design not the derivative of the forward, so
finite differences of the objective through such a module never agree with it. The check cuts the
objective at each surrogate module instead. With ``x`` the module's inputs and ``y`` its outputs at the
point, and ``g`` the gradient its own backward gave ``x`` there (captured during the analytic pass),
the numeric side differences

    J'(θ) = J(θ, with the module's outputs held at y) + <g, x(θ)>

whose exact gradient at the point is the one autograd computes through the surrogate's backward: what
is upstream of the module is checked against ``g`` (as the module form checks a unit with ``y_grad``),
what is downstream on the module's held output, and that output itself is checked as one more tensor,
``"<module>:output"``, against the gradient training gives it (a wrong backward downstream shows there,
and would otherwise pass into ``g`` unseen). The surrogate itself is not compared (its own parameters
are left out of the check, named "surrogate, by design").

torch's fake-quantize modules (``torch.ao.quantization.FakeQuantizeBase``: their straight-through
rule is documented) are surrogates without a declaration.

Example:
    >>> class Sign(nn.Module):
    ...     def forward(self, x):  # straight-through sign
    ...         return x + (torch.sign(x) - x).detach()
    >>> model = nn.Sequential(nn.Linear(3, 3), Sign(), nn.Linear(3, 1))
    >>> sorted(find_surrogates(model, ["1"]))
    ['1']
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

SurrogateSpec = Optional[Sequence[Union[str, type]]]


def _builtin(module: nn.Module) -> bool:
    """torch's fake quantization: a documented straight-through estimator."""
    try:
        from torch.ao.quantization import FakeQuantizeBase
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return isinstance(module, FakeQuantizeBase)


def find_surrogates(model: nn.Module, spec: SurrogateSpec = None) -> Dict[str, nn.Module]:
    """Module name -> module for the declared surrogates (names, classes or class names) and torch's
    fake quantizers; the outermost where one holds another.

    Raises:
        ValueError: A declared name or class that matches no module of ``model``.
    """
    spec = list(spec or ())
    found: Dict[str, nn.Module] = {}
    matched = [False] * len(spec)
    for name, module in model.named_modules():
        hit = _builtin(module)
        for i, s in enumerate(spec):
            if (isinstance(s, str) and (s == name or s == type(module).__name__)) or (
                    isinstance(s, type) and isinstance(module, s)):
                matched[i] = hit = True
        if hit and name and not any(name.startswith(outer + ".") for outer in found):
            found[name] = module
    missing = [s for s, ok in zip(spec, matched) if not ok]
    if missing:
        names = [m if isinstance(m, str) else m.__name__ for m in missing]
        raise ValueError(f"surrogates: {names} match no module of {type(model).__name__} (give module names as "
                         f"model.named_modules() spells them, module classes, or class names)")
    return found


def inside(name: str, surrogates: Dict[str, nn.Module]) -> bool:
    """True when module ``name`` is a surrogate or sits inside one (the module form does not check it).

    Example:
        >>> inside("quant.proj", {"quant": nn.Identity()}), inside("quantize", {"quant": nn.Identity()})
        (True, False)
    """
    return any(name == s or name.startswith(s + ".") for s in surrogates)


def surrogate_note(surrogates: Dict[str, nn.Module], form: str) -> str:
    """The report's note naming the surrogates and what the check does about them."""
    owned = surrogate_parameters(surrogates)
    how = ("the objective is cut there: what is upstream is checked against the gradient their backward gives, "
           "their outputs against the gradient training gives them" if form == "objective" else
           "not checked as units: the units around them are, on the inputs the live forward gives them")
    return (f"surrogate, by design: {', '.join(surrogates)} ({how})"
            + (f"; their parameters {', '.join(owned)} not checked by the backward part (surrogate, by design)"
               if owned else ""))


def surrogate_parameters(surrogates: Dict[str, nn.Module]) -> List[str]:
    """Names of the parameters that belong to a surrogate module (their gradient is the surrogate's)."""
    return [f"{name}.{p}" for name, module in surrogates.items() for p, _ in module.named_parameters()]


def _floating(args: Sequence[Any]) -> List[Tuple[int, torch.Tensor]]:
    return [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())]


class SurrogateCut:
    """The cut of the objective at each surrogate module (see the module's docstring).

    :meth:`capturing` wraps the analytic forward (outputs and inputs recorded per call) and
    :meth:`take_gradients` follows it; :meth:`cut` wraps each numeric evaluation, and :meth:`term` is then
    ``<g, x>`` for that evaluation.
    """

    def __init__(self, surrogates: Dict[str, nn.Module]) -> None:
        self.surrogates = surrogates
        self._outputs: Dict[str, List[Any]] = {n: [] for n in surrogates}
        self._inputs: Dict[str, List[Dict[int, torch.Tensor]]] = {n: [] for n in surrogates}
        self._grads: Dict[str, List[Dict[int, torch.Tensor]]] = {n: [] for n in surrogates}
        self._output_graph: Dict[str, List[Optional[torch.Tensor]]] = {n: [] for n in surrogates}
        #: ``"<module>:output"`` -> (the held output, perturbed by the check; the gradient training gives it)
        self.outputs: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._calls: Dict[str, int] = {}
        self._term = 0.0

    @contextlib.contextmanager
    def _hooked(self, make: Any) -> Iterator[None]:
        """Each surrogate module with the forward hook ``make(name)`` for the duration."""
        handles = [module.register_forward_hook(make(name)) for name, module in self.surrogates.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Record each call's outputs and inputs (then :meth:`take_gradients` with the analytic total)."""
        with self._hooked(self._capture):
            yield

    def _capture(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, out: Any) -> Any:
            self._inputs[name].append({i: x for i, x in _floating(args) if x.requires_grad})
            self._outputs[name].append(_detached(out))
            first = _first_floating(out)
            if first is None or not first.requires_grad:
                self._output_graph[name].append(None)
                return None
            self._output_graph[name].append(first)
            # The rest of the forward gets a copy: an in-place op after the module changes the copy, and the
            # gradient taken at ``first`` stays the gradient of the module's own output.
            return _with_first(out, first.clone())
        hook._gradwatch_hook = True  # type: ignore[attr-defined]
        return hook

    def take_gradients(self, total: torch.Tensor) -> None:
        """The gradient of the analytic ``total`` by each surrogate call's inputs (one more backward, the graph
        kept for the parameters' gradients)."""
        keys = [(n, k, i) for n, calls in self._inputs.items() for k, xs in enumerate(calls) for i in xs]
        tensors = [self._inputs[n][k][i] for n, k, i in keys]
        outs = [(n, k, y) for n, ys in self._output_graph.items() for k, y in enumerate(ys) if y is not None]
        wanted = tensors + [y for _, _, y in outs]
        got = (torch.autograd.grad(total, wanted, retain_graph=True, allow_unused=True)
               if wanted and total.requires_grad else [None] * len(wanted))
        self._grads = {n: [{} for _ in calls] for n, calls in self._inputs.items()}
        for (n, k, i), g in zip(keys, got):
            if g is not None:
                self._grads[n][k][i] = g.detach()
        self.outputs = {}
        for (n, k, _), g in zip(outs, got[len(tensors):]):
            held = _first_floating(self._outputs[n][k])
            if held is not None:
                self.outputs[f"{n}:output" if k == 0 else f"{n}:output[{k}]"] = (
                    held, torch.zeros_like(held) if g is None else g.detach())
        self._inputs = {n: [] for n in self.surrogates}  # the graph's tensors: not kept beyond the analytic pass
        self._output_graph = {n: [] for n in self.surrogates}

    @contextlib.contextmanager
    def cut(self) -> Iterator[None]:
        """Hold each call's outputs at the point's and accumulate ``<g, x>`` (read it with :meth:`term`)."""
        self._calls = {n: 0 for n in self.surrogates}
        self._term = 0.0
        with self._hooked(self._hold):
            yield

    def _hold(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, out: Any) -> Any:
            k = self._calls[name]
            self._calls[name] = k + 1
            if k >= len(self._outputs[name]):
                raise RuntimeError(f"surrogate module {name!r} was called more often in a check evaluation than in "
                                   f"the analytic pass ({len(self._outputs[name])} calls)")
            grads = self._grads[name][k]
            for i, x in _floating(args):
                g = grads.get(i)
                if g is not None:
                    self._term += float(torch.real(torch.sum(torch.conj(g.to(x.dtype)) * x))) if x.is_complex() \
                        else float(torch.sum(g.to(x.dtype) * x))
            return _detached(self._outputs[name][k])  # a fresh copy: an in-place op downstream cannot change it
        hook._gradwatch_hook = True  # type: ignore[attr-defined]
        return hook

    def term(self) -> float:
        """``<g, x>`` summed over the surrogate calls of the last evaluation under :meth:`cut`."""
        return self._term


def _first_floating(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() or out.is_complex() else None
    if isinstance(out, (tuple, list)):
        return next((t for t in map(_first_floating, out) if t is not None), None)
    return None


def _with_first(out: Any, new: torch.Tensor) -> Any:
    """``out`` with its first floating tensor (:func:`_first_floating`) replaced by ``new``."""
    if isinstance(out, torch.Tensor):
        return new
    if isinstance(out, (tuple, list)):
        items, done = [], False
        for o in out:
            if not done and _first_floating(o) is not None:
                o, done = _with_first(o, new), True
            items.append(o)
        return type(out)(items) if isinstance(out, list) else tuple(items)
    return out


def _detached(out: Any) -> Any:
    """The outputs held during a check: copies of their own (the check perturbs the first floating one)."""
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, tuple):
        return tuple(_detached(o) for o in out)
    if isinstance(out, list):
        return [_detached(o) for o in out]
    if isinstance(out, dict):
        return {k: _detached(v) for k, v in out.items()}
    return out
