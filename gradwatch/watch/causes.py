"""One cause, one alert: the failing tensors of a check that one diagnosis explains, said once for the run.

A scale of the whole step, a cut, a count or a term puts the same words in every failing tensor's diagnosis; a wrong
backward in one module fails that module's tensors and every tensor upstream of it. :class:`Causes` groups a check's
failing tensors of one part by what explains them (a module named in the same check, else the same words), gives each
group of two or more one alert (the cause, how many tensors, the first names), and keeps it: the same cause at a later
check updates its count and last step (:attr:`Causes.seen`, the check record's ``causes``), never a new alert. Each
tensor keeps its own verdict and history (:class:`~gradwatch.watch.trend.TrendTracker`). Pure state, plain JSON.

Example:
    >>> causes = Causes()
    >>> groups = causes.group("training", {"a": "x is 2.00x", "b": "x is 2.00x", "c": None})
    >>> [(g.where, g.names) for g in groups]
    [('*', ['a', 'b'])]
    >>> causes.note(3, "training", groups[0]), causes.note(5, "training", groups[0])
    (True, False)
    >>> causes.seen[groups[0].key]["checks"], causes.seen[groups[0].key]["last_step"]
    (2, 5)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, cast

#: The words of a diagnosis that name no cause (a disagreement of unknown origin): such tensors alert one by one.
_NO_CAUSE = re.compile(r"not by a constant factor|neither by a constant factor|small disagreement spread|"
                       r"numeric gradient is zero where analytic is not")
#: Figures that change from check to check with the same cause (counts, a step's ratio): left out of a cause's key.
_FIGURES = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
#: A backward ratio ("analytic is 2.00x numeric") stays in the key: two such factors are two bugs.
_RATIO = re.compile(r"-?\d+\.\d+x")
#: How many names an alert gives.
FIRST = 3
#: The room in a unit's reason for being over it (said once for all of them).
_ROOM = re.compile(r",? over the room memory_budget leaves \(([^)]*)\)")


def over_the_room(units: Sequence[Tuple[str, str]]) -> Tuple[str, str]:
    """``(label, why)`` of the one alert of units (``(name, why)`` each) said over the room at one check: they are one
    cause, the room, said once; the first :data:`FIRST` named with what each needed.

    Example:
        >>> over_the_room([("a", "needs 9 MB, over the room memory_budget leaves (4 MB)"),
        ...                ("b", "needs 7 MB, over the room memory_budget leaves (4 MB)")])
        ('2 units (`a`, `b`)', 'one cause, the room memory_budget leaves (4 MB) at this check: `a` needs 9 MB; `b` needs 7 MB')
    """
    first = units[:FIRST]
    names = ", ".join(f"`{name or '<model>'}`" for name, _ in first) + \
        (f" and {len(units) - FIRST} more" if len(units) > FIRST else "")
    room = _ROOM.search(units[0][1])
    whys = "; ".join(f"`{name or '<model>'}` {_ROOM.sub('', why)}" for name, why in first)
    return (f"{len(units)} units ({names})",
            f"one cause, the room memory_budget leaves{' (' + room.group(1) + ')' if room else ''} at this check: {whys}")


def cause_words(diagnosis: Optional[str]) -> Optional[str]:
    """The words of a diagnosis several tensors can share as one cause, or None where they name none.

    Example:
        >>> cause_words("analytic is 2.00x numeric (constant ratio): a factor in backward is wrong")
        'analytic is 2.00x numeric (constant ratio): a factor in backward is wrong'
        >>> cause_words("analytic differs from numeric at 3 of 8 sampled entries, not by a constant factor") is None
        True
    """
    if not diagnosis or _NO_CAUSE.search(diagnosis):
        return None
    return diagnosis


def cause_key(part: str, where: str, words: str) -> str:
    """What tells one cause from another over a run: the part, the module (or ``"*"``) and the words with their
    figures left out (the training part's all of them: a cut's counts and scale change from step to step; the backward
    part's but its ratios).

    Example:
        >>> cause_key("training", "*", "training's gradient is 0.87x the step's") == cause_key(
        ...     "training", "*", "training's gradient is 0.91x the step's")
        True
        >>> cause_key("backward", "*", "analytic is 2.00x numeric") == cause_key("backward", "*", "analytic is 1.50x numeric")
        False
    """
    if part == "training":
        text = _FIGURES.sub("#", words)
    else:
        kept = _RATIO.findall(words)
        text = _FIGURES.sub("#", _RATIO.sub("@", words)) + "|" + ",".join(kept)
    return f"{part}|{where}|{text}"


def names_text(names: Sequence[str], first: int = FIRST) -> str:
    """The first ``first`` names, and how many more.

    Example:
        >>> names_text(["a", "b", "c", "d", "e"])
        'a, b, c and 2 more'
    """
    shown = ", ".join(names[:first])
    return shown + (f" and {len(names) - first} more" if len(names) > first else "")


def message(step: int, part: str, group: "Group", verdict: str, worst: float) -> str:
    """The alert of a cause: what, where, how many tensors and the first names, then what to look at.

    Example:
        >>> g = Group("k", "*", "training's gradient is 2.00x the objective's", ["a", "b"])
        >>> message(4, "training", g, "wrong", 0.3).split("; judged")[0]
        "2 tensors at step 4 (training), one cause: training's gradient is 2.00x the objective's (a, b)"
    """
    n = len(group.names)
    later = ("Said once for the run: a later check that finds it again updates this alert (its count and last step "
             "go in the check records' causes)")
    judged = f"judged rel_diff up to {worst:.1e} ({verdict.upper()})"
    if group.where != "*":
        up = (f"; {len(group.upstream)} of them upstream of it fail through it: {names_text(group.upstream)}"
              if group.upstream else "")
        return (f"{group.where} at step {step}: one cause of {n} failing tensors ({names_text(group.names)}): "
                f"{group.words}, {judged}{up} — look at the backward of {group.where} (custom autograd Functions, "
                f".detach()/.data, in-place ops); the tensors upstream of it get their gradient through it. {later}")
    if part == "training":
        return (f"{n} tensors at step {step} (training), one cause: {group.words} ({names_text(group.names)}); {judged}"
                " — the gradient the optimizer applies is not the objective's: look at the training loop between the "
                f"loss and watch.step (loss terms, scaling, accumulation, hooks, .grad edits). {later}")
    return (f"{n} tensors at step {step}, one cause: {group.words} ({names_text(group.names)}); {judged} — check the "
            f"backward of the ops these tensors feed (custom autograd Functions, .detach()/.data, in-place ops). {later}")


@dataclass
class Group:
    """Tensors of one part that one cause explains at a check.

    Attributes:
        key: The cause's key (:func:`cause_key`).
        where: The module named (its alert's tensor), or ``"*"`` for a cause of the whole step or objective.
        words: The cause in words (a diagnosis, or the module's own failing entries).
        names: The tensors it explains, the module's own first, then those upstream of it.
        upstream: Of ``names``, the tensors outside the module that fail through it.
    """

    key: str
    where: str
    words: str
    names: List[str]
    upstream: List[str] = field(default_factory=list)


class Causes:
    """The causes a run's checks alerted, each said once and updated after (see the module docstring).

    Example:
        See the module's example.
    """

    def __init__(self) -> None:
        #: key -> ``{"part", "where", "words", "first_step", "last_step", "checks", "count", "tensors"}``.
        self.seen: Dict[str, Dict[str, Any]] = {}

    def known(self, part: str, name: str) -> Optional[str]:
        """The key of a cause already said that explained ``name`` in ``part`` (None if none)."""
        for key, entry in self.seen.items():
            if entry["part"] == part and name in entry["tensors"]:
                return key
        return None

    def group(self, part: str, diagnoses: Mapping[str, Optional[str]],
              modules: Sequence[Sequence[Any]] = ()) -> List[Group]:
        """The groups a check's failing tensors of ``part`` form.

        Args:
            part: ``"backward"`` or ``"training"``.
            diagnoses: Failing tensor -> its diagnosis, in the report's order.
            modules: ``(module, its own failing entries)`` for each module the check named (the module form's unit
                with a failing input, a localized module), in model order. Failing tensors outside every named module
                are upstream of the last one (a wrong backward corrupts every gradient that flows through it).

        Returns:
            Each module's group, then each group of words two or more tensors share (or one a cause already said
            explains); tensors in none alert on their own.
        """
        groups: List[Group] = []
        left = dict(diagnoses)
        named = [(str(m), list(own)) for m, own in modules]
        for i, (module, own) in enumerate(named):
            mine = [n for n in list(left) if n.startswith(module + ".") or n.startswith(module + ":") or n == module]
            upstream = [n for n in list(left) if n not in mine and not any(
                n.startswith(m + ".") or n.startswith(m + ":") for m, _ in named)] if i == len(named) - 1 else []
            key = cause_key(part, module, "module")
            if not mine + upstream or len(mine + upstream) < 2 and key not in self.seen:
                continue  # one tensor: its own alert, as before (none: what it explains is said elsewhere)
            for n in mine + upstream:
                left.pop(n, None)
            words = "its backward is wrong, checked alone" + (f" ({', '.join(own[:FIRST])})" if own else "")
            before = {self.known(part, n) for n in mine + upstream if ":" not in n}
            if key not in self.seen and len(before) == 1 and None not in before:
                key = cast(str, before.pop())  # the cause an earlier check said of these tensors: named now, not new
            same = next((g for g in groups if g.key == key), None)
            if same is not None:
                same.names.extend(mine + upstream)
                same.upstream.extend(upstream)
            else:
                groups.append(Group(key, module, words, mine + upstream, upstream))
        for name in list(left):  # a tensor a cause already said explained, failing again: that cause again
            prior = self.known(part, name)
            if prior is not None:
                entry = self.seen[prior]
                found = next((g for g in groups if g.key == prior), None)
                if found is None:
                    found = Group(prior, entry["where"], entry["words"], [])
                    groups.append(found)
                found.names.append(name)
                left.pop(name)
        by_words: Dict[str, List[str]] = {}
        for name, diagnosis in left.items():
            shared = cause_words(diagnosis)
            if shared is not None:
                by_words.setdefault(shared, []).append(name)
        for words, names in by_words.items():
            key = cause_key(part, "*", words)
            found = next((g for g in groups if g.key == key), None)
            if found is not None:
                found.names.extend(names)
            elif len(names) >= 2 or key in self.seen:
                groups.append(Group(key, "*", words, names))
        return groups

    def note(self, step: int, part: str, group: Group) -> bool:
        """Count ``group`` at this check; True when its cause is new (its alert is due), False when it updates one."""
        entry = self.seen.get(group.key)
        if entry is None:
            self.seen[group.key] = {"part": part, "where": group.where, "words": group.words, "first_step": int(step),
                                    "last_step": int(step), "checks": 1, "count": len(group.names),
                                    "tensors": list(group.names)}
            return True
        entry["tensors"].extend(n for n in group.names if n not in entry["tensors"])
        entry["last_step"], entry["checks"], entry["count"] = int(step), entry["checks"] + 1, len(entry["tensors"])
        return False

    def record(self, group: Group, new: bool) -> Dict[str, Any]:
        """What a check record keeps of a cause it found: ``{"part", "where", "cause", "tensors", "count",
        "first_step", "last_step", "checks", "new"}`` (``tensors``: this check's; ``count``: the run's so far)."""
        entry = self.seen[group.key]
        return {"part": entry["part"], "where": group.where, "cause": group.words, "tensors": list(group.names),
                "count": entry["count"], "first_step": entry["first_step"], "last_step": entry["last_step"],
                "checks": entry["checks"], "new": new}

    def state_dict(self) -> List[Dict[str, Any]]:
        """Plain JSON: a resumed run updates the causes it already said instead of alerting them again."""
        return [{"key": k, **{f: (list(v) if isinstance(v, list) else v) for f, v in e.items()}} for k, e in self.seen.items()]

    def load_state_dict(self, state: Sequence[Mapping[str, Any]]) -> None:
        self.seen = {str(s["key"]): {"part": str(s["part"]), "where": str(s["where"]), "words": str(s["words"]),
                                     "first_step": int(s["first_step"]), "last_step": int(s["last_step"]),
                                     "checks": int(s["checks"]), "count": int(s["count"]),
                                     "tensors": [str(n) for n in s["tensors"]]} for s in state}


__all__ = ["FIRST", "Causes", "Group", "cause_key", "cause_words", "message", "names_text", "over_the_room"]
