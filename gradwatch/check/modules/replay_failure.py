"""A unit whose forward cannot run alone: checked another way, or "not checked" with a reason the user can act on.

The module form runs each unit alone on the inputs training gave it: a ``float64`` copy of a module, or its own code
with the modules it calls standing in as stubs that replay their recorded outputs (:mod:`~gradwatch.check.modules.stubs`).
Some forwards cannot run so: own code with state of its own (a counter that picks the branch, so the replay calls
another module than training did, or divides by what the counter became), a read the stubs cannot answer. What such a
forward raises is gradwatch's business, never the reason a user reads (``'Stub' object has no attribute 'resnets'``,
``ZeroDivisionError: float division by zero``). So:

- an own-code unit whose first run raised is checked whole instead, where that fits the room (:func:`whole_bytes`)
  and its forward is a function (:func:`stateless`: two runs give the same bits): a ``float64`` copy of the module
  with the modules it calls, on the same inputs, its own parameters and its input judged as before;
- else the reason says in words what could not run (:func:`why_not_alone`), with the words the model's own code
  raised where they are its own; the note's "check it instead" says what to do. The exception is kept for debugging
  (``ModuleCheck.error``, the log at debug level).

Example:
    >>> why_not_alone(AttributeError("'Stub' object has no attribute 'resnets'"), own=True)
    'its own code reads `resnets` of a module it calls, which the stand-in for that module cannot answer'
    >>> why_not_alone(ZeroDivisionError("float division by zero"), own=True)
    'its own code fails when it runs apart from the modules it calls (their recorded outputs standing in)'
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from gradwatch.check.modules.stubs import ReplayMismatch
from gradwatch.check.objective.dropout_off import dropout_off
from gradwatch.check.objective.dtensor import CollectiveInCheck
from gradwatch.check.objective.rng import preserved_rng
from gradwatch.plan.memory import MODULE_BYTES_PER_ENTRY
from gradwatch.plan.units import Unit
from gradwatch.trees import rebuild, tensor_leaves

logger = logging.getLogger("gradwatch")

#: How :attr:`ModuleCheck.error` begins where the forward raised at an evaluation, not at its first run.
EVALUATING = "at an evaluation: "

_NO_ATTRIBUTE = re.compile(r"'(?P<cls>\w+)' object has no attribute '(?P<name>\w+)'")
#: gradwatch's own code: an exception raised there says nothing of the model.
_PACKAGE = Path(__file__).resolve().parents[2]
#: Exceptions Python raises by itself, whose words are about the interpreter, not the model.
_PYTHONS = (ZeroDivisionError, KeyError, AttributeError, IndexError, TypeError, NameError, UnboundLocalError,
            AssertionError, StopIteration, RecursionError, OverflowError)
#: The module form's own stand-ins: their class names are gradwatch's, never the user's.
_STANDINS = ("Stub", "ModelStub", "ModuleView", "OwnCode", "LossCode")


def why_not_alone(err: BaseException, own: bool, evaluating: bool = False) -> str:
    """The reason a unit is not checked, in the user's terms, from what its forward raised when run alone: what it
    reads or calls that the replay cannot give, or what it fails on; never the exception's class or words.

    Args:
        err: What the forward raised.
        own: Whether the unit is a module's own code (the modules it calls stubbed), else a whole module.
        evaluating: Whether it raised at an evaluation of the finite differences (its inputs or parameters moved by a
            small step), not at its first run.

    Example:
        >>> why_not_alone(ReplayMismatch("the own code called `b`, which it did not call in the live forward", "b"),
        ...               own=True)
        'its own code calls `b` when it runs again, which it did not call in training (a forward with state of its own)'
        >>> why_not_alone(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), own=False, evaluating=True)[:50]
        'its forward fails when it runs again near its inpu'
    """
    logger.debug("gradwatch: a unit's forward raised when run alone: %s: %s", type(err).__name__, err)
    return _with_own_words(_why(err, own, evaluating), err)


def _with_own_words(why: str, err: BaseException) -> str:
    """``why``, and the words the model's own code raised with where they are its own: an exception of a class of its
    or a library's (not one Python raises by itself, ``ZeroDivisionError``, ``KeyError``...) whose message names
    nothing of gradwatch's, raised outside gradwatch."""
    words = str(err).strip().splitlines()
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if not words or tb is None or isinstance(err, (ReplayMismatch, *_PYTHONS)) \
            or Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE) \
            or re.search(r"gradwatch|\bStub\b|ModuleView|OwnCode", words[0]):
        return why
    return f"{why}; its code says: {words[0][:200]}"


def _why(err: BaseException, own: bool, evaluating: bool) -> str:
    if isinstance(err, CollectiveInCheck):  # gradwatch's own refusal, written for the user: what and what to do
        return str(err)
    if isinstance(err, ReplayMismatch):
        if err.more:
            return (f"its own code calls `{err.module}` more often when it runs again than in training (a forward "
                    "with state of its own)")
        return (f"its own code calls `{err.module}` when it runs again, which it did not call in training (a forward "
                "with state of its own)")
    if evaluating:
        return ("its forward fails when it runs again near its inputs and parameters (the finite differences): a "
                "forward with state of its own, or an op that fails there")
    found = _NO_ATTRIBUTE.search(str(err)) if isinstance(err, AttributeError) else None
    if found is not None and own:
        of = "a module it calls" if found["cls"] in _STANDINS else f"a module it calls (a {found['cls']})"
        return f"its own code reads `{found['name']}` of {of}, which the stand-in for that module cannot answer"
    if own:
        return "its own code fails when it runs apart from the modules it calls (their recorded outputs standing in)"
    return "its forward fails when it runs alone in float64 on the inputs training gave it"


def uncopyable(err: BaseException) -> str:
    """Why ``copy.deepcopy`` could not copy a module, in its terms: the object it holds that cannot be copied.

    Example:
        >>> uncopyable(TypeError("cannot pickle '_thread.lock' object"))
        'it holds a _thread.lock object, which cannot be copied'
    """
    found = re.search(r"cannot pickle '([\w.]+)' object", str(err))
    return (f"it holds a {found.group(1)} object, which cannot be copied" if found is not None
            else "it holds an object that copy.deepcopy refuses")


def whole_bytes(unit: Unit, children: Dict[str, List[Any]], dtype: torch.dtype = torch.float64) -> int:
    """About what checking an own-code unit whole needs beyond checking its own code: ``dtype`` copies of the
    parameters of the modules it calls (the copy, its gradient, a perturbation), and what their forwards hold, sized
    on the outputs they gave (:data:`~gradwatch.plan.memory.MODULE_BYTES_PER_ENTRY` per entry).

    Example:
        >>> block = nn.Sequential(nn.Linear(4, 4))
        >>> whole_bytes(Unit("", block, kind="own", stubbed=("0",)), {"0": [torch.zeros(2, 4)]})
        864
    """
    own = {id(p) for p in unit.params.values()}
    size = torch.empty((), dtype=dtype).element_size()
    params = sum(p.numel() for p in unit.module.parameters() if id(p) not in own) * size * 3
    outputs = sum(t.numel() for outs in children.values() for o in outs for t in tensor_leaves(o)
                  if t.is_floating_point())
    return int(params + outputs * MODULE_BYTES_PER_ENTRY)


def whole_instead(unit: Unit, error: Optional[str], children: Dict[str, List[Any]], room: float,
                  dtype: torch.dtype = torch.float64) -> bool:
    """Whether a unit whose replay raised (``error``, :attr:`ModuleCheck.error`) is checked whole instead: an own-code
    unit whose first run raised (an evaluation that raises says the forward itself fails near its point, or has state)
    and whose whole check fits ``room`` (the bytes left beside its own code's check).

    Example:
        >>> whole_instead(Unit("", nn.Linear(2, 2), kind="own"), "AttributeError: x", {}, room=float("inf"))
        True
    """
    return unit.kind == "own" and error is not None and not error.startswith(EVALUATING) and \
        whole_bytes(unit, children, dtype) <= room


def stateless(copy: nn.Module, args: Any, kwargs: Any) -> bool:
    """Whether ``copy`` computes the same outputs, bit for bit, when run twice on the same inputs (its dropout off):
    a forward with state of its own (a counter that picks a branch) is no function a finite difference can check.

    Example:
        >>> class Counts(nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.runs = 0
        ...     def forward(self, x):
        ...         self.runs += 1
        ...         return x * self.runs
        >>> stateless(nn.Linear(2, 2), (torch.ones(1, 2),), {}), stateless(Counts(), (torch.ones(1, 2),), {})
        (True, False)
    """
    def run() -> List[torch.Tensor]:
        a, k = rebuild((args, kwargs), lambda t: t.clone())
        with torch.no_grad(), preserved_rng():
            return [t for t in tensor_leaves(copy(*a, **k)) if isinstance(t, torch.Tensor)]

    try:
        with dropout_off(copy):
            first, second = run(), run()
    except Exception:  # noqa: BLE001 - it does not run whole either: not checked, for the reason already given
        return False
    return len(first) == len(second) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(first, second))


def whole_params(copy: nn.Module, unit: Unit) -> Dict[str, nn.Parameter]:
    """The copy's parameters the unit's own code uses, by their name in the copy.

    Example:
        >>> block = nn.Sequential(nn.Linear(2, 2))
        >>> unit = Unit("b", block, params={"b.0.weight": block[0].weight}, kind="own")
        >>> list(whole_params(block, unit))
        ['0.weight']
    """
    prefix = f"{unit.name}." if unit.name else ""
    named = dict(copy.named_parameters())
    return {k[len(prefix):]: named[k[len(prefix):]] for k in unit.params if k[len(prefix):] in named}


__all__ = ["EVALUATING", "stateless", "uncopyable", "whole_bytes", "whole_instead", "whole_params", "why_not_alone"]
