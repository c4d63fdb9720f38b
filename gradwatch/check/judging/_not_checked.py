"""What a check could not check, read off its notes: :class:`NotChecked` items, each with how to check it instead.

Pure words: no torch. :mod:`gradwatch.check.judging.report` holds the names others import.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

#: A note that names something a check could not check: ``<subject> not checked[ on <where>]: <why>`` (a unit of the
#: module form: ``module form: `<name>` (<kind>)``; a module's double backward; ``independence``; any other part).
_NOT_CHECKED_NOTE = re.compile(r"^(?P<subject>.+?) not checked(?P<on> on [^:]*)?: (?P<why>.*)$", re.S)
#: The module form's pieces over the room ``memory_budget`` leaves, and each piece's label in it.
_OVER_ROOM = re.compile(r"^module form: \d+ piece\(s\) not checked, over the room the memory budget leaves "
                        r"\((?P<room>[^)]*)\): (?P<pieces>.*)$", re.S)
_PIECE = re.compile(r"^(?P<label>(?:own code of )?`(?P<what>[^`]*)` \([^)]*\))(?P<rest>.*)$", re.S)
#: How the reason ends where a piece of the module form did not fit the room its check had (the next check of one
#: process takes it first; its not_checked alert waits for a second check without it).
OVER_ROOM = "over the room memory_budget leaves"
#: The training part's note at a check before the first backward (no ``.grad`` yet).
_NO_GRAD_YET = "no watched parameter has a .grad yet"
#: What a whole part is called in words.
_PART_WORDS = {"backward": "the backward part", "inner": "the double backward", "training": "the training verdict",
               "independence": "independence"}


@dataclass(frozen=True)
class NotChecked:
    """A unit or a part a check could not check: what, why, and how to check it instead.

    Attributes:
        part: ``"backward"`` (a unit of the module form), ``"inner"`` (a module's double backward), ``"training"``
            (the training verdict) or ``"independence"``.
        what: The unit or module (``"blocks.0.attn"``), or ``"*"`` for the whole part.
        why: Why it could not be checked, in the words of the check's note.
        how: How to check it instead.
        label: How the check's notes name it (``"`blocks.0.attn` (Attention, own code)"``).

    Example:
        >>> item = NotChecked("independence", "*", "a sharded (FSDP2) model is not supported by it yet", "...")
        >>> item.label, item.key
        ('independence', ('independence', '*', 'a sharded (FSDP#) model is not supported by it yet'))
    """

    part: str
    what: str
    why: str
    how: str
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", _PART_WORDS.get(self.part, self.part) if self.what == "*" else
                               f"`{self.what}`")

    @property
    def key(self) -> Tuple[str, str, str]:
        """What tells one from another over a run: the part, what, and why with its figures left out (a piece over
        the room at every check, or a row slice's shapes in an error, are one thing)."""
        return self.part, self.what, re.sub(r"[\d.]+ ?[KMG]?B\b|\d+", "#", self.why)

    def to_dict(self) -> Dict[str, str]:
        """``{"part", "what", "why", "how", "label"}``."""
        return asdict(self)


def not_checked_in(notes: Sequence[str], training_note: Optional[str] = None, trained: bool = True) -> List[NotChecked]:
    """What a check's notes say it could not check (its ``notes``; ``training_note`` when the training part judged
    nothing, ``trained`` False), each with how to check it instead. Not here: what is left out by design (declared
    ``surrogates``, ``padding_idx`` rows), what other alerts say (non-finite, a step of an accumulation), and a check
    before the first backward (no ``.grad`` to judge yet: a moment of the run, which ``gradwatch report`` lists as not
    judged).

    Example:
        >>> notes = ["module form: `fc` (Linear rows 0:8) not checked: it raised", "fc's double backward not checked: ...",
        ...          "independence not checked on the batch of rank 1: loss_fn never calls the model itself",
        ...          "surrogate, by design: q (not checked as units: ...)", "not checked: emb.weight row 0 (padding_idx)"]
        >>> [(i.part, i.what, i.label) for i in not_checked_in(notes)]
        [('backward', 'fc', '`fc` (Linear rows 0:8)'), ('inner', 'fc', "fc's double backward"), ('independence', '*', 'independence')]
        >>> not_checked_in(notes)[2].why
        'on the batch of rank 1: loss_fn never calls the model itself'
        >>> not_checked_in([], "not judged: the replayed gradient ... does not fit in the room memory_budget leaves",
        ...                trained=False)[0].how
        'a larger memory_budget (or none) leaves room for the replayed gradient'
    """
    out: List[NotChecked] = []
    for note in notes:
        text = str(note)
        over = _OVER_ROOM.match(text)
        if over is not None:
            for piece in over["pieces"].split("; "):
                found = _PIECE.match(piece.strip())
                if found is not None:
                    why = f"{found['rest'].strip()}, {OVER_ROOM} ({over['room']})"
                    out.append(NotChecked("backward", found["what"], why, _how("backward", found["what"], why),
                                          found["label"]))
            continue
        found = _NOT_CHECKED_NOTE.match(text)
        if found is not None:
            where = f"{found['on'].strip()}: " if found["on"] else ""
            out.append(_item(found["subject"], where + found["why"].strip()))
    if not trained and training_note and "not judged" in training_note and _NO_GRAD_YET not in training_note:
        why = re.sub(r"^not judged: ", "", training_note.strip())
        out.append(NotChecked("training", "*", why, _how("training", "*", why)))
    return out


def _item(subject: str, why: str) -> NotChecked:
    """What a note's subject names (:data:`_NOT_CHECKED_NOTE`), in its part."""
    if subject.startswith("module form: "):
        label = subject[len("module form: "):]
        unit = re.match(r"`([^`]*)`", label)
        part, what = "backward", unit.group(1) if unit else label
    elif "double backward" in subject:
        part, what, label = "inner", subject.split("'s double backward")[0] if "'s " in subject else "*", subject
    elif subject.startswith("independence"):
        part, what, label = "independence", "*", ""
    else:  # another part's words ("terms that read the parameters directly")
        part, what, label = "backward", subject, subject
    return NotChecked(part, what, why, _how(part, what, why), label if what != "*" else "")


def _how(part: str, what: str, why: str) -> str:
    """How to check what a check could not (:func:`not_checked_in`)."""
    sharded = "DTensor" in why or "sharded" in why or "FSDP" in why
    if part == "backward":
        if sharded:
            return "form='objective' checks it on a gathered replica (the whole model on every rank)"
        if what == "<loss_fn>":
            return "form='objective' checks loss_fn's own code inside the whole objective (where memory_budget allows)"
        if "memory_budget" in why or "the room" in why:
            return ("a larger memory_budget (or none) leaves it room; or check it alone in a test with "
                    "gradwatch.check_backward on a smaller input")
        if "cannot copy" in why:
            return ("form='objective' with dtype=None checks it in place inside the whole objective (no copy); or "
                    "check it alone in a test with gradwatch.check_backward")
        return ("form='objective' checks it inside the whole objective (a float64 copy of the model, where "
                "memory_budget allows); or check it alone in a test with gradwatch.check_backward, given the "
                "inputs and state its forward expects")
    if part == "inner":
        if sharded:
            return "form='objective' checks it on a gathered replica"
        return ("a larger memory_budget (or none) leaves it room; or check the module alone in a test with "
                "gradwatch.check_double_backward") if "memory_budget" in why else \
            "check the module alone in a test with gradwatch.check_double_backward"
    if part == "independence":
        where = "an unsharded copy of the model, in one process" if sharded else "the inputs the model is called on"
        return f"gradwatch.check_independence(model, inputs, structure=...) on {where}"
    if "memory_budget" in why:
        return "a larger memory_budget (or none) leaves room for the replayed gradient"
    return "the backward part's verdicts stand; each check record's training_note says what the replay needs"
