"""Batched evaluation of the perturbed objectives with ``torch.func.functional_call`` + ``torch.vmap``.

The loop path writes ``θ ± t·v`` into a parameter and runs the whole
objective once per perturbation. Here the perturbed copies of one tensor
are stacked, ``(B, *p.shape)``, and the data loss is evaluated for all of
them in one vmapped call of ``loss_fn`` on the (shadow) model, with the
stacked tensor swapped in by :func:`torch.func.functional_call`. The terms
that read only the parameters (regularizers, coupled weight decay) are
evaluated as the loop evaluates them, with the perturbation written in
place: a regularizer may filter on ``p.requires_grad``, which a vmapped
tensor does not report.

Not every model can be vmapped (data-dependent control flow, ``.item()``,
in-place updates of buffers or inputs, ops without a batching rule). The
first batch of each tensor of a model is therefore checked against one loop
evaluation; on any exception or any mismatch beyond the noise floor the
check falls back to the loop, silently, and the decision is remembered for
the model: one ``logger.info`` line, no warnings. A model compiled with
``torch.compile`` is evaluated in the loop from the start (:func:`compiled_modules`). The same comparison is
timed (after the model's first batch, which pays vmap's one-time costs):
a tensor whose batched evaluation costs more per perturbation than a loop
evaluation (ops that vmap runs one by one, a perturbation that makes every
later op batched) is evaluated in the loop from then on.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch import check_model
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    >>> x, y = torch.randn(16, 4), torch.randn(16, 1)
    >>> loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])
    >>> check_model(model, loss, (x, y)).ok
    True
    >>> batched_state(model)["enabled"]
    True
"""

from __future__ import annotations

import logging
import math
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from gradwatch.check.objective.terms import Objective, as_scalar
from gradwatch.check.probes.lines import BatchProbe, Evaluator, Terms

logger = logging.getLogger("gradwatch")

#: Most perturbed copies evaluated in one vmapped call.
MAX_BATCH = 32
#: Memory for the stacked perturbed copies of one tensor in one call, in bytes.
BATCH_BYTES = 64 * 2**20
#: Decide per tensor from timings whether batching pays (False: always batch where it works).
TIME_DECISIONS = True


@dataclass
class _ModelState:
    """What was learned about batching one model (kept while the model lives)."""

    disabled: Optional[str] = None
    settled: Set[Tuple[Any, str]] = field(default_factory=set)
    loop_tensors: Dict[Tuple[Any, str], str] = field(default_factory=dict)
    batches: int = 0
    logged_slow: bool = False


_STATES: "weakref.WeakKeyDictionary[nn.Module, _ModelState]" = weakref.WeakKeyDictionary()


def _state(model: nn.Module) -> _ModelState:
    try:
        st = _STATES.get(model)
        if st is None:
            st = _STATES[model] = _ModelState()
        return st
    except TypeError:  # not weak-referenceable: decide per check
        return _ModelState()


def batched_state(model: nn.Module) -> Dict[str, Any]:
    """What gradwatch decided about batched evaluation for ``model``.

    Returns:
        ``{"enabled": bool, "reason": why the whole model falls back (or None), "batches": vmapped
        calls so far, "loop_tensors": {tensor: why} for tensors where batching did not pay}``.
    """
    st = _STATES.get(model) if _weakrefable(model) else None
    if st is None:
        return {"enabled": True, "reason": None, "batches": 0, "loop_tensors": {}}
    return {"enabled": st.disabled is None, "reason": st.disabled, "batches": st.batches,
            "loop_tensors": {name: why for (_, name), why in st.loop_tensors.items()}}


def reset_batched_state(model: Optional[nn.Module] = None) -> None:
    """Forget the decisions for ``model`` (all models when None): the next check tries batching again."""
    if model is None:
        _STATES.clear()
    elif _weakrefable(model):
        _STATES.pop(model, None)


def _weakrefable(model: Any) -> bool:
    try:
        weakref.ref(model)
        return True
    except TypeError:
        return False


def _owners(model: nn.Module) -> Dict[int, List[Tuple[nn.Module, str]]]:
    """Every (module, attribute) that holds each parameter: tied parameters have several."""
    out: Dict[int, List[Tuple[nn.Module, str]]] = {}
    seen: Set[int] = set()
    for m in model.modules():
        if id(m) in seen:
            continue
        seen.add(id(m))
        for key, value in m._parameters.items():
            if value is not None:
                out.setdefault(id(value), []).append((m, key))
    return out


def _loss_key(loss_fn: Any) -> Any:
    return getattr(loss_fn, "__code__", None) or id(loss_fn)


class BatchedProbe(BatchProbe):
    """Evaluates the check objective at stacked perturbations of one tensor (see the module docstring).

    Args:
        key_model: The model whose decisions are remembered (the live model, not a shadow).
        target: The model evaluated (the shadow copy, or the live model in place).
        objective: The check objective.
        batch: The (cast) batch.
        reseed: Puts the RNG streams in the evaluation state (called before each batch).
        guard: Restores buffers after each batch.
        evaluator: The loop evaluator: validation evaluations go through it, and its
            count grows by the number of perturbations each batch evaluates.
        tolerance: Largest acceptable absolute difference between a batched and a loop
            value of the loss (the noise floor of one evaluation).
        activations: Bytes of one evaluation's activations, where the caller knows them (0: not counted).
    """

    def __init__(self, key_model: nn.Module, target: nn.Module, objective: Objective, batch: Any,
                 reseed: Callable[[], None], guard: Any, evaluator: Evaluator, tolerance: float,
                 activations: int = 0) -> None:
        self.key_model = key_model
        self.activations = max(0, int(activations))
        self.state = _state(key_model)
        self.objective = objective
        self.batch = batch
        self.reseed = reseed
        self.guard = guard
        self.evaluator = evaluator
        self.tolerance = float(tolerance)
        self.target = target
        self.owners = _owners(target)
        self.param_terms = bool(objective.regularizers or objective.weight_decay)
        self.loss_key = _loss_key(objective.loss_fn)
        compiled = compiled_modules(target)
        if compiled:
            self.disable(f"{compiled[0]} is compiled with torch.compile: traced under vmap, dynamo gives up on its "
                         "code and the live model would stop running its compiled graph after the check")

    @property
    def enabled(self) -> bool:
        return self.state.disabled is None

    def wants(self, name: str) -> bool:
        """True when tensor ``name`` should be tried in batches."""
        return self.state.disabled is None and (self.loss_key, name) not in self.state.loop_tensors

    def chunk(self, p: torch.Tensor) -> int:
        """Perturbed copies of ``p`` per vmapped call: each holds the copy and, under vmap, one forward's
        activations (``activations``: a model with a large output, a language model's logits over its vocabulary,
        would otherwise hold 32 of them at once)."""
        per_copy = max(1, p.numel() * p.element_size() + self.activations)
        return max(1, min(MAX_BATCH, BATCH_BYTES // per_copy))

    def disable(self, reason: str) -> None:
        """Fall back to the loop for this model from now on (logged once)."""
        if self.state.disabled is None:
            self.state.disabled = reason
            logger.info("gradwatch: batched evaluation is not available for %s (%s); evaluating one perturbation at a time",
                        type(self.key_model).__name__, reason)

    def __call__(self, name: str, p: torch.Tensor, saved: torch.Tensor, stacked: torch.Tensor) -> Optional[List[Terms]]:
        if not self.wants(name):
            return None
        try:
            start = time.perf_counter()
            losses = self._losses(p, stacked)
            seconds = time.perf_counter() - start
        except Exception as err:  # noqa: BLE001 - anything vmap cannot do means: use the loop
            self.guard.restore_changed()
            self.disable(f"{type(err).__name__}: {_first_line(err)}")
            return None
        if losses is None:
            return None
        self.state.batches += 1
        self.evaluator.count += len(losses)
        out: List[Terms] = [{"loss": v} for v in losses]
        if self.param_terms:
            with torch.no_grad():
                try:
                    for row, terms in zip(stacked, out):
                        p.copy_(row)
                        self.reseed()
                        terms.update({k: float(v) for k, v in self.objective.param_terms(self.target).items()})
                finally:
                    p.copy_(saved)
        key = (self.loss_key, name)
        if key not in self.state.settled:
            loop_seconds = self._validate(p, saved, stacked[0], out[0])
            if loop_seconds is None:
                return None
            per_eval = seconds / len(losses)
            if not TIME_DECISIONS:
                self.state.settled.add(key)
            elif self.state.batches > 1:  # the model's first batch pays vmap's one-time costs: time the next
                self.state.settled.add(key)
                if per_eval > loop_seconds:
                    why = f"a batched evaluation took {per_eval * 1e6:.0f} us, a loop evaluation {loop_seconds * 1e6:.0f} us"
                    self.state.loop_tensors[key] = why
                    if not self.state.logged_slow:
                        self.state.logged_slow = True
                        logger.debug("gradwatch: %s of %s is evaluated one perturbation at a time (%s)",
                                     name, type(self.key_model).__name__, why)
        return out

    def _losses(self, p: torch.Tensor, stacked: torch.Tensor) -> Optional[List[float]]:
        # The stacked copy is swapped in where the model holds p, for the call of loss_fn only
        # (what torch.func.functional_call does, without its per-call walk over the whole model).
        owners = self.owners[id(p)]
        loss_fn, target, batch = self.objective.loss_fn, self.target, self.batch

        def one(row: torch.Tensor) -> torch.Tensor:
            for m, key in owners:
                m._parameters[key] = row  # type: ignore[assignment]  # a plain tensor in the parameter's place, as functional_call
            try:
                return as_scalar("loss_fn", loss_fn(target, batch)).to(torch.float64)
            finally:
                for m, key in owners:
                    m._parameters[key] = p  # type: ignore[assignment]  # the parameter (or its shadow) put back

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.reseed()
            with torch.no_grad():
                values = torch.vmap(one, randomness="same")(stacked)
            self.guard.restore_fast()
        del caught  # vmap's "performance drop" warnings: the timing in _validate decides
        if values.shape != (stacked.shape[0],):
            self.disable(f"the batched loss has shape {tuple(values.shape)}")
            return None
        return values.tolist()

    def _validate(self, p: torch.Tensor, saved: torch.Tensor, row: torch.Tensor, batched: Terms) -> Optional[float]:
        """One loop evaluation at the first perturbation must give the same terms, within the noise floor.

        Returns the wall time of a loop evaluation, or None (and batching is off for the model) on a
        mismatch. With :data:`TIME_DECISIONS` the evaluation runs twice and the faster run counts:
        the first one often runs on cold caches (the engine's own code ran just before it).
        """
        runs = 2 if TIME_DECISIONS else 1
        loop_seconds = float("inf")
        with torch.no_grad():
            try:
                p.copy_(row)
                for _ in range(runs):
                    start = time.perf_counter()
                    loop = self.evaluator()
                    loop_seconds = min(loop_seconds, time.perf_counter() - start)
            finally:
                p.copy_(saved)
        for k, v in loop.items():
            b = batched.get(k)
            same = b is not None and (b == v or (math.isfinite(b) and math.isfinite(v) and abs(b - v) <= self.tolerance))
            if not same:
                self.disable(f"the batched value of {k!r} ({b!r}) differs from a loop evaluation ({v!r})")
                return None
        return loop_seconds


def compiled_modules(model: nn.Module) -> List[str]:
    """Names of the modules compiled with ``torch.compile`` (its wrapper, or ``module.compile()``) in ``model``.

    Such a model is evaluated one perturbation at a time: under ``vmap`` dynamo recompiles the
    module's code, hits a graph break it cannot resume from and marks that code to be skipped,
    for the live model too (the frames are shared), which then runs eagerly for the rest of
    training. Functions compiled with ``torch.compile`` inside ``forward`` are not detected.

    Example:
        >>> compiled_modules(nn.Linear(2, 1))
        []
    """
    names = []
    for name, m in model.named_modules():
        if getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule":
            names.append(f"`{name}`" if name else f"the model ({type(m).__name__})")
    return names


def _first_line(err: Any) -> str:
    text = str(err).strip().splitlines()
    line = text[0] if text else type(err).__name__
    return line if len(line) <= 160 else line[:157] + "..."
