"""Module-local checks: name the module, or the custom ``autograd.Function``, whose backward is wrong.

An end-to-end check says *which parameter's* gradient disagrees; a wrong
backward anywhere downstream of that parameter corrupts it. Here each module
is checked alone: forward hooks capture every leaf module's input on the
check batch (one forward of the float64 shadow), then for each module

    J(x, θ) = <module(x; θ), c>      with c a seeded random cotangent,

is compared, by the same sampled two-sided differences as the end-to-end
check (:func:`gradwatch.check.probes.engine.check_tensors`: determinism, kink guard, noise floor), with
its vector-Jacobian products: the gradients of J with respect to the module's
input (the input gradient the module passes back) and to its own parameters.
One evaluation costs one module's forward, not the whole network's.

A custom ``torch.autograd.Function`` inside a module is named too: it shows
up as a node of the module's own backward graph (``grad_fn._forward_cls``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
    >>> checks = localize(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), (x, y))
    >>> [(c.name, c.type, c.failed) for c in checks]
    [('0', 'Linear', False), ('1', 'Tanh', False), ('2', 'Linear', False)]
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from gradwatch.check.judging.report import TensorCheck, json_float, suspects
from gradwatch.check.modules.own_code import OwnCode
from gradwatch.check.modules.replay_failure import EVALUATING, why_not_alone
from gradwatch.check.numerics.differences import machine_eps
from gradwatch.check.numerics.sampling import generator, tensor_seed
from gradwatch.check.objective.dropout_off import dropout_off
from gradwatch.check.objective.guards import BufferGuard, frozen_batchnorm_stats
from gradwatch.check.objective.padding_idx import padding_rows_constant
from gradwatch.check.objective.precision import ShadowPrecision
from gradwatch.check.objective.rng import Reseeder, preserved_rng
from gradwatch.check.objective.shadow import Shadow, cast_floats, restore_params, snapshot_params
from gradwatch.check.probes.batched import compiled_modules
from gradwatch.check.probes.engine import check_tensors
from gradwatch.check.probes.experts import in_order
from gradwatch.check.probes.lines import EngineSettings, Evaluator, TermScales, part_key
from gradwatch.options import CheckOptions
from gradwatch.trees import rebuild

LossFn = Callable[[nn.Module, Any], torch.Tensor]


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


# --------------------------------------------------------------------------- trees of tensors


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor inside tuples, lists and dicts (:func:`gradwatch.trees.rebuild`)."""
    return rebuild(obj, fn)


def _leaves(obj: Any, path: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor, in order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}[{k}]")


def _float_outputs(out: Any) -> List[torch.Tensor]:
    return [t for _, t in _leaves(out) if t.is_floating_point()]


# --------------------------------------------------------------------------- capture


def _select(model: nn.Module, modules: Sequence[Union[str, nn.Module]]) -> Dict[str, nn.Module]:
    """Modules named by ``modules`` (names, glob patterns or module objects), in model order."""
    named = dict(model.named_modules())
    by_id = {id(m): n for n, m in named.items()}
    out: Dict[str, nn.Module] = {}
    for spec in modules:
        if isinstance(spec, nn.Module):
            if id(spec) not in by_id:
                raise ValueError(f"modules: {type(spec).__name__} is not a submodule of {type(model).__name__}")
            out[by_id[id(spec)]] = spec
            continue
        hits = [n for n in named if n == spec or fnmatch.fnmatchcase(n, str(spec))]
        if not hits:
            shown = ", ".join(repr(n) for n in list(named)[1:9])
            raise ValueError(f"modules: {spec!r} matches no submodule; modules are: {shown}, ...")
        for n in hits:
            out[n] = named[n]
    return {n: out[n] for n in named if n in out}


def _owned(module: nn.Module, calls: Dict[str, int], name: str) -> Dict[str, nn.Parameter]:
    """Trainable parameters a module's own forward uses: its direct ones, and those of submodules
    the forward never called as modules (``MultiheadAttention.out_proj`` is used through its weight)."""
    out = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad and p.is_floating_point()}
    for sub_name, sub in module.named_modules():
        if not sub_name or calls.get(f"{name}.{sub_name}" if name else sub_name, 0):
            continue
        # skip submodules below a called submodule: they belong to it
        parts = sub_name.split(".")
        if any(calls.get(".".join(([name] if name else []) + parts[:i]), 0) for i in range(1, len(parts))):
            continue
        for n, p in sub.named_parameters(recurse=False):
            if p.requires_grad and p.is_floating_point():
                out[f"{sub_name}.{n}"] = p
    return out


def _capture(target: nn.Module, loss_fn: LossFn, batch: Any, chosen: Sequence[str]) -> Tuple[Dict[str, Tuple[Any, Any]], Dict[str, int]]:
    """How often each module runs in one forward, and the chosen modules' (args, kwargs) at their
    first call (detached copies)."""
    captured: Dict[str, Tuple[Any, Any]] = {}
    calls: Dict[str, int] = {}
    wanted = set(chosen)

    def hook_for(name: str, keep: bool):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls[name] = calls.get(name, 0) + 1
            if keep and name not in captured:
                # Opaque inputs (a KV cache) are copied as they are now: the rest of the forward mutates them.
                captured[name] = copy_opaque(map_tensors((args, kwargs), lambda t: t.detach().clone()))

        return hook

    handles = []
    for n, m in target.named_modules():
        keep = n in wanted
        handles.append(m.register_forward_pre_hook(hook_for(n, keep), with_kwargs=True))
    try:
        with torch.no_grad():
            loss_fn(target, batch)
    finally:
        for h in handles:
            h.remove()
    return captured, calls


def _innermost(named: Dict[str, nn.Module], calls: Dict[str, int]) -> List[str]:
    """Called modules whose forward called no other module (in model order): the default set.

    ``MultiheadAttention`` is one (it uses ``out_proj`` through its weight, never calls it);
    a ``Sequential`` or a model's top level is not.
    """
    out = []
    for n, m in named.items():
        if not calls.get(n, 0):
            continue
        prefix = f"{n}." if n else ""
        if not any(calls.get(prefix + d, 0) for d, _ in m.named_modules() if d):
            out.append(n)
    return out


# --------------------------------------------------------------------------- one module


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
    call inside the deterministic context of :func:`localize` (dropout off, RNG preserved)
    for a side-effect-free check. ``restore=False`` (a throwaway copy of the module, as the
    module form of :mod:`gradwatch.check.modules.module_form` checks): no snapshot of the parameters is kept
    beyond the one each tensor's probing keeps, so the check holds less memory. ``constants``: ``id`` of
    floating inputs that are not differentiated (they did not require grad where they were captured).
    ``screen``: detection first (:func:`gradwatch.check.probes.reexamine.screen_sample`): one probe per tensor settles
    it when both sides agree; the full sample only for the rest.
    """
    start = time.perf_counter()
    result = ModuleCheck(name=name, type=type(module).__name__, calls=calls)
    inputs = [(path, t) for path, t in _leaves((args, kwargs))
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
            leaves = {id(t): t.detach().clone().requires_grad_(True) for t in work.values()}
            a_g, k_g = map_tensors((args_w, kwargs_w), lambda t: leaves.get(id(t), t))
            a_c, k_c = _call_inputs(a_g, k_g)
            out = _float_outputs(module(*a_c, **k_c))
            if not out:
                result.inconclusive = "the module has no floating output"
                return result
            gen = generator(tensor_seed(opts.seed, name + "/cotangent"))
            # drawn in float32 (float64 draws cost 6x more; the cotangent used is the one stored, either way)
            cot = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device, o.dtype) for o in out]
            j = sum(((o * c).sum() for o, c in zip(out, cot)), torch.zeros((), dtype=out[0].dtype, device=out[0].device))
            # The analytic side's forward stands for the first of the engine's two evaluations at the point.
            terms = [o.detach() * c for o, c in zip(out, cot)]
            base_terms = {part_key(i): float(t.sum()) for i, t in enumerate(terms)}
            absum = tuple(float(t.abs().sum()) for t in terms)
            sqsum = tuple(float(t.square().sum()) for t in terms)
            magnitude, term_norm = float(sum(absum)), math.sqrt(sum(sqsum))
            wrt = list(leaves.values()) + list(params.values())
            scales = _term_scales(out, absum, sqsum, wrt, keys[:len(work)] + list(params))
            del terms
            gs: Sequence[Optional[torch.Tensor]]
            if j.requires_grad and j.grad_fn is not None:
                result.functions = _custom_functions(j.grad_fn)
                gs = torch.autograd.grad(j, wrt, allow_unused=True)
            else:
                gs = [None] * len(wrt)
        guard.restore_changed()
        grads = [torch.zeros_like(w) if g is None else g.detach() for g, w in zip(gs, wrt)]
    except Exception as err:  # noqa: BLE001 - a module that cannot be replayed alone is reported, not fatal
        guard.restore_changed()
        result.inconclusive = why_not_alone(err, own=isinstance(module, OwnCode))
        result.error = f"{type(err).__name__}: {err}"
        result.seconds = time.perf_counter() - start
        return result

    def evaluate() -> Dict[str, float]:
        reseed()
        with torch.no_grad():
            a_c, k_c = _call_inputs(args_w, kwargs_w)
            outs = _float_outputs(module(*a_c, **k_c))
            # Part by part: a part the probed tensor does not move cancels exactly (TermScales).
            parts = {part_key(i): float((o * c).sum()) for i, (o, c) in enumerate(zip(outs, cot))}
        guard.restore_fast()
        return parts

    evaluator = Evaluator(evaluate, recordable=not compiled_modules(module))
    saved = snapshot_params(params) if restore else {}
    try:
        with frozen_batchnorm_stats(module):
            eps = max([machine_eps(t.dtype) for t in work.values()] + [machine_eps(p.dtype) for p in params.values()])
            settings = EngineSettings.from_options(opts, eps, magnitude, term_norm=term_norm)
            if screen:
                settings = dataclasses.replace(settings, screen=True)
            tensors = list(work.values()) + list(params.values())
            keys_all = keys[:len(work)] + list(params)  # one key per distinct input tensor, as `work` holds them
            targets = [(key, f"{name}:{key}", t, {"total": g}) for key, t, g in zip(keys_all, tensors, grads)]
            for judged in check_tensors(targets, evaluator, settings, opts.seed, base_terms=base_terms, scales=scales):
                result.tensors[judged.key] = judged.check
            result.tensors = in_order(result.tensors, keys_all)
    except Exception as err:  # noqa: BLE001 - as above: a module whose evaluations raise is reported, not fatal
        result.inconclusive = why_not_alone(err, own=isinstance(module, OwnCode), evaluating=True)
        result.error = f"{EVALUATING}{type(err).__name__}: {err}"
    finally:
        if restore:
            restore_params(params, saved)
        guard.restore_changed()
    result.evaluations = evaluator.count
    result.seconds = time.perf_counter() - start
    return result


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


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.is_floating_point() else t


def _opaque(obj: Any) -> bool:
    """An input that is not a tensor, a standard container or a plain value (a KV cache, a config)."""
    if isinstance(obj, (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)):
        return False
    if isinstance(obj, (list, tuple)):
        return any(_opaque(v) for v in obj)
    if isinstance(obj, dict):
        return any(_opaque(v) for v in obj.values())
    return True


def _call_inputs(args: Any, kwargs: Any) -> Tuple[Any, Any]:
    """Fresh inputs for one call of a module: floating tensors cloned, opaque objects deep-copied.

    A module may work in place on its input (``ReLU(inplace=True)``) or mutate an object it is
    given (a transformers ``Cache`` appends keys and values at every call): each evaluation gets
    its own copies, so every evaluation computes the same function.
    """
    return copy_opaque(map_tensors((args, kwargs), _fresh))


def copy_opaque(obj: Any) -> Any:
    """``obj`` with its opaque parts deep-copied; the tensors in its standard containers stay as they are.

    Objects that cannot be copied are kept as they are.
    """
    if not _opaque(obj):
        return obj
    memo: Dict[int, Any] = {id(t): t for _, t in _leaves(obj)}  # deepcopy keeps these tensors
    for t in _recorded(obj):  # (deepcopy refuses a tensor a graph recorded: its values are copied, detached)
        memo.setdefault(id(t), t.detach().clone())
    try:
        return copy.deepcopy(obj, memo)
    except Exception:  # noqa: BLE001 - an object that refuses copying: passed as captured
        return obj


def _recorded(obj: Any, depth: int = 8) -> Iterator[torch.Tensor]:
    """The tensors with a ``grad_fn`` held inside ``obj`` (its attributes, slots and containers, ``depth`` levels
    down, modules left out): a transformers ``Cache`` a forward with grad filled holds its keys and values so.

    Example:
        >>> class Held:
        ...     def __init__(self, t):
        ...         self.layers = [{"keys": t}]
        >>> w = torch.ones(2, requires_grad=True)
        >>> [t.shape for t in _recorded(Held(w * 2))], list(_recorded(Held(w)))
        ([torch.Size([2])], [])
    """
    seen: Set[int] = set()
    todo: List[Tuple[Any, int]] = [(obj, depth)]
    while todo:
        item, left = todo.pop()
        if id(item) in seen or left < 0 or isinstance(item, (nn.Module, str, bytes, int, float, type)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if item.grad_fn is not None:
                yield item
            continue
        if isinstance(item, dict):
            values: Sequence[Any] = list(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            values = list(item)
        else:
            values = list(getattr(item, "__dict__", {}).values())
            values += [getattr(item, s) for s in getattr(type(item), "__slots__", ()) if isinstance(s, str) and hasattr(item, s)]
        todo.extend((v, left - 1) for v in values)


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


def _ancestors(name: str) -> List[str]:
    """``"a.b.c"`` -> ``["a.b", "a", ""]`` (the model itself is ``""``)."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _enclosing_to_check(named: Dict[str, nn.Module], calls: Dict[str, int], done: set, failing: List[str]) -> List[str]:
    """Enclosing modules to check after the leaves, innermost first.

    Modules that hold a failing leaf are left out: they fail with it, whether its failure is
    genuine or not. Every other called module is a candidate even when some leaf failed: a leaf
    can fail alone falsely (a float32 island it cannot resolve in isolation, a forward that needs
    its enclosing module's state), and that must not hide a bug in another layer's own code.
    """
    holding = {a for leaf in failing for a in _ancestors(leaf)}
    order = list(named)
    parents = [n for n in named if calls.get(n, 0) and n not in done and n not in holding]
    parents.sort(key=lambda n: (-(n.count(".") + 1) if n else 0, order.index(n)))
    return parents


# --------------------------------------------------------------------------- public entry point


def localize(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    modules: Optional[Sequence[Union[str, nn.Module]]] = None,
    *,
    enclosing: bool = False,
    **options: Any,
) -> List[ModuleCheck]:
    """Check modules one at a time on their inputs from the check batch.

    Args:
        model: The model.
        loss_fn: ``loss_fn(model, batch) -> scalar`` (run once, to capture module inputs).
        batch: The batch.
        modules: Names (glob patterns allowed) or module objects to check. Default: every
            module the forward calls that calls no other module itself (leaf modules, and
            modules like ``MultiheadAttention`` that use a submodule's weights directly).
        enclosing: With the default ``modules``: check the enclosing modules next, innermost
            first, until one fails (a bug in a module's own code outside its submodules, e.g. a
            wrong custom softmax in an attention module's ``forward``). Modules that hold a failing
            leaf are skipped (they fail with it), but a failing leaf does not end the search: a
            leaf can fail alone falsely, and the layer with the bug is still named.
            ``check_model(..., localize=True)`` sets it: the end-to-end check failed.
        **options: ``coords``, ``directions``, ``eps``, ``bands``, ``fail_at``, ``seed``,
            ``dtype`` (float64 shadow copy by default; None: in place), ``detect_kinks``.

    Returns:
        One :class:`ModuleCheck` per checked module, in model order (failing ones have
        ``failed`` True and a ``summary()`` naming the module, its type and any custom Function).
    """
    options = {k: v for k, v in options.items() if k not in ("tensors", "per_term")}
    opts = CheckOptions(**options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    names = list(_select(model, modules)) if modules is not None else None  # module objects given are the live ones
    dtype = opts.torch_dtype
    if dtype is None:
        target = model
    else:
        shadow = Shadow(model, dtype)
        target = shadow.module
        batch = cast_floats(batch, dtype)
    named = dict(target.named_modules())
    in_place_params = {n: p for n, p in target.named_parameters()} if opts.dtype is None else {}
    saved = snapshot_params(in_place_params)
    guard = BufferGuard(target)
    results: List[ModuleCheck] = []

    def capture(chosen: Sequence[str]) -> Tuple[Dict[str, Tuple[Any, Any]], Dict[str, int]]:
        Reseeder(opts.seed)()
        with frozen_batchnorm_stats(target):
            out = _capture(target, loss_fn, batch, chosen)
        guard.restore_changed()
        return out

    def run(n: str, captured: Dict[str, Tuple[Any, Any]], calls: Dict[str, int]) -> ModuleCheck:
        args, kwargs = captured[n]
        return check_module(n, named[n], args, kwargs, opts, calls.get(n, 1), params=_owned(named[n], calls, n))

    try:
        # On a shadow, casts down stay in its dtype (as in check_model): a norm computing in float32 inside a
        # float64 copy would otherwise fail alone, falsely (gradwatch.check.objective.precision).
        precision = ShadowPrecision(dtype) if dtype is not None else contextlib.nullcontext()
        with preserved_rng(), dropout_off(target) as dropout, padding_rows_constant(target), precision:
            if names is None:
                # One forward to see which modules run and which call others, one to capture inputs.
                _, calls = capture([])
                names = _innermost(named, calls)
                default = True
            else:
                default = False
            captured, calls = capture(names)
            dropout.settle()
            first = [n for n in named if n in captured]
            results = [run(n, captured, calls) for n in first]
            if default and enclosing:
                parents = _enclosing_to_check(named, calls, set(first), [r.name for r in results if r.failed])
                if parents:
                    captured, calls = capture(parents)
                for n in parents:
                    check = run(n, captured, calls)
                    results.append(check)
                    if check.failed:
                        break
    finally:
        guard.restore_changed()
        restore_params(in_place_params, saved)
    return results


def name_straight_through(report: Any, model: nn.Module, loss_fn: Any, batch: Any, opts: Any) -> bool:
    """Name the module of an undeclared straight-through the objective form only saw through its parameters.

    When :func:`suspects` finds one but no module, the report's modules are checked one at a time
    (:func:`gradwatch.check.modules.localize.localize`, as ``check_model(..., localize=True)`` does) and the failing
    ones go to ``report.localized``. Returns True when it ran (a watch runs it once); what it raised becomes a note.
    """
    modules, explained = suspects(report)
    if not explained or modules:
        return False

    try:
        report.localized = localize(model, loss_fn, batch, enclosing=True, dtype=opts.dtype, seed=opts.seed)
    except Exception as err:  # noqa: BLE001 - naming the module is a courtesy; the check stands without it
        report.notes.append(f"could not name the module of the straight-through: {type(err).__name__}: {err}")
    return True


def name_shared_module(report: Any, model: nn.Module, loss_fn: Any, batch: Any, opts: Any) -> bool:
    """Name the module whose backward several failing tensors share, where the objective form named none.

    A wrong backward in one module fails its own tensors and every tensor upstream of it: the objective form sees
    them all and names no module. Then the report's modules are checked one at a time (:func:`localize`, as
    ``check_model(..., localize=True)`` does) and the failing ones go to ``report.localized``, where a watch's trends
    list the upstream tensors under that module's one alert (:mod:`gradwatch.watch.causes`). Not where fewer than two
    tensors fail, where a module is named already, or where one factor explains every failure (a scale of the whole
    objective: no module has it). Returns True when it ran (a watch runs it once); what it raised becomes a note.

    Example:
        >>> from gradwatch.check.judging.report import CheckReport
        >>> name_shared_module(CheckReport(tensors={}), nn.Linear(2, 1), None, None, None)
        False
    """
    failing = report.failures
    if len(failing) < 2 or report.localized or any(":" in t.name for t in failing) or suspects(report)[1]:
        return False
    if failing[0].ratio is not None and len({t.diagnosis for t in failing}) == 1:
        return False
    began = time.perf_counter()
    try:
        report.localized = localize(model, loss_fn, batch, enclosing=True, dtype=opts.dtype, seed=opts.seed)
    except Exception as err:  # noqa: BLE001 - naming the module is a courtesy; the check stands without it
        report.notes.append(f"could not name the module the failing tensors share: {type(err).__name__}: {err}")
    spent = time.perf_counter() - began
    report.seconds += spent
    report.localize_seconds += spent
    return True
