"""The independence part of a watch: which structures to check on the live batch, and its alerts.

``GradWatch(independence=...)`` runs :func:`gradwatch.check_independence` at every check on the
model's inputs of the batch being checked. Those are captured by calling ``loss_fn(model, batch)``
with a forward pre-hook on the model that records the call and stops it at once (no forward runs).
``"auto"`` chooses from the model and that call: a Hugging Face decoder-only causal LM is checked
``causal``, plus ``padding`` when the call carries an ``attention_mask`` with padded positions, plus
``documents`` when the call is packed (its ``position_ids`` restart at 0, or it carries ``seq_idx`` or
flash-attention's ``cu_seq_lens_q``: :func:`~gradwatch.check.independence.structures.packed_documents`); any other
model is checked ``documents`` when the batch and its call are packed, and not checked otherwise (name the
structures to check it).

Example:
    >>> from torch import nn
    >>> IndependencePart("auto").structures_for(nn.Linear(2, 2), (), {}) is None
    True
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from gradwatch.check.independence.check import IndependenceReport, ModelCall, check_independence
from gradwatch.check.independence.report import merge_ranks
from gradwatch.check.independence.structures import INDEPENDENCE_WORDS, PACKED_KEYS, packed_documents, parse_independence
from gradwatch.check.objective.generators import HeldGenerators
from gradwatch.check.objective.rng import preserved_rng
from gradwatch.errors import first_line
from gradwatch.parallel.lockstep import Lockstep
from gradwatch.parallel.shard_check import reshard
from gradwatch.plan.cycle import next_pass
from gradwatch.trees import rebuild, tensor_leaves
from gradwatch.watch.parts.context import CheckContext
from gradwatch.watch.trend import Alert

logger = logging.getLogger("gradwatch")

#: What to do about a broken structure (its alert's last line).
_TODO = (" — look where it starts: a mask, position ids, or an op that mixes samples or positions (a normalization's "
         "statistics over the batch, a pooling or a reshape across samples); if the model means it, do not declare "
         "that structure")

#: Samples a check of structures within one sample (``causal``, ``padding``) runs on: each probe is a backward pass of
#: the model, and a leak within a sample is the model's code, the same in every sample (TRL's first check was mostly
#: these probes on its whole batch: docs/costs.md).
WITHIN_SAMPLES = 2


def within_samples(args: tuple, kwargs: dict, structures: Sequence[str]) -> Tuple[Tuple[tuple, dict], Optional[str]]:
    """The call cut to its first :data:`WITHIN_SAMPLES` samples (and as many more as reach its first padded one) where
    every structure is one within a sample, with a note saying so; else the call as it is and None. The samples kept
    are the first ones, so that positions named in a report are the batch's.

    Example:
        >>> ids, mask = torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3)
        >>> mask[3, 0] = 0
        >>> (_, kw), note = within_samples((), {"input_ids": ids, "attention_mask": mask}, ["causal", "padding"])
        >>> kw["input_ids"].shape[0], note
        (4, "independence checked on the batch's first 4 of 4 samples (a leak within a sample is the model's code)")
        >>> (_, kw), _ = within_samples((), {"input_ids": ids}, ["causal"])
        >>> kw["input_ids"].shape[0]
        2
    """
    if not structures or not set(structures) <= {"causal", "padding"}:
        return (args, kwargs), None
    first = next(tensor_leaves((args, kwargs)), None)
    size = int(first.shape[0]) if first is not None and first.dim() else 0
    keep = WITHIN_SAMPLES
    mask = kwargs.get("attention_mask")
    if "padding" in structures and isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == size:
        padded = (mask == 0).any(dim=1).nonzero()
        if padded.numel():
            keep = max(keep, int(padded[0]) + 1)
    if size <= WITHIN_SAMPLES:
        return (args, kwargs), None
    keep = min(keep, size)
    cut = (args, kwargs) if keep == size else rebuild((args, kwargs), lambda t: t[:keep] if t.dim() and t.shape[0] == size else t)
    return cut, f"independence checked on the batch's first {keep} of {size} samples (a leak within a sample is the model's code)"


class _Captured(Exception):
    """Raised by the capturing pre-hook: the model's call is recorded and the forward is not run."""


def capture_call(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any) -> Optional[Tuple[tuple, dict]]:
    """``(args, kwargs)`` of the first call of ``model`` that ``loss_fn(model, batch)`` makes (None if none)."""
    seen: List[Tuple[tuple, dict]] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((args, dict(kwargs)))
        raise _Captured

    handle = model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    try:
        with torch.no_grad():
            loss_fn(model, batch)
    except _Captured:
        pass
    finally:
        handle.remove()
    return seen[0] if seen else None


def _hf_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face decoder-only model with a language-modelling head."""
    if "transformers" not in sys.modules:
        return False
    base = getattr(type(model), "get_base_model", None)  # a PEFT model: the model it wraps says what it is
    if callable(base):
        model = base(model)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    name = type(model).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def packed_batch(batch: Any) -> bool:
    """Whether a batch may be a packed call (keyword arguments naming its documents: :data:`PACKED_KEYS`); only then is
    the model call of a model other than a Hugging Face causal LM captured under ``"auto"``.

    Example:
        >>> packed_batch({"input_ids": torch.zeros(1, 4), "position_ids": torch.zeros(1, 4)}), packed_batch(torch.zeros(2))
        (True, False)
    """
    kwargs = batch if isinstance(batch, Mapping) else getattr(batch, "kwargs", None)
    return isinstance(kwargs, Mapping) and any(isinstance(kwargs.get(k), torch.Tensor) for k in PACKED_KEYS)


class IndependencePart:
    """What the watch checks for independence, and the alerts it raises (a part: see :class:`~gradwatch.watch.parts.context.Part`).

    Args:
        option: The ``independence`` option (see :func:`parse_independence`).
        cooldown: Checks during which the same leak (structure and module) does not alert again.

    Example:
        >>> part = IndependencePart(["causal"])
        >>> part.enabled, part.alerts(0, None), part.state_dict()
        (True, [], {'checks': 1, 'last': []})
    """

    name = "independence"

    def __init__(self, option: Any, cooldown: int = 10) -> None:
        self.option = parse_independence(option)
        self.cooldown = cooldown
        self._last: Dict[Tuple[str, Optional[str]], int] = {}
        self._checks = 0

    @property
    def enabled(self) -> bool:
        """Whether the ``independence`` option asks for any check."""
        return self.option is not None

    @staticmethod
    def due(checks: int, cycle: Optional[int]) -> Optional[int]:
        """None when a check that follows ``checks`` checks runs the part, else the number of the check that next does:
        the first check of each pass of ``cycle`` (K) checks, and every check while K is 1 or not known yet.

        A leak between samples or positions is the model's code, as a backward formula is: it is looked for once
        in the K checks in which every op and parameter row is checked, not at each of them (at GPT-2's size the
        check is a forward and two backward passes through the LM head, most of a training step).

        Example:
            >>> [IndependencePart.due(n, 4) for n in range(6)], IndependencePart.due(3, None)
            ([None, 4, 4, 4, None, 8], None)
        """
        return next_pass(checks, cycle)

    def structures_for(self, model: nn.Module, args: tuple, kwargs: dict) -> Optional[List[str]]:
        """The structures to check on this call (None: nothing)."""
        if self.option is None:
            return None
        if self.option != "auto":
            return list(self.option)
        packed = packed_documents(kwargs) is not None
        if not _hf_causal_lm(model):
            return ["documents"] if packed else None
        out = ["causal"]
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask == 0).any()):
            out.append("padding")
        if packed:
            out.append("documents")
        return out

    def skips(self, model: nn.Module, batch: Any) -> bool:
        """Whether ``"auto"`` leaves this check alone without capturing the model call: neither a Hugging Face causal LM
        nor a batch that may be packed (:func:`packed_batch`)."""
        return self.option == "auto" and not _hf_causal_lm(model) and not packed_batch(batch)

    def run(self, check: CheckContext) -> Optional[IndependenceReport]:
        """The part on one check: its report put in ``check.report.independence`` (and returned); why it was not
        checked, or that it failed, becomes a note of the report (the other parts' verdicts stand).

        Distributed, every rank's batch is checked: under DDP (and on a gathered replica) each rank checks its own
        on its own copy, the ranks' reports merged with theirs
        (:func:`gradwatch.check.independence.report.merge_ranks`); a model sharded with FSDP2 is checked on the
        live model by every rank together, one rank's batch after the other (:meth:`on_shards`).
        """
        report = check.report
        if report is None or not self.enabled:
            return None
        ctx = check.watch
        if ctx.by_shard and ctx.dist is not None:
            return self.on_shards(check)
        try:
            with ctx.recorder_paused():
                report.independence, why = self.check_call(check.target, ctx.objective.loss_fn, check.batch,
                                                           check.opts.seed, ctx.held_generators())
        except Exception as exc:  # noqa: BLE001 - the user's model or inputs: say it, keep the other parts
            logger.debug("gradwatch: the independence check raised", exc_info=exc)
            why = ("independence not checked: probing the model on the watched batch failed "
                   f"({first_line(exc)}); the other parts stand")
        if why:
            report.notes.append(why)
        return report.independence

    def on_shards(self, check: CheckContext) -> Optional[IndependenceReport]:
        """Every rank's batch checked on the live sharded model, by every rank together.

        The live model's forwards all-gather, and a check's passes depend on its batch (the leaks it confirms): so
        the ranks exchange the model calls of their batches (captured before the model runs: no collective),
        then each call is checked by every rank alike, one after the other (the same passes, so the same
        collectives, in the same order), between agreement points (:class:`~gradwatch.parallel.lockstep.Lockstep`).
        A rank that raises there stops the others at their next point: the part is a note on every rank, the
        other parts' verdicts stand. The merged report is rank 0's to send (the ranks hold the same).
        """
        ctx, report = check.watch, check.report
        assert report is not None and ctx.dist is not None
        model, seed = check.target, check.opts.seed
        if self.skips(model, check.batch):
            return None
        generators = ctx.held_generators()
        mine: Any = None
        try:
            held = HeldGenerators.of(generators)
            with ctx.recorder_paused(), preserved_rng():
                call = capture_call(model, ctx.objective.loss_fn, check.batch)
            held.reset()
            mine = "loss_fn never calls the model itself" if call is None else call
        except Exception as exc:  # noqa: BLE001 - the user's loss_fn: said on every rank, the others still checked
            mine = f"loss_fn failed when its model call was captured ({first_line(exc)})"
        calls = ctx.dist.everyone(mine, "the model calls of the independence check")
        found: List[Tuple[int, Optional[IndependenceReport]]] = []
        try:
            with Lockstep(ctx.dist, model), ctx.recorder_paused():
                for rank, call in enumerate(calls):
                    if isinstance(call, str):
                        report.notes.append(f"independence not checked on the batch of rank {rank}: {call}")
                        continue
                    structures = self.structures_for(model, *call)
                    if structures:
                        found.append((rank, check_independence(model, ModelCall(*call), structures, seed=seed,
                                                               generators=generators)))
        except Exception as exc:  # noqa: BLE001 - every rank stopped at the same point: a note, the rest stands
            logger.debug("gradwatch: the independence check raised on the shards", exc_info=exc)
            report.notes.append("independence not checked: probing the sharded model failed on a rank "
                                f"({first_line(exc)}); the other parts stand")
            return None
        finally:
            reshard(model)
        merged = merge_ranks(found)
        if ctx.dist.is_main:
            report.independence = merged
        return merged

    def check_call(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any, seed: int,
                   generators: Sequence[Any] = ()) -> Tuple[Optional[IndependenceReport], Optional[str]]:
        """The check on the batch's model call: ``(report, None)``, or ``(None, why not)``; None, None: off.

        ``generators``: those the model and ``loss_fn`` hold; put back afterwards, as are torch's, numpy's
        and ``random``'s global ones (capturing the call runs ``loss_fn`` up to the model's forward).
        """
        if self.option is None or self.skips(model, batch):
            return None, None
        held = HeldGenerators.of(generators)
        try:
            with preserved_rng():
                call = capture_call(model, loss_fn, batch)
            held.reset()
            if call is None:  # said where asked for, or for a causal LM; a packed batch of another model: silent
                said = self.option != "auto" or _hf_causal_lm(model)
                return None, "independence not checked: loss_fn never calls the model itself" if said else None
            args, kwargs = call
            structures = self.structures_for(model, args, kwargs)
            if not structures:
                return None, None
            (args, kwargs), cut = within_samples(args, kwargs, structures)
            report = check_independence(model, ModelCall(args, kwargs), structures, seed=seed, generators=generators)
            if cut:
                report.notes.append(cut)
            return report, None
        finally:
            held.reset()

    def alerts(self, step: int, results: Optional[IndependenceReport]) -> List[Alert]:
        """One ``independence`` alert per broken structure (silent for ``cooldown`` checks after it alerted)."""
        self._checks += 1
        if results is None:
            return []
        out = []
        for v in results.violations:
            key = (v.structure, v.module)
            last = self._last.get(key)
            if last is not None and self._checks - last <= self.cooldown:
                continue
            self._last[key] = self._checks
            where = "*" if v.module is None else (v.module or "(model forward)")
            out.append(Alert(step=step, tensor=where, kind="independence", severity="error", value=v.change,
                             baseline=None, message=f"step {step}: {v.structure} independence broken: {v.describe()}{_TODO}",
                             part="independence"))
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"checks": self._checks, "last": [[s, m, c] for (s, m), c in self._last.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._checks = int(state.get("checks", 0))
        self._last = {(s, m): int(c) for s, m, c in state.get("last", [])}


__all__: Sequence[str] = ["INDEPENDENCE_WORDS", "IndependencePart", "capture_call", "parse_independence"]
