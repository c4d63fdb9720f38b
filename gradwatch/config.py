"""Every GradWatch option in one dataclass, and YAML loading with messages that point at the mistake.

One name everywhere: the keyword of :class:`gradwatch.GradWatch`, the YAML
key, the CLI flag (``--kebab-case``) and the JSONL field.

A YAML config is a mapping of option names to values. It may instead keep
the options under a top-level ``gradwatch:`` section; then only that section
is read and every other top-level key is ignored, so the options can live in
a larger training config. An empty file (or ``gradwatch:`` with nothing under
it) means all defaults.

Options may also be given in their groups (:data:`OPTION_GROUPS`): the keyword
``schedule={"every": 50}`` and the YAML section ``schedule: {every: 50}`` are
``every=50``; the option keeps its one name, and is given flat or in its group,
not both. An option that can be off says it with ``off`` (False and None too).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import yaml

from gradwatch._option_syntax import DISTRIBUTED_MODES as DISTRIBUTED_MODES  # these four: imported from gradwatch.config
from gradwatch._option_syntax import flatten_groups as flatten_groups
from gradwatch._option_syntax import parse_distributed as parse_distributed
from gradwatch._option_syntax import parse_max_interval as parse_max_interval
from gradwatch.check.independence.structures import parse_independence
from gradwatch.check.objective.terms import parse_regularizers
from gradwatch.check.replay.items import ITEMS_MODES
from gradwatch.errors import ConfigError
from gradwatch.options import OFF, CheckOptions, SharedOptions, document_options, is_off, option, option_help, parse_level, trend_options
from gradwatch.plan.cycle import PIECE_STEPS

#: Options that belong to :class:`gradwatch.options.CheckOptions` and the watch takes too (:class:`~gradwatch.options.SharedOptions`).
CHECK_OPTION_NAMES: Tuple[str, ...] = tuple(SharedOptions.names())
#: Options that belong to :class:`gradwatch.watch.trend.TrendTracker` (besides ``bands``).
TREND_OPTION_NAMES: Tuple[str, ...] = ("baseline_checks", "drift_window", "drift_decades", "alert_cooldown")
#: The groups of options: a keyword or YAML section of a group's name takes its options by their own names
#: (``schedule={"every": 50}`` is ``every=50``). Every option is in one group.
OPTION_GROUPS: Dict[str, Tuple[str, ...]] = {
    "check": CHECK_OPTION_NAMES + ("regularizers",),
    "schedule": ("every", "overhead_budget", "max_interval"),
    "budget": ("tensors_per_check", "pace", "memory_budget"),
    "parts": ("form", "training", "items", "independence"),
    "alerts": ("baseline_checks", "drift_window", "drift_decades", "alert_cooldown", "raise_on"),
    "logging": ("log_dir", "tensorboard", "jsonl"),
}
#: The options that can be off: None in Python (``"off"``, False and None are accepted), ``off`` in every text (YAML,
#: :meth:`GradWatchConfig.to_dict`, the records, the docs).
OFF_OPTIONS: Tuple[str, ...] = ("max_interval", "pace", "memory_budget", "raise_on", "independence")
#: What each group decides (the headings of the options tables).
GROUP_DOCS: Dict[str, str] = {
    "check": "what one check samples and how it judges (check_model's options too), and the objective's extra terms",
    "schedule": "when the watch checks",
    "budget": "what one check may take: tensors, training steps, memory",
    "parts": "which parts check, and in which form",
    "alerts": "trends, and which alerts raise",
    "logging": "where the results go",
}
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
class GradWatchConfig(SharedOptions):
    """Every YAML-able :class:`gradwatch.GradWatch` option, validated on construction.

    The check options are those every check shares, :class:`gradwatch.options.SharedOptions` (inherited: one
    declaration, one validation; ``check_model``'s own ``localize``, ``batched`` and ``screen`` are not the
    watch's); the options of the watch follow. Each field's help is listed
    under Attributes below and in :data:`OPTION_DOCS`. Values are stored normalized: ``dtype`` as
    ``"float64"``/``"float32"``/None, ``fail_at`` and ``raise_on`` as lowercase names, ``bands``
    as a tuple of floats, an option that is off (:data:`OFF_OPTIONS`) as None (``"off"`` in
    :meth:`to_dict`). The constructor takes the options flat; :meth:`from_dict`, :meth:`replace`,
    :func:`load_config` and :func:`resolve_config` take them in their groups too (:data:`OPTION_GROUPS`).

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
        None, "with every: auto, longest gap between checks: steps (500) or a time ('30 min', '2 h'); off: no cap")
    tensors_per_check: int = option(
        0, "parameter tensors checked per check, rotating through all; 0 checks all (module form: whole units per check; "
           "0: all, or spread over the K checks the row blocks take where some unit is sliced)")
    pace: Optional[float] = option(
        PIECE_STEPS, "module form: training steps a check's pieces may take (those left wait for the next checks: the cycle K "
             "grows); > 0, off: no pace (each check takes its whole turn of the cycle)")
    memory_budget: Optional[float] = option(
        0.1, "memory a check may add above training's own peak (CPU RSS, CUDA allocated), as a fraction; > 0, off: unbounded")
    form: str = option(
        "auto", "backward part's form: auto (the whole objective where it fits memory_budget and costs less, "
                "else module by module), objective, module")
    baseline_checks: int = option(3, "first checks of a tensor whose median is its baseline; >= 1")
    drift_window: int = option(3, "checks in the rolling median compared with the baseline; >= 1")
    drift_decades: float = option(2.0, "powers of ten above the baseline that count as drift; > 0")
    alert_cooldown: int = option(10, "checks of a tensor during which a persisting alert stays silent; >= 0")
    raise_on: Optional[str] = option(
        None, "raise GradientDriftError on alerts of this level or worse: off (never), suspicious or wrong (fail_at's words)")
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
        if is_off(self.max_interval):
            self.max_interval = None
        try:
            parse_max_interval(self.max_interval)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        tpc = self.tensors_per_check
        if isinstance(tpc, bool) or not isinstance(tpc, int) or tpc < 0:
            raise ConfigError(f"tensors_per_check: got {tpc!r}, expected an integer >= 0 (0 = all tensors)")
        pace = None if is_off(self.pace) else self.pace
        if pace is not None and (not _is_number(pace) or not 0 < pace < float("inf")):
            raise ConfigError(f"pace: got {self.pace!r}, expected a number of training steps > 0 (2.0) or off (no pace)")
        self.pace = None if pace is None else float(pace)
        mem = None if is_off(self.memory_budget) else self.memory_budget
        if mem is not None and (not _is_number(mem) or not mem > 0 or mem != mem or mem == float("inf")):
            raise ConfigError(f"memory_budget: got {self.memory_budget!r}, expected a number > 0 (0.1 = 10% above "
                              "training's peak memory) or off (no bound)")
        self.memory_budget = None if mem is None else float(mem)
        form = self.form.lower() if isinstance(self.form, str) else self.form
        if form not in FORMS:
            raise ConfigError(f"form: got {self.form!r}, expected one of {', '.join(FORMS)}")
        self.form = form
        try:
            self.independence = None if is_off(self.independence) else parse_independence(self.independence)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        level = parse_level("raise_on", self.raise_on, off=True)  # fail_at's parser, words and messages
        self.raise_on = None if level is None else level.value
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
        """JSON/YAML-safe dict of every option (bands as a list; callables by name; an option that is off as ``"off"``).

        Example:
            >>> d = GradWatchConfig().to_dict()
            >>> d["dtype"], d["bands"], d["every"], d["raise_on"]
            ('float64', [1e-07, 0.0001, 0.01], 'auto', 'off')
        """
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update({name: OFF for name in OFF_OPTIONS if d[name] is None})
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
            d: Option name -> value, or group name -> its options (:data:`OPTION_GROUPS`).
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
        """A validated copy with some options changed, flat or in their groups (unknown names are refused).

        Example:
            >>> GradWatchConfig().replace(every=10).every, GradWatchConfig().replace(schedule={"every": 10}).every
            (10, 10)
        """
        return _built(lambda flat: dataclasses.replace(self, **flat), overrides, "")


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
    """The tables of options of docs/reference/options.md, one per group, rendered from their declarations (a test keeps
    the page equal to it).

    Example:
        >>> lines = options_markdown().splitlines()
        >>> print(lines[0])
        ### `check`: what one check samples and how it judges (check_model's options too), and the objective's extra terms
        >>> lines[5]
        '| `directions` | `--directions` | `4` | random Rademacher directions per checked tensor; >= 0 |'
    """
    table = {name: (default, meaning) for name, default, meaning in options_table()}
    tables = []
    for group, names in OPTION_GROUPS.items():
        rows = [f"### `{group}`: {GROUP_DOCS[group]}", "", "| Option (keyword, YAML key) | CLI flag | Default | Meaning |",
                "|---|---|---|---|"]
        for name in names:
            default, meaning = table[name]
            text = meaning.replace("|", "\\|")
            rows.append(f"| `{name}` | `{'--' + name.replace('_', '-')}` | `{show_value(default)}` | {text} |")
        tables.append("\n".join(rows))
    return "\n\n".join(tables)


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


def resolve_config(config: Union[GradWatchConfig, str, os.PathLike, None] = None,
                   options: Optional[Mapping[str, Any]] = None) -> GradWatchConfig:
    """The watch's configuration as every front end takes it (``config=`` and keyword options): ``config`` (a
    :class:`GradWatchConfig`, the path of a YAML config, or None for the defaults) with ``options``, flat or in their
    groups, overriding it.

    Raises:
        ConfigError: ``config`` of another type, a config file :func:`load_config` refuses, or a bad option.

    Example:
        >>> cfg = resolve_config(GradWatchConfig(every=5), {"alerts": {"raise_on": "wrong"}})
        >>> cfg.every, cfg.raise_on, resolve_config(None, {"every": 10}).every
        (5, 'wrong', 10)
    """
    if config is None:
        base = GradWatchConfig()
    elif isinstance(config, GradWatchConfig):
        base = config
    elif isinstance(config, (str, os.PathLike)):
        base = load_config(config)
    else:
        raise ConfigError(f"config: got {type(config).__name__}, expected a GradWatchConfig or the path of a YAML "
                          "config (str or Path)")
    return base.replace(**options) if options else base


def config_keys(path: Union[str, os.PathLike]) -> List[str]:
    """The options a YAML config sets (those in its groups by their own names), in the file's order.

    Raises:
        ConfigError: As :func:`load_config`.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "gw.yaml"
        >>> _ = p.write_text("coords: 4\\nschedule:\\n  every: 25\\n")
        >>> config_keys(p)
        ['coords', 'every']
    """
    section, source, prefix = _read_section(path)
    return [k for k in flatten_groups(section or {}, OPTION_GROUPS, f"{source}: {prefix}")[0] if k in option_names()]


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


def _check_keys(d: Mapping[str, Any], where: str) -> None:
    """Refuse a key that names no option (nor group); ``where`` starts the message (``"run.yaml: gradwatch."``)."""
    valid = option_names()
    for key in d:
        if not isinstance(key, str):
            raise ConfigError(f"{where}{key!r}: option names must be strings")
        if key not in valid:
            close = difflib.get_close_matches(key.replace("-", "_"), valid + list(OPTION_GROUPS), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}{key}: unknown option, {hint}(valid options: {', '.join(valid)}; "
                              f"groups: {', '.join(OPTION_GROUPS)})")


def _built(make: Callable[[Dict[str, Any]], GradWatchConfig], options: Mapping[str, Any], where: str) -> GradWatchConfig:
    """``make(flat options)``, its groups taken out of ``options`` and its keys checked first; a bad value's message
    starts with ``where`` and names a grouped option with its group (``"run.yaml: schedule.every: got 0, ..."``)."""
    flat, grouped = flatten_groups(options, OPTION_GROUPS, where)
    _check_keys(flat, where)
    try:
        return make(flat)
    except ConfigError as err:
        name = str(err).split(":", 1)[0]
        raise ConfigError(f"{where}{grouped[name] + '.' if name in grouped else ''}{err}") from None


def _from_mapping(d: Any, source: str, prefix: str) -> GradWatchConfig:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a mapping of option: value, got {type(d).__name__}")
    return _built(lambda flat: GradWatchConfig(**flat), d, f"{source}: {prefix}")
