"""What an independence check found: :class:`IndependenceReport`, one :class:`StructureResult` per structure,
and the :class:`Violation` (which output depends on which input, how much, and the module where it starts).

Plain data, no model: built by :func:`gradwatch.check_independence`, written to the records by the watch.

Example:
    >>> v = Violation("batch", (0, 0), (1, -1), 0.5, 0.2, "norm")
    >>> IndependenceReport({"batch": StructureResult("batch", 2, v)}).ok
    False
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gradwatch.check.judging.report import json_float


@dataclass
class Violation:
    """One output that depends on an input it must not.

    Attributes:
        structure: The structure broken (``"batch"``, ``"causal"``, ``"documents"``, ``"padding"``).
        output: ``(sample, position)`` of the output that moved most (position 0 without a sequence).
        input: ``(sample, position)`` of the input changed (position -1: the whole sample).
        gradient: The forbidden gradient, relative to the largest allowed gradient of the same probe.
        change: How much the output moved when the input was changed, relative to the outputs' scale.
        module: The first module (in the order modules finish their forward) whose output moved;
            ``""`` is the model's own ``forward``; None when no module's output could be compared.
        expected: The module is one ``allow=`` names: a dependence by design, not a leak.
        remedy: What made the leak go away when the model was called again otherwise (packed documents), or None.

    Example:
        >>> v = Violation("causal", (0, 2), (0, 3), 0.4, 0.1, "blocks.0.attn")
        >>> "position 2 of sample 0 depends on position 3" in v.describe()
        True
    """

    structure: str
    output: Tuple[int, int]
    input: Tuple[int, int]
    gradient: float
    change: float
    module: Optional[str] = None
    expected: bool = False
    remedy: Optional[str] = None

    def describe(self) -> str:
        """One sentence: which output depends on which input, how much, and where it starts."""
        (bo, to), (bi, ti) = self.output, self.input
        if self.structure == "batch":
            what = f"sample {bo}'s output depends on sample {bi}'s input"
        else:
            kind = {"causal": "a later position", "documents": "another document",
                    "padding": "a padded position"}.get(self.structure, "a forbidden input")
            what = f"the output at position {to} of sample {bo} depends on position {ti} ({kind})"
        where = ("" if self.module is None else
                 " in the model's own forward" if self.module == "" else f" from module {self.module}")
        return (f"{self.structure}: {what}{where} (gradient {self.gradient:.2g} of the largest allowed one; "
                f"changing that input moved the output by {self.change:.2g} of its scale)"
                + ("" if self.remedy is None else f"; {self.remedy}"))

    def to_dict(self) -> Dict[str, Any]:
        """JSON-safe dict."""
        d = asdict(self)
        d["output"], d["input"] = list(self.output), list(self.input)
        d["gradient"], d["change"] = json_float(self.gradient), json_float(self.change)
        return d


@dataclass
class StructureResult:
    """One structure's verdict.

    Attributes:
        structure: Its name.
        probes: Vector-Jacobian products made (0: nothing to check, see ``note``).
        violation: The largest confirmed leak, or None.
        note: Why nothing was checked, or what was found and not confirmed.
    """

    structure: str
    probes: int = 0
    violation: Optional[Violation] = None
    note: Optional[str] = None

    @property
    def ok(self) -> bool:
        """No leak (a dependence an ``allow=``-ed module causes is not one)."""
        return self.violation is None or self.violation.expected


@dataclass
class IndependenceReport:
    """What :func:`check_independence` found.

    Attributes:
        results: Structure name -> :class:`StructureResult`, in the order asked.
        notes: How the check ran (the input differentiated, eval mode, what was left out).
        forwards: Forward passes made (the one building the graph included).
        backwards: Vector-Jacobian products made (each a backward to the input only).
        seconds: Wall time.

    Example:
        >>> r = IndependenceReport({"batch": StructureResult("batch", 2)})
        >>> r.ok, r.worst is None
        (True, True)
    """

    results: Dict[str, StructureResult]
    notes: List[str] = field(default_factory=list)
    forwards: int = 0
    backwards: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no structure is broken."""
        return all(r.ok for r in self.results.values())

    @property
    def violations(self) -> List[Violation]:
        """The leaks found (allowed dependences left out), worst first."""
        found = [r.violation for r in self.results.values() if r.violation is not None and not r.violation.expected]
        return sorted(found, key=lambda v: -v.change)

    @property
    def expected(self) -> List[Violation]:
        """Dependences that a module named in ``allow=`` causes (by design)."""
        return [r.violation for r in self.results.values() if r.violation is not None and r.violation.expected]

    @property
    def worst(self) -> Optional[Violation]:
        """The leak that moved its output most, or None."""
        found = self.violations
        return found[0] if found else None

    def to_dict(self) -> Dict[str, Any]:
        """JSON-safe dict (the ``independence`` field of a check's record)."""
        return {
            "ok": self.ok,
            "structures": {k: {"ok": r.ok, "probes": r.probes, "note": r.note,
                               "violation": None if r.violation is None else r.violation.to_dict()}
                           for k, r in self.results.items()},
            "notes": list(self.notes), "forwards": self.forwards, "backwards": self.backwards,
            "seconds": round(self.seconds, 6),
        }

    def __str__(self) -> str:
        head = "independence: OK" if self.ok else f"independence: LEAK ({', '.join(v.structure for v in self.violations)})"
        lines = [head]
        for name, r in self.results.items():
            if r.violation is not None:
                tag = "expected (allow=)" if r.violation.expected else "LEAK"
                lines.append(f"  {tag}: {r.violation.describe()}")
            else:
                lines.append(f"  {name}: ok ({r.probes} probe{'' if r.probes == 1 else 's'})" + (f"; {r.note}" if r.note else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def merge_ranks(reports: Sequence[Tuple[int, Optional[IndependenceReport]]]) -> Optional[IndependenceReport]:
    """One report from the ranks' checks of their own batches (``[(rank, report or None), ...]``): per structure,
    the worst leak of any rank (a note names the rank whose batch showed it), probes, passes and notes added up.

    Example:
        >>> v = Violation("batch", (0, 0), (1, -1), 0.5, 0.2, "norm")
        >>> merged = merge_ranks([(0, IndependenceReport({"batch": StructureResult("batch", 2)})),
        ...                       (1, IndependenceReport({"batch": StructureResult("batch", 2, v)}))])
        >>> merged.ok, merged.results["batch"].probes, merged.notes
        (False, 4, ['checked on the batches of ranks 0, 1', 'batch independence broken on the batch of rank 1'])
    """
    present = [(rank, r) for rank, r in reports if r is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0][1]
    merged = IndependenceReport({}, [f"checked on the batches of ranks {', '.join(str(rank) for rank, _ in present)}"])
    broken: Dict[str, int] = {}
    for rank, r in present:
        for name, result in r.results.items():
            have = merged.results.get(name)
            if have is None:
                merged.results[name] = StructureResult(name, result.probes, result.violation, result.note)
                if result.violation is not None:
                    broken[name] = rank
                continue
            have.probes += result.probes
            have.note = have.note or result.note
            if result.violation is not None and (have.violation is None or _graver(result.violation, have.violation)):
                have.violation, broken[name] = result.violation, rank
        merged.forwards += r.forwards
        merged.backwards += r.backwards
        merged.seconds += r.seconds
        merged.notes.extend(n for n in r.notes if n not in merged.notes)
    merged.notes.extend(f"{name} independence broken on the batch of rank {rank}" for name, rank in broken.items())
    return merged


def _graver(a: Violation, b: Violation) -> bool:
    """A leak before an expected dependence, then the larger change."""
    return (not a.expected, a.change) > (not b.expected, b.change)
