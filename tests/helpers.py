"""Small models and batches shared by test modules (a 3-4-1 MLP with an MSE loss)."""

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
