"""Old import paths inside :mod:`gradwatch.check`, kept for one release with a ``DeprecationWarning``.

gradwatch 0.2 moved the 30 flat modules of ``gradwatch.check`` into packages by job. Importing an old path
(``gradwatch.check.engine``, ``gradwatch.check.isolation``, ...) still works and warns once, naming the new path;
the old module that became a package (``objective``, ``replay``, ``independence``) answers its old names the same way.
The public names of :mod:`gradwatch` never moved.

Example:
    >>> import sys, warnings
    >>> _ = sys.modules.pop("gradwatch.check.numeric", None)  # import it afresh, as a user's first import does
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     from gradwatch.check.numeric import rel_diff
    >>> rel_diff([1.0], [1.0]), "gradwatch.check.numerics.differences" in str(seen[0].message)
    (0.0, True)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any, Dict, Optional, Sequence

PACKAGE = "gradwatch.check"

#: Old module (under ``gradwatch.check``) -> its new path, for a module that moved whole.
MOVED: Dict[str, str] = {
    "batched": "gradwatch.check.probes.batched",
    "cut": "gradwatch.check.replay.cut",
    "double_backward": "gradwatch.check.higher_order.double_backward",
    "dropout": "gradwatch.check.objective.functional_dropout",
    "generators": "gradwatch.check.objective.generators",
    "graph": "gradwatch.check.objective.checkpointed",
    "independence_report": "gradwatch.check.independence.report",
    "inner": "gradwatch.check.higher_order.inner",
    "item_probe": "gradwatch.check.replay.item_probe",
    "items": "gradwatch.check.replay.items",
    "judge": "gradwatch.check.judging.judge",
    "localize": "gradwatch.check.modules.localize",
    "memory": "gradwatch.plan.memory",
    "modular": "gradwatch.check.modules.module_form",
    "padding": "gradwatch.check.objective.padding_idx",
    "precision": "gradwatch.check.objective.precision",
    "report": "gradwatch.check.judging.report",
    "row_replay": "gradwatch.check.replay.rows",
    "sampling": "gradwatch.check.numerics.sampling",
    "sketch": "gradwatch.check.numerics.sketch",
    "structures": "gradwatch.check.independence.structures",
    "surrogate": "gradwatch.check.objective.surrogate",
    "training": "gradwatch.check.judging.training_judge",
    "vjp_probe": "gradwatch.check.probes.outputs",
}

#: Old module that was split -> (the module holding most of it, {name: module for the rest}).
SPLIT: Dict[str, tuple] = {
    "engine": ("gradwatch.check.probes.engine", {
        "BatchProbe": "gradwatch.check.probes.lines",
        "DENSE_SIGNS_MAX": "gradwatch.check.probes.lines",
        "EngineSettings": "gradwatch.check.probes.lines",
        "Evaluator": "gradwatch.check.probes.lines",
        "IMPRECISE": "gradwatch.check.probes.reexamine",
        "KINK_SCALES": "gradwatch.check.probes.reexamine",
        "LOW_PRECISION_EPS": "gradwatch.check.probes.reexamine",
        "LOW_PRECISION_SCALES": "gradwatch.check.probes.reexamine",
        "Outcome": "gradwatch.check.probes.lines",
        "PRECISE": "gradwatch.check.probes.reexamine",
        "SMOOTH_SIDES": "gradwatch.check.probes.reexamine",
        "Sample": "gradwatch.check.probes.lines",
        "Target": "gradwatch.check.probes.lines",
        "Terms": "gradwatch.check.probes.lines",
        "WIDEN_MAX": "gradwatch.check.probes.reexamine",
        "_apply": "gradwatch.check.probes.lines",
        "_lin": "gradwatch.check.probes.lines",
        "_linear_at": "gradwatch.check.probes.reexamine",
        "_probe": "gradwatch.check.probes.lines",
        "_restore": "gradwatch.check.probes.lines",
        "_slope": "gradwatch.check.probes.lines",
        "all_finite": "gradwatch.check.probes.lines",
        "batched_bases": "gradwatch.check.probes.lines",
        "below_resolution": "gradwatch.check.probes.reexamine",
        "build_samples": "gradwatch.check.probes.lines",
        "classify_kink": "gradwatch.check.probes.reexamine",
        "flat_at_widest": "gradwatch.check.probes.reexamine",
        "floor_at": "gradwatch.check.probes.lines",
        "pinpoint": "gradwatch.check.probes.reexamine",
        "prepare_slopes": "gradwatch.check.probes.lines",
        "resolve_low_precision": "gradwatch.check.probes.reexamine",
        "resolves": "gradwatch.check.probes.reexamine",
        "screen": "gradwatch.check.probes.reexamine",
        "screen_sample": "gradwatch.check.probes.reexamine",
        "screened": "gradwatch.check.probes.reexamine",
        "smooth_sides": "gradwatch.check.probes.reexamine",
        "total": "gradwatch.check.probes.lines",
        "unexplained": "gradwatch.check.probes.reexamine",
        "unresolvable": "gradwatch.check.probes.reexamine",
        "usable_floor": "gradwatch.check.probes.reexamine",
        "widen": "gradwatch.check.probes.reexamine",
    }),
    "isolation": ("gradwatch.check.objective.guards", {
        "Reseeder": "gradwatch.check.objective.rng",
        "Shadow": "gradwatch.check.objective.shadow",
        "_COMPLEX_OF": "gradwatch.check.objective.shadow",
        "_RNG_GUARD": "gradwatch.check.objective.rng",
        "_cast_inputs_hook": "gradwatch.check.objective.shadow",
        "_has_dropout_prob": "gradwatch.check.objective.dropout_off",
        "_layerdrop": "gradwatch.check.objective.dropout_off",
        "_needs_cast": "gradwatch.check.objective.shadow",
        "_outermost_rng": "gradwatch.check.objective.rng",
        "_positive": "gradwatch.check.objective.dropout_off",
        "_restoring_rng": "gradwatch.check.objective.rng",
        "_same_np_state": "gradwatch.check.objective.rng",
        "cast_floats": "gradwatch.check.objective.shadow",
        "dropout_off": "gradwatch.check.objective.dropout_off",
        "is_dtensor": "gradwatch.check.objective.dtensor",
        "is_sharded": "gradwatch.check.objective.dtensor",
        "param_signature": "gradwatch.check.objective.shadow",
        "preserved_rng": "gradwatch.check.objective.rng",
        "restore_params": "gradwatch.check.objective.shadow",
        "seed_everything": "gradwatch.check.objective.rng",
        "snapshot_params": "gradwatch.check.objective.shadow",
    }),
    "numeric": ("gradwatch.check.numerics.differences", {
        "DEFAULT_BANDS": "gradwatch.bands",
        "Verdict": "gradwatch.bands",
        "_VERDICT_ORDER": "gradwatch.bands",
        "_VERDICT_RANK": "gradwatch.bands",
        "validate_bands": "gradwatch.bands",
    }),
    "owncode": ("gradwatch.check.modules.own_code", {
        "named_leaves": "gradwatch.trees",
        "rebuild": "gradwatch.trees",
        "rebuild_at": "gradwatch.trees",
        "tensor_leaves": "gradwatch.trees",
    }),
}

#: Old module that became a package of the same name -> the module that holds its old names.
BECAME_PACKAGE: Dict[str, str] = {
    "objective": "gradwatch.check.objective.terms",
    "replay": "gradwatch.check.replay.reference",
    "independence": "gradwatch.check.independence.check",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new} in gradwatch 0.2; the old path goes in the next release",
                  DeprecationWarning, stacklevel=3)


def new_home(old: str, name: Optional[str] = None) -> str:
    """The module that now holds ``name`` of the old module ``old`` (its short name under ``gradwatch.check``).

    Example:
        >>> new_home("isolation", "preserved_rng")
        'gradwatch.check.objective.rng'
    """
    if old in MOVED:
        return MOVED[old]
    if old in BECAME_PACKAGE:
        return BECAME_PACKAGE[old]
    default, names = SPLIT[old]
    return names.get(name or "", default)


def package_attribute(package: str, name: str) -> Any:
    """An old name asked of a package that was a module (``gradwatch.check.replay.Replay``), with the warning."""
    old = package.rsplit(".", 1)[1]
    if name.startswith("__"):
        raise AttributeError(name)
    home = new_home(old, name)
    module = importlib.import_module(home)
    if not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{home}.{name}")
    value = getattr(module, name)
    setattr(sys.modules[package], name, value)  # warned once; later lookups find it
    return value


class _Loader(importlib.abc.Loader):
    """Answers an old path with the module that moved (the same object) or a :class:`_SplitModule`."""

    def __init__(self) -> None:
        self._spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        old = spec.name.rsplit(".", 1)[1]
        if old in MOVED:
            _warn(spec.name, MOVED[old])
            module = importlib.import_module(MOVED[old])
            self._spec = module.__spec__  # importlib sets the old spec on it next; exec_module puts its own back
            return module
        _warn(spec.name, ", ".join(sorted({SPLIT[old][0], *SPLIT[old][1].values()})))
        return _SplitModule(spec.name, old)

    def exec_module(self, module: types.ModuleType) -> None:
        if self._spec is not None:
            module.__spec__ = self._spec


class _SplitModule(types.ModuleType):
    """An old module that was split: each name is fetched from the module that holds it now."""

    def __init__(self, name: str, old: str) -> None:
        super().__init__(name)
        self._old = old

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(new_home(self._old, name)), name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        prefix, _, old = fullname.rpartition(".")
        if prefix != PACKAGE or (old not in MOVED and old not in SPLIT):
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader())


def install() -> None:
    """Answer the old paths (once per process)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
