"""The training reference: the step's objective replayed as training ran it (``reference``), its items and
weights (``items``, ``item_probe``), the cut step named (``cut``), per-row gradients (``rows``).
"""

from typing import Any

from gradwatch.check._moved import package_attribute


def __getattr__(name: str) -> Any:
    """The names this path held in 0.1, when it was a module (deprecated; see :mod:`gradwatch.check._moved`)."""
    return package_attribute(__name__, name)
