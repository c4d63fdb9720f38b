"""In a real browser: headless Chromium opens TensorBoard on a demo run and the ``gradwatch report --html`` page.

TensorBoard runs as a subprocess (``python -m tensorboard.main --port 0``); Chromium is driven over its
DevTools protocol (tests/browser.py, standard library only). The test asserts what a person would see: the
IMAGES tab draws both verdict maps (their ``<img>`` decoded, at the size written), the CUSTOM SCALARS tab
draws the log10 charts with their lines, and the HTML page shows each part's map, the summary and the alerts.
``make test`` installs Chromium first where it is missing (``python tests/browser.py install``); the test is
skipped, with the reason, only where it could not be installed.
"""

from __future__ import annotations

import time
import urllib.parse

import pytest
from browser import DEEP_ALL, Browser, TensorBoardServer, chromium, get_json

from gradwatch.cli import commands as cli
from gradwatch.io.records import custom_scalars_layout
from gradwatch.io.sinks import MAP_IMAGE_TAG

pytestmark = pytest.mark.slow

MAPS = [f"{MAP_IMAGE_TAG}/backward", f"{MAP_IMAGE_TAG}/training"]
LOG10_CHARTS = [title for title in custom_scalars_layout()["gradwatch"] if title.startswith("log10")]


@pytest.fixture(scope="module")
def chrome():
    path, why = chromium(install=True)
    if path is None:
        print(f"browser test skipped: {why}")
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("browser") / "demo"
    assert cli.main(["demo", "--steps", "40", "--logdir", str(logdir)]) == 0  # the late bug: alerts at step 20
    return logdir


#: tag -> the natural width of each image TensorBoard's IMAGES tab has decoded for it (0 while loading).
IMAGES_SHOWN = f"""Object.fromEntries(({DEEP_ALL})('tf-image-loader').map(e => [e.tag,
    Array.from(e.shadowRoot ? e.shadowRoot.querySelectorAll('img') : []).map(i => i.complete ? i.naturalWidth : 0)]))"""
#: title -> the SVG paths each CUSTOM SCALARS chart card has drawn (its lines and their points).
CHARTS_DRAWN = f"""Object.fromEntries(({DEEP_ALL})('tf-custom-scalar-multi-line-chart-card').map(c => {{
    let n = 0;
    (function walk(r) {{ n += r.querySelectorAll('svg path').length;
                         r.querySelectorAll('*').forEach(e => {{ if (e.shadowRoot) walk(e.shadowRoot); }}); }})(c.shadowRoot || c);
    return [c.title, n]; }}))"""


def test_tensorboard_and_the_html_report_in_chromium(chrome, demo_run, tmp_path, capsys):
    started = time.monotonic()
    page = tmp_path / "report.html"
    assert cli.main(["report", str(demo_run), "--html", str(page)]) == 0
    capsys.readouterr()
    server = TensorBoardServer(demo_run)
    try:
        base = server.url(time.monotonic() + 60)
        deadline = time.monotonic() + 30
        while True:  # the event files load in the background
            tags = get_json(base + "/data/plugin/images/tags").get(".", {})
            if set(MAPS) <= set(tags) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert set(MAPS) <= set(tags), tags
        layout = get_json(base + "/data/plugin/custom_scalars/layout")
        assert [c["title"] for c in layout["category"][0]["chart"]][:2] == LOG10_CHARTS
        served = get_json(base + "/data/plugin/images/images?" + urllib.parse.urlencode({"run": ".", "tag": MAPS[0]}))
        assert [e["step"] for e in served] == [0, 10, 20, 30]  # one map per check

        with Browser(chrome) as browser:
            browser.open(base + "/?darkMode=false#images")
            shown = browser.wait_for(f"(() => {{ const s = {IMAGES_SHOWN}; "
                                     f"return {MAPS!r}.every(t => (s[t] || []).some(w => w > 0)) && s; }})()", timeout=30)
            assert all(max(shown[t]) > 0 for t in MAPS), shown
            browser.open(base + "/?darkMode=false#custom_scalars")
            drawn = browser.wait_for(f"(() => {{ const d = {CHARTS_DRAWN}; "
                                     f"return {LOG10_CHARTS!r}.every(t => d[t] > 0) && d; }})()", timeout=30)
            assert all(drawn[t] > 0 for t in LOG10_CHARTS), drawn

            browser.open(page.as_uri())
            maps = browser.wait_for("""(() => { const m = Array.from(document.querySelectorAll('img.verdict-map'));
                return m.length && m.every(i => i.complete && i.naturalWidth > 0) &&
                       m.map(i => [i.id, i.naturalWidth, +i.getAttribute('width')]); })()""", timeout=10)
            assert [m[0] for m in maps] == ["verdict-map-backward", "verdict-map-training", "verdict-map-update"]
            assert all(natural == declared for _, natural, declared in maps)
            text = browser.evaluate("document.body.innerText")
            assert "4 checks, steps 0-30, 8 tensors" in text
            assert "Alerts (" in text
            assert "fc1.weight" in text
    finally:
        server.stop()
    assert server.proc.poll() is not None
    assert time.monotonic() - started < 90

