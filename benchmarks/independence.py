"""What one ``check_independence`` call costs on a ~100M transformer, in forward+backward passes of the same batch.

The model is ``real_size.py``'s ``t100m`` (width 768, 12 ``nn.TransformerEncoderLayer`` with a causal mask,
vocabulary 32,000, ~134M parameters), its positions widened to 128; batch 2 x 128 token ids. Measured side by
side in one process, each the median of ``--repeats`` runs after one warm-up:

- a training forward+backward (cross-entropy, ``loss.backward()`` into every parameter's ``.grad``);
- ``check_independence(model, ids, ["batch", "causal"])`` on the correct model (nothing found);
- the same on the model with the causal mask left out (a leak found: confirmation and localization included).

Prints one JSON line: seconds of each and the ratios (the issue's bound: at most 10 passes), the forwards
and backwards each call made, and whether the leak was found and where.

Example::

    python benchmarks/independence.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, List

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from real_size import _models  # noqa: E402

from gradwatch import check_independence  # noqa: E402


class NoMask(nn.Module):
    """The same model with its causal mask forgotten (every position sees every other)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        m = self.inner
        t = ids.shape[1]
        x = m.tok(ids) + m.pos(torch.arange(t, device=ids.device))
        for layer in m.layers:
            x = layer(x)
        return m.head(m.ln(x))


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times: List[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = _models()["T100M"](block=args.length).train()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 32000, (args.batch, args.length))

    def train_step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()

    step = _median_seconds(train_step, args.repeats)
    model.zero_grad(set_to_none=True)
    reports = {}

    def check(m: nn.Module, key: str) -> Callable[[], None]:
        def run() -> None:
            reports[key] = check_independence(m, ids, ["batch", "causal"])
        return run

    correct = _median_seconds(check(model, "correct"), args.repeats)
    leaky = _median_seconds(check(NoMask(model), "leak"), args.repeats)
    ok, leak = reports["correct"], reports["leak"]
    print(json.dumps({
        "params": params, "batch": [args.batch, args.length], "threads": torch.get_num_threads(),
        "train_step_s": round(step, 3),
        "correct_s": round(correct, 3), "correct_passes": round(correct / step, 2),
        "correct_forwards": ok.forwards, "correct_backwards": ok.backwards, "correct_ok": ok.ok,
        "leak_s": round(leaky, 3), "leak_passes": round(leaky / step, 2),
        "leak_forwards": leak.forwards, "leak_backwards": leak.backwards, "leak_found": not leak.ok,
        "leak_module": None if leak.worst is None else leak.worst.module,
    }))


if __name__ == "__main__":
    main()
