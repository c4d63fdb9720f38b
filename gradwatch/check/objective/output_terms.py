"""The losses a model's output reports beside its ``loss``, and the coefficient its loss gives each.

A mixture of experts adds a router loss to its data loss inside ``forward`` (transformers' Mixtral, Qwen2-MoE and
OLMoE: ``loss += router_aux_loss_coef * aux_loss``) and reports the router loss on its own (``aux_loss``; Switch
Transformers also ``router_z_loss``). The training part names such a term when training weighs it otherwise than
the step's objective does (:mod:`gradwatch.watch.term_weights`); these two functions find the terms in an output
and, by name, the coefficient the model's loss multiplies each by (an attribute of the model or of its ``config``).

Example:
    >>> import torch
    >>> out = {"loss": torch.tensor(2.0), "aux_loss": torch.tensor(0.5), "logits": torch.ones(2, 3)}
    >>> sorted(output_losses(out))
    ['aux_loss']
    >>> class Config:
    ...     router_aux_loss_coef = 0.01
    >>> class Model(torch.nn.Module):
    ...     config = Config()
    >>> loss_coefficient(Model(), "aux_loss")
    ('router_aux_loss_coef', 0.01)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import torch
from torch import nn

#: Last words of an attribute that holds a term's coefficient (``router_aux_loss_coef``, ``aux_loss_alpha``).
COEFFICIENT_WORDS = ("coef", "coeff", "coefficient", "alpha", "weight", "factor", "scale", "lambda")


def _fields(output: Any) -> Iterator[Tuple[str, Any]]:
    """``(name, value)`` of a mapping (a ``ModelOutput`` is one) or a dataclass; nothing of anything else."""
    if isinstance(output, Mapping):
        yield from ((str(k), v) for k, v in output.items())
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        yield from ((f.name, getattr(output, f.name, None)) for f in dataclasses.fields(output))


def output_losses(output: Any) -> Dict[str, torch.Tensor]:
    """The scalar losses ``output`` reports beside ``loss``: fields named ``*loss*`` holding a real 0-d tensor.

    Example:
        >>> sorted(output_losses({"loss": torch.tensor(1.0), "router_z_loss": torch.tensor(0.1), "n_loss": 3}))
        ['router_z_loss']
    """
    out: Dict[str, torch.Tensor] = {}
    for name, value in _fields(output):
        if (name != "loss" and "loss" in name.lower() and isinstance(value, torch.Tensor) and value.numel() == 1
                and value.is_floating_point()):
            out[name] = value.reshape(())
    return out


def output_loss(output: Any) -> Optional[torch.Tensor]:
    """The ``loss`` field of ``output`` (None when it has none).

    Example:
        >>> float(output_loss({"loss": torch.tensor(1.5)}))
        1.5
    """
    value = dict(_fields(output)).get("loss")
    return value if isinstance(value, torch.Tensor) and value.numel() == 1 else None


def _stem(name: str) -> Optional[str]:
    """The word that names a loss field's term: the one before ``loss`` (``aux`` of ``router_aux_loss``)."""
    words = [w for w in name.lower().replace("-", "_").split("_") if w]
    if "loss" in words:
        before = [w for w in words[:words.index("loss")] if w != "router"]
        return before[-1] if before else None
    words = [w for w in words if w not in ("router",)]
    return words[-1] if words else None


def _numbers(obj: Any) -> Iterator[Tuple[str, float]]:
    for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield name, float(value)
    for name in dir(type(obj)):  # class attributes (a config's defaults)
        value = getattr(type(obj), name, None)
        if not name.startswith("_") and isinstance(value, (int, float)) and not isinstance(value, bool):
            yield name, float(value)


def loss_coefficient(model: nn.Module, name: str) -> Optional[Tuple[str, float]]:
    """``(attribute, value)``: the coefficient the model's loss gives the output's term ``name``, found by name.

    An attribute of the model, then of its ``config``, whose words hold the term's word (``aux`` of ``aux_loss``,
    ``z`` of ``router_z_loss``) and end in one of :data:`COEFFICIENT_WORDS`; None when there is none.

    Example:
        >>> m = nn.Linear(1, 1)
        >>> m.z_loss_weight = 1e-3
        >>> loss_coefficient(m, "router_z_loss"), loss_coefficient(m, "aux_loss")
        (('z_loss_weight', 0.001), None)
    """
    stem = _stem(name)
    if stem is None:
        return None
    for source in (model, getattr(model, "config", None)):
        if source is None:
            continue
        for attr, value in _numbers(source):
            words = attr.lower().split("_")
            if stem in words[:-1] and words[-1] in COEFFICIENT_WORDS:
                return attr, value
    return None


__all__ = ["COEFFICIENT_WORDS", "loss_coefficient", "output_loss", "output_losses"]
