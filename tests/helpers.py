"""Small models and batches shared by test modules (a 3-4-1 MLP with an MSE loss; a tanh with a planted backward bug)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def batch(n: int = 6):
    return torch.randn(n, 3), torch.randn(n, 1)


class WrongTanh(torch.autograd.Function):
    """tanh whose backward forgets the square: 1 - y instead of 1 - y**2."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y)


class Act(nn.Module):
    """tanh, or with ``wrong`` the :class:`WrongTanh` whose backward is wrong."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.wrong = wrong

    def forward(self, x):
        return WrongTanh.apply(x) if self.wrong else torch.tanh(x)
