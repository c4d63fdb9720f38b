"""Options of a gradient check, validated once, with one name everywhere.

The same names are keywords of :func:`gradwatch.check_model`, keys of the
YAML config, ``--kebab-case`` CLI flags and fields of the JSONL records.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, List, Optional, Tuple, Union

import torch

from .errors import ConfigError
from .check.numeric import DEFAULT_BANDS, Verdict, validate_bands

#: Largest ``eps`` accepted: the step is relative to ``|theta|``, and a central difference over a larger
#: one measures the curvature of the objective rather than its gradient.
MAX_EPS = 0.1

_DTYPE_NAMES = {
    "float64": torch.float64,
    "double": torch.float64,
    "float32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(value: Any) -> Optional[torch.dtype]:
    """``torch.float64``/``numpy.float64``/``"float64"`` -> float64, ``"float32"`` -> float32, ``None``/``"none"`` -> in place.

    Example:
        >>> parse_dtype("float64")
        torch.float64
        >>> parse_dtype(None) is None
        True
    """
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "native", "")):
        return None
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ConfigError(f"dtype: got {value}, expected a floating dtype (float64, float32) or None for in place")
        return value
    if isinstance(value, str) and value.lower().replace("torch.", "") in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower().replace("torch.", "")]
    converted = torch_dtype_of_numpy(value)
    if converted is not None:
        if not converted.is_floating_point:
            raise ConfigError(f"dtype: got {value!r}, expected a floating dtype (float64, float32) or None for in place")
        return converted
    raise ConfigError(f"dtype: got {value!r}, expected 'float64', 'float32', torch.float64, numpy.float64 "
                      "or None (check in place)")


def torch_dtype_of_numpy(value: Any) -> Optional[torch.dtype]:
    """The torch dtype of a numpy dtype or scalar type (``numpy.float64``), None for anything else.

    Example:
        >>> import numpy
        >>> torch_dtype_of_numpy(numpy.float64), torch_dtype_of_numpy("float64")
        (torch.float64, None)
    """
    if isinstance(value, (str, bytes)) or value is None:
        return None
    import numpy as np

    if not (isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic))):
        return None
    try:
        return torch.from_numpy(np.empty(0, dtype=np.dtype(value))).dtype
    except TypeError:  # a numpy dtype torch has no counterpart for (strings, objects)
        return None


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: got {value!r} ({type(value).__name__}), expected an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{name}: got {value!r}, expected an integer >= {minimum}")
    return value


@dataclass
class CheckOptions:
    """Options shared by every gradient check.

    Attributes:
        coords: Coordinates sampled per tensor (half the largest ``|grad|``, half random); >= 1.
        directions: Random Rademacher directions per tensor; >= 0.
        eps: Finite-difference step; ``None`` picks ``machine_eps ** (1/3)`` scaled by ``|θ|``, of the coarsest
            precision the objective measurably computes in (see :mod:`gradwatch.check.precision`).
        bands: Upper bounds of EXCELLENT, ACCEPTABLE, SUSPICIOUS (the chapter's 1e-7, 1e-4, 1e-2).
        fail_at: Verdict from which a tensor counts as failing ("suspicious" or "wrong").
        seed: Sampling seed.
        dtype: Evaluate on a shadow copy in this dtype (default float64); ``None`` checks in place.
        detect_kinks: Re-examine disagreeing samples for non-differentiable points.
        per_term: Also check each term of the objective (loss, each regularizer) on its own.
        tensors: Glob patterns of parameter names to check (``None``: all trainable).

    Example:
        >>> CheckOptions(coords=4).directions
        4
        >>> CheckOptions(coords=0)
        Traceback (most recent call last):
        ...
        gradwatch.errors.ConfigError: coords: got 0, expected an integer >= 1
    """

    coords: int = 8
    directions: int = 4
    eps: Optional[float] = None
    bands: Tuple[float, float, float] = DEFAULT_BANDS
    fail_at: Union[str, Verdict] = Verdict.SUSPICIOUS
    seed: int = 0
    dtype: Optional[Union[str, torch.dtype]] = torch.float64
    detect_kinks: bool = True
    per_term: bool = False
    tensors: Optional[List[str]] = None

    def __post_init__(self) -> None:
        self.coords = _int("coords", self.coords, 1)
        self.directions = _int("directions", self.directions, 0)
        if self.eps is not None:
            if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0 < self.eps <= MAX_EPS:
                raise ConfigError(
                    f"eps: got {self.eps!r}, expected a number > 0 and <= {MAX_EPS:g} (a relative step: larger steps "
                    "measure curvature, not the gradient) or None (step chosen from the dtype)"
                )
            self.eps = float(self.eps)
        try:
            self.bands = validate_bands(self.bands)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        try:
            self.fail_at = Verdict.parse(self.fail_at)
        except ValueError as err:
            raise ConfigError(f"fail_at: {err}") from None
        if self.fail_at not in (Verdict.SUSPICIOUS, Verdict.WRONG):
            raise ConfigError(f"fail_at: got {self.fail_at.value!r}, expected 'suspicious' or 'wrong'")
        self.seed = _int("seed", self.seed, 0)
        self.dtype = parse_dtype(self.dtype)
        for name in ("detect_kinks", "per_term"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: got {getattr(self, name)!r}, expected true or false")
        if self.tensors is not None:
            if isinstance(self.tensors, str):
                self.tensors = [self.tensors]
            if not all(isinstance(t, str) for t in self.tensors):
                raise ConfigError(f"tensors: got {self.tensors!r}, expected a list of name patterns like 'encoder.*'")
            if not self.tensors:
                raise ConfigError("tensors: got [], expected a non-empty list of name patterns like 'encoder.*', "
                                  "or null to check every trainable parameter")
            self.tensors = list(self.tensors)

    @classmethod
    def names(cls) -> List[str]:
        """The option names, in declaration order."""
        return [f.name for f in fields(cls)]
