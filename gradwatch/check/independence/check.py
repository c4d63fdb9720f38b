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
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn

from gradwatch.check.independence._call import (
    INPUT_KEYS,
    LOSS_ONLY,
    Layout,
    ModelCall,
    Runner,
    call_of,
    output_tensor,
    packed_call_remedy,
    primary_input,
)
from gradwatch.check.independence._checker import CANDIDATES, CHANGE_EPS, GRADIENT_EPS, Allow, Checker
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
from gradwatch.check.objective.rng import preserved_rng


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



def _mask_of(value: Any, batch: int, length: int, what: str) -> torch.Tensor:
    mask = torch.as_tensor(value).detach().cpu()
    if mask.dim() == 1:
        mask = mask.unsqueeze(0).expand(batch, -1)
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{what}: got shape {tuple(mask.shape)}, expected ({batch}, {length}) (batch, sequence)")
    return mask



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
    structures, allowed = _validated(model, structure, batch_dim, seq_dim, causal_probes_count, allow)
    args, kwargs, notes = _checked_call(inputs)
    where, primary = primary_input(args, kwargs)
    mask = attention_mask if attention_mask is not None else _padding_mask(kwargs, structures, notes)
    # batch alone: every position of a sample at once, unless a padding mask says which positions are real
    seq = any(s != "batch" for s in structures) or (mask is not None and primary.dim() > seq_dim)
    runner = Runner(model, args, kwargs, where, primary, seed)
    # every forward starts from the same states of the generators the model holds; they are put back after
    runner.held = HeldGenerators([model]) if generators is None else HeldGenerators.of(generators)
    checker = Checker(model, runner, Layout(batch_dim, seq_dim if seq else None), allowed)
    results = _check_structures(checker, structures, mask, document_ids, kwargs, causal_probes_count, seed, notes)
    return IndependenceReport(results, notes, runner.forwards, checker.backwards, time.perf_counter() - start)


def _validated(model: Any, structure: Union[str, Sequence[str]], batch_dim: int, seq_dim: int, causal_probes_count: int,
               allow: Any) -> Tuple[Tuple[str, ...], List[Allow]]:
    """The arguments of :func:`check_independence` checked: ``(structures, allowed modules)``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    structures = parse_structures(structure)
    for label, value in (("batch_dim", batch_dim), ("seq_dim", seq_dim), ("causal_probes_count", causal_probes_count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{label}: got {value!r}, expected an integer >= 0")
    if batch_dim == seq_dim:
        raise ValueError(f"batch_dim and seq_dim: both {batch_dim}; they must differ")
    return structures, _validate_allow(allow, model)


def _checked_call(inputs: Any) -> Tuple[list, dict, List[str]]:
    """``(args, kwargs, notes)`` of the checked call: the keywords that turn the output into a loss left out."""
    args, kwargs = call_of(inputs)
    notes: List[str] = []
    for key, why in LOSS_ONLY.items():
        if key in kwargs:
            kwargs.pop(key)
            notes.append(f"{key} left out of the call: {why}")
    return args, kwargs, notes


def _check_structures(checker: Checker, structures: Sequence[str], mask: Any, document_ids: Any,
                      kwargs: Mapping[str, Any], causal_count: int, seed: int, notes: List[str]
                      ) -> Dict[str, StructureResult]:
    """Each structure's probes on the model in its quiet state (:func:`_quiet_state`); ``notes`` gets what it says."""
    runner = checker.runner
    results: Dict[str, StructureResult] = {}
    generator = torch.Generator().manual_seed(seed)
    with _quiet_state(checker.model, cast(HeldGenerators, runner.held)) as state_notes:
        notes += state_notes
        checker.start()
        batch, length = checker.grid_shape()
        valid = None if mask is None else _mask_of(mask, batch, length, "attention_mask") != 0
        notes.insert(0, f"differentiated with respect to {_describe_input(runner.where, runner)}")
        for name in structures:
            probes = _probes(name, batch, length, valid, document_ids, kwargs, causal_count, generator)
            results[name] = _check_structure(checker, name, probes, generator)
    del checker.out
    return results


def _check_structure(checker: Checker, name: str, probes: Union[List[Probe], str], generator: torch.Generator
                     ) -> StructureResult:
    """One structure's result: its largest confirmed leak (a note where there was nothing to check)."""
    if isinstance(probes, str):
        return StructureResult(name, 0, note=probes)
    result = StructureResult(name, len(probes))
    for probe in probes:
        violation, note = checker.check(probe, generator)
        result.note = result.note or note
        if violation is not None and (result.violation is None or violation.change > result.violation.change):
            result.violation = violation
        if violation is not None and not violation.expected:
            break  # one confirmed leak per structure: the rest of its probes would cost without telling more
    return result


def _describe_input(where: Tuple[str, Any], runner: Runner) -> str:
    kind, key = where
    what = f"argument {key}" if kind == "arg" else key
    if runner.site is None:
        return f"the input ({what})"
    name = next((n for n, m in runner.model.named_modules() if m is runner.site), "?")
    return f"the output of {name} (the embedding of {what})"


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


__all__ = ["CANDIDATES", "CHANGE_EPS", "GRADIENT_EPS", "INPUT_KEYS", "Allow", "IndependenceReport", "ModelCall",
           "StructureResult", "Violation", "check_independence", "output_tensor", "packed_call_remedy", "STRUCTURES"]
