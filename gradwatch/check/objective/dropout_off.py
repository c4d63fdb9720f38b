"""Dropout modules turned off for a check, and put back as they were."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, List, Tuple

from torch import nn
from torch.nn.modules.dropout import _DropoutNd

if TYPE_CHECKING:
    from gradwatch.check.objective.functional_dropout import DropoutRecord


def _has_dropout_prob(module: nn.Module) -> bool:
    return isinstance(module, (nn.MultiheadAttention, nn.RNNBase)) and float(getattr(module, "dropout", 0.0)) > 0


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _layerdrop(name: str, module: nn.Module, configs: set) -> List[str]:
    """Layerdrop a module in train mode applies: its ``layerdrop`` attribute, or its (transformers) config's
    ``*layerdrop`` fields (each config once)."""
    where = name or type(module).__name__
    found = []
    if _positive(getattr(module, "layerdrop", None)):
        found.append(f"layerdrop {module.layerdrop:g} in `{where}`")
    config = module.__dict__.get("config")
    if config is not None and id(config) not in configs:
        configs.add(id(config))
        fields = getattr(config, "__dict__", {})
        found.extend(f"layerdrop {v:g} (config.{k} of `{where}`)" for k, v in fields.items()
                     if k.endswith("layerdrop") and _positive(v))
    return found


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator["DropoutRecord"]:
    """Switch every dropout off for the duration, restoring flags and probabilities after.

    Dropout modules go to eval, ``MultiheadAttention``/RNN ``dropout`` probabilities to 0, and
    functional dropout calls made meanwhile in this thread run with training off
    (:class:`gradwatch.check.objective.functional_dropout.FunctionalDropoutOff`). Yields a
    :class:`gradwatch.check.objective.functional_dropout.DropoutRecord` of what was switched off; call its ``settle()``
    after the first forward (the counts are per forward). Layerdrop (a module attribute
    ``layerdrop`` > 0, or a transformers config's ``layerdrop``/``encoder_layerdrop``/... fields)
    is recorded as staying on.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)).train()
        >>> with dropout_off(m) as record:
        ...     m[1].training
        False
        >>> m[1].training, record.modules
        (True, 1)
    """
    from gradwatch.check.objective.functional_dropout import DropoutRecord, FunctionalDropoutOff

    record = DropoutRecord()
    configs: set = set()
    flags: List[Tuple[nn.Module, bool]] = []
    probs: List[Tuple[Any, float]] = []  # modules with a float `dropout` attribute
    for name, module in model.named_modules():
        if isinstance(module, _DropoutNd):
            if module.training and float(module.p) > 0:
                record.modules += 1
            flags.append((module, module.training))
            module.training = False
        elif _has_dropout_prob(module):
            record.probabilities += 1
            probs.append((module, module.dropout))
            module.dropout = 0.0
        if module.training:
            record.stays_on.extend(_layerdrop(name, module, configs))
    mode = FunctionalDropoutOff(record)
    try:
        with mode:
            yield record
    finally:
        for module, flag in flags:
            module.training = flag
        for module, p in probs:
            module.dropout = p
