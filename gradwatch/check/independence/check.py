"""Independence checks: does an output depend on an input it must not (another sample, a later token,
another packed document, a padded position)?

:func:`check_independence` answers with the model's own autograd. One forward builds the graph from
*the input* (a floating input tensor, or for integer token ids the output of the module that embeds
them, substituted through a forward hook) to the output (a tensor, the first tensor of a tuple, or a
Hugging Face ``ModelOutput``'s ``logits`` / ``last_hidden_state``). Each probe of
:mod:`gradwatch.check.independence.structures` is one vector-Jacobian product with a random cotangent on some
outputs: the gradient at the inputs they must not depend on is exactly zero in a model without the
leak. A nonzero one (above ``8 * eps`` of the largest allowed gradient) is a candidate, and a
candidate is *confirmed* by a finite change: the forbidden input is replaced by another value, the
model runs again, and the outputs that must not move are compared; so a reported leak is real. The
confirmed change is then run once more with every module's output recorded: the first module, in
the order modules finish their forward, whose output moves is where the dependence starts.

The model runs in eval mode (dropout off; BatchNorm on its running statistics, since in train mode
it mixes the batch by design), every random generator seeded alike for each forward and put back
afterwards. Parameters, buffers, ``.grad``, random states and train/eval modes are as they were.

Example:
    >>> from torch import nn
    >>> report = check_independence(nn.Linear(4, 2), torch.randn(3, 4), structure="batch")
    >>> report.ok
    True
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from gradwatch.check.independence.report import IndependenceReport, StructureResult, Violation
from gradwatch.check.independence.structures import (
    PACKED_KEYS,
    STRUCTURES,
    Probe,
    batch_probes,
    causal_probes,
    document_probes,
    documents_from_positions,
    packed_documents,
    padding_probes,
    parse_structures,
)
from gradwatch.check.objective.generators import HeldGenerators
from gradwatch.check.objective.guards import BufferGuard, suspended_hooks
from gradwatch.check.objective.rng import preserved_rng, seed_everything

#: Keyword arguments of a Hugging Face model call that may hold the input, in order of preference.
INPUT_KEYS = ("input_ids", "inputs_embeds", "input_values", "pixel_values", "x", "input")
#: Gradient at a forbidden input, relative to the largest allowed one, above which it is a candidate (times eps).
GRADIENT_EPS = 8.0
#: Change of a guarded output, relative to the output's scale, above which a finite change confirms (times eps).
CHANGE_EPS = 8.0
#: Candidates confirmed per probe at most (the largest forbidden gradients first).
CANDIDATES = 3

Allow = Union[str, type, nn.Module]


# ----------------------------------------------------------------------------------------------------------------
# The call: where the input is, what the output is, the (sample, position) grid of both.


@dataclass
class ModelCall:
    """Positional and keyword arguments of one model call together (what a watch captures from ``loss_fn``)."""

    args: tuple
    kwargs: Dict[str, Any]


def _call_of(inputs: Any) -> Tuple[list, dict]:
    """``(args, kwargs)`` of the model call: a tensor, a tuple/list of arguments, a dict of keyword arguments."""
    if isinstance(inputs, ModelCall):
        return list(inputs.args), dict(inputs.kwargs)
    if isinstance(inputs, torch.Tensor):
        return [inputs], {}
    if isinstance(inputs, Mapping):
        return [], dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return list(inputs), {}
    raise TypeError(f"inputs: got {type(inputs).__name__}, expected a tensor, a tuple of arguments or a dict of "
                    "keyword arguments (a Hugging Face model's input_ids, attention_mask, position_ids)")


def _primary(args: list, kwargs: dict) -> Tuple[Tuple[str, Any], torch.Tensor]:
    """Where the input is (``("arg", i)`` or ``("kw", key)``) and the tensor."""
    for key in INPUT_KEYS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return ("kw", key), kwargs[key]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return ("arg", i), a
    for key, v in kwargs.items():
        if isinstance(v, torch.Tensor) and key not in ("attention_mask", "position_ids", "token_type_ids"):
            return ("kw", key), v
    raise TypeError("inputs: no tensor to check independence of (give a tensor, or input_ids / inputs_embeds)")


#: Keywords of a training call that turn the output into a loss, left out of the checked call (and why).
_LOSS_ONLY = {
    "labels": "the outputs are checked, not the loss",
    # TRL's fused LM head: with it a causal LM returns per-token log-probabilities of the labels, not its logits
    "fused_lm_head": "the logits are checked (TRL's fused LM head returns the labels' log-probabilities)",
    "num_items_in_batch": "the outputs are checked, not the loss",
}


def output_tensor(out: Any) -> torch.Tensor:
    """The model output to check: a tensor; a ``ModelOutput``'s ``logits`` or ``last_hidden_state``; a tuple's first.

    Example:
        >>> output_tensor((torch.ones(2), None)).shape
        torch.Size([2])
    """
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = out.get(key) if isinstance(out, Mapping) else getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    values = list(out.values()) if isinstance(out, Mapping) else list(out) if isinstance(out, (tuple, list)) else []
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise TypeError(f"the model returned {type(out).__name__}; check_independence needs a tensor, a tuple whose first "
                    "floating tensor is the output, or a ModelOutput with logits or last_hidden_state")


@dataclass
class _Layout:
    """How a ``[B, T]`` grid maps onto a tensor: which dims are the batch and the sequence (None: no sequence)."""

    batch_dim: int
    seq_dim: Optional[int]

    def fits(self, t: torch.Tensor, batch: int, length: int) -> bool:
        dims = t.dim()
        if dims <= self.batch_dim or t.shape[self.batch_dim] != batch:
            return False
        if self.seq_dim is None:
            return True
        return dims > self.seq_dim and t.shape[self.seq_dim] == length

    def grid(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, T, F]`` view/copy of ``t`` (T = 1 without a sequence)."""
        if self.seq_dim is None:
            moved = t.movedim(self.batch_dim, 0)
            return moved.reshape(moved.shape[0], 1, -1)
        moved = t.movedim((self.batch_dim, self.seq_dim), (0, 1))
        return moved.reshape(moved.shape[0], moved.shape[1], -1)

    def spread(self, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A ``[B, T]`` mask broadcast to ``like``'s shape."""
        shape = [1] * like.dim()
        shape[self.batch_dim] = mask.shape[0]
        if self.seq_dim is None:
            mask = mask[:, 0]
        else:
            shape[self.seq_dim] = mask.shape[1]
        return mask.reshape(shape).expand(like.shape)


class _Runner:
    """Runs the model with the input replaced by ``variable + delta``, in eval mode, seeded alike each time."""

    def __init__(self, model: nn.Module, args: list, kwargs: dict, where: Tuple[str, Any], primary: torch.Tensor,
                 seed: int) -> None:
        self.model, self.args, self.kwargs, self.where, self.seed = model, args, kwargs, where, seed
        self.site: Optional[nn.Module] = None  # the module embedding integer ids
        self.site_name: Optional[str] = None
        self.variable: Optional[torch.Tensor] = None
        self.forwards = 0
        self._delta: Optional[torch.Tensor] = None
        self._taken = False
        self.held: Optional[HeldGenerators] = None
        if primary.is_floating_point() or primary.is_complex():
            self.variable = primary.detach().clone().requires_grad_(True)
        else:
            self.primary = primary

    def _set(self, value: torch.Tensor) -> Tuple[list, dict]:
        args, kwargs = list(self.args), dict(self.kwargs)
        kind, key = self.where
        if kind == "arg":
            args[key] = value
        else:
            kwargs[key] = value
        return args, kwargs

    def _site_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._taken:
            return None  # a second call of the embedding (a tied head, say) is the model's own use
        if self.variable is None:  # discovery: the first module to finish that took the integer ids
            ids = self.primary
            first = args[0] if args else None
            if not (isinstance(first, torch.Tensor) and isinstance(output, torch.Tensor) and output.is_floating_point()
                    and first.shape == ids.shape and output.shape[:ids.dim()] == ids.shape
                    and (first is ids or (first.dtype == ids.dtype and torch.equal(first, ids)))):
                return None  # the ids as given, or a view of them (GPT-2 reshapes input_ids before embedding them)
            self.site = module
            self.variable = output.detach().clone().requires_grad_(True)
        elif module is not self.site:
            return None
        self._taken = True
        return self.variable if self._delta is None else self.variable + self._delta

    def run(self, delta: Optional[torch.Tensor] = None, grad: bool = False,
            hooks: Sequence[Tuple[nn.Module, Callable]] = ()) -> torch.Tensor:
        """The output tensor (detached unless ``grad``)."""
        self._delta, self._taken = delta, False
        handles = []
        try:
            if self.variable is None or self.site is not None:
                sites = [self.site] if self.site is not None else list(self.model.modules())
                handles += [m.register_forward_hook(self._site_hook) for m in sites]
            handles += [m.register_forward_hook(h, with_kwargs=True) for m, h in hooks]
            if self.site is None and self.variable is not None:
                value = self.variable if delta is None else self.variable + delta
                args, kwargs = self._set(value if grad else value.detach())
            else:
                args, kwargs = self.args, self.kwargs
            seed_everything(self.seed)
            if self.held is not None:
                self.held.reset()
            with torch.set_grad_enabled(grad):
                out = output_tensor(self.model(*args, **kwargs))
            self.forwards += 1
        finally:
            for h in handles:
                h.remove()
        if self.variable is None:
            raise ValueError(f"check_independence: no module of {type(self.model).__name__} took the integer input "
                             f"(shape {tuple(self.primary.shape)}) as its first argument and returned floating "
                             "embeddings; pass the embeddings instead (inputs_embeds, or a floating input)")
        return out if grad else out.detach()


@contextmanager
def _quiet_state(model: nn.Module, held: HeldGenerators) -> Iterator[List[str]]:
    """Eval mode, the user's module hooks suspended, every generator and buffer put back, the train/eval flags as they
    were; yields notes.

    ``held``: the generators the model holds (``torch.Generator``, numpy, ``random``), put back on exit.
    """
    modes = [(m, m.training) for m in model.modules()]
    notes = []
    if any(t for _, t in modes):
        norms = [type(m).__name__ for m, t in modes if t and isinstance(m, nn.modules.batchnorm._BatchNorm)]
        notes.append("checked in eval mode: dropout off" + (
            f"; {norms[0]} on its running statistics (in train mode it mixes the batch by design)" if norms else ""))
    guard = BufferGuard(model)
    try:
        with preserved_rng(), suspended_hooks(model):  # the user's hooks run in training's forwards only
            model.eval()
            yield notes
    finally:
        for m, t in modes:
            m.training = t
        guard.restore_changed()
        held.reset()


def _allowed(name: Optional[str], model: nn.Module, allow: Sequence[Allow]) -> bool:
    if name is None or not allow:
        return False
    modules = dict(model.named_modules())
    chain = [name]
    while "." in chain[-1]:
        chain.append(chain[-1].rsplit(".", 1)[0])
    for n in chain:
        m = modules.get(n)
        for a in allow:
            if isinstance(a, str) and n == a:
                return True
            if isinstance(a, type) and isinstance(m, a):
                return True
            if isinstance(a, nn.Module) and m is a:
                return True
    return False


def _validate_allow(allow: Any, model: nn.Module) -> List[Allow]:
    items = [allow] if isinstance(allow, (str, type, nn.Module)) else list(allow or ())
    names = {n for n, _ in model.named_modules()}
    for a in items:
        if isinstance(a, str) and a not in names:
            raise ValueError(f"allow: no module named {a!r} in {type(model).__name__} "
                             f"(names as model.named_modules() gives them, e.g. {sorted(names - {''})[:3]})")
        if not isinstance(a, (str, type, nn.Module)):
            raise TypeError(f"allow: got {a!r}, expected module names, module classes or modules")
    return items


def _eps(t: torch.Tensor) -> float:
    return float(torch.finfo(t.dtype).eps) if t.is_floating_point() else float(torch.finfo(torch.float32).eps)


def _mask_of(value: Any, batch: int, length: int, what: str) -> torch.Tensor:
    mask = torch.as_tensor(value).detach().cpu()
    if mask.dim() == 1:
        mask = mask.unsqueeze(0).expand(batch, -1)
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{what}: got shape {tuple(mask.shape)}, expected ({batch}, {length}) (batch, sequence)")
    return mask


# ----------------------------------------------------------------------------------------------------------------


class _Checker:
    """One call of :func:`check_independence`: the graph, the probes, confirmation and localization."""

    def __init__(self, model: nn.Module, runner: _Runner, layout: _Layout, allow: Sequence[Allow]) -> None:
        self.model, self.runner, self.layout, self.allow = model, runner, layout, allow
        self.backwards = 0
        self._base: Optional[torch.Tensor] = None
        self._noise: Optional[float] = None

    def start(self) -> None:
        self.out = self.runner.run(grad=True)
        var = self.runner.variable
        assert var is not None  # run() raises when no input was found
        self.var: torch.Tensor = var
        if not self.layout.fits(self.var, *self.grid_shape()) or not self.layout.fits(self.out, *self.grid_shape()):
            raise ValueError(f"check_independence: the input {tuple(self.var.shape)} and the output "
                             f"{tuple(self.out.shape)} must share the batch dimension ({self.layout.batch_dim})"
                             + ("" if self.layout.seq_dim is None else
                                f" and the sequence dimension ({self.layout.seq_dim})"))

    def grid_shape(self) -> Tuple[int, int]:
        v = self.runner.variable
        assert v is not None
        b = v.shape[self.layout.batch_dim]
        t = 1 if self.layout.seq_dim is None else v.shape[self.layout.seq_dim]
        return b, t

    def gradient(self, probe: Probe, generator: torch.Generator) -> torch.Tensor:
        """Per (sample, position), the largest |gradient| of the probe's cotangent with respect to the input."""
        # A random cotangent of rank one, a random weight per (sample, position) times a random vector over the
        # features: an output that depends on an input at all gives that input a nonzero gradient with probability
        # one, as a dense draw does, and it costs two small draws and one product instead of a draw of the whole
        # output (37 ms in float32 for GPT-2's logits over its 50,257-token vocabulary, 170 ms in float64).
        grid_dims = {d % self.out.dim() for d in (self.layout.batch_dim, self.layout.seq_dim) if d is not None}
        features = [1 if d in grid_dims else n for d, n in enumerate(self.out.shape)]
        along = torch.randn(features, generator=generator, dtype=torch.float32).to(self.out.device, self.out.dtype)
        where = torch.randn(probe.outputs.shape, generator=generator, dtype=torch.float32) * probe.outputs
        cot = self.layout.spread(where.to(self.out.device, self.out.dtype), self.out) * along
        (g,) = torch.autograd.grad(self.out, self.var, cot, retain_graph=True, allow_unused=True)
        self.backwards += 1
        if g is None:
            return torch.zeros(self.grid_shape())
        mag = self.layout.grid(g.detach()).abs().amax(-1).double().cpu()
        return torch.nan_to_num(mag, nan=float("inf"))

    def _baseline(self) -> Tuple[torch.Tensor, float]:
        if self._base is None:
            self._base = self.runner.run()
            again = self.runner.run()
            self._noise = float((again - self._base).abs().max()) if again.numel() else 0.0
        assert self._noise is not None
        return self._base, self._noise

    def _delta(self, probe: Probe, b: int, s: int, generator: torch.Generator) -> torch.Tensor:
        grid = self.layout.grid(self.var.detach())
        rms = float(grid[b].double().pow(2).mean().sqrt()) or 1.0
        where = torch.zeros(self.grid_shape(), dtype=torch.bool)
        if probe.same_sample:
            where[b, s] = True
        else:
            where[b, :] = True
        noise = torch.randn(self.var.shape, generator=generator, dtype=torch.float64).to(self.var.dtype) * rms
        return noise.to(self.var.device) * self.layout.spread(where.to(self.var.device), self.var)

    def _guarded(self, probe: Probe, b: int) -> torch.Tensor:
        """The outputs that must not move when input ``b`` changes: its probe outputs (or those of other samples)."""
        guarded = probe.outputs.clone()
        if probe.same_sample:
            keep = torch.zeros_like(guarded)
            keep[b] = True
            guarded &= keep
        return guarded

    def confirm(self, probe: Probe, b: int, s: int, generator: torch.Generator
                ) -> Optional[Tuple[Tuple[int, int], float, torch.Tensor]]:
        """``(output that moved most, relative change, delta)`` if changing input ``(b, s)`` moves a guarded output."""
        base, noise = self._baseline()
        delta = self._delta(probe, b, s, generator)
        found = self._moves(self.runner.run(delta), base, noise, self._guarded(probe, b))
        return None if found is None else (found[0], found[1], delta)

    def _moves(self, moved: torch.Tensor, base: torch.Tensor, noise: float, guarded: torch.Tensor
               ) -> Optional[Tuple[Tuple[int, int], float]]:
        """``(guarded output that moved most, relative change)`` when one moved beyond the noise, else None."""
        diff = self.layout.grid(moved - base).abs().amax(-1).double().cpu()
        diff = torch.nan_to_num(diff, nan=float("inf")).masked_fill(~guarded, 0.0)
        scale = float(self.layout.grid(base).abs().amax(-1).double().cpu()[guarded].max()) if guarded.any() else 0.0
        top = float(diff.max())
        if top <= max(10.0 * noise, CHANGE_EPS * _eps(base) * scale) or top == 0.0:
            return None
        flat = int(diff.reshape(-1).argmax())
        return (flat // diff.shape[1], flat % diff.shape[1]), top / (scale or 1.0)

    def remedy(self, probe: Probe, b: int, delta: torch.Tensor) -> Optional[str]:
        """A packed call that leaks across documents, called again as a Hugging Face model masks packed documents
        (:func:`packed_call_remedy`): what to change, in words, when the leak is gone then (None otherwise)."""
        fix = packed_call_remedy(self.model, self.runner.kwargs)
        if fix is None:
            return None
        kwargs, words = fix
        runner = self.runner
        primary = runner.variable.detach() if runner.site is None and runner.variable is not None else runner.primary
        again = _Runner(self.model, runner.args, kwargs, runner.where, primary, runner.seed)
        again.held = runner.held
        try:
            base = again.run()
            noise = float((again.run() - base).abs().max()) if base.numel() else 0.0
            still = self._moves(again.run(delta), base, noise, self._guarded(probe, b))
        except Exception:  # noqa: BLE001 - the model refuses the other call: no remedy to say
            return None
        finally:
            runner.forwards += again.forwards
        if still is not None:
            return None
        return (f"called again {words}, the documents are independent: this model masks packed documents from "
                "position_ids only without a cache and without a 2-D attention_mask (transformers); train with that "
                "call, or give it a block-diagonal 4-D attention_mask")

    def localize(self, probe: Probe, b: int, delta: torch.Tensor) -> Optional[str]:
        """Where the dependence starts: the first module (in the order modules finish their forward) whose output
        at the guarded positions moves with ``delta`` while none of its inputs there does ("" for the model's own
        forward when no module qualifies but the output moves)."""
        guarded = self._guarded(probe, b)
        shape = self.grid_shape()
        names = {id(m): n for n, m in self.model.named_modules()}

        def sliced(t: Any) -> Optional[torch.Tensor]:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not self.layout.fits(t, *shape):
                return None
            return self.layout.grid(t.detach())[guarded.to(t.device)].double().cpu()

        def recorder(store: List[Tuple[str, List[torch.Tensor], Optional[torch.Tensor]]]) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                if module is self.runner.site:
                    return
                ins = [x for x in map(sliced, [*args, *kwargs.values()]) if x is not None]
                first = output if isinstance(output, torch.Tensor) else next(
                    (o for o in output if isinstance(o, torch.Tensor)), None) if isinstance(output, (tuple, list)) else None
                store.append((names.get(id(module), "?"), ins, sliced(first)))
            return hook

        def moved(a: torch.Tensor, c: torch.Tensor) -> bool:
            scale = float(a.abs().max()) if a.numel() else 0.0
            gap = float(torch.nan_to_num((c - a).abs(), nan=float("inf")).max()) if a.numel() else 0.0
            return gap > CHANGE_EPS * _eps(self.out) * (scale or 1.0)

        base: List[Tuple[str, List[torch.Tensor], Optional[torch.Tensor]]] = []
        changed: List[Tuple[str, List[torch.Tensor], Optional[torch.Tensor]]] = []
        modules = list(self.model.modules())
        self.runner.run(hooks=[(m, recorder(base)) for m in modules])
        self.runner.run(delta, hooks=[(m, recorder(changed)) for m in modules])
        for (name, ins_a, out_a), (_, ins_c, out_c) in zip(base, changed):
            if out_a is None or out_c is None or out_a.shape != out_c.shape or not moved(out_a, out_c):
                continue
            if not any(a.shape == c.shape and moved(a, c) for a, c in zip(ins_a, ins_c)):
                return name
        return None

    def check(self, probe: Probe, generator: torch.Generator) -> Tuple[Optional[Violation], Optional[str]]:
        """The probe's largest confirmed leak (or None, with a note when a candidate was not confirmed)."""
        mag = self.gradient(probe, generator)
        allowed = mag.masked_fill(probe.forbidden, 0.0)
        scale = float(allowed.max()) or float(mag.max()) or 1.0
        forbidden = mag.masked_fill(~probe.forbidden, 0.0)
        threshold = GRADIENT_EPS * _eps(self.var) * scale
        if float(forbidden.max()) <= threshold:
            return None, None
        order = forbidden.reshape(-1).argsort(descending=True)[:CANDIDATES].tolist()
        width = forbidden.shape[1]
        for flat in order:
            b, s = flat // width, flat % width
            if float(forbidden[b, s]) <= threshold:
                break
            found = self.confirm(probe, b, s, generator)
            if found is None:
                continue
            output, change, delta = found
            module = self.localize(probe, b, delta)
            where_in = (b, s if probe.same_sample else -1)
            v = Violation(probe.structure, output, where_in, float(forbidden[b, s]) / scale, change, module,
                          expected=_allowed(module, self.model, self.allow))
            if probe.structure == "documents" and not v.expected:
                v.remedy = self.remedy(probe, b, delta)
            return v, None
        return None, (f"a gradient of {float(forbidden.max()) / scale:.2g} reached a forbidden input, but changing "
                      "that input moved no guarded output: not a dependence (counted as none)")


def check_independence(
    model: nn.Module,
    inputs: Any,
    structure: Union[str, Sequence[str]] = "batch",
    *,
    batch_dim: int = 0,
    seq_dim: int = 1,
    document_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    allow: Union[Allow, Sequence[Allow]] = (),
    causal_probes_count: int = 2,
    seed: int = 0,
    generators: Optional[Sequence[Any]] = None,
) -> IndependenceReport:
    """Check that the model's outputs do not depend on inputs they must not.

    Args:
        model: The model (any ``nn.Module``; a Hugging Face model is called with ``**inputs``).
        inputs: A tensor, a tuple of positional arguments, or a dict of keyword arguments
            (``input_ids``, ``attention_mask``, ``position_ids``; ``labels``, ``num_items_in_batch`` and TRL's
            ``fused_lm_head`` are dropped).
        structure: ``"batch"`` (sample i's output does not depend on sample j's input),
            ``"causal"`` (position t's output does not depend on later positions), ``"documents"``
            (packed documents do not depend on each other), ``"padding"`` (real positions do not
            depend on padded ones), or a list of them.
        batch_dim: The batch dimension of the input and of the output.
        seq_dim: Their sequence dimension (used by every structure but ``batch``; ``batch`` uses it
            when both have it).
        document_ids: ``[B, T]`` document index per position (``documents``); default: from
            ``inputs["position_ids"]``, a new document wherever they restart at 0 (or ``seq_idx``, or
            flash-attention's ``cu_seq_lens_q``: :func:`~gradwatch.check.independence.structures.packed_documents`).
        attention_mask: ``[B, T]``, nonzero at real positions (``padding``); default:
            ``inputs["attention_mask"]`` when it is ``[B, T]`` (a 4-D mask, the model's own attention pattern,
            is passed to the model and not read). When known, padded positions are left out of the other structures.
        allow: Modules (names, classes or modules) that may create a dependence by design
            (an MoE router with capacity, say): a dependence first seen in their output is reported as
            expected, not as a leak.
        causal_probes_count: Probes of ``causal``, each cutting every sample at a different place.
        seed: Seed of the random cotangents and changes (the model's own generators are seeded alike
            for every forward and put back).
        generators: The generators the model holds, put back afterwards (default: found by walking the
            model; a watch passes those it already found).

    Returns:
        An :class:`IndependenceReport` (``.ok``, ``.worst``, ``str()``).

    Raises:
        ValueError: An unknown structure, ``documents`` without document ids or restarting position
            ids, ``padding`` without a mask, input and output not sharing the batch/sequence dims.
        TypeError: Inputs or output of a kind it cannot read.

    Example:
        >>> from torch import nn
        >>> leak = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))  # eval mode: no batch mixing
        >>> check_independence(leak, torch.randn(4, 3), "batch").ok
        True
    """
    start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    structures = parse_structures(structure)
    for label, value in (("batch_dim", batch_dim), ("seq_dim", seq_dim), ("causal_probes_count", causal_probes_count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{label}: got {value!r}, expected an integer >= 0")
    if batch_dim == seq_dim:
        raise ValueError(f"batch_dim and seq_dim: both {batch_dim}; they must differ")
    allowed = _validate_allow(allow, model)
    args, kwargs = _call_of(inputs)
    notes: List[str] = []
    for key, why in _LOSS_ONLY.items():
        if key in kwargs:
            kwargs.pop(key)
            notes.append(f"{key} left out of the call: {why}")
    where, primary = _primary(args, kwargs)
    mask = attention_mask if attention_mask is not None else _padding_mask(kwargs, structures, notes)
    # batch alone: every position of a sample at once, unless a padding mask says which positions are real
    seq = any(s != "batch" for s in structures) or (mask is not None and primary.dim() > seq_dim)
    results: Dict[str, StructureResult] = {}
    runner = _Runner(model, args, kwargs, where, primary, seed)
    generator = torch.Generator().manual_seed(seed)
    # every forward starts from the same states of the generators the model holds; they are put back after
    runner.held = HeldGenerators([model]) if generators is None else HeldGenerators.of(generators)
    with _quiet_state(model, runner.held) as state_notes:
        notes += state_notes
        layout = _Layout(batch_dim, seq_dim if seq else None)
        checker = _Checker(model, runner, layout, allowed)
        checker.start()
        batch, length = checker.grid_shape()
        valid = None if mask is None else _mask_of(mask, batch, length, "attention_mask") != 0
        notes.insert(0, f"differentiated with respect to {_describe_input(where, runner)}")
        for name in structures:
            probes = _probes(name, batch, length, valid, document_ids, kwargs, causal_probes_count, generator)
            if isinstance(probes, str):
                results[name] = StructureResult(name, 0, note=probes)
                continue
            result = results[name] = StructureResult(name, len(probes))
            for probe in probes:
                violation, note = checker.check(probe, generator)
                result.note = result.note or note
                if violation is not None and (result.violation is None or violation.change > result.violation.change):
                    result.violation = violation
                if violation is not None and not violation.expected:
                    break  # one confirmed leak per structure: the rest of its probes would cost without telling more
    del checker.out
    return IndependenceReport(results, notes, runner.forwards, checker.backwards, time.perf_counter() - start)


def _describe_input(where: Tuple[str, Any], runner: _Runner) -> str:
    kind, key = where
    what = f"argument {key}" if kind == "arg" else key
    if runner.site is None:
        return f"the input ({what})"
    name = next((n for n, m in runner.model.named_modules() if m is runner.site), "?")
    return f"the output of {name} (the embedding of {what})"


def packed_call_remedy(model: nn.Module, kwargs: Mapping[str, Any]) -> Optional[Tuple[Dict[str, Any], str]]:
    """The packed call as a Hugging Face model masks its documents, and the change in words; None when it is that already.

    transformers' ``create_causal_mask`` reads packed documents from ``position_ids`` only when it is given no 2-D
    ``attention_mask`` and no cache; a causal LM makes a cache whenever ``use_cache`` is true (``config.use_cache``
    by default), in training too.

    Example:
        >>> from types import SimpleNamespace
        >>> m = nn.Linear(1, 1); m.config = SimpleNamespace(use_cache=True)
        >>> packed_call_remedy(m, {"position_ids": torch.tensor([[0, 1, 0]]), "attention_mask": torch.ones(1, 3)})[1]
        'without its all-ones attention_mask and with use_cache=False'
    """
    config = getattr(model, "config", None)
    if config is None or not isinstance(kwargs.get("position_ids"), torch.Tensor):
        return None
    call, words = dict(kwargs), []
    mask = call.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask != 0).all()):  # no padding it would lose
        call.pop("attention_mask")
        words.append("without its all-ones attention_mask")
    if call.get("use_cache", getattr(config, "use_cache", None)):
        call["use_cache"] = False
        words.append("with use_cache=False")
    return (call, " and ".join(words)) if words else None


def _padding_mask(kwargs: Mapping[str, Any], structures: Sequence[str], notes: List[str]) -> Any:
    """The call's ``attention_mask`` where it says which positions are real (``[B, T]``); None for a mask the model takes
    as its attention pattern (``[B, 1, T, T]``: a block-diagonal mask over packed documents), said in a note."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() <= 2:
        return mask
    if "padding" in structures:
        raise ValueError(f"structure 'padding' needs a [batch, sequence] padding mask; inputs['attention_mask'] has shape "
                         f"{tuple(mask.shape)} (the model's own attention pattern): pass attention_mask= 1 at real "
                         "positions, 0 at padded ones")
    notes.append(f"attention_mask of shape {tuple(mask.shape)} given to the model as it is: not read as a padding mask "
                 "(every position taken as real)")
    return None


def _documents(batch: int, length: int, document_ids: Any, kwargs: Mapping[str, Any]) -> torch.Tensor:
    """``[B, T]`` document index per position: ``document_ids=``, else what the packed call says (:func:`packed_documents`)."""
    if document_ids is not None:
        return _mask_of(document_ids, batch, length, "document_ids")
    docs = packed_documents(kwargs)
    if docs is not None:
        name = next(k for k in PACKED_KEYS if packed_documents({k: kwargs.get(k)}) is not None)
        return _mask_of(docs, batch, length, name)
    if kwargs.get("position_ids") is not None:  # one document a row: position ids as given, no restart
        return documents_from_positions(_mask_of(kwargs["position_ids"], batch, length, "position_ids"))
    raise ValueError("structure 'documents' needs document_ids= or inputs['position_ids'] that restart at 0 at each "
                     "document of the packed sequences (or seq_idx, or flash-attention's cu_seq_lens_q); the call's "
                     f"keyword arguments: {sorted(kwargs)}")


def _probes(name: str, batch: int, length: int, valid: Optional[torch.Tensor], document_ids: Any,
            kwargs: Mapping[str, Any], causal_count: int, generator: torch.Generator) -> Union[List[Probe], str]:
    """A structure's probes, restricted to real positions when padding is known; a note when there is nothing to do."""
    if name == "padding":
        if valid is None:
            raise ValueError("structure 'padding' needs attention_mask= (or inputs['attention_mask']): 1 at real "
                             "positions, 0 at padded ones")
        probes = padding_probes(valid)
        return probes or "nothing to check: no padded position in this batch"
    if name == "batch":
        probes = batch_probes(batch, length)
        if not probes:
            return "nothing to check: a batch of one sample"
    elif name == "causal":
        probes = causal_probes(batch, length, causal_count, generator)
        if not probes:
            return "nothing to check: sequences of one position"
    else:
        probes = document_probes(_documents(batch, length, document_ids, kwargs), valid)
        if not probes:
            return "nothing to check: one document per sequence"
    if valid is not None:
        for p in probes:
            p.outputs &= valid
            p.forbidden &= valid
    return probes


__all__ = ["IndependenceReport", "ModelCall", "StructureResult", "Violation", "check_independence", "output_tensor",
           "packed_call_remedy", "STRUCTURES"]
