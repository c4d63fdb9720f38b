"""The verdict map: its grid from records and from a run read back, its pixels, the TensorBoard images the sink
writes (the same pixels, the check's alerts marked), its cost at 150 tensors, and ``gradwatch report --html``."""

from __future__ import annotations

import re
import statistics
import struct
import time
import zlib

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gradwatch.cli import commands as cli
from gradwatch.io import verdict_map as vm
from gradwatch.io._pixel_font import text_mask
from gradwatch.io.runs import from_records
from gradwatch.io.sinks import MAP_IMAGE_TAG, TensorBoardSink, read_jsonl


def decode_png(data: bytes) -> np.ndarray:
    """The pixels of a PNG :func:`gradwatch.io.verdict_map.png_bytes` wrote (8-bit, filters none or up): RGB."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        chunks[kind] = chunks.get(kind, b"") + data[pos + 8:pos + 8 + n]
        pos += 12 + n
    w, h, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert depth == 8 and colour in (2, 3)
    channels = 3 if colour == 2 else 1
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + w * channels)
    out = raw[:, 1:].copy()
    for y in range(h):
        assert raw[y, 0] in (0, 2)
        if raw[y, 0] == 2 and y:
            out[y] += out[y - 1]
    if colour == 3:
        palette = np.frombuffer(chunks[b"PLTE"], np.uint8).reshape(-1, 3)
        return palette[out]
    return out.reshape(h, w, 3)


def find_text(img: np.ndarray, text: str) -> list:
    """Where ``text`` is drawn in ink in an indexed map: ``[(y, x), ...]``."""
    mask = text_mask(text)
    ink = (img == vm.INK).astype(np.uint8)
    first = next(i for i in range(mask.shape[0]) if mask[i].any())
    pattern = mask[first].astype(np.uint8).tobytes()
    found = []
    for y in range(first, ink.shape[0] - mask.shape[0] + first + 1):
        row = ink[y].tobytes()
        x = row.find(pattern)
        while x != -1:
            window = ink[y - first:y - first + mask.shape[0], x:x + mask.shape[1]]
            if window.shape == mask.shape and np.array_equal(window.astype(bool), mask):
                found.append((y - first, x))
            x = row.find(pattern, x + 1)
    return found


def history_records(n: int = 150, checks: int = 6, wrong=range(40, 44), wrong_from: int = 3):
    """Check and alert records of a run: ``n`` tensors, a rotating third left out, a few WRONG late and alerted."""
    rng = np.random.default_rng(0)
    names = [f"layers.{i // 6}.{('q', 'k', 'v', 'o', 'fc1', 'fc2')[i % 6]}.weight" for i in range(n)]
    records = [{"type": "run", "options": {"bands": [1e-7, 1e-4, 1e-2]}}]
    for c in range(checks):
        tensors, training = {}, {}
        for i, name in enumerate(names):
            if c and (i + c) % 3 == 0:
                continue  # not in this check
            verdict = "wrong" if i in wrong and c >= wrong_from else str(rng.choice(["excellent", "acceptable"]))
            tensors[name] = {"verdict": verdict, "judged_rel_diff": 0.5 if verdict == "wrong" else 1e-9, "rel_diff": 1e-9}
            training[name] = {"verdict": None if i == 0 else "excellent", "judged_rel_diff": 0.0, "rel_diff": 0.0}
        records.append({"type": "check", "step": 10 * c, "tensors": tensors, "training": training})
        records += [{"type": "alert", "step": 10 * c, "tensor": names[i], "kind": "threshold", "severity": "error",
                     "part": "backward", "message": f"{names[i]}: WRONG\nwhy\nwhat to do"}
                    for i in wrong if c >= wrong_from and names[i] in tensors]
    return names, records


def test_grid_from_records_and_from_a_run_read_back_agree():
    names, records = history_records()
    live = vm.MapHistory()
    for rec in records:
        if rec["type"] == "check":
            live.add_check(rec)
        elif rec["type"] == "alert":
            live.add_alert(rec)
    data = from_records(records)
    for part, history in (("backward", data.history), ("training", data.training)):
        a, b = live.grid(part), vm.grid_from_history(history, data.check_steps, data.alerts, part)
        assert a.names == b.names == names and a.steps == b.steps == [0, 10, 20, 30, 40, 50]
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.alerts, b.alerts)
    grid = live.grid("backward")
    assert grid.codes[40, 3] == vm.WRONG
    assert grid.alerts[40, 3]
    assert not grid.alerts[40, :3].any()
    assert grid.codes[2, 1] == vm.NOT_IN_CHECK  # (2 + 1) % 3 == 0: left out of check 1
    training = live.grid("training")
    assert training.codes[0, 0] == vm.NO_VERDICT and not training.alerts.any()  # backward alerts stay off it


def test_alerts_of_a_cause_and_of_the_whole_check():
    h = vm.MapHistory()
    h.add_check({"step": 5, "tensors": {"a": {"verdict": "wrong"}, "b": {"verdict": "wrong"}, "c": {"verdict": "excellent"}},
                 "training": {"a": {"verdict": "excellent"}}})
    h.add_alert({"step": 5, "tensor": "act", "tensors": ["a", "b"], "part": "backward"})  # one alert for one cause
    h.add_alert({"step": 5, "tensor": "*", "part": "training"})
    h.add_alert({"step": 5, "tensor": "blocks.0", "part": "independence"})  # a module: the column, in every map
    back, train = h.grid("backward"), h.grid("training")
    assert back.alerts[:, 0].tolist() == [True, True, False] and back.check_alerts.tolist() == [True]
    assert not train.alerts.any() and train.check_alerts.tolist() == [True]


def test_columns_beyond_the_window_are_dropped():
    h = vm.MapHistory()
    for step in range(vm.MAX_COLUMNS + 5):
        h.add_check({"step": step, "tensors": {"w": {"verdict": "excellent"}}})
    grid = h.grid("backward")
    assert len(grid.steps) == vm.MAX_COLUMNS
    assert grid.steps[0] == 5
    assert grid.dropped == 5
    assert find_text(vm.render_indexed(grid), f"the latest {vm.MAX_COLUMNS} of {vm.MAX_COLUMNS + 5} checks")


def _changed(a: np.ndarray, b: np.ndarray):
    ys, xs = np.nonzero(a != b)
    return ys, xs


def test_a_cell_is_its_band_colour_and_an_alert_a_dot_in_it():
    names, records = history_records(n=20, checks=4, wrong=(), wrong_from=99)
    data = from_records(records)
    base = vm.grid_from_history(data.history, data.check_steps, [], "backward")
    codes = base.codes.copy()
    codes[7, 2] = vm.WRONG
    worse = vm.VerdictGrid(base.names, base.steps, codes, base.alerts.copy(), base.check_alerts, "backward")
    img0, img1 = vm.render_indexed(base), vm.render_indexed(worse)
    assert img0.shape == img1.shape
    ys, xs = _changed(img0, img1)
    cell = img1[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    row_h, col_w = vm.cell_size(20, 4)
    # one cell turns red, all of it (its row and column less the gaps between cells): 20 rows are all named
    assert (ys.max() - ys.min() + 1, xs.max() - xs.min() + 1) == (row_h - 1, col_w - 1)
    assert set(cell.ravel().tolist()) == {vm.WRONG} and len(ys) == (row_h - 1) * (col_w - 1)
    assert find_text(img1, names[7])
    alerted = vm.VerdictGrid(base.names, base.steps, codes, base.alerts.copy(), base.check_alerts, "backward")
    alerted.alerts[7, 2] = True
    img2 = vm.render_indexed(alerted)
    ys, xs = _changed(img1, img2)
    assert set(img2[ys, xs].tolist()) == {vm.INK}  # the dot in the cell and the bar left of the row
    assert xs.min() < 6 and vm.WRONG in img2[ys.min():ys.max() + 1, xs.max() - 1:xs.max() + 3]
    assert np.array_equal(vm.PALETTE[img2], vm.render(alerted))


def test_readable_at_200_tensors_the_alerted_and_failing_ones_named():
    names, records = history_records(n=200, checks=8, wrong=(3, 4, 100, 101, 102, 199), wrong_from=5)
    data = from_records(records)
    grid = vm.grid_from_history(data.history, data.check_steps, data.alerts, "backward")
    img = vm.render_indexed(grid)
    row_h, col_w = vm.cell_size(200, 8)
    assert row_h >= 4 and col_w >= 4  # a row of a few px, a gap between rows
    assert img.shape[0] <= 1000 and img.shape[1] <= 1200
    for i in (3, 4, 100, 101, 102, 199):
        assert find_text(img, names[i]), names[i]
    assert not find_text(img, names[50])  # a tensor that never failed is not named when rows are this thin
    for words in ("excellent <1e-7", "suspicious <1e-2", "no verdict", "not in the check", "alert",
                  "backward: 200 tensors x 8 checks (steps 0-70)"):
        assert find_text(img, words), words


def test_every_row_named_when_rows_are_tall_enough():
    names, records = history_records(n=12, checks=3)
    data = from_records(records)
    img = vm.render_indexed(vm.grid_from_history(data.history, data.check_steps, data.alerts, "backward"))
    assert all(find_text(img, name) for name in names)


def test_png_round_trip():
    img = np.random.default_rng(0).integers(0, 256, (17, 23, 3), dtype=np.uint8)
    assert np.array_equal(decode_png(vm.png_bytes(img)), img)
    names, records = history_records(n=30, checks=3)
    data = from_records(records)
    grid = vm.grid_from_history(data.history, data.check_steps, data.alerts, "backward")
    png, h, w = vm.map_png(grid)
    assert np.array_equal(decode_png(png), vm.render(grid)) and (h, w) == vm.render(grid).shape[:2]


def test_drawing_a_check_at_150_tensors_takes_a_few_ms():
    names, records = history_records(n=150, checks=20)
    live = vm.MapHistory()
    for rec in records:
        if rec["type"] == "check":
            live.add_check(rec)
        elif rec["type"] == "alert":
            live.add_alert(rec)
    times = []
    for _ in range(15):
        t = time.perf_counter()
        for part in vm.PARTS:
            vm.map_png(live.grid(part))
        times.append((time.perf_counter() - t) / 2)
    median = statistics.median(times)
    print(f"verdict map, 150 tensors x 20 checks: {1e3 * median:.2f} ms per part (median of 15)")
    assert median < 0.030  # about 4 ms on one core here; docs/concepts/verdict-map.md has the figures


def _events(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_sink_writes_each_parts_map_with_the_checks_alerts(tmp_path):
    names, records = history_records(n=40, checks=5, wrong=(10, 11), wrong_from=2)
    sink = TensorBoardSink(tmp_path)
    sink.write_run(records[0])
    pending = []
    for rec in records[1:] + [{"type": "check", "step": 999}]:  # the sentinel flushes the last check's alerts
        if rec["type"] == "alert":
            pending[-1][1].append(rec)
            continue
        if rec["step"] == 999:
            break
        pending.append((rec, []))
    for rec, alerts in pending:
        sink.write_check(rec, alert_count=len(alerts))
        for a in alerts:
            sink.write_alert(a)
    sink.close()
    acc = _events(tmp_path)
    assert set(acc.Tags()["images"]) == {f"{MAP_IMAGE_TAG}/backward", f"{MAP_IMAGE_TAG}/training"}
    images = acc.Images(f"{MAP_IMAGE_TAG}/backward")
    assert [e.step for e in images] == [0, 10, 20, 30, 40]  # one image per check
    data = from_records(records)
    want = vm.render(vm.grid_from_history(data.history, data.check_steps, data.alerts, "backward"))
    got = decode_png(images[-1].encoded_image_string)
    assert np.array_equal(got, want)  # the same pixels as the report's, this check's alerts marked
    assert (images[-1].width, images[-1].height) == (want.shape[1], want.shape[0])
    tags = set(acc.Tags()["scalars"])
    assert {f"gradwatch/log10_judged_rel_diff/{names[10]}", f"gradwatch/training/log10_judged_rel_diff/{names[1]}",
            "gradwatch/bands/log10_excellent", "gradwatch/bands/log10_suspicious"} <= tags
    assert [e.value for e in acc.Scalars(f"gradwatch/log10_judged_rel_diff/{names[10]}")][-1] == pytest.approx(np.log10(0.5))
    assert {e.value for e in acc.Scalars(f"gradwatch/training/log10_judged_rel_diff/{names[1]}")} == {-16.0}  # judged 0
    assert {e.value for e in acc.Scalars("gradwatch/bands/log10_acceptable")} == {-4.0}


def test_a_check_whose_alerts_never_come_is_drawn_at_the_next_or_at_close(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write_check({"type": "check", "step": 0, "tensors": {"w": {"verdict": "wrong"}}}, alert_count=2)
    sink.write_alert({"step": 0, "tensor": "w", "kind": "threshold", "severity": "error", "message": "w"})
    sink.close()  # one alert of 2 came: drawn at close, with it
    [image] = _events(tmp_path).Images(f"{MAP_IMAGE_TAG}/backward")
    grid = vm.grid_from_history({"w": [{"step": 0, "verdict": "wrong"}]}, [0], [{"step": 0, "tensor": "w"}])
    assert np.array_equal(decode_png(image.encoded_image_string), vm.render(grid))


def test_report_html_is_one_self_contained_page(tmp_path, capsys):
    names, records = history_records(n=150, checks=5, wrong=(40, 41), wrong_from=2)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checks.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in records))
    out = tmp_path / "report.html"
    assert cli.main(["report", str(run)]) == 0
    text = capsys.readouterr().out
    assert cli.main(["report", str(run), "--html", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == text and f"wrote {out}" in captured.err  # the text report as before
    page = out.read_text()
    assert not re.search(r"(src|href)=\"(?!data:)", page) and "http" not in page  # nothing fetched
    for part in ("backward", "training"):
        m = re.search(rf'<img class="verdict-map" id="verdict-map-{part}" width="(\d+)" height="(\d+)"[^>]* '
                      r'src="data:image/png;base64,([^"]+)"', page)
        assert m, part
        png = __import__("base64").b64decode(m.group(3))
        assert decode_png(png).shape[:2] == (int(m.group(2)), int(m.group(1)))
    summary = re.search(r'<pre class="summary" id="summary">(.*?)</pre>', page, re.S).group(1)
    assert "5 checks, steps 0-40, 150 tensors" in __import__("html").unescape(summary)
    assert names[40] in page and "what to do" in page  # the flagged table and the alerts' whole messages
    records_back, _ = read_jsonl(run)
    assert page.count("<tr><td>") >= sum(r["type"] == "alert" for r in records_back)
