"""Gradient checks at small weight scales: false alarms on correct models, planted 1% bugs caught.

What it measures. Correct models and models with a planted 1% weight-gradient bug (an ``autograd.Function``
Linear whose weight gradient is 1.01x) are checked after every parameter is multiplied by a scale (1, 1e-1, ...,
1e-8: near-zero init, heavy weight decay), in float32 and float64, over several seeds (the seed draws the weights,
the batch and the check's sampling: ``seed=seed``). Cross-entropy loss throughout. Models (``--models``):

- ``mlp1_<act>``: one hidden layer, ``Linear(16, W) -> act -> Linear(W, 5)``; bugs ``first`` (``0.weight``) and
  ``last`` (``2.weight``);
- ``mlp2_<act>``: two hidden layers, ``Linear(8, W) -> act -> Linear(W, 16) -> act -> Linear(16, 3)`` (W = 16 is the
  original 8-16-16-3 model); bugs ``middle`` (``2.weight``) and ``last`` (``4.weight``);
- ``cnn``: conv 3x3 (1 -> C), ReLU, max-pool 2, conv 3x3 (C -> C), ReLU, ``Linear(4C, 3)`` on 1x10x10 images;
  C from ``--cnn-widths`` (4: the original CNN; 32: wider); bug ``last`` (``6.weight``);

with ``<act>`` one of relu, leaky_relu, gelu, tanh, W the first hidden layer's width (``--widths``) and a batch of
B samples (``--batches``). Forms (``--forms``):

- ``check_model``: ``check_model(model, loss, batch, seed=seed)`` at its defaults (the objective form);
- ``watch_module``: one check of ``GradWatch(form="module", training=False, independence="off", seed=seed)`` after
  a backward (``every=1, log_dir=None``);
- ``watch_objective``: the same with ``form="objective"``.

A correct model's SUSPICIOUS or WRONG tensor is a false alarm; tensors without a verdict (inconclusive) are counted
apart. A bug run catches the bug when the planted weight fails; other tensors failing in a bug run are listed.

The grid. The full product (widths 16, 32, 64, 128 x batches 8, 32, 128 x 3 seeds, CNN channels 4 and 32, 9 scales,
2 dtypes, 9 models, 3 forms, correct and buggy: ``--product``) is 48,600 checks, some 2.5 hours on one core. The
default instead runs the (width, batch, seed) cells of ``CELLS`` and ``CNN_CELLS``, each with every model, scale,
dtype and form: every width and every batch, correct and buggy, seeds 0-2, the known failing corner (one hidden
layer, W 64-128, B 128) included; 5,346 checks, about 17 minutes on one core. Any of ``--widths``, ``--batches``,
``--seeds``, ``--cnn-widths`` switches to the full product of the values given (the defaults above for the others).
``--quick`` (600 checks, about 2 minutes) keeps that failing case (``mlp1_relu``, W 128, B 128, seed 0, scales 1e-3
and 1e-4). The number of checks and a rough time are printed first; progress goes to stderr every 1000 checks.

Examples::

    python benchmarks/small_weights.py --quick
    python benchmarks/small_weights.py --json /tmp/small_weights.json            # the default grid, ~17 min
    python benchmarks/small_weights.py --models mlp1_relu --widths 64,128 --batches 64,128 --scales 1e-3,1e-4 \\
        --seeds 8 --dtypes float64 --forms check_model
    python benchmarks/small_weights.py --product                                  # everything, ~2.5 h

One thread (``torch.set_num_threads(1)``); the estimated number of checks is printed first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradwatch import GradWatch, check_model  # noqa: E402

SCALES = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8)
ACTS = {"relu": nn.ReLU, "leaky_relu": nn.LeakyReLU, "gelu": nn.GELU, "tanh": nn.Tanh}
MODELS = tuple(f"mlp1_{a}" for a in ACTS) + tuple(f"mlp2_{a}" for a in ACTS) + ("cnn",)
FORMS = ("check_model", "watch_module", "watch_objective")
FORM_ALIASES = {"objective": "check_model", "module": "watch_module"}  # the old names
DTYPES = {"float32": torch.float32, "float64": torch.float64}
WIDTHS = (16, 32, 64, 128)
BATCHES = (8, 32, 128)
CNN_WIDTHS = (4, 32)
# The default grid: (width, batch, seed, with the bug runs) cells rather than every width x batch x seed, each cell run
# with every model of its family, scale, dtype and form. Every width and every batch is covered by correct and buggy
# models, over seeds 0-2; the corner where one-hidden-layer ReLU MLPs gave false alarms at scales 1e-3 and 1e-4
# (W 64-128, B 128) is in, and the wide CNN at batch 128 (false alarms on an activation's input gradient, "2:input").
CELLS = ((16, 32, 0, True), (32, 8, 1, True), (64, 128, 2, True), (128, 128, 0, True))
CNN_CELLS = ((4, 32, 0, True), (32, 128, 0, False))  # C = 4 at B = 32: the original CNN
QUICK = {"models": ("mlp1_relu", "mlp1_gelu", "mlp2_tanh", "cnn"), "cells": ((16, 8, 0, True), (128, 128, 0, True)),
         "cnn_cells": ((32, 8, 0, True),), "scales": (1.0, 1e-3, 1e-4, 1e-6, 1e-8)}
BUGS = {"mlp1": ("first", "last"), "mlp2": ("middle", "last"), "cnn": ("last",)}
PLANTED = {("mlp1", "first"): "0.weight", ("mlp1", "last"): "2.weight", ("mlp2", "middle"): "2.weight",
           ("mlp2", "last"): "4.weight", ("cnn", "last"): "6.weight"}


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


def family(model: str) -> str:
    return model.split("_", 1)[0]


def build(model: str, width: int, bug: str) -> Tuple[nn.Module, Tuple[int, ...], int]:
    """The model, one sample's input shape and the number of classes."""

    def linear(i: int, o: int, where: str) -> nn.Module:
        return (OffLinear if bug == where else nn.Linear)(i, o)

    if model == "cnn":
        c = width
        return (nn.Sequential(nn.Conv2d(1, c, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(c, c, 3), nn.ReLU(),
                              nn.Flatten(), linear(4 * c, 3, "last")), (1, 10, 10), 3)
    act = ACTS[model.split("_", 1)[1]]
    if family(model) == "mlp1":
        return nn.Sequential(linear(16, width, "first"), act(), linear(width, 5, "last")), (16,), 5
    return (nn.Sequential(nn.Linear(8, width), act(), linear(width, 16, "middle"), act(), linear(16, 3, "last")),
            (8,), 3)


def run(model: str, width: int, batch_size: int, scale: float, dtype: str, seed: int, bug: str,
        form: str) -> Dict[str, Any]:
    torch.manual_seed(seed)
    m, shape, classes = build(model, width, bug)
    m = m.to(DTYPES[dtype])
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    batch = (torch.randn(batch_size, *shape).to(DTYPES[dtype]), torch.randint(0, classes, (batch_size,)))

    def loss(mm: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(mm(b[0]), b[1])

    row: Dict[str, Any] = {"model": model, "width": width, "batch": batch_size, "scale": scale, "dtype": dtype,
                           "seed": seed, "bug": bug, "form": form}
    start = time.perf_counter()
    try:
        if form == "check_model":
            report = check_model(m, loss, batch, seed=seed)
        else:  # one check of the watch, after the backward training would do (in float64 on its copy)
            watch = GradWatch(m, loss, every=1, log_dir=None, form=form.split("_")[1], training=False,
                              independence="off", seed=seed)
            try:
                loss(m, batch).backward()
                report = watch.step(batch)
            finally:
                watch.close()
            if report is None:
                raise RuntimeError("the watch did not check at step 1")
    except Exception as e:  # noqa: BLE001 - the library may be mid-edit: one row's error must not end the run
        row.update(error=f"{type(e).__name__}: {e}"[:300], failing=[], inconclusive=[],
                   seconds=round(time.perf_counter() - start, 3))
        if bug != "none":
            row.update(caught=False, others_failing=[])
        return row
    failed = [(n, t) for n, t in report.tensors.items() if t.failed]
    row["failing"] = [n for n, _ in failed]
    row["verdicts"] = {n: t.verdict.value if t.verdict is not None else None for n, t in failed}
    row["diagnosis"] = failed[0][1].diagnosis if failed else None
    row["inconclusive"] = sorted(n for n, t in report.tensors.items() if t.verdict is None)
    row["inconclusive_kinds"] = sorted({t.inconclusive_kind.value for t in report.tensors.values()
                                        if t.verdict is None and t.inconclusive_kind is not None})
    row["seconds"] = round(time.perf_counter() - start, 3)
    if bug != "none":
        # the module form also names a unit's input gradient ("2:input"); only the planted weight is the catch
        planted_name = PLANTED[(family(model), bug)]
        row["caught"] = planted_name in row["failing"]
        row["others_failing"] = [n for n in row["failing"] if n != planted_name]
    return row


Cell = Tuple[int, int, int, bool]  # width (the CNN's channels), batch, seed, with the bug runs


def grid(models: Sequence[str], cells: Sequence[Cell], cnn_cells: Sequence[Cell], scales: Sequence[float],
         dtypes: Sequence[str], forms: Sequence[str]) -> List[Tuple[Any, ...]]:
    jobs = []
    for form, model in itertools.product(forms, models):
        for width, batch_size, seed, bugs in (cnn_cells if model == "cnn" else cells):
            for bug in ("none",) + (BUGS[family(model)] if bugs else ()):
                for dtype, scale in itertools.product(dtypes, scales):
                    jobs.append((model, width, batch_size, scale, dtype, seed, bug, form))
    return jobs


def cost(job: Tuple[Any, ...]) -> float:
    """Rough seconds of one check on one core (measured on the 2-core development machine)."""
    model, width, batch_size = job[:3]
    return 0.15 + 0.03 * (width * batch_size) ** 0.5 if model == "cnn" else 0.13 + 6e-6 * width * batch_size


def pick_models(spec: Optional[str]) -> Tuple[str, ...]:
    """``mlp1_relu``, or every model of a family (``mlp1``, ``mlp2``, ``cnn``) or an activation (``relu``)."""
    if not spec:
        return MODELS
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in tokens if not any(t in (m, family(m), m.split("_", 1)[-1]) for m in MODELS)]
    if unknown:
        raise SystemExit(f"unknown --models {unknown}; known: {', '.join(MODELS)}, mlp1, mlp2 or an activation")
    return tuple(m for m in MODELS if any(t in (m, family(m), m.split("_", 1)[-1]) for t in tokens))


def ints(spec: str) -> Tuple[int, ...]:
    return tuple(int(v) for v in spec.split(",") if v.strip())


def describe(r: Dict[str, Any]) -> str:
    return f"{r['model']} W{r['width']} B{r['batch']} scale {r['scale']:g} {r['dtype']} seed {r['seed']}"


def summarize(rows: List[Dict[str, Any]], form: str, scales: Sequence[float], listed: int) -> None:
    mine = [r for r in rows if r["form"] == form]
    correct = [r for r in mine if r["bug"] == "none"]
    alarms = [r for r in correct if r["failing"]]
    errors = [r for r in mine if "error" in r]
    inconclusive = [r for r in correct if r["inconclusive"]]
    kinds = Counter(k for r in inconclusive for k in r.get("inconclusive_kinds", []))
    seconds = sum(r["seconds"] for r in mine)
    print(f"[{form}] correct models: {len(correct)} checks, {len(alarms)} false alarms, "
          f"{len(inconclusive)} with an inconclusive tensor {dict(kinds) if kinds else ''}; "
          f"{len(mine)} checks in {seconds:.0f} s")
    for r in alarms[:listed]:
        tensors = ", ".join(f"{n} {str(v).upper()}" for n, v in r["verdicts"].items())
        print(f"  false alarm: {describe(r)}: {tensors}; {r['failing'][0]}: {r['diagnosis']}")
    if len(alarms) > listed:
        print(f"  ... {len(alarms) - listed} more false alarms (--list, --json)")
    for r in errors[:listed]:
        print(f"  error: {describe(r)} bug {r['bug']}: {r['error']}")
    if errors:
        print(f"  {len(errors)} checks raised")
    bug_rows = [r for r in mine if r["bug"] != "none"]
    if bug_rows:
        print("planted 1% weight-gradient bugs caught, per scale (batches x dtypes x seeds per cell):")
        print(f"{'model/width/bug':<26}" + "".join(f"{s:>8g}" for s in scales))
        keys = sorted({(r["model"], r["width"], r["bug"]) for r in bug_rows},
                      key=lambda k: (MODELS.index(k[0]), k[1], k[2]))
        for model, width, bug in keys:
            cells = []
            for scale in scales:
                part = [r for r in bug_rows if (r["model"], r["width"], r["bug"], r["scale"]) == (model, width, bug, scale)]
                cells.append(f"{sum(r['caught'] for r in part)}/{len(part)}")
            print(f"{f'{model}/{width}/{bug}':<26}" + "".join(f"{c:>8}" for c in cells))
        others = [r for r in bug_rows if r["others_failing"]]
        print(f"bug runs where another tensor failed too: {len(others)}")
        for r in others[:listed]:
            print(f"  {describe(r)} bug {r['bug']}: {r['others_failing']}")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma list of {', '.join(FORMS)}")
    parser.add_argument("--models", help="comma list of models (mlp1_relu, ..., mlp2_tanh, cnn), families (mlp1, mlp2) "
                        "or activations (relu: both depths); default every model")
    parser.add_argument("--widths", help=f"first hidden layer widths (default {WIDTHS}); any of --widths, --batches, "
                        "--seeds, --cnn-widths, --product: their full product, bug runs everywhere (default: CELLS)")
    parser.add_argument("--batches", help=f"batch sizes (default {BATCHES})")
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 3 with a product)")
    parser.add_argument("--cnn-widths", help=f"the CNN's channel counts (default {CNN_WIDTHS})")
    parser.add_argument("--product", action="store_true", help="every width x batch x seed: 48,600 checks, ~2.5 h")
    parser.add_argument("--scales", help="comma list (default 1,1e-1,...,1e-8)")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--quick", action="store_true", help="a ~2 minute subset holding the known failing case "
                        "(flags given with it override its models, cells and scales)")
    parser.add_argument("--list", type=int, default=50, help="list at most this many rows of each kind per form")
    parser.add_argument("--json", help="write every row to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("gradwatch").setLevel(logging.CRITICAL)  # the watch's alert lines: the rows hold them

    forms = tuple(FORM_ALIASES.get(f, f) for f in args.forms.split(",") if f)
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        raise SystemExit(f"unknown --forms {unknown}; known: {', '.join(FORMS)}")
    models = pick_models(args.models)
    scales = tuple(float(s) for s in args.scales.split(",")) if args.scales else SCALES
    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    if any(d not in DTYPES for d in dtypes):
        raise SystemExit(f"--dtypes: {', '.join(DTYPES)}")
    product = args.product or any(v is not None for v in (args.widths, args.batches, args.seeds, args.cnn_widths))
    if product:
        widths, batches = ints(args.widths) if args.widths else WIDTHS, ints(args.batches) if args.batches else BATCHES
        seeds = range(args.seeds if args.seeds is not None else 3)
        cnn_widths = ints(args.cnn_widths) if args.cnn_widths else CNN_WIDTHS
        cells: Sequence[Cell] = [(w, b, s, True) for w, b, s in itertools.product(widths, batches, seeds)]
        cnn_cells: Sequence[Cell] = [(w, b, s, True) for w, b, s in itertools.product(cnn_widths, batches, seeds)]
    else:
        cells, cnn_cells = (QUICK["cells"], QUICK["cnn_cells"]) if args.quick else (CELLS, CNN_CELLS)
    if args.quick:
        models = models if args.models else QUICK["models"]
        scales = scales if args.scales else QUICK["scales"]

    jobs = grid(models, cells, cnn_cells, scales, dtypes, forms)
    if product:
        show = f"widths {widths} x batches {batches} x seeds 0..{len(seeds) - 1}"
        cnn_show = f"channels {cnn_widths} x batches {batches} x seeds 0..{len(seeds) - 1}"
    else:
        show = ", ".join(f"W{w}/B{b}/s{s}" + ("" if bugs else " (correct only)") for w, b, s, bugs in cells)
        cnn_show = ", ".join(f"C{w}/B{b}/s{s}" + ("" if bugs else " (correct only)") for w, b, s, bugs in cnn_cells)
    print(f"{len(jobs)} checks, about {sum(map(cost, jobs)) / 60:.0f} min on one core. Forms: {', '.join(forms)}. "
          f"Models: {', '.join(models)}. MLP cells: {show}. CNN cells: {cnn_show}. "
          f"Scales: {', '.join(f'{s:g}' for s in scales)}. Dtypes: {', '.join(dtypes)}.", flush=True)
    start = time.perf_counter()
    rows: List[Dict[str, Any]] = []
    for i, job in enumerate(jobs, 1):
        rows.append(run(*job))
        if i % 1000 == 0:
            print(f"  {i}/{len(jobs)} checks, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print()
    for form in forms:
        summarize(rows, form, scales, args.list)
    print(f"{len(rows)} checks in {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
