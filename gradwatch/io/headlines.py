"""An alert's three lines: a headline (what, where, how bad) of at most 120 characters, why, and what to do.

The headline is built from the alert's fields (its kind, part, tensor, value, count and step), never cut in the
middle of its meaning: a long tensor name is shortened in its middle (``model.layers.1…gate_up_proj[expert 3]``).
Why and what to do come from the words of the place that raised it: its message, where `` — `` sets what to do apart
(or already on lines of their own: ``why: ...``, ``what to do: ...``); a kind whose message says no what to do gets
its kind's. :class:`gradwatch.Alert` composes its three lines here, and ``gradwatch report`` derives them for records
written before alerts had them. Pure strings: no torch, no state.

Example:
    >>> lines = alert_lines({"step": 4, "tensor": "fc.weight", "kind": "threshold", "severity": "error",
    ...                      "value": 0.32, "message": "fc.weight at step 4: judged rel_diff 3.2e-01 (WRONG) — "
    ...                      "check the backward of the ops this tensor feeds"})
    >>> print(joined(*lines))
    WRONG backward gradient: fc.weight, rel_diff 3.2e-01 (step 4)
    why: judged rel_diff 3.2e-01 (WRONG)
    what to do: check the backward of the ops this tensor feeds
"""

from __future__ import annotations

import math
import re
import textwrap
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

#: Most characters of a headline.
MAX_HEADLINE = 120
#: What stands for the left-out middle of a shortened name.
ELLIPSIS = "…"
#: What sets what to do apart from why in a one-line message.
DASH = " — "
_WHY, _TODO = "why: ", "what to do: "
_GRAD = {"backward": "backward gradient", "training": "training .grad"}
#: What to do, for a kind whose message says none.
_TODO_OF = {
    "error": "look at the exception above; the check was skipped and training continues",
    "independence": "look where it starts: a mask, position ids, or an op that mixes the batch or the sequence "
                    "(a normalization's statistics, a pooling, a reshape across samples)",
    "paused": "fix the cause and call watch.resume() (or restart the run) to check again",
    "not_checked": "each check record's notes say why; check it alone with check_model, or with form='objective'",
}
_TODO_ANY = "look at the tensors and the step it names: gradwatch report <run> lists each check's verdicts"
_PREFIX = re.compile(r"^(?:(?P<who>.+?) at )?step \d+(?: \((?:training|update|inner|independence)\))?[:,] ", re.S)
_KEPT = re.compile(r"[{\[][^{}\[\]\n]{0,40}[}\]]")  # a short dict or list in a message: never wrapped inside
_LINES = re.compile(r"^(?P<head>[^\n]*)\nwhy: (?P<why>.*?)\nwhat to do: (?P<todo>.*?)(?: — (?P<rest>.*))?$", re.S)
_NOT_CHECKED = re.compile(r"^(?P<who>.+?) not checked \((?P<part>\w+) part\): ", re.S)


def shorten(name: str, room: int) -> str:
    """``name`` in at most ``room`` characters: the middle of its dotted path left out, its last part (with its
    ``[expert 3]`` or ``:input``) kept; characters from its middle where even that is too long.

    Example:
        >>> shorten("model.layers.1.mlp.experts.gate_up_proj[expert 3]", 40)
        'model.layers.1…gate_up_proj[expert 3]'
        >>> shorten("model.layers.1.mlp.experts.gate_up_proj[expert 3]", 30)
        'model…gate_up_proj[expert 3]'
        >>> shorten("encoder.blocks.3.attention.inner.proj.weight", 36)
        'encoder.blocks.3…inner.proj.weight'
        >>> shorten("a" * 50, 11)
        'aaa…aaaaaaa'
    """
    room = max(int(room), 5)
    if len(name) <= room:
        return name
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(name):  # the dots outside brackets and parentheses
        depth += (ch in "[(") - (ch in "])")
        if ch == "." and depth == 0:
            parts.append(name[start:i])
            start = i + 1
    parts.append(name[start:])
    left: List[str] = []
    right = [parts[-1]]
    middle = parts[:-1]
    if len(ELLIPSIS) + len(right[0]) > room or not middle:
        keep = room - len(ELLIPSIS)
        head = keep // 3
        return name[:head] + ELLIPSIS + name[len(name) - (keep - head):]
    digit = next((k for k, part in enumerate(middle) if part.isdigit()), 0)  # the first index (a layer's)
    i, j, turn = 0, len(middle) - 1, 1
    blocked: Set[int] = set()
    while i <= j and len(blocked) < 2:  # from the left up to the first index, then a part from each end in turn
        first = i <= digit and 0 not in blocked
        side, turn = (0, turn) if first else (turn % 2, turn + 1)
        if side in blocked:
            continue
        grown = (left + [middle[i]], right) if side == 0 else (left, [middle[j]] + right)
        if len(".".join(grown[0])) + len(ELLIPSIS) + len(".".join(grown[1])) > room:
            blocked.add(side)
            continue
        left, right = grown
        i, j = (i + 1, j) if side == 0 else (i, j - 1)
    spare = room - len(ELLIPSIS) - len(".".join(right))
    if not left and spare >= 4:  # a first part too long to keep whole: its start
        left = [parts[0][:spare]]
    return ".".join(left) + ELLIPSIS + ".".join(right)


def line(what: str, where: str = "", extra: str = "", step: Any = None) -> str:
    """A headline: ``what: where, extra (step N)``, ``where`` shortened to fit :data:`MAX_HEADLINE` (``extra`` left
    out where ``where`` would have under 16 characters).

    Example:
        >>> line("WRONG backward gradient", "fc.weight", "rel_diff 3.2e-01", 4)
        'WRONG backward gradient: fc.weight, rel_diff 3.2e-01 (step 4)'
        >>> len(line("WRONG backward gradient", "m." * 100 + "weight", "rel_diff 3.2e-01", 4))
        120
    """
    when = "" if step is None else f" (step {step})"
    for more in ((f", {extra}" if where else f": {extra}") if extra else "", ""):
        head = what + (": " if where else "")
        room = MAX_HEADLINE - len(head) - len(more) - len(when)
        if where and room < 16 and more:
            continue
        text = head + (shorten(where, room) if where else "") + more + when
        return text if len(text) <= MAX_HEADLINE else text[:MAX_HEADLINE - len(ELLIPSIS)] + ELLIPSIS
    return (what + when)[:MAX_HEADLINE]


def _num(value: Any) -> Optional[float]:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _fmt(value: Optional[float]) -> str:
    return "none" if value is None else f"{value:.1e}" if math.isfinite(value) else str(value)


def headline(alert: Mapping[str, Any]) -> str:
    """The headline of an alert's fields (``step, tensor, kind, severity, value, baseline, message, part, count``).

    Example:
        >>> headline({"step": 0, "tensor": "*", "kind": "threshold", "severity": "error", "value": 0.13,
        ...           "part": "training", "count": 16, "message": "..."})
        'WRONG training .grad: 16 tensors, one cause, rel_diff up to 1.3e-01 (step 0)'
        >>> headline({"step": 2, "tensor": "*", "kind": "not_checked", "part": "training",
        ...           "message": "step 2: the training verdict was never given to 2 tensors (a, b) at 3 checks"})
        'training verdict never given: 2 tensors (step 2)'
    """
    kind, part, step = str(alert.get("kind")), str(alert.get("part") or "backward"), alert.get("step")
    tensor, message = str(alert.get("tensor")), str(alert.get("message") or "")
    where = "" if tensor == "*" else tensor
    value, count = _num(alert.get("value")), int(alert.get("count") or 1)
    bad = value is not None and not math.isnan(value)
    grad = _GRAD.get(part, f"{part} gradient")
    verdict = "WRONG" if alert.get("severity") == "error" else "SUSPICIOUS"
    if kind == "threshold" and count > 1:
        up = f"rel_diff up to {_fmt(value)}" if bad else ""
        if where:
            return line(f"{verdict} {grad}", where, f"one cause of {count} tensors" + (f", {up}" if up else ""), step)
        return line(f"{verdict} {grad}", f"{count} tensors", "one cause" + (f", {up}" if up else ""), step)
    if kind == "threshold":
        return line(f"{verdict} {grad}", where or "the check", f"rel_diff {_fmt(value)}" if bad else "", step)
    if kind == "drift":
        base = _num(alert.get("baseline"))
        return line(f"{grad} drifting", where, f"rel_diff {_fmt(value)} vs baseline {_fmt(base)}", step)
    if kind == "nonfinite":
        return line("non-finite check", where, "no verdict", step) if where else \
            line("the check objective or a gradient is not finite", "", "no verdict", step)
    if kind == "nondeterministic":
        return line("nondeterministic check objective", "", "no verdict", step)
    if kind == "not_checked":
        return _not_checked(part, where, message, step)
    if kind == "error":
        return _error(message, step)
    if kind == "surrogate":
        return line("undeclared surrogate gradient", where or "a module", f"rel_diff {_fmt(value)}" if bad else "", step)
    if kind == "paused":
        return line("gradwatch paused its checks", "", "training goes on unchecked", step)
    if kind == "independence":
        found = re.search(r"(\w+) independence broken", message)
        change = f"change {value:.2g}" if bad and value is not None else ""
        return line(f"{found.group(1) if found else 'an'} independence broken", where, change, step)
    if kind == "partial_window":
        return line("training .grad of a partial accumulation window", "",
                    f"{value:.3g}x the step's objective" if bad and value is not None else "", step)
    if kind == "unjudged":
        return line("training verdict off", "", "micro-batches not handed to the watch", step)
    if kind == "term_weight":
        return line("a loss term weighted otherwise than in the step's objective", "",
                    f"rel_diff up to {_fmt(value)}" if bad else "", step)
    return line(f"{kind.replace('_', ' ')} ({part})", where, f"value {_fmt(value)}" if bad else "", step)


def _not_checked(part: str, where: str, message: str, step: Any) -> str:
    found = re.search(r"never given to (\d+) tensors?", message)
    if found:
        n = int(found.group(1))
        return line(f"{part} verdict never given", f"{n} tensor{'s' if n != 1 else ''}", "", step)
    found = re.search(r"never given at (\d+) checks in a row", message)
    if found:
        return line(f"{part} verdict never given", "", f"{found.group(1)} checks in a row", step)
    named = _NOT_CHECKED.match(_PREFIX.sub("", message, count=1))
    label = named.group("who").replace("`", "") if named else where
    if not where:
        return line(f"{label or 'the ' + part + ' part'} not checked", "", "", step)
    return line(f"not checked ({part})", label, "", step)


def _error(message: str, step: Any) -> str:
    """``check raised KeyError in loss_fn: 'labels' (step 7)``: where shortened, then the exception's words cut."""
    raised = re.search(r"raised ([\w.]+): (.*?)(?: \(in ([^)]+)\))?(?: — |$)", message, re.S)
    if raised is None:
        return line("the check failed", "", "", step)
    words = raised.group(2).strip()
    first, where = (words.splitlines()[0] if words else ""), raised.group(3) or ""
    what, when = f"check raised {raised.group(1)}", "" if step is None else f" (step {step})"
    room = MAX_HEADLINE - len(what) - len(when)
    said = (f" in {where}" if where else "") + (f": {first}" if first else "")
    if len(said) <= room:
        return what + said + when
    if where:
        where = shorten(where, max(room - 4 - min(len(first) + 2, room // 2), 16))
    said = f" in {where}" if where else ""
    left = room - len(said) - 2 - len(ELLIPSIS)
    if first and left > 0:
        said += f": {first if len(first) <= left + len(ELLIPSIS) else first[:left].rstrip() + ELLIPSIS}"
    return (what + said)[:MAX_HEADLINE - len(when)] + when


def split(message: str) -> Optional[Tuple[str, str, str]]:
    """A message already on three lines (``headline``, ``why: ...``, ``what to do: ...``) as its three lines; None
    for a message in one, or one that quotes such lines inside its own (an exception's words, then `` — `` and
    the site's what to do: :func:`one_line`).

    Example:
        >>> split("x failed\\nwhy: y\\nwhat to do: z")
        ('x failed', 'y', 'z')
        >>> split("x failed — do z") is None, split("x: it failed\\nwhy: y\\nwhat to do: z — or w") is None
        (True, True)
    """
    found = _LINES.match(message)
    if found is None or found.group("rest") is not None:
        return None
    return found.group("head").strip(), _flat(found.group("why")), _flat(found.group("todo"))


def one_line(message: str) -> str:
    """A message on one line: lines it quotes (``why: ...``, ``what to do: ...``) joined into it, what they say to
    do kept with the site's, after `` — ``.

    Example:
        >>> one_line("x: it failed\\nwhy: y\\nwhat to do: z — or w")
        'x: it failed: y — z; or w'
    """
    found = _LINES.match(message)
    if found is not None and found.group("rest") is not None:
        message = (f"{found.group('head')}: {found.group('why')}{DASH}{found.group('todo')}; "
                   f"{found.group('rest')}")
    return _flat(message)


def _flat(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text).strip()


def _moved_step(head: str) -> str:
    """``step 3: what`` (a headline written with its step first) as ``what (step 3)``."""
    found = re.match(r"^step (\d+)(?: \(\w+\))?: (.+)$", head)
    return line(found.group(2), "", "", found.group(1)) if found else head


def alert_lines(alert: Mapping[str, Any]) -> Tuple[str, str, str]:
    """``(headline, why, todo)`` of an alert's fields: those it has, the others derived from its message and fields.

    Example:
        >>> alert_lines({"step": 3, "tensor": "*", "kind": "nondeterministic", "message": "step 3: the objective is "
        ...              "nondeterministic — seed the randomness inside loss_fn"})
        ('nondeterministic check objective: no verdict (step 3)', 'the objective is nondeterministic', 'seed the randomness inside loss_fn')
    """
    message = str(alert.get("message") or "")
    given = [str(alert.get(k) or "") for k in ("headline", "why", "todo")]
    if all(given):
        return given[0], given[1], given[2]
    three = split(message)
    if three is not None:
        head, why, todo = _moved_step(three[0]), three[1], three[2]
    else:
        body = one_line(message)
        head = headline(alert if alert.get("kind") == "error" else {**alert, "message": body})  # an exception's 1st line
        found = _PREFIX.match(body)
        if found:
            who = found.group("who")
            body = (f"{who}: " if who and who not in head else "") + body[found.end():]
        why, dash, todo = body.rpartition(DASH)
        if not dash:
            why, todo = body, _TODO_OF.get(str(alert.get("kind")), _TODO_ANY)
    return _flat(given[0] or head), _flat(given[1] or why), _flat(given[2] or todo)


def joined(head: str, why: str, todo: str) -> str:
    """An alert's message: its headline, ``why: ...`` and ``what to do: ...``, each on its own line.

    Example:
        >>> joined("x failed", "y", "z").splitlines()
        ['x failed', 'why: y', 'what to do: z']
    """
    return f"{head}\n{_WHY}{why}\n{_TODO}{todo}"


def with_lines(record: Mapping[str, Any]) -> Dict[str, Any]:
    """An alert record with its ``headline``, ``why`` and ``todo`` (derived where a record written before alerts had
    them lacks them); its ``message`` as written.

    Example:
        >>> rec = with_lines({"step": 1, "tensor": "w", "kind": "drift", "value": 1e-3, "baseline": 1e-9,
        ...                   "message": "w drifted"})
        >>> rec["headline"], rec["todo"][:19]
        ('backward gradient drifting: w, rel_diff 1.0e-03 vs baseline 1.0e-09 (step 1)', 'look at the tensors')
    """
    out = dict(record)
    out["headline"], out["why"], out["todo"] = alert_lines(record)
    return out


def wrapped(record: Mapping[str, Any], indent: str = "    ", width: int = 100) -> List[str]:
    """An alert for a terminal: its headline, then why and what to do indented below it, wrapped at ``width``.

    Example:
        >>> wrapped({"headline": "x failed (step 1)", "why": "y", "todo": "z"}, indent="  ")
        ['  x failed (step 1)', '      why: y', '      what to do: z']
    """
    head, why, todo = alert_lines(record)
    below = indent + "    "
    out = [indent + head]
    for label, text in ((_WHY, why), (_TODO, todo)):
        text = _KEPT.sub(lambda m: m.group(0).replace(" ", "\0"), label + text)  # {'l2': 0.05} on one line
        out += [w.replace("\0", " ") for w in textwrap.wrap(text, width=width, initial_indent=below, subsequent_indent=below
                                                            + "  ", break_long_words=False, break_on_hyphens=False)]
    return out


__all__ = ["DASH", "ELLIPSIS", "MAX_HEADLINE", "alert_lines", "headline", "joined", "line", "shorten", "split",
           "with_lines", "wrapped"]
