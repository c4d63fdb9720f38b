"""How options may be written: in their groups, and the values of the few whose words need reading (a time, a mode).

:mod:`gradwatch.config` reads every option through here: a group's keyword or YAML section is taken apart into the
options it names (:func:`flatten_groups`), ``max_interval`` is read as steps or a time (:func:`parse_max_interval`),
and the ``distributed`` keyword as ``auto``/``on``/``off`` (:func:`parse_distributed`).
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from gradwatch.errors import ConfigError
from gradwatch.options import OFF, is_off

#: Values of ``distributed``: coordinate the ranks when 2+ are initialized, always (an error without a process group),
#: or never.
DISTRIBUTED_MODES = ("auto", "on", OFF)


def flatten_groups(options: Mapping[str, Any], groups: Mapping[str, Sequence[str]], where: str = ""
                   ) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """``options`` with each group's options taken out of it, and the group each of those came from.

    Args:
        options: Option name -> value, or group name -> a mapping of its options (None: none).
        groups: Group name -> the names of its options (:data:`gradwatch.config.OPTION_GROUPS`).
        where: The start of every error message (``"run.yaml: "``, ``"run.yaml: gradwatch."``).

    Raises:
        ConfigError: A group that is not a mapping, a key its group does not take (naming the ones it takes), or an
            option given both flat and in its group.

    Example:
        >>> groups = {"schedule": ("every", "max_interval"), "check": ("coords",)}
        >>> flatten_groups({"schedule": {"every": 50}, "coords": 4}, groups)
        ({'every': 50, 'coords': 4}, {'every': 'schedule'})
        >>> flatten_groups({"every": 5, "schedule": {"every": 50}}, groups)
        Traceback (most recent call last):
        ...
        gradwatch.errors.ConfigError: schedule.every: given both flat (every: 5) and in schedule (every: 50); give it once
    """
    flat: Dict[str, Any] = {}
    grouped: Dict[str, str] = {}
    for key, value in options.items():
        group = key if isinstance(key, str) and key in groups else None
        for name, v in (_group_options(key, value, groups, where) if group else {key: value}).items():
            if name in flat:
                home = grouped.get(name) or str(group)
                flat_value, group_value = (v, flat[name]) if name in grouped else (flat[name], v)
                raise ConfigError(f"{where}{home}.{name}: given both flat ({name}: {flat_value!r}) and in {home} "
                                  f"({name}: {group_value!r}); give it once")
            flat[name] = v
            if group:
                grouped[name] = group
    return flat, grouped


def _group_options(group: str, value: Any, groups: Mapping[str, Sequence[str]], where: str) -> Mapping[str, Any]:
    """The options a group's keyword or section gives, each checked to be the group's."""
    takes = groups[group]
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}{group}: got {value!r}, expected a mapping of its options ({group} takes "
                          f"{', '.join(takes)})")
    for key in value:
        if key not in takes:
            home = next((g for g, names in groups.items() if key in names), None)
            close = difflib.get_close_matches(str(key).replace("-", "_"), takes, n=1, cutoff=0.6)
            why = (f"not an option of {group}, it is in {home}" if home else
                   "unknown option" + (f", did you mean {close[0]!r}?" if close else ""))
            raise ConfigError(f"{where}{group}.{key}: {why} ({group} takes {', '.join(takes)})")
    return value


def parse_distributed(value: Any) -> str:
    """The ``distributed`` keyword of :class:`gradwatch.GradWatch` normalized: ``"auto"``, ``"on"`` (True too) or
    ``"off"`` (False and None too, as every option that can be off).

    Raises:
        ConfigError: Any other value, naming the accepted ones.

    Example:
        >>> [parse_distributed(v) for v in ("auto", "OFF", False, None, True, "on")]
        ['auto', 'off', 'off', 'off', 'on', 'on']
    """
    if is_off(value):
        return OFF
    if value is True:
        return "on"
    if isinstance(value, str) and value.strip().lower() in DISTRIBUTED_MODES:
        return value.strip().lower()
    raise ConfigError(f"distributed: got {value!r}, expected 'auto', 'on' or 'off' (True and False: 'on' and 'off')")


_INTERVAL_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(steps?|min|mins|minutes?|m|h|hours?)\s*$", re.I)


def parse_max_interval(value: Any) -> Tuple[Optional[int], Optional[float]]:
    """``max_interval`` as ``(steps, seconds)``: an integer is steps; ``"N steps"``, ``"N min"`` or ``"N h"`` too.

    Raises:
        ValueError: Anything else, naming what is accepted.

    Example:
        >>> parse_max_interval(500), parse_max_interval("30 min"), parse_max_interval("off")
        ((500, None), (None, 1800.0), (None, None))
    """
    if is_off(value):
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
    raise ValueError(f"max_interval: got {value!r}, expected off, a number of steps >= 1 (500), "
                     "or a time such as '30 min' or '2 h'")
