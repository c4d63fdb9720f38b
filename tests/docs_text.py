"""Where the documentation's text lives, for the tests that hold it to the code.

README.md is short; everything else is in the MkDocs pages under docs/ (mkdocs.yml lists them). A test that
keeps a sentence, a table or a code block true reads the page that holds it: ``page("reference/cli.md")``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def markdown_files() -> List[Path]:
    """README.md, then every page under docs/ in path order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def page_path(name: str) -> Path:
    """``"README.md"`` or a page relative to docs/ (``"guides/independence.md"``); it must exist."""
    path = README if name == "README.md" else DOCS / name
    assert path.is_file(), f"no documentation page {path}"
    return path


def page(name: str) -> str:
    """The text of one page: ``"README.md"`` or a path relative to docs/."""
    return page_path(name).read_text()


def all_text() -> str:
    """README.md and every docs page, one after the other."""
    return "\n".join(path.read_text() for path in markdown_files())


def python_blocks(text: str) -> List[str]:
    """The ```python blocks of a page's text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def title(name: str) -> str:
    """A page's first-level heading."""
    match = re.search(r"^# (.+)$", page(name), re.M)
    assert match, f"{name} has no '# ' title"
    return match.group(1).strip()
