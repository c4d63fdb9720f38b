"""Every GradWatch option in one dataclass, and YAML loading with messages that point at the mistake.

One name everywhere: the keyword of :class:`gradwatch.GradWatch`, the YAML
key, the CLI flag (``--kebab-case``) and the JSONL field.

A YAML config is a mapping of option names to values. It may instead keep
the options under a top-level ``gradwatch:`` section; then only that section
is read and every other top-level key is ignored, so the options can live in
a larger training config. An empty file (or ``gradwatch:`` with nothing under
it) means all defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import yaml

from gradwatch.check.independence.structures import parse_independence
from gradwatch.check.objective.terms import parse_regularizers
from gradwatch.check.replay.items import ITEMS_MODES
from gradwatch.errors import ConfigError
from gradwatch.options import CheckOptions, document_options, option, option_help, trend_options
from gradwatch.plan.cycle import PIECE_STEPS

#: Options that belong to :class:`gradwatch.options.CheckOptions`.
CHECK_OPTION_NAMES: Tuple[str, ...] = tuple(CheckOptions.names())
#: Options that belong to :class:`gradwatch.watch.trend.TrendTracker` (besides ``bands``).
TREND_OPTION_NAMES: Tuple[str, ...] = ("baseline_checks", "drift_window", "drift_decades", "alert_cooldown")
#: Declared types whose values PyYAML may leave as strings ("1e-4") and that are read as numbers.
_FLOAT_TYPES = ("float", "Optional[float]")
#: Values of the ``form`` option.
FORMS = ("auto", "objective", "module")
_DTYPE_CANONICAL = {"float64": "float64", "double": "float64", "float32": "float32", "float": "float32"}


def _number(value: Any) -> Any:
    """A string that parses as a float becomes that float (PyYAML reads ``1e-4`` as a string)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class GradWatchConfig(CheckOptions):
    """Every YAML-able :class:`gradwatch.GradWatch` option, validated on construction.

    The check options are those of :class:`gradwatch.options.CheckOptions` (inherited: one
    declaration, one validation); the options of the watch follow. Each field's help is listed
    under Attributes below and in :data:`OPTION_DOCS`. Values are stored normalized: ``dtype`` as
    ``"float64"``/``"float32"``/None, ``fail_at`` and ``raise_on`` as lowercase names, ``bands``
    as a tuple of floats.

    Raises:
        ConfigError: An option has the wrong type or is out of range.

    Example:
        >>> cfg = GradWatchConfig(coords=4, overhead_budget="5e-3")
        >>> cfg.overhead_budget, cfg.check_options().coords
        (0.005, 4)
        >>> GradWatchConfig(every=0)
        Traceback (most recent call last):
        ...
        gradwatch.errors.ConfigError: every: got 0, expected an integer >= 1 or 'auto'
    """

    every: Union[int, str] = option("auto", "check every N training steps (integer >= 1), or auto to follow overhead_budget")
    overhead_budget: float = option(0.02, "with every: auto, fraction of training time the checks may take; 0 < x <= 1")
    max_interval: Optional[Union[int, str]] = option(
        None, "with every: auto, longest gap between checks: steps (500) or a time ('30 min', '2 h'); null: no cap")
    tensors_per_check: int = option(
        0, "parameter tensors checked per check, rotating through all; 0 checks all (module form: whole units per check; "
           "0: all, or spread over the K checks the row blocks take where some unit is sliced)")
    pace: Optional[float] = option(
        PIECE_STEPS, "module form: training steps a check's pieces may take (those left wait for the next checks: the cycle K "
             "grows); > 0, null: no pace (each check takes its whole turn of the cycle)")
    memory_budget: Optional[float] = option(
        0.1, "memory a check may add above training's own peak (CPU RSS, CUDA allocated), as a fraction; > 0, null: unbounded")
    form: str = option(
        "auto", "backward part's form: auto (the whole objective where it fits memory_budget and costs less, "
                "else module by module), objective, module")
    baseline_checks: int = option(3, "first checks of a tensor whose median is its baseline; >= 1")
    drift_window: int = option(3, "checks in the rolling median compared with the baseline; >= 1")
    drift_decades: float = option(2.0, "powers of ten above the baseline that count as drift; > 0")
    alert_cooldown: int = option(10, "checks of a tensor during which a persisting alert stays silent; >= 0")
    raise_on: Optional[str] = option(None, "raise GradientDriftError on alerts of this level: null (never), wrong, suspicious")
    log_dir: Optional[str] = option(
        None, "directory for TensorBoard events and the JSONL log; null lets the hook choose (e.g. the Lightning logger's)")
    tensorboard: bool = option(True, "write TensorBoard scalars and alert text")
    jsonl: bool = option(True, "write one JSON record per check and per alert to a JSONL file in log_dir")
    regularizers: Optional[Any] = option(None, "extra objective terms: {l1: coef, l2: coef} (callables allowed from Python)")
    training: bool = option(
        True, "also judge the gradient training applied: the live .grad against the objective's gradient, "
        "recomputed on the live model as training computed it")
    items: Any = option(
        "auto", "what loss_fn averages over, to weigh a step's micro-batches and ranks in the training verdict: auto "
        "(found in the batch: target tokens of labels holding -100, masks or samples, decided by evaluating loss_fn), "
        "samples, micro_batches (each micro-batch's mean weighs alike: a loss that couples samples), or from Python a "
        "callable items(batch) -> count")
    independence: Optional[Union[str, List[str]]] = option(
        "auto", "also check that outputs depend only on the inputs they may: auto (Hugging Face causal LMs: causal, "
        "plus padding and documents when the batch has them; any model called on packed documents: documents), off, "
        "or batch, causal, documents, padding (a list combines them)")

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type in _FLOAT_TYPES:
                setattr(self, f.name, _number(getattr(self, f.name)))
        if isinstance(self.bands, (list, tuple)):
            self.bands = tuple(_number(b) for b in self.bands)
        if any(isinstance(b, bool) for b in (self.bands if isinstance(self.bands, tuple) else ())):
            raise ConfigError(f"bands: got {list(self.bands)!r}, expected three increasing positive numbers")
        super().__post_init__()  # the check options, validated as CheckOptions validates them
        self.fail_at = self.fail_verdict.value
        self.dtype = None if self.dtype is None else str(self.dtype).replace("torch.", "")
        self._validate_hook_options()
        trend_options(self.bands, **{k: getattr(self, k) for k in TREND_OPTION_NAMES})
        self.drift_decades = float(self.drift_decades)

    def _validate_hook_options(self) -> None:
        if isinstance(self.every, str) and self.every.lower() == "auto":
            self.every = "auto"
        elif isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"every: got {self.every!r}, expected an integer >= 1 or 'auto'")
        budget = self.overhead_budget
        if not _is_number(budget) or not 0 < budget <= 1:
            raise ConfigError(f"overhead_budget: got {budget!r}, expected a number with 0 < x <= 1 (0.02 = 2%)")
        self.overhead_budget = float(budget)
        try:
            parse_max_interval(self.max_interval)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        tpc = self.tensors_per_check
        if isinstance(tpc, bool) or not isinstance(tpc, int) or tpc < 0:
            raise ConfigError(f"tensors_per_check: got {tpc!r}, expected an integer >= 0 (0 = all tensors)")
        pace = self.pace
        if isinstance(pace, str) and pace.lower() in ("none", "null"):
            pace = None
        if pace is not None and (not _is_number(pace) or not 0 < pace < float("inf")):
            raise ConfigError(f"pace: got {self.pace!r}, expected a number of training steps > 0 (2.0) or null (no pace)")
        self.pace = None if pace is None else float(pace)
        mem = self.memory_budget
        if isinstance(mem, str) and mem.lower() in ("none", "null"):
            mem = None
        if mem is not None and (not _is_number(mem) or not mem > 0 or mem != mem or mem == float("inf")):
            raise ConfigError(f"memory_budget: got {self.memory_budget!r}, expected a number > 0 (0.1 = 10% above "
                              "training's peak memory) or null (no bound)")
        self.memory_budget = None if mem is None else float(mem)
        form = self.form.lower() if isinstance(self.form, str) else self.form
        if form not in FORMS:
            raise ConfigError(f"form: got {self.form!r}, expected one of {', '.join(FORMS)}")
        self.form = form
        try:
            self.independence = parse_independence(self.independence)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        raise_on = self.raise_on
        if isinstance(raise_on, str) and raise_on.lower() in ("none", "null"):
            raise_on = None
        if raise_on is not None:
            raise_on = str(getattr(raise_on, "value", raise_on)).lower()
            if raise_on not in ("wrong", "suspicious"):
                raise ConfigError(f"raise_on: got {self.raise_on!r}, expected null (never), 'wrong' or 'suspicious'")
        self.raise_on = raise_on
        if self.log_dir is not None:
            if not isinstance(self.log_dir, (str, os.PathLike)) or not str(os.fspath(self.log_dir)):
                raise ConfigError(f"log_dir: got {self.log_dir!r}, expected a directory path or null")
            self.log_dir = str(os.fspath(self.log_dir))
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ConfigError(f"{f.name}: got {getattr(self, f.name)!r}, expected true or false")
        self._validate_regularizers()
        self._validate_items()

    def _validate_items(self) -> None:
        items = self.items
        if callable(items):
            return
        if isinstance(items, str) and items.lower().replace("-", "_") in ITEMS_MODES:
            self.items = items.lower().replace("-", "_")
            return
        raise ConfigError(f"items: got {items!r}, expected one of {', '.join(ITEMS_MODES)} or (from Python) a callable "
                          "items(batch) -> the number of items loss_fn averages over in that batch")

    def _validate_regularizers(self) -> None:
        regs = self.regularizers
        if isinstance(regs, Mapping):
            regs = {str(k): _number(v) for k, v in regs.items()}
        try:
            parse_regularizers(regs)
        except (TypeError, ValueError) as err:
            msg = str(err)
            if not msg.startswith("regularizers"):
                msg = f"regularizers: {msg}"
            raise ConfigError(f"{msg} (got {self.regularizers!r})") from None
        self.regularizers = {k: float(v) if _is_number(v) else v for k, v in regs.items()} if isinstance(regs, dict) else regs

    # ------------------------------------------------------------------ views

    def check_options(self) -> CheckOptions:
        """The check options as a validated :class:`~gradwatch.options.CheckOptions`.

        Example:
            >>> GradWatchConfig(coords=3).check_options().coords
            3
        """
        return CheckOptions(**{k: getattr(self, k) for k in CHECK_OPTION_NAMES})

    def trend_kwargs(self) -> Dict[str, Any]:
        """This config's bands and trend options, as :class:`gradwatch.TrendTracker` takes them.

        Example:
            >>> GradWatchConfig(drift_window=5).trend_kwargs()["drift_window"]
            5
        """
        return {"bands": self.bands, **{k: getattr(self, k) for k in TREND_OPTION_NAMES}}

    def to_dict(self) -> Dict[str, Any]:
        """JSON/YAML-safe dict of every option (bands as a list; callables by name).

        Example:
            >>> d = GradWatchConfig().to_dict()
            >>> d["dtype"], d["bands"], d["every"]
            ('float64', [1e-07, 0.0001, 0.01], 'auto')
        """
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["bands"] = list(self.bands)
        d["tensors"] = None if self.tensors is None else list(self.tensors)
        if isinstance(self.regularizers, dict):
            d["regularizers"] = {k: v if _is_number(v) else _callable_name(v) for k, v in self.regularizers.items()}
        elif self.regularizers is not None:
            d["regularizers"] = [_callable_name(r) for r in self.regularizers]
        if callable(self.items):
            d["items"] = _callable_name(self.items)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<dict>") -> "GradWatchConfig":
        """Build from a mapping (a parsed YAML file), refusing unknown keys and bad values.

        Args:
            d: Option name -> value.
            source: Where ``d`` came from, named first in every error message.

        Raises:
            ConfigError: ``"<source>: <key>: got <value>, expected <what is accepted>"``.

        Example:
            >>> GradWatchConfig.from_dict({"every": 50}).every
            50
            >>> GradWatchConfig.from_dict({"evry": 50}, source="run.yaml")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            gradwatch.errors.ConfigError: run.yaml: evry: unknown option, did you mean 'every'? ...
        """
        return _from_mapping(d, source, "")

    def replace(self, **overrides: Any) -> "GradWatchConfig":
        """A validated copy with some options changed (unknown names are refused).

        Example:
            >>> GradWatchConfig().replace(every=10).every
            10
        """
        _check_keys(overrides, None, "")
        return dataclasses.replace(self, **overrides)


document_options(GradWatchConfig)

#: One-line meaning of each option (docs options table, CLI help, configs/default.yaml), read from its declaration.
OPTION_DOCS: Dict[str, str] = option_help(GradWatchConfig)


def option_names() -> List[str]:
    """Every option name, in declaration order.

    Example:
        >>> option_names()[:3]
        ['coords', 'directions', 'eps']
    """
    return [f.name for f in fields(GradWatchConfig)]


def options_table() -> List[Tuple[str, Any, str]]:
    """``(name, default, meaning)`` for every option; defaults as in YAML/JSON (``to_dict`` form).

    Example:
        >>> options_table()[0]
        ('coords', 8, 'coordinates sampled per checked tensor (half largest |grad|, half random); >= 1')
    """
    defaults = GradWatchConfig().to_dict()
    return [(name, defaults[name], OPTION_DOCS[name]) for name in option_names()]


def show_value(value: Any) -> str:
    """An option value as it is written in YAML (``null``, ``true``, ``[1.0e-07, 0.0001, 0.01]``, ``{l2: 1.0e-05}``).

    Example:
        >>> show_value(None), show_value(True), show_value("auto"), show_value((1e-7, 1e-4, 1e-2))
        ('null', 'true', 'auto', '[1.0e-07, 0.0001, 0.01]')
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        return yaml.safe_dump(value if not isinstance(value, tuple) else list(value), default_flow_style=True).strip()
    return json.dumps(value)


def options_markdown() -> str:
    """The table of options of docs/reference/options.md, rendered from their declarations (a test keeps the page equal to it).

    Example:
        >>> options_markdown().splitlines()[3]
        '| `directions` | `--directions` | `4` | random Rademacher directions per checked tensor; >= 0 |'
    """
    rows = ["| Option (keyword, YAML key) | CLI flag | Default | Meaning |", "|---|---|---|---|"]
    for name, default, meaning in options_table():
        flag = "--" + name.replace("_", "-")
        text = meaning.replace("|", "\\|")
        rows.append(f"| `{name}` | `{flag}` | `{show_value(default)}` | {text} |")
    return "\n".join(rows)


def load_config(path: Union[str, os.PathLike]) -> GradWatchConfig:
    """Read a YAML config (see the module docstring for its layout).

    Args:
        path: The YAML file.

    Raises:
        ConfigError: Missing file, invalid YAML, a top level that is not a
            mapping, or a bad option; the message starts with the file name.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "gw.yaml"
        >>> _ = p.write_text("gradwatch:\\n  every: 25\\n  overhead_budget: 1e-2\\n")
        >>> cfg = load_config(p)
        >>> cfg.every, cfg.overhead_budget
        (25, 0.01)
    """
    section, source, prefix = _read_section(path)
    return GradWatchConfig() if section is None else _from_mapping(section, source, prefix)


def config_problems(path: Union[str, os.PathLike]) -> List[str]:
    """Every problem of a YAML config, one message per bad key (empty when :func:`load_config` accepts it).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "gw.yaml"
        >>> _ = p.write_text("every: 0\\nevry: 5\\ncoords: 4\\n")
        >>> [m.split(": ", 1)[1][:30] for m in config_problems(p)]
        ['every: got 0, expected an inte', 'evry: unknown option, did you ']
    """
    try:
        load_config(path)
        return []
    except ConfigError as err:
        first = str(err)
    try:
        section, source, prefix = _read_section(path)
    except ConfigError as err:
        return [str(err)]
    problems = []
    for key, value in (section or {}).items():
        try:
            _from_mapping({key: value}, source, prefix)
        except ConfigError as err:
            problems.append(str(err))
    return problems or [first]  # a problem between options, none alone


def _read_section(path: Union[str, os.PathLike]) -> Tuple[Optional[Mapping[str, Any]], str, str]:
    """``(options mapping or None for all defaults, source name, key prefix)`` of a YAML config file."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{source}: cannot read config file ({err})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: invalid YAML{_yaml_problem(err)}") from None
    if data is None:
        return None, source, ""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: expected a mapping of option: value at the top level, got {type(data).__name__} ({data!r:.60})"
        )
    if "gradwatch" in data:
        section = data["gradwatch"]
        if section is None:
            return None, source, "gradwatch."
        if not isinstance(section, Mapping):
            raise ConfigError(f"{source}: gradwatch: got {type(section).__name__}, expected a mapping of option: value")
        return section, source, "gradwatch."
    return data, source, ""


def _yaml_problem(err: yaml.YAMLError) -> str:
    """``" at line 2, column 9: while parsing a flow sequence, expected ',' or ']'..."`` (one line)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context, cmark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and cmark is not None:
        context += f" started at line {cmark.line + 1}, column {cmark.column + 1}"
    words = [w for w in (context, getattr(err, "problem", None)) if w]
    return f"{where}: {', '.join(words) if words else str(err).splitlines()[0]}"


def _callable_name(fn: Any) -> str:
    return f"<callable {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}>"


def _check_keys(d: Mapping[str, Any], source: Optional[str], prefix: str) -> None:
    valid = option_names()
    where = f"{source}: " if source else ""
    for key in d:
        if not isinstance(key, str):
            raise ConfigError(f"{where}{prefix}{key!r}: option names must be strings")
        if key not in valid:
            close = difflib.get_close_matches(key.replace("-", "_"), valid, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}{prefix}{key}: unknown option, {hint}(valid options: {', '.join(valid)})")


def _from_mapping(d: Any, source: str, prefix: str) -> GradWatchConfig:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a mapping of option: value, got {type(d).__name__}")
    _check_keys(d, source, prefix)
    try:
        return GradWatchConfig(**d)
    except ConfigError as err:
        raise ConfigError(f"{source}: {prefix}{err}") from None


_INTERVAL_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(steps?|min|mins|minutes?|m|h|hours?)\s*$", re.I)


def parse_max_interval(value: Any) -> Tuple[Optional[int], Optional[float]]:
    """``max_interval`` as ``(steps, seconds)``: an integer is steps; ``"N steps"``, ``"N min"`` or ``"N h"`` too.

    Raises:
        ValueError: Anything else, naming what is accepted.

    Example:
        >>> parse_max_interval(500), parse_max_interval("30 min"), parse_max_interval(None)
        ((500, None), (None, 1800.0), (None, None))
    """
    if value is None:
        return None, None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return int(value), None
    m = _INTERVAL_RE.match(value) if isinstance(value, str) else None
    if m is not None and float(m.group(1)) > 0:
        number, unit = float(m.group(1)), m.group(2).lower()
        if unit.startswith("step"):
            if number.is_integer():
                return int(number), None
        else:
            return None, number * (3600.0 if unit.startswith("h") else 60.0)
    raise ValueError(f"max_interval: got {value!r}, expected null, a number of steps >= 1 (500), "
                     "or a time such as '30 min' or '2 h'")
