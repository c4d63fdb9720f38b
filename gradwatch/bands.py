"""Verdicts and their bands: the words every layer speaks, from options up to the records."""

from __future__ import annotations

import enum
import math
from typing import Sequence, Union

#: Relative-difference bands from the gradient-check chapter:
#: below 1e-7 excellent, below 1e-4 acceptable, below 1e-2 suspicious.
DEFAULT_BANDS = (1e-7, 1e-4, 1e-2)


class Verdict(str, enum.Enum):
    """How well analytic and numerical gradients agree (the chapter's bands).

    Ordered from best to worst; compare with ``Verdict.rank``.

    Example:
        >>> Verdict.from_value(3e-9)
        <Verdict.EXCELLENT: 'excellent'>
        >>> Verdict.from_value(0.5).is_failure(Verdict.SUSPICIOUS)
        True
    """

    EXCELLENT = "excellent"
    ACCEPTABLE = "acceptable"
    SUSPICIOUS = "suspicious"
    WRONG = "wrong"

    @property
    def rank(self) -> int:
        """0 for EXCELLENT up to 3 for WRONG."""
        return _VERDICT_RANK[self]

    def is_failure(self, fail_at: "Verdict") -> bool:
        """True when this verdict is ``fail_at`` or worse."""
        return self.rank >= fail_at.rank

    @classmethod
    def parse(cls, value: Union[str, "Verdict"]) -> "Verdict":
        """Accept a Verdict or its name in any case (``"wrong"``, ``"WRONG"``)."""
        if isinstance(value, Verdict):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        names = ", ".join(repr(v.value) for v in cls)
        raise ValueError(f"unknown verdict {value!r}; expected one of {names}")

    @classmethod
    def from_value(cls, value: float, bands: Sequence[float] = DEFAULT_BANDS) -> "Verdict":
        """Map a relative difference to its band (``nan`` is WRONG)."""
        excellent, acceptable, suspicious = validate_bands(bands)
        if not math.isfinite(value) or value >= suspicious:
            return cls.WRONG
        if value < excellent:
            return cls.EXCELLENT
        if value < acceptable:
            return cls.ACCEPTABLE
        return cls.SUSPICIOUS


_VERDICT_ORDER = [Verdict.EXCELLENT, Verdict.ACCEPTABLE, Verdict.SUSPICIOUS, Verdict.WRONG]


_VERDICT_RANK = {v: i for i, v in enumerate(_VERDICT_ORDER)}


def validate_bands(bands: Sequence[float]) -> tuple:
    """Check that ``bands`` is three increasing positive numbers; return them as a tuple."""
    try:
        values = tuple(float(b) for b in bands)
    except (TypeError, ValueError):
        raise ValueError(f"bands must be three numbers (excellent, acceptable, suspicious), got {bands!r}") from None
    if len(values) != 3 or not all(v > 0 for v in values) or not values[0] < values[1] < values[2]:
        raise ValueError(
            f"bands must be three increasing positive numbers (excellent, acceptable, suspicious), got {bands!r}"
        )
    return values
