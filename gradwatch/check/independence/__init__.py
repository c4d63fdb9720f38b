"""Independence: whether outputs depend only on the inputs they should (batch, causal, documents,
padding): the check (``check``), the structures (``structures``) and the report (``report``).
"""

from typing import Any

from gradwatch.check._moved import package_attribute


def __getattr__(name: str) -> Any:
    """The names this path held in 0.1, when it was a module (deprecated; see :mod:`gradwatch.check._moved`)."""
    return package_attribute(__name__, name)
