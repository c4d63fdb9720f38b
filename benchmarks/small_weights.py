"""``check_model`` on correct models at small weight scales (false alarms) and on planted 1% bugs (caught).

Models (batch 32, cross-entropy over 3 classes): MLPs 8 -> 16 -> 16 -> 3 with ReLU, LeakyReLU, GELU or
Tanh, and a CNN (conv 3x3, ReLU, max-pool, conv 3x3, ReLU, Linear) on 1x10x10 images. Every parameter is
multiplied by the scale (1, 1e-1, ..., 1e-8: near-zero init, heavy weight decay), in float32 and float64, over
several seeds, and checked by ``check_model`` at its defaults (the objective form) and by one check of the
watch's module form (``GradWatch(form="module")``: each module alone on its captured inputs):

- correct: a SUSPICIOUS or WRONG tensor is a false alarm; tensors without a verdict (inconclusive: the
  disagreement is below what central differences of the objective resolve at that scale) are counted apart;
- ``last``: the last Linear computed by an ``autograd.Function`` whose weight gradient is 1% too large; caught
  when that weight fails;
- ``middle``: the same in the middle Linear (the second convolution's Linear-free CNN has none: MLPs only).

In the objective form, expect the last layer's bug caught at every scale whose gradient stands above the
objective's rounding (its weight gradient is about the scale times the loss gradient); a middle layer's
gradient scales with the square of the scale, so its bug fades into the rounding sooner. The module form
differences each module's own outputs, whose scale follows the weights'.

Example::

    python benchmarks/small_weights.py --seeds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradwatch import GradWatch, check_model  # noqa: E402

SCALES = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8)
MODELS = ("relu", "leaky_relu", "gelu", "tanh", "cnn")
ACTS = {"relu": nn.ReLU, "leaky_relu": nn.LeakyReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class _OffLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        return g @ w, 1.01 * (g.t() @ x), g.sum(0)  # the weight's gradient 1% too large


class OffLinear(nn.Linear):
    """An ``nn.Linear`` whose weight gradient is 1% too large."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OffLinear.apply(x, self.weight, self.bias)


def build(model: str, bug: str) -> nn.Module:
    def linear(i: int, o: int, where: str) -> nn.Module:
        return (OffLinear if bug == where else nn.Linear)(i, o)

    if model == "cnn":
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3), nn.ReLU(),
                             nn.Flatten(), linear(16, 3, "last"))
    act = ACTS[model]
    return nn.Sequential(nn.Linear(8, 16), act(), linear(16, 16, "middle"), act(), linear(16, 3, "last"))


def planted(model: str, bug: str) -> str:
    return {"last": "6.weight" if model == "cnn" else "4.weight", "middle": "2.weight"}[bug]


def run(model: str, scale: float, dtype: torch.dtype, seed: int, bug: str, form: str = "objective") -> Dict[str, Any]:
    torch.manual_seed(seed)
    m = build(model, bug).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    x = torch.randn(32, 1, 10, 10) if model == "cnn" else torch.randn(32, 8)
    batch = (x.to(dtype), torch.randint(0, 3, (32,)))

    def loss(mm: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(mm(b[0]), b[1])

    if form == "objective":
        report = check_model(m, loss, batch)
    else:  # the watch's module form, one check (each module alone on its captured inputs, in float64)
        watch = GradWatch(m, loss, every=1, log_dir=None, form="module", training=False, independence="off")
        loss(m, batch).backward()
        report = watch.step(batch)
        watch.close()
    planted_name = planted(model, bug) if bug != "none" else None
    # the module form also names a unit's input gradient ("2:input"): the planted module's entries count as it
    failing = sorted(n for n, t in report.tensors.items() if t.failed)
    row = {"model": model, "scale": scale, "dtype": str(dtype).replace("torch.", ""), "seed": seed, "bug": bug,
           "form": form, "failing": failing,
           "inconclusive": sorted(n for n, t in report.tensors.items() if t.verdict is None),
           "seconds": round(report.seconds, 3)}
    if planted_name is not None:
        row["caught"] = planted_name in failing
        row["others_failing"] = [n for n in failing if n != planted_name]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--forms", default="objective,module", help="objective (check_model), module (the watch's)")
    parser.add_argument("--json", help="write every row to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: List[Dict[str, Any]] = []
    start = time.perf_counter()
    forms = [f for f in args.forms.split(",") if f]
    for form in forms:
        for model in MODELS:
            for bug in ("none", "last") + (("middle",) if model != "cnn" else ()):
                for dtype in (torch.float32, torch.float64):
                    for scale in SCALES:
                        for seed in range(args.seeds):
                            rows.append(run(model, scale, dtype, seed, bug, form))
    for form in forms:
        mine = [r for r in rows if r["form"] == form]
        correct = [r for r in mine if r["bug"] == "none"]
        alarms = [r for r in correct if r["failing"]]
        print(f"[{form} form] correct models: {len(correct)} checks ({len(MODELS)} models x {len(SCALES)} scales x 2 "
              f"dtypes x {args.seeds} seeds): {len(alarms)} false alarms, "
              f"{sum(bool(r['inconclusive']) for r in correct)} with an inconclusive tensor")
        for r in alarms:
            print(f"  false alarm: {r['model']} scale {r['scale']:g} {r['dtype']} seed {r['seed']}: {r['failing']}")
        print(f"planted 1% weight-gradient bugs caught, per scale ({args.seeds} seeds x 2 dtypes per cell):")
        print(f"{'model/bug':<18}" + "".join(f"{s:>8g}" for s in SCALES))
        for model in MODELS:
            for bug in ("last",) + (("middle",) if model != "cnn" else ()):
                cells = []
                for scale in SCALES:
                    part = [r for r in mine if r["model"] == model and r["bug"] == bug and r["scale"] == scale]
                    cells.append(f"{sum(r['caught'] for r in part)}/{len(part)}")
                print(f"{model + '/' + bug:<18}" + "".join(f"{c:>8}" for c in cells))
        wrong_others = [r for r in mine if r["bug"] != "none" and r["others_failing"]]
        print(f"bug runs where another tensor failed too: {len(wrong_others)}\n")
    print(f"{len(rows)} checks in {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
