"""One call of :func:`~gradwatch.check.independence.check.check_independence` at work (:class:`Checker`): a probe's
gradient at the forbidden inputs, a candidate confirmed by a finite change, and the module where the dependence starts."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from gradwatch.check.independence._call import Layout, Runner, packed_call_remedy
from gradwatch.check.independence.report import Violation
from gradwatch.check.independence.structures import Probe

#: Gradient at a forbidden input, relative to the largest allowed one, above which it is a candidate (times eps).
GRADIENT_EPS = 8.0
#: Change of a guarded output, relative to the output's scale, above which a finite change confirms (times eps).
CHANGE_EPS = 8.0
#: Candidates confirmed per probe at most (the largest forbidden gradients first).
CANDIDATES = 3

Allow = Union[str, type, nn.Module]


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


def _eps(t: torch.Tensor) -> float:
    return float(torch.finfo(t.dtype).eps) if t.is_floating_point() else float(torch.finfo(torch.float32).eps)


class Checker:
    """One call of :func:`~gradwatch.check.independence.check.check_independence`: the graph, the probes, confirmation
    and localization."""

    def __init__(self, model: nn.Module, runner: Runner, layout: Layout, allow: Sequence[Allow]) -> None:
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
        # output (costly over a language model's logits, the more in float64).
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
        again = Runner(self.model, runner.args, kwargs, runner.where, primary, runner.seed)
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
