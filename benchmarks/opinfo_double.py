"""``check_double_backward`` against PyTorch's OpInfo samples, next to ``torch.autograd.gradgradcheck``.

The samples are those of ``opinfo.py`` (the first float64 sample of every operator that supports backward on
the CPU, under the same exclusions), restricted to operators that support second derivatives
(``supports_gradgrad``) and whose own ``test_fn_gradgrad`` is not skipped or expected to fail on CPU float64.
On each sample it runs:

* ``gradwatch.check_double_backward`` at its defaults on the correct operator (random ``y_grad`` and
  ``x_grad_grad``): any ``GradientCheckError`` is a false alarm, any other exception an error;
* the same on a mutant whose first backward is right and whose double backward is 1% off in ONE element:
  the operator's backward is an ``autograd.Function`` computing the true vector-Jacobian product, whose own
  backward computes the true second-order product and multiplies one element of one input's part by 1.01
  (drawn among elements whose second-order gradient is at least 1e-3 and 1% of that input's largest);
* ``torch.autograd.gradgradcheck`` in fast and in slow mode on both (``check_batched_grad=False``, the
  operator's own ``gradcheck_nondet_tol``).

Prints false alarms, errors and mutants caught per tool, the mutants slow gradgradcheck catches that
``check_double_backward`` misses, and each tool's time. Not part of the test run.

Run: ``.venv/bin/python benchmarks/opinfo_double.py`` (needs the ``bench`` extra; ``--only NAME``,
``--json PATH``, ``-v`` as ``opinfo.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from opinfo import _float_fn, collect, float_outputs, y_grads  # noqa: E402

import gradwatch  # noqa: E402

TOOLS = ("check_double_backward", "gradgradcheck_fast", "gradgradcheck_slow")


def _gradgrad_disabled(op) -> bool:
    from torch.testing._internal.opinfo.core import DecorateInfo

    return any(isinstance(d, DecorateInfo) and d.is_active("TestBwdGradients", "test_fn_gradgrad", "cpu", torch.float64, {})
               for d in op.decorators)


def _first_order(fn: Callable[..., Any], xs: Sequence[torch.Tensor], gys: Sequence[torch.Tensor],
                 create_graph: bool) -> List[torch.Tensor]:
    outs = float_outputs(fn(*xs))
    pairs = [(o, g) for o, g in zip(outs, gys) if o.requires_grad and g is not None]
    if not pairs:
        return [torch.zeros_like(x) for x in xs]
    grads = torch.autograd.grad([o for o, _ in pairs], list(xs), [g for _, g in pairs], create_graph=create_graph,
                                allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs)]


def double_mutant(fn: Callable[..., Any], n: int, which: int, index: int, factor: float = 1.01) -> Callable[..., Any]:
    """``fn`` whose first backward is right and whose double backward multiplies element ``index`` of the part
    with respect to input ``which`` by ``factor``."""

    class VJP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            ctx.save_for_backward(*args)
            with torch.enable_grad():
                xs = [a.detach().requires_grad_(True) for a in args[:n]]
                return tuple(g.detach() for g in _first_order(fn, xs, args[n:], create_graph=False))

        @staticmethod
        def backward(ctx, *ggs):
            args = ctx.saved_tensors
            with torch.enable_grad():
                xs = [a.detach().requires_grad_(True) for a in args[:n]]
                gys = [a.detach().requires_grad_(True) for a in args[n:]]
                grads = _first_order(fn, xs, gys, create_graph=True)
                terms = [(g * gg).sum() for g, gg in zip(grads, ggs) if gg is not None and g.requires_grad]
                if not terms:
                    return tuple(torch.zeros_like(a) for a in args)
                second = torch.autograd.grad(sum(terms), xs + gys, allow_unused=True)
            second = [torch.zeros_like(a) if s is None else s.clone(memory_format=torch.contiguous_format)
                      for s, a in zip(second, args)]
            second[which].view(-1)[index] *= factor  # contiguous copies: the element is the one chosen
            return tuple(second)

    class Forward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            ctx.save_for_backward(*xs)
            return tuple(o.detach().clone() for o in float_outputs(fn(*xs)))

        @staticmethod
        def backward(ctx, *gys):
            xs = ctx.saved_tensors
            gys = tuple(torch.zeros_like(o) if g is None else g for g, o in zip(gys, float_outputs(fn(*xs))))
            return VJP.apply(*xs, *gys)

    return lambda *xs: Forward.apply(*xs)


def choose(name: str, fn: Callable[..., Any], xs: Sequence[torch.Tensor], gys: Sequence[torch.Tensor],
           ggx: Sequence[torch.Tensor]) -> Optional[Tuple[int, int]]:
    """(input, element) of the second-order gradient to make 1% off, among large enough elements."""
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    with torch.enable_grad():
        grads = _first_order(fn, leaves, gys, create_graph=True)
        terms = [(g * gg).sum() for g, gg in zip(grads, ggx) if g.requires_grad]
        if not terms:
            return None
        second = torch.autograd.grad(sum(terms), leaves, allow_unused=True)
    candidates = []
    for k, s in enumerate(second):
        if s is None:
            continue
        a = s.detach().abs().reshape(-1)
        if a.numel() == 0:
            continue
        ok = (a >= 1e-3) & (a >= 1e-2 * a.max()) & torch.isfinite(a)
        candidates += [(k, int(i)) for i in torch.nonzero(ok).reshape(-1).tolist()]
    if not candidates:
        return None
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 3)
    return candidates[int(torch.randint(len(candidates), (1,), generator=gen))]


def _result(run: Callable[[], Any]) -> str:
    try:
        ok = run()
        return "ok" if ok is not False else "alarm"
    except gradwatch.GradientCheckError:
        return "alarm"
    except Exception as e:  # noqa: BLE001 - an error is a result here
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"


def run_case(case: Dict[str, Any], tools: Sequence[str], times: Dict[str, float],
             tolerances: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    name, xs, fn = case["name"], case["xs"], _float_fn(case["fn"])
    with torch.no_grad():
        outs = fn(*xs)
    gys = y_grads(name, outs)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 4)
    ggx = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in xs]
    mutation = choose(name, fn, xs, gys, ggx)
    row: Dict[str, Any] = {"name": name, "numel": sum(x.numel() for x in xs), "mutation": mutation,
                           "correct": {}, "mutant": {}, "seconds": {}}
    nondet = case["op"].gradcheck_nondet_tol
    for tool in tools:
        for kind in ("correct", "mutant"):
            if kind == "mutant" and mutation is None:
                continue
            f = fn if kind == "correct" else double_mutant(fn, len(xs), *mutation)
            start = time.perf_counter()
            torch.manual_seed(0)
            if tool == "check_double_backward":
                res = _result(lambda f=f: gradwatch.check_double_backward(f, tuple(x.clone() for x in xs),
                                                                          tuple(gys), tuple(ggx), **(tolerances or {})))
            else:
                inputs = tuple(x.detach().clone().requires_grad_(True) for x in xs)
                fast = tool.endswith("fast")
                res = _result(lambda f=f, inputs=inputs, fast=fast: torch.autograd.gradgradcheck(
                    f, inputs, fast_mode=fast, raise_exception=False, check_batched_grad=False, nondet_tol=nondet))
            seconds = time.perf_counter() - start
            times[tool] += seconds
            row["seconds"][f"{kind}/{tool}"] = round(seconds, 4)
            row[kind][tool] = res
    return row


def summarize(rows: List[Dict[str, Any]], times: Dict[str, float], tools: Sequence[str]) -> str:
    mutants = [r for r in rows if r["mutation"] is not None]
    lines = [f"{len(rows)} samples with second derivatives, {len(mutants)} mutants (double backward 1% off in one "
             "element, first backward right)", "",
             f"{'tool':<22} {'false alarms':>12} {'errors':>7} {'mutants caught':>15} {'seconds':>8}"]
    if "gradgradcheck_slow" in tools and "check_double_backward" in tools:
        extra = [r for r in mutants if r["mutant"].get("check_double_backward") == "alarm"
                 and r["mutant"].get("gradgradcheck_slow") != "alarm"]
        lines.insert(1, f"({len(extra)} mutants check_double_backward catches and slow gradgradcheck misses: "
                        + ", ".join(r["name"] for r in extra) + ")")
    for tool in tools:
        alarms = sum(r["correct"].get(tool) == "alarm" for r in rows)
        errors = sum(str(r["correct"].get(tool, "")).startswith("error") for r in rows)
        caught = sum(r["mutant"].get(tool) == "alarm" for r in mutants)
        failed = sum(str(r["mutant"].get(tool, "")).startswith("error") for r in mutants)
        lines.append(f"{tool:<22} {alarms:>12} {errors:>7} {f'{caught}/{len(mutants)}':>15} {times[tool]:>8.1f}"
                     + (f"  ({failed} mutants raised)" if failed else ""))
    if "check_double_backward" in tools and "gradgradcheck_slow" in tools:
        missed = [r for r in mutants if r["mutant"].get("gradgradcheck_slow") != "ok"
                  and r["mutant"].get("check_double_backward") == "ok"]
        lines.append(f"mutants slow gradgradcheck catches and check_double_backward misses: {len(missed)}")
        lines += [f"  {r['name']} (input {r['mutation'][0]}, element {r['mutation'][1]}, {r['numel']} elements)"
                  for r in missed]
    for r in rows:
        if r["correct"].get("check_double_backward", "ok") != "ok":
            lines.append(f"  check_double_backward on correct {r['name']}: {r['correct']['check_double_backward']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", help="only operators whose full name contains this")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    p.add_argument("--atol", type=float, help="check_double_backward's atol (default: its own)")
    p.add_argument("--rtol", type=float, help="check_double_backward's rtol (default: its own)")
    p.add_argument("--names", help="comma-separated exact operator names to run (e.g. the ones a run missed)")
    p.add_argument("--json", help="write every row to this file")
    p.add_argument("-v", "--verbose", action="store_true", help="print each sample as it runs")
    args = p.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    for t in tools:
        if t not in TOOLS:
            p.error(f"--tools: unknown tool {t!r}; expected some of {', '.join(TOOLS)}")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cases = [c for c in collect(args.only, 1) if c["op"].supports_gradgrad and not _gradgrad_disabled(c["op"])]
    if args.names:
        wanted = set(args.names.split(","))
        cases = [c for c in cases if c["name"] in wanted]
    tolerances = {k: v for k, v in (("atol", args.atol), ("rtol", args.rtol)) if v is not None}
    times = {t: 0.0 for t in tools}
    rows = []
    for case in cases:
        row = run_case(case, tools, times, tolerances)
        rows.append(row)
        if args.verbose:
            print(row["name"], row["numel"], row["correct"], row["mutant"], flush=True)
    print(f"torch {torch.__version__}, gradwatch {gradwatch.__version__}")
    print(summarize(rows, times, tools))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "seconds": times}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
