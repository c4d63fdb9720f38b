"""``gradwatch report --html``: one self-contained page per report (inline CSS, the maps as inline PNGs, no URL).

Per run: the summary the text report prints, the verdict map of each part (:mod:`gradwatch.io.verdict_map`,
the same image TensorBoard shows; and the optimizer's update, one column per step verified, where the run has
``update`` records), the tensors the maps flag by name (alerted, or suspicious and worse), and every alert with
its whole message.
"""

from __future__ import annotations

import base64
import html
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from gradwatch.io.runs import RunData
from gradwatch.io.verdict_map import SUSPICIOUS, VerdictGrid, grid_from_history, map_png

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 1400px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.2em; margin-top: 2em; } h3 { font-size: 1.05em; }
pre.summary { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 12px; }
img.verdict-map { image-rendering: pixelated; border: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
.wrong { color: #b2182b; font-weight: bold; } .suspicious { color: #c96a00; }
details pre { white-space: pre-wrap; margin: 0.3em 0; }
"""
_VERDICTS = ("not in the check", "no verdict", "excellent", "acceptable", "suspicious", "wrong")


def html_page(runs: Sequence[Tuple[RunData, str]], title: str = "gradwatch report") -> str:
    """The page: for each ``(run, summary text)``, its summary, maps, flagged tensors and alerts.

    Args:
        runs: Each run read back (:func:`gradwatch.io.runs.read_runs`) with the text ``gradwatch report`` prints
            for it.
        title: The page's title and heading.

    Returns:
        The HTML document: one file, nothing fetched (the maps are ``data:image/png`` URIs).

    Example:
        >>> from gradwatch.io.runs import from_records
        >>> data = from_records([{"type": "check", "step": 0, "tensors": {"w": {"verdict": "wrong",
        ...                       "judged_rel_diff": 0.5, "rel_diff": 0.5}}}])
        >>> page = html_page([(data, "1 check, 1 tensor")])
        >>> 'id="verdict-map-backward"' in page and "http" not in page
        True
    """
    body: List[str] = [f"<h1>{html.escape(title)}</h1>"]
    for i, (data, text) in enumerate(runs):
        suffix = "" if i == 0 else f"-{i + 1}"
        if len(runs) > 1:
            body.append(f"<h2>Run {i + 1} of {len(runs)}{html.escape(f' (run_id {data.run_id})' if data.run_id else '')}</h2>")
        body += _run_section(data, text, suffix)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _run_section(data: RunData, text: str, suffix: str) -> List[str]:
    steps = data.check_steps
    span = "" if not steps else f", steps {steps[0]}-{steps[-1]}"
    out = [f"<p class=\"headline\">{len(steps)} checks{span}, {len(data.history)} tensors, {len(data.alerts)} alerts "
           f"({html.escape(str(data.path))}). The maps first, then the summary <code>gradwatch report</code> prints, "
           "then every alert.</p>"]
    maps = [("backward", data.history, steps), ("training", data.training, steps),
            ("update", data.update.history, data.update.steps)]  # the update: a column per step verified
    for part, history, columns in maps:
        if not history:
            continue
        grid = grid_from_history(history, columns, data.alerts, part)
        out += _map_figure(grid, data.bands, part, suffix)
        out += _flagged_table(grid)
    out.append(f"<h3>Summary</h3>\n<pre class=\"summary\" id=\"summary{suffix}\">{html.escape(text)}</pre>")
    out += _alerts_table(data.alerts)
    return out


def _map_figure(grid: VerdictGrid, bands: Sequence[float], part: str, suffix: str) -> List[str]:
    png, height, width = map_png(grid, bands)
    uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    columns = "steps verified after a check" if part == "update" else "checks"
    alt = (f"verdict map of the {part} part: {len(grid.names)} tensors by {len(grid.steps)} {columns}, "
           "coloured by band (green excellent to red wrong, grey no verdict), a dot for an alert")
    return [
        f"<h3>Verdict map: {part}</h3>",
        f"<figure><img class=\"verdict-map\" id=\"verdict-map-{part}{suffix}\" width=\"{width}\" height=\"{height}\" "
        f"alt=\"{html.escape(alt)}\" src=\"{uri}\" onload=\"this.setAttribute('data-drawn', this.naturalWidth)\">"
        "<figcaption>Rows: tensors in the model's order. Columns: checks. A black bar left of a row: the tensor "
        "alerted; a tick above a column: an alert on the whole check.</figcaption></figure>",
    ]


def _flagged_table(grid: VerdictGrid) -> List[str]:
    """The tensors the map flags, by name: what the image labels only where there is room."""
    rows: List[str] = []
    for i, name in enumerate(grid.names):
        alerted = [grid.steps[j] for j in range(len(grid.steps)) if grid.alerts[i, j]]
        worst = int(grid.codes[i].max(initial=0))
        if not alerted and worst < SUSPICIOUS:
            continue
        bad = [grid.steps[j] for j in range(len(grid.steps)) if grid.codes[i, j] >= SUSPICIOUS]
        rows.append(f"<tr><td>{i + 1}</td><td><code>{html.escape(name)}</code></td>"
                    f"<td class=\"{_VERDICTS[worst]}\">{_VERDICTS[worst]}</td><td>{_steps(bad)}</td><td>{_steps(alerted)}</td></tr>")
    if not rows:
        return ["<p>No tensor alerted or was judged suspicious or worse.</p>"]
    return [f"<details{' open' if len(rows) <= 20 else ''}><summary>{len(rows)} tensors alerted or judged suspicious "
            "or worse, by name</summary><table class=\"flagged\"><tr><th>row</th><th>tensor</th><th>worst verdict</th>"
            "<th>suspicious or worse at steps</th><th>alerts at steps</th></tr>", *rows, "</table></details>"]


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(str(s) for s in steps[:12]) + (f" ... ({len(steps)})" if len(steps) > 12 else "")


def _alerts_table(alerts: Sequence[Mapping[str, Any]]) -> List[str]:
    if not alerts:
        return ["<h3>Alerts: none</h3>"]
    out = [f"<h3>Alerts ({len(alerts)})</h3>", "<table class=\"alerts\"><tr><th>step</th><th>part</th><th>tensor</th>"
           "<th>kind</th><th>severity</th><th>message</th></tr>"]
    for a in alerts:
        message = str(a.get("message") or "")
        head, _, rest = message.partition("\n")
        if a.get("headline") and not rest.strip():  # a record written before alerts had three lines: derived
            head, rest = str(a["headline"]), f"why: {a.get('why')}\nwhat to do: {a.get('todo')}"
        cells: Dict[str, Any] = {k: a.get(k) for k in ("step", "part", "tensor", "kind", "severity")}
        text = f"<details><summary>{html.escape(head)}</summary><pre>{html.escape(rest)}</pre></details>" if rest.strip() \
            else html.escape(head)
        out.append("<tr>" + "".join(f"<td>{html.escape(str(v if v is not None else ''))}</td>" for v in cells.values())
                   + f"<td>{text}</td></tr>")
    out.append("</table>")
    return out
