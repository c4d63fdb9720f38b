"""One cause, one alert: the failing tensors of a check that one diagnosis explains, said once for the run.

A scale of the whole step, a cut, a count or a term puts the same words in every failing tensor's diagnosis; a wrong
backward in one module fails that module's tensors and every tensor upstream of it. :class:`Causes` groups a check's
failing tensors of one part by what explains them (a module named in the same check, else the same words), gives each
group of two or more one alert (the cause, how many tensors, the first names), and keeps it: the same cause at a later
check updates its count and last step (:attr:`Causes.seen`, the check record's ``causes``), never a new alert. Each
tensor keeps its own verdict and history (:class:`~gradwatch.watch.trend.TrendTracker`). Pure state, plain JSON.

What a run's checks could not check is said once for the run too (:class:`Gaps`), and the words of the tracker's
other alerts (a threshold, a drift, a non-finite or nondeterministic check, a part never given a verdict, a check that
raised) are composed here: the tracker decides which alerts a check raises, this module what they say.

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

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, cast

from gradwatch.check.judging.report import OVER_ROOM, CheckReport, InconclusiveKind, NotChecked
from gradwatch.errors import said

#: The words of a diagnosis that name no cause (a disagreement of unknown origin): such tensors alert one by one.
_NO_CAUSE = re.compile(r"not by a constant factor|neither by a constant factor|small disagreement spread|"
                       r"numeric gradient is zero where analytic is not")
#: Figures that change from check to check with the same cause (counts, a step's ratio): left out of a cause's key.
_FIGURES = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
#: A backward ratio ("analytic is 2.00x numeric") stays in the key: two such factors are two bugs.
_RATIO = re.compile(r"-?\d+\.\d+x")
#: How many names an alert gives.
FIRST = 3
#: Tensor name used for alerts about the whole check.
WHOLE_CHECK = "*"
#: Why a tensor got no verdict where another alert says it, or where it is by design (an expert no token reached).
_SAID_ELSEWHERE = (InconclusiveKind.NONFINITE, InconclusiveKind.NONDETERMINISTIC, InconclusiveKind.NOT_REACHED)
#: Checks in a row in which a part gave no tensor a verdict before its one ``not_checked`` alert (a cycle of K checks,
#: whichever comes first: a cycle is at least this long where the watch cuts its work).
NEVER_GIVEN = 3
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


def named_modules(report: CheckReport) -> List[Tuple[str, List[str]]]:
    """The modules a check named, in order, each with its own failing entries: a module form's unit whose input's
    (or output's) gradient failed, and a failing module of the report's localization."""
    named: Dict[str, List[str]] = {}
    for c in report.localized:
        if getattr(c, "failed", False):  # the root module's own code: "<model>", as a unit of the module form
            named.setdefault(str(c.name) or "<model>", []).extend(n for n, t in c.tensors.items() if t.failed)
    for t in report.tensors.values():
        if t.failed and ":" in t.name and t.name.rsplit(":", 1)[1].split("[")[0] in ("input", "output"):
            named.setdefault(t.name.rsplit(":", 1)[0], []).append(t.name.rsplit(":", 1)[1])
    return list(named.items())


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


class Gaps:
    """What a run's checks could not check, each said once for the run (the tracker's ``not_checked`` alerts).

    A unit or a part a check could not check is said the first time in the run it is not checked for that reason
    (:attr:`NotChecked.key`); a piece over the room :data:`OVER_ROOM` the second time, and the units of one part over
    the room at one check as one cause (:func:`over_the_room`). A part that gave no tensor a verdict, or tensors of a
    part never given one while the others got theirs, at :data:`NEVER_GIVEN` checks in a row: said once for the part.
    Pure state; the tracker's state dict keeps it.
    """

    def __init__(self) -> None:
        self.said: Set[Tuple[str, ...]] = set()  # the keys of what was said not checked (NotChecked.key)
        self.over_room_once: Set[Tuple[str, ...]] = set()  # over the room at one check so far: said at the second
        self.idle: Dict[str, int] = {}  # part -> checks in a row in which it gave no tensor a verdict
        self.missed: Dict[Tuple[str, str], int] = {}  # (part, tensor) -> checks in a row that tried it, no verdict

    def due(self, items: Sequence[NotChecked]) -> List[Tuple[str, str, str, str, str]]:
        """``(what, label, part, why, how)`` of each ``not_checked`` alert ``items`` raise now, in order (those over
        the room after the others, one for each part)."""
        out = []
        over: Dict[str, List[NotChecked]] = {}  # part -> its units over the room at this check: one cause
        for item in items:
            if item.key in self.said:
                continue
            if OVER_ROOM in item.why and item.key not in self.over_room_once:
                self.over_room_once.add(item.key)
                continue
            self.said.add(item.key)
            if OVER_ROOM in item.why:
                over.setdefault(item.part, []).append(item)
                continue
            out.append((item.what, item.label, item.part, item.why, item.how))
        for part, same in over.items():
            if len(same) == 1:
                item = same[0]
                out.append((item.what, item.label, item.part, item.why, item.how))
                continue
            label, why = over_the_room([(i.what, i.why) for i in same])
            out.append((same[0].what, label, part, why, same[0].how))
        return out

    def never_given(self, step: int, report: CheckReport) -> List[Tuple[str, str]]:
        """``(part, message)`` of each part that gave no tensor a verdict at :data:`NEVER_GIVEN` checks in a row (the
        reason in the check's words and what to do), or some of whose tensors it never gave one; none where that
        part's alert was said already, or where another alert says why (micro-batches not handed to the watch:
        ``unjudged``; a check before the first backward)."""
        out: List[Tuple[str, str]] = []
        note = report.training_note or ""
        reasons = {
            "backward": next((t.inconclusive for t in report.tensors.values() if t.inconclusive), None)
            if report.tensors and not (report.nondeterministic or report.nonfinite) and all(
                t.verdict is None and t.inconclusive_kind not in _SAID_ELSEWHERE for t in report.tensors.values())
            else None,
            "training": note if note and not any(t.verdict is not None for t in report.training.values())
            and "a .grad yet" not in note and not note.startswith("skipped: accumulating") else None,
        }
        for part, why in reasons.items():
            if why is None:
                self.idle.pop(part, None)
                out += self._never_given_to_some(step, report, part)
                continue
            self.idle[part] = self.idle.get(part, 0) + 1
            said = any(k[0] == part and k[1] == WHOLE_CHECK for k in self.said)
            if self.idle[part] < NEVER_GIVEN or said:
                continue
            self.said.add((part, WHOLE_CHECK, "never given"))
            out.append((part, never_given_message(step, part, why, self.idle[part])))
        return out

    def _never_given_to_some(self, step: int, report: CheckReport, part: str) -> List[Tuple[str, str]]:
        """Tensors of ``part`` that the check tried and gave no verdict at :data:`NEVER_GIVEN` checks in a row while
        others got theirs (a unit that cannot be checked, a tensor the replay cannot reach): one alert for the part
        and the run, naming them and why (an expert no token reached, a non-finite or nondeterministic check, is said
        elsewhere or is no gap)."""
        checks: Mapping[str, Any] = report.tensors if part == "backward" else report.training
        if report.nondeterministic or report.nonfinite:
            return []  # said by those alerts
        for name, t in checks.items():
            kind = getattr(t, "inconclusive_kind", None)
            if t.verdict is None and t.inconclusive and kind not in _SAID_ELSEWHERE and \
                    not str(t.inconclusive).startswith("not reached"):  # an expert no token reached: no gap
                self.missed[(part, name)] = self.missed.get((part, name), 0) + 1
            elif t.verdict is not None:
                self.missed.pop((part, name), None)
        missed = [n for (p, n), k in self.missed.items() if p == part and k >= NEVER_GIVEN]
        if not missed or any(k[0] == part and k[1] == WHOLE_CHECK for k in self.said):
            return []
        self.said.add((part, WHOLE_CHECK, "never given"))
        return [(part, never_given_to_some_message(step, part, missed, checks, NEVER_GIVEN))]


# ------------------------------------------------------------------ the words of the tracker's other alerts


def fmt(value: Optional[float]) -> str:
    """A judged value in an alert: ``1.0e-05``, or ``none``.

    Example:
        >>> fmt(1e-5), fmt(None)
        ('1.0e-05', 'none')
    """
    return "none" if value is None else f"{value:.1e}"


def threshold_message(step: int, t: Any, part: str, band: float, baseline: Optional[float]) -> str:
    """A tensor's ``threshold`` alert (its verdict SUSPICIOUS or WRONG): where, how bad, then what to look at."""
    base = f"baseline {fmt(baseline)}" if baseline is not None else "no baseline yet"
    if part == "training":
        msg = (
            f"{t.name} at step {step} (training): the live .grad differs from the objective's gradient, judged "
            f"rel_diff {fmt(t.judged_rel_diff)} ({t.verdict.value.upper()}, band >= {band:.0e}; {t.dtype} "
            f"tolerance {t.tolerance:.0e}), {base}"
        )
        if t.diagnosis:
            msg += f"; {t.diagnosis}"
        return msg + (
            " — the gradient the optimizer applies is not the objective's: look at the training loop between "
            "the loss and watch.step (extra or missing loss terms, scaling, accumulation, hooks, .grad edits)"
        )
    msg = (
        f"{t.name} at step {step}: judged rel_diff {fmt(t.judged_rel_diff)} ({t.verdict.value.upper()}, "
        f"band >= {band:.0e}), {base} (rel_diff {fmt(t.rel_diff)}, directional {fmt(t.directional_rel_diff)})"
    )
    if t.diagnosis:
        msg += f"; {t.diagnosis}"
    return msg + (
        " — check the backward of the ops this tensor feeds (custom autograd Functions, .detach()/.data, "
        "in-place ops, a loss term missing from the check objective)"
    )


def drift_message(step: int, t: Any, part: str, median: float, checks: int, baseline: float, from_zero: bool) -> str:
    """A tensor's ``drift`` alert: the median of its last ``checks`` judged values against its baseline
    (``from_zero``: a baseline within the finite-difference noise, judged 0)."""
    if part == "training":
        msg = (
            f"{t.name} at step {step} (training): the live .grad drifted away from the objective's gradient, "
            f"judged rel_diff {fmt(median)} (median of the last {checks} checks) against a baseline of "
            f"{fmt(baseline)}; verdict now {t.verdict.value.upper()}"
        )
        if t.diagnosis:
            msg += f"; {t.diagnosis}"
        return msg + " — something in the training loop changed around this step (loss terms, scaling, hooks, precision)"
    if not from_zero:
        rise = f"{math.log10(median / baseline):.1f} decades above its baseline {fmt(baseline)}"
    else:
        rise = "up from a baseline within the finite-difference noise (judged 0)"
    msg = (
        f"{t.name} at step {step}: judged rel_diff drifted to {fmt(median)} (median of the last "
        f"{checks} checks), {rise}; verdict now {t.verdict.value.upper()}"
    )
    if t.diagnosis:
        msg += f"; {t.diagnosis}"
    return msg + (
        " — gradients of this tensor are degrading: look at what changed around this step (a layer "
        "unfrozen, learning-rate or precision change, saturating or ill-conditioned ops such as "
        "exp/log/softmax/division at extreme values) and at the backward of the ops it feeds"
    )


def tensor_nonfinite_message(step: int, name: str, inconclusive: Any) -> str:
    """A tensor's ``nonfinite`` alert (its samples not finite)."""
    return (
        f"{name} at step {step}: {inconclusive}; no verdict — look for NaN/inf in this tensor, its "
        "gradient, or the activations it produces (overflow, log of 0, division by zero, exploding weights)"
    )


def nonfinite_message(step: int, objective: Any, bad_terms: Mapping[str, Any]) -> str:
    """The whole check's ``nonfinite`` alert: the objective or a gradient not finite (``bad_terms``: its non-finite
    terms)."""
    terms = ", ".join(f"{k} = {v!r}" for k, v in bad_terms.items())
    where = f" (non-finite terms: {terms})" if terms else ""
    return (
        f"step {step}: the check objective or a gradient is not finite (objective = {objective!r}){where}; "
        "no gradient was judged — look for overflow or NaN in the loss and regularizers (log of 0, division "
        "by zero, exploding activations or weights)"
    )


def nondeterministic_message(step: int) -> str:
    """The whole check's ``nondeterministic`` alert."""
    return (
        f"step {step}: the check objective is nondeterministic (two evaluations at the same parameters "
        "differ), so no gradient was judged — seed or remove randomness inside loss_fn (dropout outside "
        "nn.Dropout modules, random augmentation, sampling) or nondeterministic kernels"
    )


def straight_through_message(step: int, where: str, modules: Sequence[str], explained: Sequence[str]) -> str:
    """The ``surrogate`` alert: an undeclared straight-through in ``modules`` (where named) explains ``explained``."""
    declare = repr(modules) if modules else "['<module>']"
    name_it = "" if modules else (
        " (name it: one check with form='module', or check_model(..., localize=True))")
    return (
        f"{where} at step {step}: a straight-through or surrogate gradient, undeclared: its backward passes "
        f"a gradient its forward does not have (numeric zero where analytic is not) to {', '.join(explained)}"
        f"{name_it} — if by design (a quantizer, a spike), declare it: surrogates={declare} (YAML surrogates:, "
        "CLI --surrogates), and the check cuts the objective there and checks the rest around it. If not, it "
        "is a wrong backward. Said once for the run: these tensors raise no further alert for it"
    )


def never_given_message(step: int, part: str, why: str, checks: int) -> str:
    """The ``not_checked`` alert of a part that gave no tensor a verdict at ``checks`` checks in a row, ``why`` in the
    check's words (a call of the model unlike training's said as such)."""
    call = re.search(r"(your loss_fn calls the model with .*?, training called it without"
                     r"|training called the model with .*?, your loss_fn calls it without)(; training called"
                     r" the model with .*?, your loss_fn calls it without)?", why)
    what = "the training verdict" if part == "training" else "the backward verdict"
    why = re.sub(r"^not judged: ", "", why.strip().rstrip("."))
    how = ("pass loss_fn the call training makes" if call else
           "loss_fn(model, batch) must compute what training computes on the watched batch; each check "
           "record's training_note says what the replay needs" if part == "training" else
           "each check record's tensors say why (inconclusive); a larger coords= or dtype=torch.float64")
    return (f"step {step}: {what} not checked ({part} part): never given at {checks} checks in a row: "
            f"{call.group(0) if call else why} — check it instead: {how}. Said once for the run (each check "
            "record repeats why); not a failed verdict")


def never_given_to_some_message(step: int, part: str, missed: Sequence[str], entries: Mapping[str, Any],
                                checks: int) -> str:
    """The ``not_checked`` alert of ``missed`` tensors of a part, never given a verdict at ``checks`` checks in a row
    while the others got theirs (``entries``: the part's at this check; the first missed one's says why)."""
    why = re.sub(r"^not judged: ", "", str(entries[missed[0]].inconclusive).strip().rstrip(".")) \
        if missed[0] in entries else "no verdict"
    first = ", ".join(missed[:3]) + (f" and {len(missed) - 3} more" if len(missed) > 3 else "")
    what = "the training verdict" if part == "training" else "the backward verdict"
    return (f"step {step}: {what} was never given to {len(missed)} tensor{'s' if len(missed) > 1 else ''} "
            f"({first}) at {checks} checks in a row, while the others got theirs: {why} — check "
            f"{'them' if len(missed) > 1 else 'it'} instead: each check record's {part} entries say why; "
            "check_model on the module alone, or form='objective'. Said once for the run; not a failed verdict")


def not_checked_message(step: int, label: str, part: str, why: str, how: str) -> str:
    """A unit's or a part's ``not_checked`` alert: what, why, and how to check it instead."""
    return (f"step {step}: {label} not checked ({part} part): {why} — check it instead: {how}. Said once for the "
            "run (each check record's notes repeat it); not a failed verdict")


def error_message(step: int, exc: BaseException, where: Optional[str]) -> str:
    """The ``error`` alert of a check that raised in ``where`` (None: not the user's code)."""
    msg = f"step {step}: the gradient check raised {type(exc).__name__}: {exc}"
    if said(exc) is not None:  # gradwatch's own default objective: what of the model or batch, in words
        msg = f"step {step}: check skipped, training continues: {said(exc)}"
    elif where is None:
        msg += " — the check was skipped and training continues"
    else:
        msg += f" (in {where}) — the check was skipped and training continues; make {where} work on the watched batch"
    return msg


__all__ = [
    "FIRST", "NEVER_GIVEN", "WHOLE_CHECK", "Causes", "Gaps", "Group", "cause_key", "cause_words", "drift_message",
    "error_message", "fmt", "message", "named_modules", "names_text", "never_given_message", "never_given_to_some_message",
    "nondeterministic_message", "nonfinite_message", "not_checked_message", "over_the_room", "straight_through_message",
    "tensor_nonfinite_message", "threshold_message",
]
