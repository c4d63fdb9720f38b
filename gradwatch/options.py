"""Options of a gradient check, validated once, with one name everywhere.

The same names are keywords of :func:`gradwatch.check_model`, keys of the
YAML config, ``--kebab-case`` CLI flags and fields of the JSONL records.

Each option is declared once, as a dataclass field made by :func:`option`:
its name, type, default and one-line help. The dataclasses, the YAML
validation, the CLI flags, the docstrings and the docs' options table all read
that declaration (see :func:`gradwatch.config.options_table`): adding an
option is adding one field (plus its validation when a type check is not enough).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from gradwatch.bands import DEFAULT_BANDS, Verdict, validate_bands
from gradwatch.errors import ConfigError

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


def option(default: Any, help: str) -> Any:
    """Declare an option: a dataclass field with its default and its one-line ``help`` (the one description).

    Example:
        >>> from dataclasses import dataclass, fields
        >>> @dataclass
        ... class Demo:
        ...     steps: int = option(3, "how many steps; >= 1")
        >>> Demo().steps, fields(Demo)[0].metadata["help"]
        (3, 'how many steps; >= 1')
    """
    return field(default=default, metadata={"help": help})


def option_help(cls: Any) -> Dict[str, str]:
    """``{name: help}`` of every option of an options dataclass, in declaration order.

    Example:
        >>> option_help(CheckOptions)["coords"]
        'coordinates sampled per checked tensor (half largest |grad|, half random); >= 1'
    """
    return {f.name: f.metadata["help"] for f in fields(cls) if "help" in f.metadata}


def document_options(cls: Any) -> Any:
    """Append an ``Attributes:`` section built from each option's help to the class docstring."""
    lines = [f"        {name}: {text}" for name, text in option_help(cls).items()]
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Attributes:\n" + "\n".join(lines) + "\n"
    return cls


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: got {value!r} ({type(value).__name__}), expected an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{name}: got {value!r}, expected an integer >= {minimum}")
    return value


@dataclass
class CheckOptions:
    """Options shared by every gradient check (each field's help is listed under Attributes below).

    With ``eps=None`` the step follows the coarsest precision the objective measurably computes in
    (see :mod:`gradwatch.check.objective.precision`).

    Example:
        >>> CheckOptions(coords=4).directions
        4
        >>> CheckOptions(coords=0)
        Traceback (most recent call last):
        ...
        gradwatch.errors.ConfigError: coords: got 0, expected an integer >= 1
    """

    coords: int = option(8, "coordinates sampled per checked tensor (half largest |grad|, half random); >= 1")
    directions: int = option(4, "random Rademacher directions per checked tensor; >= 0")
    eps: Optional[float] = option(
        None, "finite-difference step relative to |theta|, 0 < eps <= 0.1; null picks eps(dtype)**(1/3) scaled by |theta|")
    bands: Tuple[float, float, float] = option(
        DEFAULT_BANDS, "upper bounds of EXCELLENT, ACCEPTABLE, SUSPICIOUS for the judged rel_diff")
    fail_at: Union[str, Verdict] = option(Verdict.SUSPICIOUS, "verdict from which a tensor counts as failing: suspicious or wrong")
    seed: int = option(0, "base sampling seed (changes every check so coverage accumulates); >= 0")
    dtype: Optional[Union[str, torch.dtype]] = option(
        torch.float64, "evaluate the check on a shadow copy in this dtype (float64, float32; in Python also torch.float64 "
        "or numpy.float64); null checks in place")
    detect_kinks: bool = option(True, "re-examine disagreeing samples for non-differentiable points before calling them wrong")
    per_term: bool = option(False, "also check each term of the objective (loss, each regularizer) on its own")
    tensors: Optional[List[str]] = option(
        None, "glob patterns of parameter names to check (e.g. ['encoder.*']); null checks all trainable")
    surrogates: Optional[List[Any]] = option(
        None, "modules whose gradient is a surrogate by design (straight-through, spikes): names, classes or class "
        "names; the check cuts the objective there instead of comparing them (torch's FakeQuantize without it)")

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
        if self.surrogates is not None:
            if isinstance(self.surrogates, (str, type)):
                self.surrogates = [self.surrogates]
            if not all(isinstance(m, (str, type)) for m in self.surrogates):
                raise ConfigError(f"surrogates: got {self.surrogates!r}, expected a list of module names "
                                  "('quant', 'encoder.spike'), module classes or class names ('StraightThrough')")
            self.surrogates = list(self.surrogates)

    @property
    def fail_verdict(self) -> Verdict:
        """``fail_at`` as the :class:`Verdict` it is normalized to."""
        return Verdict.parse(self.fail_at)

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        """``dtype`` as the ``torch.dtype`` it is normalized to (None: in place)."""
        return parse_dtype(self.dtype)

    @classmethod
    def names(cls) -> List[str]:
        """The option names, in declaration order."""
        return [f.name for f in fields(cls)]


document_options(CheckOptions)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}: got {value!r}, expected an integer >= {minimum}")
    return value


def trend_options(bands: Sequence[float] = DEFAULT_BANDS, baseline_checks: int = 3, drift_window: int = 3,
                  drift_decades: float = 2.0, alert_cooldown: int = 10) -> Tuple[Tuple[float, float, float], int, int, float, int]:
    """The options of :class:`gradwatch.TrendTracker`, validated: ``(bands, baseline_checks, drift_window, drift_decades, alert_cooldown)``.

    Raises:
        ConfigError: A value out of range, naming the option and what is accepted.

    Example:
        >>> trend_options((1e-7, 1e-4, 1e-2), 3, 3, 2, 10)
        ((1e-07, 0.0001, 0.01), 3, 3, 2.0, 10)
    """
    try:
        checked: Tuple[float, float, float] = validate_bands(bands)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if isinstance(drift_decades, bool) or not isinstance(drift_decades, (int, float)) or not drift_decades > 0:
        raise ConfigError(f"drift_decades: got {drift_decades!r}, expected a number > 0 (powers of ten)")
    return (checked, _check_int("baseline_checks", baseline_checks, 1), _check_int("drift_window", drift_window, 1),
            float(drift_decades), _check_int("alert_cooldown", alert_cooldown, 0))
