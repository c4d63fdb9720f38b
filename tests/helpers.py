"""Shared by test modules: a plain training loop and a watched one, a 3-4-1 MLP with an MSE loss, a tanh with a
planted backward bug, a tanh with a planted double-backward bug, two gloo ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import paths
import pytest
import torch
import torch.nn.functional as F
from torch import nn


def sgd_loop(model: nn.Module, watch, loss_fn, batches, opt: torch.optim.Optimizer) -> list:
    """A plain training loop: ``loss_fn(model, b)`` backward, ``watch.step(b)``, ``opt`` steps; what ``watch.step``
    returned at each step."""
    reports = []
    for b in batches:
        opt.zero_grad()
        loss_fn(model, b).backward()
        reports.append(watch.step(b))
        opt.step()
    return reports


def watch_run(loss_fn, model: nn.Module, data, **options):
    """A plain loop (SGD) with ``GradWatch(every=1)`` over the batches of ``data``: the watch and its reports."""
    from gradwatch import GradWatch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None, **options)
    return watch, sgd_loop(model, watch, loss_fn, data, opt)


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


class ScaledAffine(torch.autograd.Function):
    """``x @ w.T + b`` whose gradients are off: input, weight and bias scaled by ``factors``, and the weight's
    output rows ``rows`` (a slice, or None) by ``row_factor`` more (a kernel that treats some rows apart)."""

    @staticmethod
    def forward(ctx, x, w, b, factors=(1.0, 1.0, 1.0), rows=None, row_factor=1.0):
        ctx.save_for_backward(x, w)
        ctx.factors, ctx.rows, ctx.row_factor = factors, rows, row_factor
        return x @ w.T + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        fx, fw, fb = ctx.factors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        gw = g2.T @ x2 * fw
        if ctx.rows is not None and ctx.row_factor != 1.0:
            gw = gw.clone()
            gw[ctx.rows] *= ctx.row_factor
        return g @ w * fx, gw, g2.sum(0) * fb, None, None, None


class Act(nn.Module):
    """tanh, or with ``wrong`` the :class:`WrongTanh` whose backward is wrong."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.wrong = wrong

    def forward(self, x):
        return WrongTanh.apply(x) if self.wrong else torch.tanh(x)


def tanh_wrong_in_channel(channel, factor: float):
    """A tanh Function whose input gradient is ``factor`` times too large in ``channel`` (the second dimension;
    ``slice(None)``: everywhere)."""

    class ChannelBugTanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = torch.tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, gy):
            (y,) = ctx.saved_tensors
            g = (gy * (1 - y * y)).clone()
            g[:, channel] = g[:, channel] * factor
            return g

    return ChannelBugTanh


def make_tanh(x_error: float = 1.0, g_error: float = 1.0, element=None):
    """A tanh whose backward is another custom Function; that one's backward (tanh's double backward)
    is scaled by ``x_error`` in its gradient with respect to ``y`` (in flat element ``element`` only, when
    given) and by ``g_error`` in that to ``g``."""

    class TanhGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, g):
            ctx.save_for_backward(y, g)
            return g * (1 - y * y)

        @staticmethod
        def backward(ctx, gg):
            y, g = ctx.saved_tensors
            gy = gg * g * (-2 * y)
            if element is None:
                gy = gy * x_error
            else:
                gy = gy.clone()
                gy.view(-1)[element] *= x_error
            return gy, gg * (1 - y * y) * g_error

    class Tanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = torch.tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return TanhGrad.apply(y, g)

    return Tanh.apply


ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(script: str, path: Path, args: Sequence[str], timeout: float, what: str) -> Tuple[Tuple[int, ...], List[str]]:
    """Run ``script`` (written to ``path``) as 2 processes, ``path rank port *args``, with the checkout and
    every directory of tests on ``PYTHONPATH``; returns (exit codes, outputs). Both are killed, and the test fails, when
    they are not done within ``timeout`` seconds in all (a hang fails instead of blocking the suite)."""
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=paths.pythonpath(), OMP_NUM_THREADS="1")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(path), str(r), port, *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail(f"{what} did not finish within {timeout}s (killed): a hang")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return tuple(p.returncode for p in procs), logs


def run_launcher(script: str, path: Path, args: Sequence[str], timeout: float, what: str) -> str:
    """Run ``script`` (written to ``path``, run from its folder) as one process that starts its own ranks (Lightning's
    launchers), ``path *args``, with the checkout on ``PYTHONPATH``; returns its output, and fails the test where it
    did not exit 0. Where it is not done within ``timeout`` seconds its whole process group is killed, the ranks it
    started too, and the test fails (a hang fails instead of blocking the suite)."""
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(path), *args], cwd=path.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the ranks it started too
        proc.communicate()
        pytest.fail(f"{what} did not finish within {timeout:g} s (killed): a hang")
    assert proc.returncode == 0, log[-4000:]
    return log


def two_rank_results(script: str, out: Path, scenarios: Sequence[str], timeout: float,
                     what: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Run ``script`` on 2 ranks (:func:`run_two_ranks`, ``path rank port out scenarios``), both of which must exit 0,
    and read back what each wrote to ``out/rank{r}.json``: (rank 0's results, rank 1's)."""
    codes, logs = run_two_ranks(script, out / "worker.py", [str(out), ",".join(scenarios)], timeout, what)
    assert codes == (0, 0), f"exit codes {codes}\n" + "\n----\n".join(logs)
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in range(2))
    return r0, r1


def save_rank_results(out: str, rank: int, results: Any, default: Any = None) -> None:
    """In a 2-rank worker: write this rank's results where :func:`two_rank_results` reads them (``out/rank{r}.json``;
    ``default``: as :func:`json.dump`'s, for values JSON cannot hold)."""
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, default=default)


class WrongSoftmax(torch.autograd.Function):
    """softmax over the last dimension whose backward is 10% too large."""

    @staticmethod
    def forward(ctx, x):
        y = torch.softmax(x, -1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return 1.1 * y * (g - (g * y).sum(-1, keepdim=True))


class WrongSiluFunction(torch.autograd.Function):
    """SiLU whose backward is 1.5x the true derivative."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return nn.functional.silu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * 1.5 * s * (1 + x * (1 - s))


class WrongSilu(nn.Module):
    """SiLU with :class:`WrongSiluFunction`'s backward (a planted bug in a transformer's MLP)."""

    def forward(self, x):
        return WrongSiluFunction.apply(x)


class HotAdam(torch.optim.Adam):
    """An Adam whose step departs from Adam's: 1.3x the group's learning rate, restored after its base's step (whose
    hooks run inside its own)."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["lr"] *= 1.3
        out = super().step(closure)
        for group in self.param_groups:
            group["lr"] /= 1.3
        return out
