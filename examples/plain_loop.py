"""GradWatch in a plain PyTorch training loop.

A small classifier uses a custom ``autograd.Function`` activation (SiLU)
whose backward drops a term once ``|x| >= 3``. Early in training inputs are
small and the gradients are right; at step 60 the first layer's weights are
scaled up (as weights grow during training), inputs cross 3, and GradWatch
raises an alert naming the affected tensors. Run with ``--fixed`` for the
correct activation: no alert.

    python examples/plain_loop.py [--fixed] [--steps 120] [--logdir runs/plain]
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import gradwatch


class LateBugSiLU(torch.autograd.Function):
    """``x * sigmoid(x)``; backward forgets ``x*s*(1-s)`` where ``|x| >= 3`` unless ``fixed``."""

    fixed = False

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        d = s + x * s * (1 - s)
        if not LateBugSiLU.fixed:
            d = torch.where(x.abs() < 3, d, s)
        return grad * d


class Act(nn.Module):
    def forward(self, x):
        return LateBugSiLU.apply(x)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="use the correct activation")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--logdir", default=None, help="TensorBoard/JSONL directory (default: none)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    LateBugSiLU.fixed = args.fixed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), Act(), nn.Dropout(0.1), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    x_all, y_all = torch.randn(512, 8), torch.randint(0, 3, (512,))

    def loss_fn(m, batch):
        x, y = batch
        return nn.functional.cross_entropy(m(x), y)

    with gradwatch.GradWatch(model, loss_fn, optimizer=opt, every=10, log_dir=args.logdir) as watch:
        for step in range(args.steps):
            idx = torch.randint(0, 512, (64,))
            batch = (x_all[idx], y_all[idx])
            opt.zero_grad()
            loss = loss_fn(model, batch)
            loss.backward()
            report = watch.step(batch)
            if report is not None:
                worst = report.worst
                print(f"step {step:4d}  loss {loss.item():.3f}  worst {worst.name} {worst.judged_rel_diff:.1e} {worst.verdict.value}")
            opt.step()
            if step == 60:
                with torch.no_grad():
                    model[0].weight.mul_(6.0)  # weights grow: inputs of the activation cross |x| = 3
    print(f"{len(watch.alerts)} alerts")
    for alert in watch.alerts:
        print(f"  [{alert.kind}] {alert.message}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
