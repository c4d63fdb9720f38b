"""A 150-tensor run for the verdict map, its cost per check, and the docs' screenshots.

The model is a residual MLP of 36 blocks (LayerNorm, Linear, a custom SiLU), between an input and an output
Linear and a final LayerNorm: 150 parameter tensors. Block 20's SiLU has a hand-written backward that
forgets a term where ``|x| >= 3`` (the demo's late bug); at step 30 that block's weights grow and its inputs
cross 3. The watch checks 100 of the 150 tensors per check (``tensors_per_check``, rotating), so the map shows
cells not in a check, then the planted bug turning its tensors red and the alert on it.

    python benchmarks/verdict_map.py [--logdir runs/verdict_map] [--steps 80] [--screenshots docs/images] [--no-run]

It prints the time the TensorBoard sink spent drawing and writing each check's maps (both parts), then, with
``--screenshots``, writes ``verdict_map_tb.png`` (TensorBoard's IMAGES tab, at the image's actual size),
``log10_charts_tb.png`` (CUSTOM SCALARS) and ``report_html.png`` (``gradwatch report --html``) there, taken in
headless Chromium (tests/browser.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import gradwatch  # noqa: E402
from gradwatch.cli import commands as cli  # noqa: E402
from gradwatch.cli.demo import CustomSiLU  # noqa: E402
from gradwatch.io import sinks  # noqa: E402

BLOCKS, WIDTH, BUGGY = 36, 16, 20


class Block(nn.Module):
    def __init__(self, bug: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.act = CustomSiLU(bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.2 * self.act(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.Sequential(*(Block("late" if i == BUGGY else "none") for i in range(BLOCKS)))
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.blocks(self.inp(x))))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def run(logdir: Path, steps: int) -> list:
    """Train with the watch; returns the seconds the TensorBoard sink spent in each check's maps."""
    drawn = []
    original = sinks.TensorBoardSink._draw_maps

    def timed(self):
        if self._pending is None:  # nothing to draw: called on the way
            return
        t = time.perf_counter()
        original(self)
        drawn.append(time.perf_counter() - t)

    sinks.TensorBoardSink._draw_maps = timed  # measure the maps alone: the scalars and texts are not theirs
    try:
        torch.manual_seed(0)
        model = Net()
        assert sum(1 for _ in model.parameters()) == 150
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        x_all, y_all = torch.randn(512, 8), torch.randint(0, 3, (512,))
        with gradwatch.GradWatch(model, loss_fn, every=10, tensors_per_check=100, form="objective",
                                 log_dir=str(logdir)) as watch:
            for step in range(steps):
                idx = torch.randint(0, 512, (32,))
                batch = (x_all[idx], y_all[idx])
                opt.zero_grad()
                loss_fn(model, batch).backward()
                watch.step(batch)
                opt.step()
                if step == 30:
                    with torch.no_grad():
                        model.blocks[BUGGY].fc.weight.mul_(8.0)  # its inputs cross |x| = 3: the late bug shows
            print(f"{len(watch.alerts)} alerts")
    finally:
        sinks.TensorBoardSink._draw_maps = original
    return drawn


def screenshots(logdir: Path, out: Path) -> None:
    """TensorBoard's IMAGES and CUSTOM SCALARS tabs and the HTML report, in headless Chromium."""
    from browser import DEEP_ALL, Browser, TensorBoardServer, chromium

    path, why = chromium(install=False)
    if path is None:
        raise SystemExit(f"no screenshots: {why}")
    out.mkdir(parents=True, exist_ok=True)
    page = Path(tempfile.mkdtemp()) / "report.html"
    assert cli.main(["report", str(logdir), "--html", str(page)]) == 0
    server = TensorBoardServer(logdir)
    try:
        base = server.url(time.monotonic() + 60)
        with Browser(path, width=1300, height=1250) as b:
            b.open(base + "/?darkMode=false#images&tagFilter=verdict_map%2Fbackward")
            b.wait_for(f"({DEEP_ALL})('tf-image-loader').length > 0", timeout=30)
            b.evaluate(f"""(() => {{ const box = ({DEEP_ALL})('paper-checkbox').find(
                e => e.textContent.includes('Show actual image size')); if (box && !box.checked) box.click(); }})()""")
            b.wait_for(f"({DEEP_ALL})('tf-image-loader').every(e => Array.from(e.shadowRoot.querySelectorAll('img'))"
                       ".every(i => i.complete && i.naturalWidth > 0))", timeout=30)
            time.sleep(1.0)
            b.screenshot(out / "verdict_map_tb.png")
            b.open(base + "/?darkMode=false#custom_scalars&_smoothingWeight=0&_ignoreYOutliers=false")
            b.wait_for(f"({DEEP_ALL})('tf-custom-scalar-multi-line-chart-card').length > 0", timeout=30)
            time.sleep(4.0)  # the charts fetch their series one by one
            b.screenshot(out / "log10_charts_tb.png")
        with Browser(path, width=1100, height=1600) as b:
            b.open(page.as_uri())
            b.wait_for("Array.from(document.querySelectorAll('img.verdict-map')).every(i => i.naturalWidth > 0)")
            b.screenshot(out / "report_html.png")
    finally:
        server.stop()
    print(f"screenshots in {out}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default=None, help="run directory (default: a new temporary one)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--screenshots", metavar="DIR", default=None, help="write the docs' screenshots to DIR")
    parser.add_argument("--no-run", action="store_true", help="take the screenshots of the run already in --logdir")
    args = parser.parse_args(argv)
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="verdict-map-"))
    if not args.no_run:
        times = run(logdir, args.steps)
        print(f"run in {logdir}")
        print(f"maps drawn and written per check (both parts, 150 tensors): median {1e3 * statistics.median(times):.1f} "
              f"ms, max {1e3 * max(times):.1f} ms over {len(times)} checks")
    if args.screenshots:
        screenshots(logdir, Path(args.screenshots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
