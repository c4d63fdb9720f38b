"""The verdict map: tensors (rows) by checks (columns), each cell coloured by its verdict's band.

One map per part (backward, training). Grey is a check that gave the tensor no verdict; the lightest grey a
check it was not in (a rotating subset). A black dot is an alert on that tensor at that check; a black tick
above a column an alert on the whole check (``"*"``, or a module rather than a tensor). A black bar left of
a row says the tensor alerted in the map's window, and those rows (then the failing ones) carry their names
on the right, as many as fit; every row is named when rows are tall enough for the text.

Pure rendering: :func:`render` turns a :class:`VerdictGrid` into an RGB array with numpy alone (a 5x7
pixel font for the text), :func:`png_bytes` encodes it with zlib. :class:`MapHistory` keeps the grids of a
run check by check (what the TensorBoard sink draws from); :func:`grid_from_history` builds one from a run
read back (what ``gradwatch report --html`` draws from).
"""

from __future__ import annotations

import bisect
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from gradwatch.bands import DEFAULT_BANDS
from gradwatch.io._pixel_font import ADVANCE, GLYPH_H, text_mask

#: Cell codes of a :class:`VerdictGrid`.
NOT_IN_CHECK, NO_VERDICT, EXCELLENT, ACCEPTABLE, SUSPICIOUS, WRONG = range(6)
CODES = {"excellent": EXCELLENT, "acceptable": ACCEPTABLE, "suspicious": SUSPICIOUS, "wrong": WRONG, None: NO_VERDICT}
#: RGB of each code (green to red for the bands, greys for no verdict), then the paper, the ink and the leaders.
COLOURS = np.array([
    (236, 236, 236),  # not in the check
    (140, 140, 140),  # in the check, no verdict
    (26, 152, 80),    # excellent
    (166, 217, 106),  # acceptable
    (253, 174, 97),   # suspicious
    (215, 48, 39),    # wrong
], dtype=np.uint8)
#: The map is drawn in palette indices: a cell code ``c`` is index ``c``, then these three.
PAPER, INK, LEADER = 6, 7, 8
PALETTE = np.concatenate([COLOURS, np.array([(255, 255, 255), (20, 20, 20), (120, 120, 120)], dtype=np.uint8)])
#: The checks a map shows at most (the latest); older columns are dropped from :class:`MapHistory` too.
MAX_COLUMNS = 240
#: Longest tensor name drawn (longer ones keep their end: ``..layers.11.mlp.fc2.weight``).
LABEL_CHARS = 44
PARTS = ("backward", "training")

_LINE = GLYPH_H + 1  # a text line's pitch
_GRID_HEIGHT, _GRID_WIDTH = 800, 720  # the grid's size the cells aim for


@dataclass
class VerdictGrid:
    """What one map shows: one row per tensor, one column per check.

    Attributes:
        names: The tensors, in the order they were first seen (the model's order).
        steps: The training step of each check.
        codes: ``uint8 (len(names), len(steps))`` of the cell codes (:data:`CODES`).
        alerts: ``bool`` like ``codes``: an alert on that tensor at that check.
        check_alerts: ``bool (len(steps),)``: an alert on the whole check, or on what is not one of ``names``.
        part: ``"backward"`` or ``"training"``.
        dropped: Earlier checks not shown (beyond :data:`MAX_COLUMNS`).

    Example:
        >>> grid = grid_from_history({"w": [{"step": 0, "verdict": "wrong"}]}, [0, 5], [])
        >>> grid.codes.tolist()
        [[5, 0]]
    """

    names: List[str]
    steps: List[int]
    codes: np.ndarray
    alerts: np.ndarray
    check_alerts: np.ndarray
    part: str = "backward"
    dropped: int = 0


def grid_from_history(history: Mapping[str, Sequence[Mapping[str, Any]]], steps: Sequence[int],
                      alerts: Iterable[Mapping[str, Any]], part: str = "backward") -> VerdictGrid:
    """The grid of a run read back: ``history`` is ``{tensor: [{"step", "verdict"}, ...]}`` (a
    :class:`gradwatch.io.runs.RunData`'s ``history``, ``training`` or ``update.history``), ``steps`` its checks'
    steps, ``alerts`` its alert records (those of ``part`` mark cells; those of no tensor of the map mark their
    column).

    Example:
        >>> grid = grid_from_history({"w": [{"step": 0, "verdict": "excellent"}, {"step": 5, "verdict": None}]},
        ...                          [0, 5], [{"step": 5, "tensor": "w", "part": "backward"}])
        >>> grid.codes.tolist(), grid.alerts.tolist()
        ([[2, 1]], [[False, True]])
    """
    state = MapHistory(tuple(dict.fromkeys((*PARTS, part))))  # (the update part's map: only the report draws it)
    by_step: Dict[int, Dict[str, Optional[str]]] = {int(s): {} for s in steps}
    for name, entries in history.items():
        for entry in entries:
            by_step.setdefault(int(entry["step"]), {})[str(name)] = entry.get("verdict")
    for step in sorted(by_step):
        state.add_column(part, step, by_step[step])
    for alert in alerts:
        state.add_alert(alert)
    return state.grid(part)


@dataclass
class _Part:
    names: List[str] = field(default_factory=list)
    rows: Dict[str, int] = field(default_factory=dict)
    steps: List[int] = field(default_factory=list)
    columns: List[np.ndarray] = field(default_factory=list)  # codes per column, as long as names were then
    marks: List[set] = field(default_factory=list)  # per column: the rows alerted
    whole: List[bool] = field(default_factory=list)
    dropped: int = 0


class MapHistory:
    """The verdicts and alerts of a run, check by check: what a map is drawn from, kept as it comes.

    Args:
        parts: The parts kept (their names as in alert records' ``part``).

    Example:
        >>> h = MapHistory()
        >>> h.add_check({"step": 0, "tensors": {"w": {"verdict": "excellent"}}, "training": {}})
        >>> h.add_alert({"step": 0, "tensor": "w", "part": "backward"})
        >>> g = h.grid("backward")
        >>> g.names, g.codes.tolist(), g.alerts.tolist(), h.grid("training").names
        (['w'], [[2]], [[True]], [])
    """

    def __init__(self, parts: Sequence[str] = PARTS) -> None:
        self.parts: Dict[str, _Part] = {p: _Part() for p in parts}

    def add_check(self, record: Mapping[str, Any]) -> None:
        """Add one ``"check"`` record: its ``tensors`` are the backward part, its ``training`` the training part."""
        step = int(record["step"])
        for part, key in (("backward", "tensors"), ("training", "training")):
            if part in self.parts:
                found = record.get(key) or {}
                self.add_column(part, step, {str(n): (t or {}).get("verdict") for n, t in found.items()})

    def add_column(self, part: str, step: int, verdicts: Mapping[str, Optional[str]]) -> None:
        """Add one check of ``part``: ``verdicts`` maps each tensor it held to its verdict (None: not judged)."""
        p = self.parts[part]
        for name in verdicts:
            if name not in p.rows:
                p.rows[name] = len(p.names)
                p.names.append(name)
        column = np.full(len(p.names), NOT_IN_CHECK, dtype=np.uint8)
        for name, verdict in verdicts.items():
            column[p.rows[name]] = CODES.get(None if verdict is None else str(verdict).lower(), NO_VERDICT)
        p.steps.append(int(step))
        p.columns.append(column)
        p.marks.append(set())
        p.whole.append(False)
        if len(p.steps) > MAX_COLUMNS:
            del p.steps[0], p.columns[0], p.marks[0], p.whole[0]
            p.dropped += 1

    def add_alert(self, alert: Mapping[str, Any]) -> None:
        """Mark an alert record at its step's latest check: on its tensors (``tensor``, and a ``tensors`` list) where
        they are rows of its part's map, else on the column (a whole-check alert, a module). Alerts of another part
        (independence, inner) mark the column of every map."""
        step = alert.get("step")
        if step is None:
            return
        part = alert.get("part") or "backward"
        listed = alert.get("tensors")  # one alert for a cause many tensors share names them all
        names: List[Any] = [alert.get("tensor")] + (list(listed) if isinstance(listed, list) else [])
        for name, p in self.parts.items():
            if part in self.parts and part != name:
                continue
            if int(step) not in p.steps:
                continue
            col = len(p.steps) - 1 - p.steps[::-1].index(int(step))
            rows = [p.rows[str(n)] for n in names if str(n) in p.rows]
            p.marks[col].update(rows)
            if not rows or part not in self.parts:
                p.whole[col] = True

    def grid(self, part: str) -> VerdictGrid:
        """The grid of ``part`` now."""
        p = self.parts[part]
        n, m = len(p.names), len(p.steps)
        codes = np.full((n, m), NOT_IN_CHECK, dtype=np.uint8)
        alerts = np.zeros((n, m), dtype=bool)
        for j, (column, marks) in enumerate(zip(p.columns, p.marks)):
            codes[:len(column), j] = column
            if marks:
                alerts[sorted(marks), j] = True
        return VerdictGrid(list(p.names), list(p.steps), codes, alerts, np.array(p.whole, dtype=bool), part, p.dropped)


# --------------------------------------------------------------------- rendering

def cell_size(rows: int, columns: int) -> Tuple[int, int]:
    """Pixels per row and per column: rows 3 to 12 px (4 at 200 tensors), columns 3 to 24 px.

    Example:
        >>> cell_size(150, 8), cell_size(200, 100)
        ((5, 24), (4, 7))
    """
    return (int(np.clip(_GRID_HEIGHT // max(rows, 1), 3, 12)), int(np.clip(_GRID_WIDTH // max(columns, 1), 3, 24)))


def _labels_placed(grid: VerdictGrid, top: int, row_h: int) -> List[Tuple[int, int]]:
    """``(row, label top)`` of the names drawn: every row when rows are as tall as a line of text; else the alerted
    rows, then the failing ones (worst first), each within two lines of its row where a line is free there (in a
    long run of flagged rows, about every other one), the labels in the rows' order so that no leaders cross."""
    n = len(grid.names)
    if row_h >= _LINE:
        return [(i, top + i * row_h + (row_h - GLYPH_H) // 2) for i in range(n)]
    alerted: List[bool] = np.asarray(grid.alerts.any(axis=1)).tolist()
    worst: List[int] = np.asarray(grid.codes.max(axis=1, initial=0)).tolist()
    flagged = [i for i in range(n) if alerted[i] or worst[i] >= SUSPICIOUS]
    flagged.sort(key=lambda i: (not alerted[i], -worst[i], i))
    reach = 2 * _LINE
    low, high = top - 3, top + n * row_h + 4 - GLYPH_H  # below the title, above the legend
    tops: List[int] = []
    rows: List[int] = []

    def free(y: int) -> bool:
        k = bisect.bisect_left(tops, y)
        return (k == 0 or y - tops[k - 1] >= _LINE) and (k == len(tops) or tops[k] - y >= _LINE)

    for i in flagged:
        wanted = top + i * row_h + row_h // 2 - GLYPH_H // 2
        near = tops[bisect.bisect_left(tops, wanted - reach - _LINE):bisect.bisect_right(tops, wanted + reach + _LINE)]
        candidates = [wanted] + sorted((t + d for t in near for d in (_LINE, -_LINE)), key=lambda y: (abs(y - wanted), y))
        for y in candidates:
            if abs(y - wanted) <= reach and low <= y <= high and free(y):
                bisect.insort(tops, y)
                rows.append(i)
                break
    return list(zip(sorted(rows), tops))


def _text(img: np.ndarray, x: int, y: int, text: str, colour: int = INK) -> int:
    """Draw ``text`` with its top left at ``(x, y)``, clipped to the image; returns the x after it."""
    mask = text_mask(text)
    h, w = img.shape[:2]
    mh, mw = mask.shape
    if y >= h or x >= w or y + mh <= 0:
        return x + mw
    sub = mask[max(0, -y):min(mh, h - y), :min(mw, w - x)]
    img[max(y, 0):max(y, 0) + sub.shape[0], x:x + sub.shape[1]][sub] = colour
    return x + mw


def _short(name: str) -> str:
    return name if len(name) <= LABEL_CHARS else ".." + name[-(LABEL_CHARS - 2):]


def _line(img: np.ndarray, x0: int, y0: int, x1: int, y1: int, colour: int) -> None:
    n = max(abs(x1 - x0), abs(y1 - y0), 1)
    t = np.arange(n + 1)
    img[y0 + (t * (y1 - y0) + n // 2) // n, x0 + (t * (x1 - x0) + n // 2) // n] = colour


def _legend(bands: Sequence[float]) -> List[Tuple[Optional[int], str]]:
    e, a, s = (f"{b:.0e}".replace("e-0", "e-") for b in bands)
    return [(EXCELLENT, f"excellent <{e}"), (ACCEPTABLE, f"acceptable <{a}"), (SUSPICIOUS, f"suspicious <{s}"),
            (WRONG, "wrong"), (NO_VERDICT, "no verdict"), (NOT_IN_CHECK, "not in the check"), (None, "alert")]


def render(grid: VerdictGrid, bands: Sequence[float] = DEFAULT_BANDS, title: Optional[str] = None) -> np.ndarray:
    """Draw ``grid`` as an ``(height, width, 3)`` uint8 RGB image: a title, the cells, the names, a legend.

    The map is drawn in :data:`PALETTE` indices (:func:`render_indexed`) and coloured at the end.

    Args:
        grid: What to draw.
        bands: The run's bands, printed in the legend.
        title: First line; by default the part, the tensor and check counts and the steps.

    Example:
        >>> grid = grid_from_history({f"w{i}": [{"step": 0, "verdict": "excellent"}] for i in range(200)}, [0], [])
        >>> img = render(grid)
        >>> img.dtype, img.shape[2], img.shape[0] >= 200 * 4
        (dtype('uint8'), 3, True)
    """
    return PALETTE[render_indexed(grid, bands, title)]


def render_indexed(grid: VerdictGrid, bands: Sequence[float] = DEFAULT_BANDS, title: Optional[str] = None) -> np.ndarray:
    """:func:`render`'s image as ``(height, width)`` :data:`PALETTE` indices (a third of the pixels to write and
    to encode: :func:`map_png` writes them as a palette PNG).

    Example:
        >>> grid = grid_from_history({"w": [{"step": 0, "verdict": "wrong"}]}, [0], [])
        >>> int(render_indexed(grid).max()) < len(PALETTE)
        True
    """
    n, m = grid.codes.shape
    row_h, col_w = cell_size(n, m)
    gap_r, gap_c = int(row_h >= 4), int(col_w >= 4)
    all_fit = row_h >= _LINE
    top = _LINE + 2 + 4  # the title, then the column ticks of whole-check alerts
    left = 6  # the alerted rows' bars
    grid_h, grid_w = max(n, 1) * row_h, max(m, 1) * col_w
    labelled = _labels_placed(grid, top, row_h)
    label_w = ADVANCE * max((len(_short(grid.names[i])) for i, _ in labelled), default=0)
    leader = 0 if all_fit or not labelled else 8
    legend = _legend(bands)
    legend_w = sum(12 + ADVANCE * len(text) + 10 for _, text in legend)
    width = max(left + grid_w + 4 + leader + label_w + 4, legend_w + 4, 320)
    axis_y = top + grid_h + 2
    height = axis_y + _LINE + 4 + _LINE + 4
    img = np.full((height, width), PAPER, dtype=np.uint8)
    span = "no checks" if not grid.steps else (f"step {grid.steps[0]}" if m == 1 else f"steps {grid.steps[0]}-{grid.steps[-1]}")
    more = f", the latest {m} of {m + grid.dropped} checks" if grid.dropped else ""
    _text(img, 2, 1, title or f"{grid.part}: {n} tensors x {m} checks ({span}{more})")
    if n and m:
        _cells(img, grid, top, left, row_h, col_w, gap_r, gap_c)
    _labels(img, grid, labelled, top, left + grid_w + 4, row_h, leader)
    _axis(img, grid, axis_y, left, col_w)
    _draw_legend(img, legend, axis_y + _LINE + 3)
    return img


def _cells(img: np.ndarray, grid: VerdictGrid, top: int, left: int, row_h: int, col_w: int, gap_r: int, gap_c: int) -> None:
    n, m = grid.codes.shape
    cells = np.repeat(np.repeat(grid.codes, row_h, axis=0), col_w, axis=1)
    if gap_r:
        cells[row_h - 1::row_h] = PAPER
    if gap_c:
        cells[:, col_w - 1::col_w] = PAPER
    img[top:top + n * row_h, left:left + m * col_w] = cells
    dot_h, dot_w = max(1, (row_h - gap_r + 1) // 2), max(1, (col_w - gap_c + 1) // 2)
    off_h, off_w = (row_h - gap_r - dot_h) // 2, (col_w - gap_c - dot_w) // 2
    for i, j in zip(*np.nonzero(grid.alerts)):
        y, x = top + i * row_h + off_h, left + j * col_w + off_w
        img[y:y + dot_h, x:x + dot_w] = INK
    for i in np.nonzero(grid.alerts.any(axis=1))[0]:
        img[top + i * row_h:top + i * row_h + max(row_h - gap_r, 1), 1:left - 2] = INK
    for j in np.nonzero(grid.check_alerts)[0]:
        img[top - 4:top - 1, left + j * col_w:left + j * col_w + max(col_w - gap_c, 1)] = INK


def _labels(img: np.ndarray, grid: VerdictGrid, labelled: Sequence[Tuple[int, int]], top: int, x: int, row_h: int,
            leader: int) -> None:
    for i, y in labelled:
        if leader:
            _line(img, x, top + i * row_h + row_h // 2, x + leader - 2, y + GLYPH_H // 2, LEADER)
        _text(img, x + leader, y, _short(grid.names[i]))


def _axis(img: np.ndarray, grid: VerdictGrid, y: int, left: int, col_w: int) -> None:
    """Step numbers under the first and the last column, and in between where they do not overlap."""
    m = len(grid.steps)
    if not m:
        return
    end = -1
    every = max(1, (ADVANCE * (len(str(grid.steps[-1])) + 2)) // col_w + 1)
    picks = sorted(set(range(0, m, every)) | {m - 1})
    for j in picks:
        text = str(grid.steps[j])
        x = max(left + j * col_w + col_w // 2 - ADVANCE * len(text) // 2, 0)
        if x > end or j == m - 1:
            if j == m - 1 and x <= end:
                continue
            end = _text(img, x, y, text) + ADVANCE


def _draw_legend(img: np.ndarray, legend: Sequence[Tuple[Optional[int], str]], y: int) -> None:
    x = 2
    for code, text in legend:
        img[y:y + GLYPH_H, x:x + 9] = INK
        if code is None:  # the alert mark: a dot on a cell
            img[y + 1:y + GLYPH_H - 1, x + 1:x + 8] = EXCELLENT
            img[y + 2:y + 5, x + 3:x + 6] = INK
        else:
            img[y + 1:y + GLYPH_H - 1, x + 1:x + 8] = code
        x = _text(img, x + 12, y, text) + 10


def map_png(grid: VerdictGrid, bands: Sequence[float] = DEFAULT_BANDS, title: Optional[str] = None) -> Tuple[bytes, int, int]:
    """:func:`render` encoded as a palette PNG: ``(png, height, width)``.

    Example:
        >>> png, height, width = map_png(grid_from_history({"w": [{"step": 0, "verdict": "wrong"}]}, [0], []))
        >>> png[:4], height > 0 and width > 0
        (b'\\x89PNG', True)
    """
    img = render_indexed(grid, bands, title)
    return png_bytes(img, palette=PALETTE), img.shape[0], img.shape[1]


def png_bytes(img: np.ndarray, palette: Optional[np.ndarray] = None, level: int = 3) -> bytes:
    """Encode ``(height, width, 3)`` uint8 RGB, or ``(height, width)`` indices into ``palette`` (at most 256 RGB rows),
    as a PNG. Each row is filtered "up" (against the row above): a map's rows repeat, so most bytes are 0.

    Example:
        >>> png_bytes(np.zeros((2, 3, 3), np.uint8))[:8]
        b'\\x89PNG\\r\\n\\x1a\\n'
    """
    h, w = img.shape[:2]
    flat = img.reshape(h, -1)
    raw = np.empty((h, flat.shape[1] + 1), dtype=np.uint8)
    raw[:, 0] = 2
    raw[0, 0] = 0
    raw[0, 1:] = flat[0]
    raw[1:, 1:] = flat[1:] - flat[:-1]  # uint8: wraps modulo 256, as the filter wants

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)

    colour_type = 2 if palette is None else 3
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, colour_type, 0, 0, 0))
    if palette is not None:
        out += chunk(b"PLTE", np.asarray(palette, dtype=np.uint8).tobytes())
    return out + chunk(b"IDAT", zlib.compress(raw.tobytes(), level)) + chunk(b"IEND", b"")
