"""Measure how far the live ``.grad`` of *correct* training runs lies from the training part's reference.

The training part of a check replays the objective on the live model; a faithful replay of the same
computation gives the same bits. What remains on correct runs is rounding from a different
summation order: gradient accumulation (``loss / k`` over k micro-batches, summed into ``.grad``),
a training loss summed in one expression while the objective sums its terms one by one, and autocast.
This script trains small correct models those ways under ``GradWatch(every=1)`` and prints the largest
training ``rel_diff`` seen per compute dtype: :data:`gradwatch.check.judging.training_judge.TOLERANCE` is set about 30x above.

Run: ``.venv/bin/python benchmarks/training_tolerance.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import gradwatch


def models():
    yield "mlp", lambda: nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.Tanh(),
                                       nn.Linear(64, 5)), (16,)
    yield "cnn", lambda: nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                                       nn.Flatten(), nn.Linear(8 * 36, 5)), (64,)
    yield "transformer", lambda: nn.Sequential(nn.Unflatten(1, (4, 16)),
                                               nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True),
                                               nn.Flatten(), nn.Linear(64, 5)), (64,)


def l2_pow(model):
    return 1e-3 * sum(p.pow(2).sum() for p in model.parameters())


def l2_norm(model):
    """The same L2 term written another way: its gradient rounds differently from the objective's."""
    return 1e-3 * sum(torch.linalg.vector_norm(p) ** 2 for p in model.parameters())


def run(make, shape, autocast, accumulate, seed, steps=4, l2=l2_pow, scaler=False):
    torch.manual_seed(seed)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1])  # noqa: E731
    grad_scaler = torch.amp.GradScaler("cpu")
    watch = gradwatch.GradWatch(model, loss_fn, every=1, regularizers={"l2": 1e-3}, tensorboard=False, jsonl=False,
                                coords=1, directions=0, grad_scaler=grad_scaler if scaler == "given" else None)
    gen = torch.Generator().manual_seed(seed)
    ctx = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext
    worst = 0.0
    for _ in range(steps):
        opt.zero_grad()
        k = accumulate
        for _ in range(k):
            batch = (torch.randn(32, *shape, generator=gen), torch.randint(0, 5, (32,), generator=gen))
            with ctx():
                loss = loss_fn(model, batch) + l2(model)
            (grad_scaler.scale(loss / k) if scaler else loss / k).backward()
            if k > 1:
                watch.accumulate(batch)
        if scaler:
            grad_scaler.unscale_(opt)
        report = watch.step(None if k > 1 else batch)
        if scaler:
            grad_scaler.step(opt)
            grad_scaler.update()
        for t in report.training.values():
            worst = max(worst, t.rel_diff)
    watch.close()
    return worst


def main() -> None:
    print(f"{'model':12} {'compute dtype':14} {'accumulate':>10} {'variant':22} {'largest training rel_diff':>26}")
    variants = {"same ops": {}, "L2 written as a norm": {"l2": l2_norm}, "GradScaler, not given": {"scaler": True},
                "GradScaler, given": {"scaler": "given"}}
    for name, make, shape in models():
        for autocast in (None, torch.bfloat16, torch.float16):
            for accumulate in (1, 3):
                for variant, kw in variants.items():
                    if kw.get("scaler") and autocast is not torch.float16:
                        continue
                    worst = max(run(make, shape, autocast, accumulate, seed, **kw) for seed in range(3))
                    dtype = str(autocast or torch.float32).replace("torch.", "")
                    print(f"{name:12} {dtype:14} {accumulate:>10} {variant:22} {worst:>26.2e}")
    print("tolerances in use:", {str(k).replace("torch.", ""): v for k, v in gradwatch.check.judging.training_judge.TOLERANCE.items()})


if __name__ == "__main__":
    main()
