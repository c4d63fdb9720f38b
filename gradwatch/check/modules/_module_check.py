"""One module checked alone on captured inputs: input gradient and own parameters.

For a module and its inputs ``x`` (captured on the check batch), with ``c`` a seeded random cotangent,

    J(x, θ) = <module(x; θ), c>

is compared, by the same sampled two-sided differences as the end-to-end check
(:func:`gradwatch.check.probes.engine.check_tensors`: determinism, kink guard, noise floor), with its vector-Jacobian
products: the gradients of J with respect to the module's input (the input gradient the module passes back) and to
its own parameters. One evaluation costs one module's forward, not the whole network's. A custom
``torch.autograd.Function`` inside the module is named too: it shows up as a node of the module's own backward graph
(``grad_fn._forward_cls``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch.options import CheckOptions
    >>> check = check_module("act", nn.Tanh(), (torch.randn(4, 3, dtype=torch.float64),), {}, CheckOptions())
    >>> check.label, list(check.tensors), check.failed
    ('`act` (Tanh)', ['input'], False)
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from gradwatch.check.judging.report import TensorCheck, json_float
from gradwatch.check.modules._tensor_trees import call_inputs, float_outputs, leaves, map_tensors
from gradwatch.check.modules.own_code import OwnCode
from gradwatch.check.modules.replay_failure import EVALUATING, why_not_alone
from gradwatch.check.numerics.differences import machine_eps
from gradwatch.check.numerics.sampling import generator, tensor_seed
from gradwatch.check.objective.guards import BufferGuard, frozen_batchnorm_stats
from gradwatch.check.objective.rng import Reseeder
from gradwatch.check.objective.shadow import restore_params, snapshot_params
from gradwatch.check.probes.batched import compiled_modules
from gradwatch.check.probes.engine import check_tensors
from gradwatch.check.probes.experts import in_order
from gradwatch.check.probes.lines import EngineSettings, Evaluator, TermScales, part_key
from gradwatch.options import CheckOptions


@dataclass
class ModuleCheck:
    """Result of checking one module alone.

    Attributes:
        name: Qualified module name (``"encoder.act"``; ``""`` for the whole model).
        type: Class name of the module.
        functions: Custom ``autograd.Function`` classes in the module's backward graph.
        tensors: ``"input"`` (``"input[1]"``, ``"input[key]"`` for several) and the module's
            own parameters (``"weight"``) -> :class:`TensorCheck`.
        calls: How often the module ran in the forward (its first call is checked).
        evaluations: Evaluations of the module's forward the check made.
        seconds: Wall time of this module's check.
        inconclusive: Why the module could not be checked (no floating input or output, it raised), in the user's
            terms (:func:`~gradwatch.check.modules.replay_failure.why_not_alone`).
        error: What its forward raised when run alone (``"Type: message"``), for debugging: never the reason shown.

    Example:
        >>> ModuleCheck(name="act", type="Tanh").failed
        False
    """

    name: str
    type: str
    functions: List[str] = field(default_factory=list)
    tensors: Dict[str, TensorCheck] = field(default_factory=dict)
    calls: int = 1
    evaluations: int = 0
    seconds: float = 0.0
    inconclusive: Optional[str] = None
    error: Optional[str] = None

    @property
    def failed(self) -> bool:
        """True when any of the module's gradients failed."""
        return any(t.failed for t in self.tensors.values())

    @property
    def failures(self) -> List[str]:
        """Local names of the failing gradients (``"input"``, ``"weight"``), worst first."""
        bad = [(k, t) for k, t in self.tensors.items() if t.failed]
        bad.sort(key=lambda kt: kt[1].judged_rel_diff if math.isfinite(kt[1].judged_rel_diff) else float("inf"), reverse=True)
        return [k for k, _ in bad]

    @property
    def label(self) -> str:
        """```name``` (Type, autograd.Function Fn)."""
        shown = self.name if self.name else "<model>"
        extra = ", ".join([self.type] + [f"autograd.Function {f}" for f in self.functions])
        return f"`{shown}` ({extra})"

    def summary(self) -> str:
        """One line: ``\\`encoder.act\\` (BuggySigmoid): input gradient wrong, analytic 1.27x numeric``."""
        if self.inconclusive and not self.tensors:
            return f"{self.label}: not checked ({self.inconclusive})"
        if not self.failed:
            return f"{self.label}: ok ({', '.join(self.tensors) or 'nothing to check'})"
        parts = []
        for key in self.failures:
            t = self.tensors[key]
            what = "input gradient" if key.startswith("input") else f"gradient of {key}"
            if key.startswith("input["):
                what = f"input gradient {key[5:]}"
            verdict = t.verdict.value if t.verdict is not None else "inconclusive"
            parts.append(f"{what} {verdict}, {_short(t)}")
        return f"{self.label}: " + "; ".join(parts)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self, samples: bool = False) -> Dict[str, Any]:
        """JSON-serializable dict."""
        return {
            "name": self.name,
            "type": self.type,
            "functions": list(self.functions),
            "failed": self.failed,
            "failures": self.failures,
            "summary": self.summary(),
            "calls": self.calls,
            "evaluations": self.evaluations,
            "seconds": self.seconds,
            "inconclusive": self.inconclusive,
            "tensors": {k: t.to_dict(samples) for k, t in self.tensors.items()},
        }


def _short(check: TensorCheck) -> str:
    ratio = check.ratio
    if ratio is not None and abs(ratio + 1.0) > 1e-2:  # a plain sign flip keeps its words
        return f"analytic {ratio:.2f}x numeric"
    if check.diagnosis:
        return check.diagnosis
    return f"judged rel_diff {json_float(check.judged_rel_diff)}"


def _custom_functions(root: Any, limit: int = 10_000) -> List[str]:
    """Custom autograd.Function classes in the backward graph below ``root`` (a grad_fn)."""
    names: List[str] = []
    seen: Set[int] = set()
    stack = [root]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and cls.__name__ not in names:
            names.append(cls.__name__)
        for nxt, _ in getattr(node, "next_functions", ()):
            stack.append(nxt)
    return names


def check_module(name: str, module: nn.Module, args: Any, kwargs: Any, opts: CheckOptions, calls: int = 1,
                 params: Optional[Dict[str, nn.Parameter]] = None, restore: bool = True,
                 constants: Optional[Set[int]] = None, screen: bool = False) -> ModuleCheck:
    """Check one module on captured inputs: input gradient and own parameters (see the module docstring).

    ``args``/``kwargs`` are the module's inputs (not modified). ``params`` (default: the
    module's direct trainable parameters) are perturbed in place and restored bit for bit;
    call inside the deterministic context of :func:`~gradwatch.check.modules.localize.localize` (dropout off, RNG
    preserved) for a side-effect-free check. ``restore=False`` (a throwaway copy of the module, as the
    module form of :mod:`gradwatch.check.modules.module_form` checks): no snapshot of the parameters is kept
    beyond the one each tensor's probing keeps, so the check holds less memory. ``constants``: ``id`` of
    floating inputs that are not differentiated (they did not require grad where they were captured).
    ``screen``: detection first (:func:`gradwatch.check.probes.reexamine.screen_sample`): one probe per tensor settles
    it when both sides agree; the full sample only for the rest.
    """
    start = time.perf_counter()
    result = ModuleCheck(name=name, type=type(module).__name__, calls=calls)
    inputs = [(path, t) for path, t in leaves((args, kwargs))
              if t.is_floating_point() and t.numel() > 0 and id(t) not in (constants or ())]
    if params is None:
        params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad and p.is_floating_point()}
    if not inputs and not params:
        result.inconclusive = "no floating input and no trainable parameter"
        return result
    # Working copies of the floating inputs: the engine perturbs these in place; every call gets fresh clones
    # (a module may work in place on its input, e.g. ReLU(inplace=True)).
    work = {id(t): t.detach().clone() for _, t in inputs}
    args_w, kwargs_w = map_tensors((args, kwargs), lambda t: work.get(id(t), t))
    keys = _input_keys([p for p, _ in inputs])
    guard = BufferGuard(module)
    reseed = Reseeder(tensor_seed(opts.seed, name) % (2**31))
    try:
        with torch.enable_grad():
            reseed()
            grad_leaves = {id(t): t.detach().clone().requires_grad_(True) for t in work.values()}
            a_g, k_g = map_tensors((args_w, kwargs_w), lambda t: grad_leaves.get(id(t), t))
            a_c, k_c = call_inputs(a_g, k_g)
            out = float_outputs(module(*a_c, **k_c))
            if not out:
                result.inconclusive = "the module has no floating output"
                return result
            wrt = list(grad_leaves.values()) + list(params.values())
            side = _analytic_side(result, out, wrt, keys[:len(work)] + list(params), opts.seed)
        guard.restore_changed()
        grads = [torch.zeros_like(w) if g is None else g.detach() for g, w in zip(side.gs, wrt)]
    except Exception as err:  # noqa: BLE001 - a module that cannot be replayed alone is reported, not fatal
        guard.restore_changed()
        result.inconclusive = why_not_alone(err, own=isinstance(module, OwnCode))
        result.error = f"{type(err).__name__}: {err}"
        result.seconds = time.perf_counter() - start
        return result
    tensors = list(work.values()) + list(params.values())
    keys_all = keys[:len(work)] + list(params)  # one key per distinct input tensor, as `work` holds them
    _numeric_side(result, module, (args_w, kwargs_w), side, list(zip(keys_all, tensors, grads)), params,
                  (guard, reseed), opts, screen, restore)
    result.seconds = time.perf_counter() - start
    return result


@dataclass
class _Analytic:
    """The analytic side of a module's check: the cotangent drawn, ``<out, cot>`` part by part at the point (and its
    scales), and the vector-Jacobian product (one gradient per tensor checked, None where the graph does not reach it).
    """

    cot: List[torch.Tensor]
    base_terms: Dict[str, float]
    magnitude: float
    term_norm: float
    scales: Optional[TermScales]
    gs: Sequence[Optional[torch.Tensor]]


def _analytic_side(result: ModuleCheck, out: List[torch.Tensor], wrt: List[torch.Tensor], keys: List[str],
                   seed: int) -> _Analytic:
    """The cotangent of a module's outputs ``out`` (with grad) and the vector-Jacobian product with respect to
    ``wrt`` (named ``keys``); the custom autograd Functions met on the way go into ``result``."""
    gen = generator(tensor_seed(seed, result.name + "/cotangent"))
    # drawn in float32 (float64 draws cost several times more; the cotangent used is the one stored, either way)
    cot = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device, o.dtype) for o in out]
    j = sum(((o * c).sum() for o, c in zip(out, cot)), torch.zeros((), dtype=out[0].dtype, device=out[0].device))
    # The analytic side's forward stands for the first of the engine's two evaluations at the point.
    terms = [o.detach() * c for o, c in zip(out, cot)]
    base_terms = {part_key(i): float(t.sum()) for i, t in enumerate(terms)}
    absum = tuple(float(t.abs().sum()) for t in terms)
    sqsum = tuple(float(t.square().sum()) for t in terms)
    magnitude, term_norm = float(sum(absum)), math.sqrt(sum(sqsum))
    scales = _term_scales(out, absum, sqsum, wrt, keys)
    del terms
    gs: Sequence[Optional[torch.Tensor]]
    if j.requires_grad and j.grad_fn is not None:
        result.functions = _custom_functions(j.grad_fn)
        gs = torch.autograd.grad(j, wrt, allow_unused=True)
    else:
        gs = [None] * len(wrt)
    return _Analytic(cot, base_terms, magnitude, term_norm, scales, gs)


def _numeric_side(result: ModuleCheck, module: nn.Module, inputs: Tuple[Any, Any], side: _Analytic,
                  checked: List[Tuple[str, torch.Tensor, torch.Tensor]], params: Dict[str, nn.Parameter],
                  held: Tuple[BufferGuard, Reseeder], opts: CheckOptions, screen: bool, restore: bool) -> None:
    """Central differences of ``<module(inputs), cot>`` judged against the analytic side, tensor by tensor (``checked``:
    key, working tensor, its gradient) into ``result``; a module whose evaluations raise is reported, not fatal.
    ``held``: the module's buffers restored after each evaluation, and its random draws made alike at each."""
    guard, reseed = held
    args_w, kwargs_w = inputs

    def evaluate() -> Dict[str, float]:
        reseed()
        with torch.no_grad():
            a_c, k_c = call_inputs(args_w, kwargs_w)
            outs = float_outputs(module(*a_c, **k_c))
            # Part by part: a part the probed tensor does not move cancels exactly (TermScales).
            parts = {part_key(i): float((o * c).sum()) for i, (o, c) in enumerate(zip(outs, side.cot))}
        guard.restore_fast()
        return parts

    evaluator = Evaluator(evaluate, recordable=not compiled_modules(module))
    saved = snapshot_params(params) if restore else {}
    try:
        with frozen_batchnorm_stats(module):
            eps = max(machine_eps(t.dtype) for _, t, _ in checked)
            settings = EngineSettings.from_options(opts, eps, side.magnitude, term_norm=side.term_norm)
            if screen:
                settings = dataclasses.replace(settings, screen=True)
            targets = [(key, f"{result.name}:{key}", t, {"total": g}) for key, t, g in checked]
            for judged in check_tensors(targets, evaluator, settings, opts.seed, base_terms=side.base_terms,
                                        scales=side.scales):
                result.tensors[judged.key] = judged.check
            result.tensors = in_order(result.tensors, [key for key, _, _ in checked])
    except Exception as err:  # noqa: BLE001 - as above: a module whose evaluations raise is reported, not fatal
        result.inconclusive = why_not_alone(err, own=isinstance(module, OwnCode), evaluating=True)
        result.error = f"{EVALUATING}{type(err).__name__}: {err}"
    finally:
        if restore:
            restore_params(params, saved)
        guard.restore_changed()
    result.evaluations = evaluator.count




def _term_scales(out: Sequence[torch.Tensor], absum: Tuple[float, ...], sqsum: Tuple[float, ...],
                 wrt: Sequence[torch.Tensor], keys: Sequence[str]) -> Optional[TermScales]:
    """Which of the unit's parts (its outputs times their cotangents, evaluated part by part) each tensor of ``wrt``
    (named ``keys``) moves, by the paths of the backward graph from each output; None for a unit of one output
    (every tensor moves all of it)."""
    if len(out) < 2:
        return None
    index = {id(t): i for i, t in enumerate(wrt)}
    moved: Dict[str, Set[int]] = {key: set() for key in keys}
    for i, o in enumerate(out):
        for j in _reached(o, index):
            moved[keys[j]].add(i)
    return TermScales(absum, sqsum, {key: frozenset(terms_of) for key, terms_of in moved.items()})


def _reached(t: torch.Tensor, index: Dict[int, int]) -> Set[int]:
    """The positions (``index``: ``id`` of a tensor -> position) of the leaf tensors a path of ``t``'s backward
    graph leads to: every leaf whose perturbation can move ``t`` through a differentiable path."""
    if t.grad_fn is None:
        return {index[id(t)]} if id(t) in index else set()
    found: Set[int] = set()
    seen: Set[Any] = set()
    stack: List[Any] = [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) in index:
            found.add(index[id(leaf)])
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


def _input_keys(paths: List[str]) -> List[str]:
    """``"input"`` for one floating input, else ``"input[0]"``, ``"input[key]"``."""
    if len(paths) == 1:
        return ["input"]
    out = []
    for p in paths:
        # paths look like "[0][1]" (args) or "[1][key]" (kwargs); drop the args/kwargs level
        m = re.match(r"\[(\d)\](.*)", p)
        rest = m.group(2) if m else p
        out.append("input" + (rest or ""))
    return out

