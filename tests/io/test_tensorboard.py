"""A real TensorBoard server, started on a demo run, serves gradwatch's scalars and alert text as recorded.

The server runs as a subprocess on 127.0.0.1 with ``--port 0`` (it prints
the URL it chose on stderr; tests/browser.py's ``TensorBoardServer``) and is always stopped (terminate, then kill).
Values are compared with ``checks.jsonl``: equal within float32 precision,
at the same steps.
"""

from __future__ import annotations

import html
import json
import math
import re
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from browser import TensorBoardServer  # noqa: E402

from gradwatch.cli import commands as cli  # noqa: E402
from gradwatch.io.records import ALERTS_COUNT_TAG, ALERTS_TEXT_TAG, TENSOR_METRICS  # noqa: E402
from gradwatch.io.sinks import read_jsonl  # noqa: E402

START_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def demo_logdir(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("tb") / "demo"
    code = cli.main(["demo", "--steps", "40", "--logdir", str(logdir)])  # weights grow at step 20
    assert code == 0
    return logdir


def _get(base: str, path: str, **params):
    query = ("?" + urllib.parse.urlencode(params)) if params else ""
    with urllib.request.urlopen(base + path + query, timeout=10) as resp:
        return json.loads(resp.read().decode("utf-8"))


def _expected(logdir: Path):
    """From checks.jsonl: {tag: {step: value}} of every finite per-tensor metric, the alert counts, and the alerts."""
    records, warnings = read_jsonl(logdir)
    assert not warnings
    scalars = defaultdict(dict)
    alerts = [r for r in records if r["type"] == "alert"]
    per_step = defaultdict(int)
    for a in alerts:
        per_step[a["step"]] += 1
    for rec in (r for r in records if r["type"] == "check"):
        for name, t in rec["tensors"].items():
            for metric in TENSOR_METRICS:
                v = t.get(metric)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    scalars[f"gradwatch/{metric}/{name}"][rec["step"]] = float(v)
        for key in ("rel_diff_median", "rel_diff_p95", "rel_diff_max"):
            scalars[f"gradwatch/summary/{key}"][rec["step"]] = float(rec["summary"][key])
        scalars["gradwatch/overhead/seconds"][rec["step"]] = float(rec["seconds"])
        scalars[ALERTS_COUNT_TAG][rec["step"]] = float(per_step.get(rec["step"], 0))
    assert any(t.startswith("gradwatch/judged_rel_diff/") for t in scalars)
    return scalars, alerts


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", text)))


def test_tensorboard_serves_gradwatch_scalars_and_alerts(demo_logdir):
    scalars, alerts = _expected(demo_logdir)
    assert alerts, "the late-bug demo should have raised alerts"
    server = TensorBoardServer(demo_logdir)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        base = server.url(deadline)
        # the event files load in the background: wait until every gradwatch tag is there
        while True:
            try:
                runs = _get(base, "/data/runs")
                tags = _get(base, "/data/plugin/scalars/tags")
            except OSError:
                runs, tags = [], {}
            run = runs[0] if runs else None
            if run is not None and set(scalars) <= set(tags.get(run, {})):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"TensorBoard never served all gradwatch tags; runs={runs}, "
                            f"missing={sorted(set(scalars) - set(tags.get(run, {})))[:5]}")
            time.sleep(0.5)
        assert runs == ["."]

        for tag, expected in scalars.items():
            served = _get(base, "/data/plugin/scalars/scalars", run=run, tag=tag)
            got = {int(step): value for _, step, value in served}
            assert sorted(got) == sorted(expected), tag
            for step, value in expected.items():
                assert math.isclose(got[step], value, rel_tol=1e-6, abs_tol=1e-30), (tag, step, got[step], value)

        text_tags = _get(base, "/data/plugin/text/tags")[run]
        alert_tags = [t for t in text_tags if t == ALERTS_TEXT_TAG or t.startswith(ALERTS_TEXT_TAG + "/")]
        assert alert_tags, text_tags
        served_text = []
        for tag in alert_tags:
            served_text += _get(base, "/data/plugin/text/text", run=run, tag=tag)
        assert len(served_text) == len(alerts)
        for a in alerts:
            texts = [_plain(e["text"]) for e in served_text if e["step"] == a["step"]]
            head = f"{a['kind']} on {a['tensor']}"
            assert any(head in t and _plain(a["message"])[:80] in t for t in texts), (head, texts)
    finally:
        server.stop()
    assert server.proc.poll() is not None
