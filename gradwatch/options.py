"""Options of a gradient check, validated once, with one name everywhere.

The same names are keywords of :func:`gradwatch.check_model`, keys of the
YAML config, ``--kebab-case`` CLI flags and fields of the JSONL records;
the few options of a one-shot check alone (:data:`ONE_SHOT_OPTIONS`) are
fields of :class:`CheckOptions` and keywords of :func:`gradwatch.check_model` only.

Each option is declared once, as a dataclass field made by :func:`option`:
its name, type, default and one-line help. The dataclasses, the YAML
validation, the CLI flags, the docstrings and the docs' options table all read
that declaration (see :func:`gradwatch.config.options_table`): adding an
option is adding one field (plus its validation when a type check is not enough).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, overload

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


#: The one word of an option that is off (``raise_on``, ``independence``, ``distributed``; the limits ``max_interval``,
#: ``pace`` and ``memory_budget``). False and None say it too: YAML reads a bare ``off`` as false.
OFF = "off"


def is_off(value: Any) -> bool:
    """Whether ``value`` switches an option off: ``"off"`` (any case), False, None, or the strings ``"none"``/``"null"``.

    Example:
        >>> [is_off(v) for v in ("off", "OFF", False, None, "null", "auto", 0)]
        [True, True, True, True, True, False, False]
    """
    if value is None or value is False:
        return True
    return isinstance(value, str) and value.strip().lower() in (OFF, "none", "null")


#: The levels ``fail_at`` (what counts as a failed tensor) and ``raise_on`` (which alerts raise) take: a verdict of
#: this level or worse.
LEVELS = (Verdict.WRONG, Verdict.SUSPICIOUS)


@overload
def parse_level(name: str, value: Any) -> Verdict: ...
@overload
def parse_level(name: str, value: Any, off: bool) -> Optional[Verdict]: ...
def parse_level(name: str, value: Any, off: bool = False) -> Optional[Verdict]:
    """A level option (``fail_at``, ``raise_on``): ``"wrong"`` or ``"suspicious"`` in any case, or the :class:`Verdict`;
    with ``off``, also an :func:`is_off` value (None: never).

    Raises:
        ConfigError: ``"<name>: got <value>, expected 'wrong' or 'suspicious'"``; with ``off``, ``expected 'off'
            (never), 'wrong' or 'suspicious'``.

    Example:
        >>> parse_level("fail_at", "WRONG"), parse_level("raise_on", False, off=True)
        (<Verdict.WRONG: 'wrong'>, None)
        >>> parse_level("fail_at", "excellent")
        Traceback (most recent call last):
        ...
        gradwatch.errors.ConfigError: fail_at: got 'excellent', expected 'wrong' or 'suspicious'
    """
    if off and is_off(value):
        return None
    word = value.value if isinstance(value, Verdict) else value.strip().lower() if isinstance(value, str) else None
    for level in LEVELS:
        if word == level.value:
            return level
    words = " or ".join(repr(level.value) for level in LEVELS)
    shown = value.value if isinstance(value, Verdict) else value
    raise ConfigError(f"{name}: got {shown!r}, expected {f'{OFF!r} (never), ' if off else ''}{words}")


@dataclass
class SharedOptions:
    """Options shared by every gradient check, the watch's too (each field's help is listed under Attributes below).

    :class:`CheckOptions` adds the options of a one-shot :func:`gradwatch.check_model`;
    :class:`gradwatch.config.GradWatchConfig` adds the watch's. With ``eps=None`` the step follows the coarsest
    precision the objective measurably computes in (see :mod:`gradwatch.check.objective.precision`).

    Example:
        >>> SharedOptions(coords=4).directions
        4
        >>> SharedOptions(coords=0)
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
    fail_at: Union[str, Verdict] = option(
        Verdict.SUSPICIOUS, "verdict from which a tensor counts as failing: suspicious or wrong (raise_on's words)")
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
        self.fail_at = parse_level("fail_at", self.fail_at)
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


document_options(SharedOptions)

#: The options of a one-shot :func:`gradwatch.check_model` that the watch does not take (:class:`CheckOptions`).
ONE_SHOT_OPTIONS = ("localize", "batched", "screen")


@dataclass
class CheckOptions(SharedOptions):
    """The options of a gradient check: those every check shares (:class:`SharedOptions`), then those of a one-shot
    :func:`gradwatch.check_model` (``localize``, ``batched``, ``screen``), which the watch does not take. Each
    field's help is listed under Attributes below.

    Example:
        >>> CheckOptions(coords=4).directions, CheckOptions().screen
        (4, True)
        >>> CheckOptions(localize="yes")
        Traceback (most recent call last):
        ...
        gradwatch.errors.ConfigError: localize: got 'yes', expected true or false
    """

    localize: bool = option(
        False, "check_model only: when a tensor fails, check each module alone to name the module (or custom "
        "autograd.Function) whose backward is wrong")
    batched: bool = option(
        True, "check_model only: evaluate the perturbations of a tensor in vmapped batches where the model allows "
        "it (automatic fallback); false: one evaluation each")
    screen: bool = option(
        True, "check_model only: detection first, one random direction per tensor settles those that agree; false: "
        "the full sample on every tensor")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ONE_SHOT_OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: got {getattr(self, name)!r}, expected true or false")

    def shared(self) -> Dict[str, Any]:
        """The values of the options every check shares (:class:`SharedOptions`), by name.

        Example:
            >>> CheckOptions(coords=4, screen=False).shared()["coords"], "screen" in CheckOptions().shared()
            (4, False)
        """
        return {name: getattr(self, name) for name in SharedOptions.names()}


document_options(CheckOptions)


def check_options(options: Optional[CheckOptions] = None, **overrides: Any) -> CheckOptions:
    """The options of a check: ``options`` (default: every default) with ``overrides`` replacing its fields.

    Raises:
        TypeError: ``options`` is not a :class:`CheckOptions`, or an override names no option.
        ConfigError: A value out of range, naming the option and what is accepted.

    Example:
        >>> opts = check_options(CheckOptions(coords=4, screen=False), screen=True)
        >>> opts.coords, opts.screen
        (4, True)
    """
    if options is None:
        return CheckOptions(**overrides)
    if not isinstance(options, CheckOptions):
        raise TypeError(f"options: got {type(options).__name__}, expected a gradwatch.CheckOptions "
                        "(a GradWatchConfig gives its own with .check_options())")
    return dataclasses.replace(options, **overrides) if overrides else options


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
