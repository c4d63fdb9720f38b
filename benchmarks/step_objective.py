"""One step, one objective: the bug classes of a cut step caught and named, the correct forms clean, and the cost.

Each scenario trains a small language model on padded, variable-length token rows (labels -100 on
padding; ``tests/token_batches.py``) or a classifier, with gradient accumulation in a plain loop and
``GradWatch(every=1)``, and prints whether the first check raised a training alert, the alert's
words, and the alerts over all checks. Two sizes: ``--vocab 64 --width 16`` (the tests' size) and a
real vocabulary (GPT-2's 50,257 tokens, width 64).

Costs, measured side by side in one run:

- ``training part``: the training part of a check (the probe excluded: once per run) over the
  forward and backward of the step's micro-batches, interleaved, median of ``--repeats``;
- ``probe``: the one decision of a run (what ``loss_fn`` averages over), in seconds and in training steps;
- ``overhead``: the median step time at defaults (``every="auto"``), watched over unwatched, interleaved;
- ``memory``: peak RSS watched (``every=1``) over unwatched, one subprocess each.

Run: ``.venv/bin/python benchmarks/step_objective.py`` (about 3 minutes on 2 CPU cores); ``--quick`` for the
scenarios alone at the tests' size.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from token_batches import (  # noqa: E402
    TinyLM,
    accumulation_run,
    all_targets,
    padded_batch,
    targets,
    token_loss,
    uneven_micro_batches,  # noqa: E402
)

from gradwatch import GradWatch  # noqa: E402
from gradwatch.check.judging.report import CheckReport  # noqa: E402
from gradwatch.check.objective.rng import preserved_rng  # noqa: E402

Make = Callable[[torch.Generator], List[Any]]
Backward = Callable[[nn.Module, List[Any], int], None]


def lm_scenarios(vocab: int, width: int) -> Dict[str, Any]:
    """``name -> (expect an alert, make micro-batches, backward of micro-batch i, model, loss_fn, options)``."""

    def uneven(gen: torch.Generator) -> List[Any]:
        return uneven_micro_batches(4, gen, lengths=(3, 48))

    def even(gen: torch.Generator) -> List[Any]:
        return [padded_batch([16, 16], gen, vocab) for _ in range(4)]

    def three_even(gen: torch.Generator) -> List[Any]:
        return [padded_batch([16, 16], gen, vocab) for _ in range(3)]

    def mean_over(k: int) -> Backward:
        return lambda m, micro, i: (token_loss(m, micro[i]) / k).backward()

    def step_sum(m: nn.Module, micro: List[Any], i: int) -> None:
        (token_loss(m, micro[i], "sum") / sum(targets(b) for b in micro)).backward()

    def before_shift(m: nn.Module, micro: List[Any], i: int) -> None:
        (token_loss(m, micro[i], "sum") / sum(all_targets(b) for b in micro)).backward()

    lm = lambda: TinyLM(vocab=vocab, width=width)  # noqa: E731
    bn = lambda: TinyLM(vocab=vocab, width=width, norm="batch")  # noqa: E731
    return {
        "token means over k (the 2024 bug)": (True, uneven, mean_over(4), lm, token_loss, {}),
        "partial window over the full one": (True, three_even, mean_over(4), lm, token_loss, {}),
        "count before the shift (off by one)": (True, uneven, before_shift, lm, token_loss, {}),
        "token sum over the step's count": (False, uneven, step_sum, lm, token_loss, {}),
        "equal micro-batches, means over k": (False, even, mean_over(4), lm, token_loss, {}),
        "BatchNorm, means over k": (False, uneven, mean_over(4), bn, token_loss, {}),
        "items=micro_batches, means over k": (False, uneven, mean_over(4), lm, token_loss, {"items": "micro_batches"}),
    }


def classifier_scenarios() -> Dict[str, Any]:
    def ce(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    def make(gen: torch.Generator) -> List[Any]:
        return [(torch.randn(n, 12, generator=gen), torch.randint(0, 5, (n,), generator=gen)) for n in (3, 12, 5, 8)]

    def contrastive(m: nn.Module, b: Any) -> torch.Tensor:
        a, p = F.normalize(m(b[0]), dim=-1), F.normalize(m(b[0] + 0.1 * b[1]), dim=-1)
        return F.cross_entropy(a @ p.T / 0.1, torch.arange(len(a)))

    def noisy(gen: torch.Generator) -> List[Any]:
        return [(torch.randn(n, 12, generator=gen), torch.randn(n, 12, generator=gen)) for n in (3, 12, 5, 8)]

    mlp = lambda: nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 5))  # noqa: E731
    return {
        "sample means over k, unequal micro-batches": (True, make, lambda m, mi, i: (ce(m, mi[i]) / 4).backward(), mlp, ce, {}),
        "sample sums over the step's samples": (False, make, lambda m, mi, i: (F.cross_entropy(m(mi[i][0]), mi[i][1], reduction="sum")
                                                                               / sum(len(b[1]) for b in mi)).backward(), mlp, ce, {}),
        "in-batch contrastive, means over k": (False, noisy, lambda m, mi, i: (contrastive(m, mi[i]) / 4).backward(), mlp,
                                                contrastive, {}),
    }


def run_scenario(expect: bool, make: Make, backward: Backward, model_fn: Callable[[], nn.Module], loss_fn: Any,
                 options: Dict[str, Any], checks: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = model_fn()
    watch = GradWatch(model, loss_fn, every=1, tensorboard=False, jsonl=False, **options)
    reports, _ = accumulation_run(model, watch, checks, make, backward)
    notes = [r.training_note for r in reports if r is not None]
    words = [t.diagnosis for r in reports if r is not None for t in r.training_failures]
    training = [a for a in watch.alerts if a.part == "training"]
    watch.close()
    return {"expect_alert": expect, "alert_at_first_check": any(a.step == 0 for a in training),
            "alerts": len(watch.alerts), "training_alerts": len(training),
            "message": words[0] if words else None, "note": notes[0]}


def measure_training_part(vocab: int, k: int, repeats: int, width: int = 64) -> Dict[str, Any]:
    """The training part of a check (the probe excluded: the first check's) over the forward+backward of the step's
    k micro-batches (or of one batch of 3 rows, ``k=1``), interleaved; median of ``repeats``."""
    torch.manual_seed(0)
    model = TinyLM(vocab=vocab, width=width)
    watch = GradWatch(model, token_loss, every=1, tensorboard=False, jsonl=False)
    gen = torch.Generator().manual_seed(3)
    micro = uneven_micro_batches(k, gen, lengths=(3, 48)) if k > 1 else [padded_batch([24, 24, 24], gen, vocab)]
    total = sum(targets(b) for b in micro)
    t_fb, t_part = [], []
    verdicts: set = set()
    probe = 0.0
    for i in range(repeats + 2):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for mb in micro:
            (token_loss(model, mb, "sum") / total).backward()
            if k > 1:
                watch.accumulate(mb)
        fb = time.perf_counter() - start
        pending = watch.context.take(None if k > 1 else micro[0], None)
        with preserved_rng():
            start = time.perf_counter()
            report = CheckReport(tensors={})
            watch.training.judge(report, watch.training.replay(pending, seed=i))
            part = time.perf_counter() - start
        watch._recorder.discard(full=True)
        verdicts.update(t.verdict.value if t.verdict else "inconclusive" for t in report.training.values())
        if i == 0:
            probe = part
        if i >= 2:
            t_fb.append(fb)
            t_part.append(part)
    watch.close()
    med_fb, med_part = statistics.median(t_fb), statistics.median(t_part)
    return {"vocab": vocab, "micro_batches": k, "forward_backward_ms": 1e3 * med_fb, "training_part_ms": 1e3 * med_part,
            "ratio": med_part / med_fb, "first_check_ms": 1e3 * probe, "verdicts": sorted(verdicts),
            "probe_in_steps": (probe - med_part) / med_fb if k > 1 else None}


def measure_overhead(vocab: int, steps: int, width: int = 64) -> Dict[str, Any]:
    """Median step time at defaults (every='auto'), watched over unwatched, interleaved step by step, beside the same
    ratio for a second unwatched copy (the measurement's own spread)."""
    torch.manual_seed(0)
    models = [TinyLM(vocab=vocab, width=width) for _ in range(3)]  # plain, plain again (the control), watched
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    watch = GradWatch(models[2], token_loss, optimizer=opts[2], tensorboard=False, jsonl=False)
    gen = torch.Generator().manual_seed(5)

    def step(i: int, which: int, micro: List[Any]) -> float:
        model, opt = models[which], opts[which]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = sum(targets(b) for b in micro)
        for mb in micro:
            (token_loss(model, mb, "sum") / total).backward()
            if which == 2:
                watch.accumulate(mb)
        if which == 2:
            watch.step(global_step=i)
        opt.step()
        return time.perf_counter() - start

    times: List[List[float]] = [[], [], []]
    for i in range(steps):
        micro = uneven_micro_batches(4, gen, lengths=(3, 48))
        for which in (i % 3, (i + 1) % 3, (i + 2) % 3):  # each model first, second and third in turn
            times[which].append(step(i, which, micro))
    state = watch.state_dict()
    alerts = len(watch.alerts)
    watch.close()
    med = [statistics.median(t) for t in times]
    return {"vocab": vocab, "steps": steps, "median_ratio": med[2] / med[0], "control_ratio": med[1] / med[0],
            "total_ratio": sum(times[2]) / sum(times[0]), "checks": state["checks"], "alerts": alerts}


MEMORY_CHILD = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[3])
from token_batches import TinyLM, targets, token_loss, uneven_micro_batches
from gradwatch import GradWatch
torch.set_num_threads(1)
watched, vocab = sys.argv[1] == "1", int(sys.argv[2])
torch.manual_seed(0)
model = TinyLM(vocab=vocab, width=64)
watch = GradWatch(model, token_loss, every=1, tensorboard=False, jsonl=False) if watched else None
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(5)
for i in range(4):
    micro = uneven_micro_batches(4, gen, sizes=(2, 4), lengths=(16, 64))
    total = sum(targets(b) for b in micro)
    opt.zero_grad()
    for mb in micro:
        (token_loss(model, mb, "sum") / total).backward()
        if watch is not None:
            watch.accumulate(mb)
    if watch is not None:
        watch.step()
    opt.step()
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "alerts": len(watch.alerts) if watch else 0}))
"""


def measure_memory(vocab: int) -> Dict[str, Any]:
    """Peak RSS of 4 accumulation steps (4 micro-batches of 2-4 rows of 16-64 tokens), one subprocess each."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    out = {}
    for watched in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", MEMORY_CHILD, watched, str(vocab), tests], capture_output=True,
                              text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
        out[watched] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"vocab": vocab, "peak_mb_unwatched": out["0"]["peak_mb"], "peak_mb_watched": out["1"]["peak_mb"],
            "ratio": out["1"]["peak_mb"] / out["0"]["peak_mb"], "alerts": out["1"]["alerts"]}


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the scenarios alone, at the tests' size")
    parser.add_argument("--checks", type=int, default=4, help="checks per scenario (every=1)")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved repeats of the training-part timing")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--costs", action="store_true", help="the costs alone (no scenario)")
    parser.add_argument("--scenario", help=argparse.SUPPRESS)  # one scenario in this process: "name|vocab|width"
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("gradwatch").setLevel(logging.CRITICAL)  # the alerts are counted and printed below
    if args.scenario:
        name, vocab, width = args.scenario.split("|")
        specs = {**lm_scenarios(int(vocab), int(width)), **classifier_scenarios()}
        print(json.dumps(run_scenario(*specs[name], checks=args.checks)))
        return 0
    results: Dict[str, Any] = {"scenarios": {}}
    sizes = [] if args.costs else [(64, 16)] if args.quick else [(64, 16), (50257, 64)]
    for vocab, width in sizes:
        for name in {**lm_scenarios(vocab, width), **(classifier_scenarios() if vocab == 64 else {})}:
            # One process per scenario: a watch sizes its checks by the process's peak memory, which the
            # scenarios before would have raised.
            done = subprocess.run([sys.executable, __file__, "--scenario", f"{name}|{vocab}|{width}", "--checks",
                                   str(args.checks)], capture_output=True, text=True, check=True,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
            results["scenarios"][f"{name} [vocab {vocab}, width {width}]"] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name} [vocab {vocab}]: done", file=sys.stderr, flush=True)
    if not args.quick:
        print("training part ...", file=sys.stderr, flush=True)
        results["training_part"] = [measure_training_part(v, k, args.repeats) for v in (64, 50257) for k in (1, 4)]
        print("overhead at defaults ...", file=sys.stderr, flush=True)
        results["overhead"] = [measure_overhead(50257, 240)]
        print("memory ...", file=sys.stderr, flush=True)
        results["memory"] = [measure_memory(50257)]
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print("scenario | alert at check 1 (expected) | alerts in all | words")
    for name, r in results["scenarios"].items():
        ok = "ok" if r["alert_at_first_check"] == r["expect_alert"] and (r["expect_alert"] or r["alerts"] == 0) else "MISMATCH"
        print(f"{name} | {r['alert_at_first_check']} ({r['expect_alert']}) {ok} | {r['alerts']} | "
              f"{(r['message'] or r['note'] or '')[:260]}")
    for r in results.get("training_part", []):
        probe = "" if r["probe_in_steps"] is None else f", probe (first check) {r['probe_in_steps']:.1f} steps"
        print(f"training part, vocab {r['vocab']}, {r['micro_batches']} micro-batches: {r['training_part_ms']:.1f} ms over "
              f"{r['forward_backward_ms']:.1f} ms of forward+backward = {r['ratio']:.2f}x{probe}")
    for r in results.get("overhead", []):
        print(f"median step at defaults, vocab {r['vocab']}, 4 micro-batches: {r['median_ratio']:.3f}x "
              f"(an unwatched copy: {r['control_ratio']:.3f}x; total {r['total_ratio']:.3f}x, {r['checks']} checks in "
              f"{r['steps']} steps, {r['alerts']} alerts)")
    for r in results.get("memory", []):
        print(f"peak memory, vocab {r['vocab']}: {r['peak_mb_watched']:.0f} MB watched / {r['peak_mb_unwatched']:.0f} MB = "
              f"{r['ratio']:.3f}x ({r['alerts']} alerts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
