"""Objectives with derivatives inside, watched over 20 checks: false alarms on correct models, planted bugs caught.

The four objectives of ``tests/watch/parts/test_inner.py`` (WGAN-GP, R1, a physics-informed heat
residual with second derivatives, double backprop) on the same tanh MLPs (8 or 2 -> 32 -> 32 -> 1), in float32 and
float64, in the whole-objective form and in the module form, ``GradWatch(every=1)`` for ``--checks`` steps:

- correct models: alerts of any kind (the issue's bound: 0);
- the tanh after the first layer with its double backward 20% off (its first backward right): the first check
  whose alerts name ``1:double_backward`` (its double backward on the inputs the objective gives it);
- ``check_model`` on both: ok, and the failing entries.

Prints one JSON line per configuration, then a summary line.

Example::

    python benchmarks/objectives.py --checks 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_differentiating_objectives import OBJECTIVES, WrongDoubleBackwardTanh, batches, mlp  # noqa: E402

from gradwatch import GradWatch, check_model  # noqa: E402

torch.set_num_threads(1)


def run(name: str, dtype: torch.dtype, form: str, bug: bool, checks: int) -> Dict[str, Any]:
    loss_fn, d_in = OBJECTIVES[name]
    model = mlp(d_in, dtype, act=WrongDoubleBackwardTanh() if bug else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None, form=form, tensorboard=False, jsonl=False)
    data = batches(d_in, dtype, checks)
    caught = None
    steps = 0
    start = time.perf_counter()
    for i, b in enumerate(data):
        steps = i + 1
        opt.zero_grad()
        loss_fn(model, b).backward()
        watch.step(b)
        opt.step()
        if bug and caught is None and any(a.tensor == "1:double_backward" for a in watch.alerts):
            caught = i + 1
            break
    seconds = time.perf_counter() - start
    one_shot = check_model(model, loss_fn, data[0])
    watch.close()
    return {"objective": name, "dtype": str(dtype).replace("torch.", ""), "form": form, "bug": bug,
            "checks": steps,
            "alerts": len(watch.alerts), "alert_kinds": sorted({a.kind for a in watch.alerts}),
            "named": sorted({a.tensor for a in watch.alerts}), "caught_at_check": caught,
            "check_model_ok": one_shot.ok, "check_model_failures": [t.name for t in one_shot.failures],
            "seconds": round(seconds, 2)}


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=20)
    args = parser.parse_args(argv)
    rows: List[Dict[str, Any]] = []
    for name in sorted(OBJECTIVES):
        for dtype in (torch.float32, torch.float64):
            for form in ("objective", "module"):
                for bug in (False, True):
                    row = run(name, dtype, form, bug, args.checks)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    correct = [r for r in rows if not r["bug"]]
    planted = [r for r in rows if r["bug"]]
    print(json.dumps({
        "summary": True, "checks_per_correct_run": args.checks,
        "correct_runs": len(correct), "false_alarms": sum(r["alerts"] for r in correct),
        "planted_runs": len(planted), "caught": sum(r["caught_at_check"] is not None for r in planted),
        "caught_at_check_max": max((r["caught_at_check"] or 0) for r in planted),
        "check_model_correct_ok": sum(r["check_model_ok"] for r in correct),
        "check_model_planted_named": sum("1:double_backward" in r["check_model_failures"] for r in planted),
    }))


if __name__ == "__main__":
    main()
