"""``gradwatch bench``: what a check costs, what it catches, side by side with ``torch.autograd.gradcheck``.

One run, on the same models: a small MLP, a small CNN and a small
transformer block, each with a planted backward bug in a custom
``autograd.Function`` inside a named module, and its correct twin (same
weights, correct backward). Five sections, printed as tables and written as
JSON:

1. ``time_to_verdict``: wall time and loss evaluations until a localized
   verdict: ``check_model(..., localize=True)`` at its defaults, against
   ``torch.autograd.gradcheck`` over the model's parameters (slow mode, run
   under a time cap: when it cannot finish, the evaluations it needs,
   ``2 * n_params``, are given instead, and ``fast_mode=True``).
   ``verdict_speed``: time to a verdict, warm, one thread, median of ``repeats``: ``check_model`` at its
   defaults (detection first: one probe per tensor settles or fails it; the full sample only where the
   probe cannot tell, and, for the failing tensors, after every verdict: ``verdict_seconds``) against
   ``gradcheck(fast_mode=True)`` on the same float64 objective, for the correct twin and the buggy model,
   with the whole call's time and the localization time of the buggy one (``check_model(localize=True)``'s
   ``localize_seconds``: the failing tensors' full samples and each module alone).
2. ``detection``: whether each tool caught each planted bug, what it named,
   and false alarms on the correct twins.
3. ``efficiency``: check wall time / (loss evaluations x median time of one
   loss evaluation in float64); 1.0 is the cost of the evaluations
   themselves. Loop path and batched path (``torch.vmap``).
4. ``training_overhead``: a few hundred training steps of each correct twin
   with and without :class:`gradwatch.GradWatch` at its default config,
   interleaved step by step; the ratio of the median step times (the
   per-step price) and of the total times (which includes the checks).
5. ``scaling``: check time at the default sample size as an MLP grows from
   about 1e4 to 1e6 parameters, next to the time of one forward pass.
6. ``memory``: peak memory (CPU RSS; CUDA peak allocated) of 3 SGD steps of a 7-layer MLP
   (25M and 100M parameters; 4M with ``--quick``), batch 64, without and with
   ``GradWatch(every=1)`` at its default options, side by side, one subprocess per
   configuration (``benchmarks/membench.py``); and ``module_form``: the planted bugs caught
   by the backward part's module form (``GradWatch(form="module")``).

Figures are ratios from one run on one machine; nothing here asserts a time.

This file ships with the source tree, not with the wheel (its planted-bug
models are no part of the library): ``make bench``, ``python
benchmarks/bench.py`` or ``gradwatch bench`` in a checkout run it.

Example (as a test would run it)::

    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_arguments(p)
    >>> p.parse_args(["--quick"]).quick
    True
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd.gradcheck import GradcheckError
from torch.nn import functional as F

from gradwatch._version import __version__
from gradwatch.check.judging.report import CheckReport
from gradwatch.check.model import check_model, run_model_check
from gradwatch.check.objective.rng import preserved_rng
from gradwatch.check.objective.shadow import Shadow, cast_floats
from gradwatch.check.objective.terms import Objective
from gradwatch.check.probes.batched import batched_state, reset_batched_state
from gradwatch.io.records import to_jsonable
from gradwatch.options import CheckOptions
from gradwatch.watch.gradwatch import GradWatch

MODEL_NAMES = ("mlp", "cnn", "transformer")
SECTIONS = ("time_to_verdict", "verdict_speed", "detection", "efficiency", "training_part", "training_overhead", "scaling",
            "memory", "module_form")

#: What each size runs: (default, quick).
_SIZES = {
    "steps": (300, 40),
    "repeats": (5, 3),
    "time_cap": (20.0, 2.0),
    "scaling_widths": ((64, 288, 960), (16, 48, 96)),
}


# ============================================================================ planted bugs
# New-style autograd.Functions (forward without ctx, setup_context, generate_vmap_rule):
# torch.vmap can batch them, as it can the models around them. Each takes ``bug`` (a flag).


class SiLUFunction(torch.autograd.Function):
    """``x * sigmoid(x)``; the bug drops the ``x * s * (1 - s)`` term of the derivative."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, bug: bool) -> torch.Tensor:
        return x * torch.sigmoid(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        x, bug = inputs
        ctx.save_for_backward(x)
        ctx.bug = bug

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        d = s if ctx.bug else s * (1 + x * (1 - s))
        return g * d, None


class ChannelScaleFunction(torch.autograd.Function):
    """``x * w`` per channel; the bug doubles the weight gradient (a sum over the batch taken twice)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, bug: bool) -> torch.Tensor:
        return x * w.view(1, -1, 1, 1)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        x, w, bug = inputs
        ctx.save_for_backward(x, w)
        ctx.bug = bug

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, None]:
        x, w = ctx.saved_tensors
        gw = (g * x).sum(dim=(0, 2, 3))
        return g * w.view(1, -1, 1, 1), gw * (2.0 if ctx.bug else 1.0), None


class SoftmaxFunction(torch.autograd.Function):
    """Softmax over the last dim; the bug forgets the ``- sum(y * g)`` centering of the backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, bug: bool) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(output)
        ctx.bug = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        if ctx.bug:
            return y * g, None
        return y * (g - (y * g).sum(dim=-1, keepdim=True)), None


class SiLU(nn.Module):
    """Module around :class:`SiLUFunction`."""

    def __init__(self, bug: bool = False) -> None:
        super().__init__()
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SiLUFunction.apply(x, self.bug)


class ChannelScale(nn.Module):
    """Learnable per-channel scale around :class:`ChannelScaleFunction`."""

    def __init__(self, channels: int, bug: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(channels))
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ChannelScaleFunction.apply(x, self.weight, self.bug)


class AttnSoftmax(nn.Module):
    """Attention softmax around :class:`SoftmaxFunction`."""

    def __init__(self, bug: bool = False) -> None:
        super().__init__()
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SoftmaxFunction.apply(x, self.bug)


# ============================================================================ models


class MLP(nn.Module):
    def __init__(self, d_in: int, width: int, d_out: int, bug: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential()
        self.body.add_module("fc1", nn.Linear(d_in, width))
        self.body.add_module("act1", SiLU(bug))
        self.body.add_module("fc2", nn.Linear(width, width))
        self.body.add_module("act2", nn.Tanh())
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class CNN(nn.Module):
    def __init__(self, channels: int, side: int, classes: int, bug: bool = False) -> None:
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv1", nn.Conv2d(3, channels, 3, padding=1))
        self.features.add_module("bn1", nn.BatchNorm2d(channels))
        self.features.add_module("act1", nn.LeakyReLU(0.1))
        self.features.add_module("conv2", nn.Conv2d(channels, channels, 3, padding=1))
        self.features.add_module("scale", ChannelScale(channels, bug))
        self.features.add_module("act2", nn.Tanh())
        self.features.add_module("pool", nn.AvgPool2d(2))
        self.head = nn.Linear(channels * (side // 2) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, bug: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.softmax = AttnSoftmax(bug)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = self.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads))
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, bug: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, bug)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, seq: int, classes: int, bug: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, dim))
        self.block = Block(dim, heads, bug)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x) + self.pos).mean(dim=1))


def _xent(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


@dataclass
class Case:
    """One benchmark model: the model, its loss and batch, and where its bug is planted."""

    name: str
    model: nn.Module
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    batch: Any
    bug: bool
    planted_module: str
    planted_function: str
    planted_tensors: Tuple[str, ...]
    description: str

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def make_case(name: str, bug: bool, quick: bool = False, seed: int = 0) -> Case:
    """The benchmark model ``name`` (``mlp``, ``cnn``, ``transformer``), with or without its planted bug.

    The buggy model and its twin have identical weights and data (same ``seed``).
    """
    gen = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    if name == "mlp":
        d_in, width, batch = (32, 64, 32) if quick else (64, 256, 128)
        model = MLP(d_in, width, 10, bug)
        data = (torch.randn(batch, d_in, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
        return Case(name, model, _xent, data, bug, "body.act1", "SiLUFunction", ("body.fc1.weight", "body.fc1.bias"),
                    "SiLU backward drops the x*s*(1-s) term")
    if name == "cnn":
        ch, side, batch = (4, 8, 4) if quick else (32, 12, 8)
        model = CNN(ch, side, 10, bug)
        data = (torch.randn(batch, 3, side, side, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
        return Case(name, model, _xent, data, bug, "features.scale", "ChannelScaleFunction", ("features.scale.weight",),
                    "per-channel scale: weight gradient doubled")
    if name == "transformer":
        vocab, dim, heads, seq, batch = (8, 16, 2, 6, 4) if quick else (32, 64, 4, 16, 8)
        model = Transformer(vocab, dim, heads, seq, 10, bug)
        data = (torch.randn(batch, seq, vocab, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
        return Case(name, model, _xent, data, bug, "block.attn.softmax", "SoftmaxFunction",
                    ("block.attn.qkv.weight", "block.attn.qkv.bias"), "attention softmax backward misses its centering term")
    raise ValueError(f"unknown benchmark model {name!r}; expected one of {', '.join(MODEL_NAMES)}")


def scaling_case(width: int, batch: int = 64) -> Case:
    """A correct MLP ``64 -> width -> width -> 10`` for the scaling section."""
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    model = MLP(64, width, 10, bug=False)
    data = (torch.randn(batch, 64, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
    return Case(f"mlp-{width}", model, _xent, data, False, "", "", (), "scaling")


# ============================================================================ measurements


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def eval_seconds(case: Case, n: int = 30, dtype: torch.dtype = torch.float64) -> float:
    """Median time of one loss evaluation of a plain copy in ``dtype`` (no hooks, no grad)."""
    model = copy.deepcopy(case.model).to(dtype)
    batch = cast_floats(case.batch, dtype)
    times = []
    with torch.no_grad():
        for i in range(n + 3):
            start = time.perf_counter()
            float(case.loss_fn(model, batch))
            if i >= 3:
                times.append(time.perf_counter() - start)
    return _median(times)


class _Timeout(Exception):
    pass


class _LossModule(nn.Module):
    def __init__(self, inner: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        super().__init__()
        self.inner = inner
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.inner, batch)


def run_gradcheck(case: Case, fast_mode: bool, time_cap: float) -> Dict[str, Any]:
    """``torch.autograd.gradcheck`` over all parameters (float64, via ``torch.func.functional_call``)."""
    model = copy.deepcopy(case.model).double()
    wrapper = _LossModule(model, case.loss_fn)
    batch = cast_floats(case.batch, torch.float64)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    inputs = tuple(p.detach().clone().requires_grad_(True) for n, p in model.named_parameters() if p.requires_grad)
    n_params = sum(t.numel() for t in inputs)
    calls = [0]
    deadline = time.perf_counter() + time_cap

    def fn(*params: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if time.perf_counter() > deadline:
            raise _Timeout
        return torch.func.functional_call(wrapper, {"inner." + n: p for n, p in zip(names, params)}, (batch,))

    out: Dict[str, Any] = {"tool": "gradcheck-fast" if fast_mode else "gradcheck-slow", "n_params": n_params}
    # On a mismatch, fast mode recomputes the failing input's Jacobian in slow mode for its error message
    # (2 evaluations per entry). The verdict is already made then: skip that recompute, count up to the verdict.
    gc_module = importlib.import_module("torch.autograd.gradcheck")
    slow_message = getattr(gc_module, "_run_slow_mode_and_get_error", None)
    start = time.perf_counter()
    try:
        if slow_message is not None:
            gc_module._run_slow_mode_and_get_error = lambda *a, **k: "(slow-mode recompute skipped by gradwatch bench)"
        torch.autograd.gradcheck(fn, inputs, fast_mode=fast_mode, raise_exception=True)
        out.update(status="pass", caught=False, named=[])
    except _Timeout:
        out.update(status="timeout", caught=None, named=[])
    except GradcheckError as err:
        idx = [int(i) for i in re.findall(r"with respect to input (\d+)", str(err))]
        out.update(status="mismatch", caught=True, named=[names[i] for i in idx if i < len(names)])
    except Exception as err:  # noqa: BLE001 - report what happened, keep benchmarking
        out.update(status=f"error: {type(err).__name__}: {str(err).splitlines()[0][:120]}", caught=None, named=[])
    finally:
        if slow_message is not None:
            gc_module._run_slow_mode_and_get_error = slow_message
    seconds = time.perf_counter() - start
    out["seconds"] = seconds
    out["evaluations"] = calls[0]
    if out["status"] == "timeout":
        # Slow mode perturbs every parameter entry both ways before it compares anything.
        out["evaluations_needed"] = 2 * n_params
        out["seconds"] = None
        out["seconds_spent"] = seconds
        out["seconds_estimated"] = seconds / max(calls[0], 1) * 2 * n_params
    else:
        out["evaluations_needed"] = calls[0]
    return out


def run_gradwatch(case: Case) -> Dict[str, Any]:
    """``check_model(..., localize=True)`` at its defaults; what it caught and named.

    Run twice: the first call pays one-time costs (the float64 copy, vmap's first call and the
    validation of batched evaluation); the second is what a repeated check of the model costs.
    """
    reset_batched_state(case.model)
    start = time.perf_counter()
    report = check_model(case.model, case.loss_fn, case.batch, localize=True)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    check_model(case.model, case.loss_fn, case.batch, localize=True)
    seconds_warm = time.perf_counter() - start
    failing_modules = [c for c in report.localized if c.failed]
    return {
        "tool": "gradwatch",
        "status": "ok" if report.ok else "failed",
        "caught": not report.ok,
        "seconds": seconds,
        "seconds_warm": seconds_warm,
        "evaluations": report.evaluations,
        "module_evaluations": sum(c.evaluations for c in report.localized),
        "named": [t.name for t in report.failures],
        "modules": [c.name for c in failing_modules],
        "localized": [c.summary() for c in failing_modules],
        "diagnosis": report.failures[0].diagnosis if report.failures else None,
        "path": "batched" if batched_state(case.model)["enabled"] else "loop",
    }


def measure_verdict_speed(case: Case, repeats: int) -> Dict[str, Any]:
    """Time to a verdict of ``check_model`` and of fast gradcheck, warm, one thread, interleaved; median of ``repeats``.

    ``check_model``'s time to a verdict is its report's ``verdict_seconds`` (from the call until every tensor's
    pass or fail is known; detection first); its whole call, the failing tensors' full samples included, is
    ``check_seconds``. The localization time is ``check_model(localize=True)``'s ``localize_seconds`` (those
    full samples and each module alone), after the verdict.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reset_batched_state(case.model)
        check_model(case.model, case.loss_fn, case.batch)  # warm: the float64 copy, vmap's first call
        run_gradcheck(case, True, 60.0)
        verdicts, calls, theirs = [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            report = check_model(case.model, case.loss_fn, case.batch)
            calls.append(time.perf_counter() - start)
            verdicts.append(report.verdict_seconds)
            fast = run_gradcheck(case, True, 60.0)
            theirs.append(fast["seconds"])
        localized = check_model(case.model, case.loss_fn, case.batch, localize=True) if not report.ok else None
    finally:
        torch.set_num_threads(threads)
    gw, gc = _median(verdicts), _median(theirs)
    return {
        "model": case.name, "bug": case.bug, "gradwatch_seconds": gw, "gradcheck_fast_seconds": gc, "ratio": gw / gc,
        "check_seconds": _median(calls), "check_ratio": _median(calls) / gc,
        "gradwatch_evaluations": report.verdict_evaluations, "check_evaluations": report.evaluations,
        "gradcheck_fast_evaluations": fast["evaluations"],
        "gradwatch_caught": not report.ok, "gradcheck_fast_caught": fast["caught"],
        "failing": [t.name for t in report.failures],
        "localize_seconds": localized.localize_seconds if localized is not None else None,
        "modules": [c.name for c in localized.localized if c.failed] if localized is not None else [],
    }


def _load_beside(name: str = "membench") -> Any:
    """``benchmarks/<name>.py`` beside this file (the benchmarks are files, not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"gradwatch_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_module_form(case: Case) -> Dict[str, Any]:
    """One check of ``GradWatch(form="module")`` (each module alone in float64): what it caught and named."""
    model = copy.deepcopy(case.model)
    with GradWatch(model, case.loss_fn, every=1, log_dir=None, form="module", training=False) as watch:
        case.loss_fn(model, case.batch).backward()
        report = watch.step(case.batch)
    failing = [c for c in report.localized if c.failed] if report is not None else []
    return {"model": case.name, "bug": case.bug, "form": report.form if report is not None else None,
            "caught": bool(report is not None and not report.ok), "named_modules": [c.name for c in failing],
            "module_named": case.planted_module in [c.name for c in failing] if case.bug else None,
            "localized": [c.summary() for c in failing], "tensors": len(report.tensors) if report is not None else 0}


def measure_efficiency(case: Case, repeats: int) -> List[Dict[str, Any]]:
    """Check time / (evaluations x one evaluation), loop path and batched path, interleaved.

    Checks run on a reused shadow (as the training hook runs them). Each repeat times a
    loop check, a batched check and, next to each, the median of 15 plain float64 loss
    evaluations; the efficiency is the median over repeats of the per-repeat ratio, so a
    busy spell on a shared machine slows numerator and denominator alike.
    """
    reset_batched_state(case.model)
    shadow = Shadow(case.model, torch.float64)
    objective = Objective(case.loss_fn)
    opts = CheckOptions()
    paths = (False, True)
    for batched in paths:  # warm-up (and, for the batched path, the batching decision)
        run_model_check(case.model, objective, case.batch, opts, shadow=shadow, batched=batched)
    runs: Dict[bool, List[Tuple[float, float, Any]]] = {b: [] for b in paths}
    for _ in range(repeats):
        for batched in paths:
            report = run_model_check(case.model, objective, case.batch, opts, shadow=shadow, batched=batched)
            runs[batched].append((report.seconds, eval_seconds(case, n=15), report))
    state = batched_state(case.model)
    out = []
    for batched in paths:
        rows = runs[batched]
        report = rows[-1][2]
        out.append({
            "model": case.name,
            "n_params": case.n_params,
            "path": "batched" if batched and state["enabled"] else "loop",
            "requested": "batched" if batched else "loop",
            "fallback": None if (not batched or state["enabled"]) else state["reason"],
            "check_seconds": _median([r[0] for r in rows]),
            "evaluations": report.evaluations,
            "eval_seconds": _median([r[1] for r in rows]),
            "efficiency": _median([r[0] / (r[2].evaluations * r[1]) for r in rows]),
            "ok": report.ok,
        })
    return out


def measure_overhead(case: Case, steps: int) -> Dict[str, Any]:
    """Training steps with and without GradWatch (default config, no log files), interleaved step by step."""
    plain = copy.deepcopy(case.model)
    watched = copy.deepcopy(case.model)
    opt_a = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    opt_b = torch.optim.SGD(watched.parameters(), lr=0.01, momentum=0.9)
    watch = GradWatch(watched, case.loss_fn, optimizer=opt_b, log_dir=None)

    def step(model: nn.Module, opt: torch.optim.Optimizer, with_watch: bool) -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = case.loss_fn(model, case.batch)
        loss.backward()
        if with_watch:
            watch.step(case.batch)
        opt.step()
        return time.perf_counter() - start

    for _ in range(3):  # warm-up of the plain model only: the watched run starts cold, as a real one does
        step(plain, opt_a, False)
    t_plain: List[float] = []
    t_watch: List[float] = []
    for i in range(steps):
        if i % 2 == 0:
            t_plain.append(step(plain, opt_a, False))
            t_watch.append(step(watched, opt_b, True))
        else:
            t_watch.append(step(watched, opt_b, True))
            t_plain.append(step(plain, opt_a, False))
    state = watch.state_dict()
    watch.close()
    return {
        "model": case.name,
        "steps": steps,
        "median_step_seconds": _median(t_plain),
        "median_step_seconds_watched": _median(t_watch),
        "median_ratio": _median(t_watch) / _median(t_plain),
        "total_ratio": sum(t_watch) / sum(t_plain),
        "checks": state["checks"],
        "alerts": len(watch.alerts),
    }


#: Interleaved repeats of the training part and one forward+backward: a median of 20 moved by 5% from run to run
#: on a shared 2-core machine, one of 100 by about 1% (each repeat costs a few milliseconds).
TRAINING_PART_REPEATS = 100


def measure_training_part(case: Case, repeats: int) -> Dict[str, Any]:
    """The training part's cost next to one forward and backward of the live model, interleaved.

    Per repeat: one training step's forward and backward (timed), then the training part alone on it
    (the replay of the objective on the live model and the comparison of every watched tensor's
    ``.grad``; timed), on the correct twin, inside the check's RNG guard (one for both parts of a
    check, so not counted here). The ratio of the medians is what a check adds for it.
    """
    model = copy.deepcopy(case.model)
    watch = GradWatch(model, case.loss_fn, log_dir=None, every=1)
    t_fb: List[float] = []
    t_part: List[float] = []
    verdicts = set()
    try:
        for i in range(repeats + 2):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            case.loss_fn(model, case.batch).backward()
            fb = time.perf_counter() - start
            pending = watch.context.take(case.batch, None)
            with preserved_rng():  # the check's RNG guard, which the backward part shares: not counted here
                start = time.perf_counter()
                report = CheckReport(tensors={})
                watch.training.judge(report, watch.training.replay(pending))
                part = time.perf_counter() - start
            watch._recorder.discard(full=True)  # as GradWatch.step does before a step it will check
            if i >= 2:  # the first two warm up
                t_fb.append(fb)
                t_part.append(part)
            verdicts.update(t.verdict.value if t.verdict else None for t in report.training.values())
    finally:
        watch.close()
    return {
        "model": case.name, "repeats": repeats, "forward_backward_seconds": _median(t_fb),
        "training_part_seconds": _median(t_part), "ratio": _median(t_part) / _median(t_fb),
        "verdicts": sorted(v or "inconclusive" for v in verdicts),
    }


def measure_scaling(widths: Sequence[int], repeats: int) -> List[Dict[str, Any]]:
    rows = []
    for w in widths:
        case = scaling_case(w)
        for eff in measure_efficiency(case, repeats):
            rows.append({
                "width": w,
                "n_params": case.n_params,
                "path": eff["path"],
                "forward_seconds": eff["eval_seconds"],
                "check_seconds": eff["check_seconds"],
                "evaluations": eff["evaluations"],
                "check_over_forward": eff["efficiency"] * eff["evaluations"],
                "efficiency": eff["efficiency"],
            })
    return rows


# ============================================================================ the run


def run_benchmark(models: Sequence[str] = MODEL_NAMES, quick: bool = False, time_cap: Optional[float] = None,
                  steps: Optional[int] = None, repeats: Optional[int] = None, scaling: bool = True,
                  memory: bool = True, progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Every section for ``models``; returns the JSON-able result (see the module docstring)."""
    size = 1 if quick else 0
    time_cap = float(time_cap if time_cap is not None else _SIZES["time_cap"][size])
    steps = int(steps if steps is not None else _SIZES["steps"][size])
    repeats = int(repeats if repeats is not None else _SIZES["repeats"][size])
    say = progress or (lambda msg: None)
    started = time.perf_counter()
    out: Dict[str, Any] = {
        "meta": {
            "gradwatch": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "processor": platform.processor() or None, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "quick": quick, "time_cap_seconds": time_cap, "steps": steps, "repeats": repeats,
            "models": list(models), "command": "gradwatch bench" + (" --quick" if quick else ""),
        },
        "time_to_verdict": [], "verdict_speed": [], "detection": [], "efficiency": [], "training_part": [], "training_overhead": [],
        "scaling": [], "memory": [], "module_form": [],
    }
    for name in models:
        buggy, twin = make_case(name, True, quick), make_case(name, False, quick)
        say(f"{name}: gradwatch")
        gw_bug, gw_twin = run_gradwatch(buggy), run_gradwatch(twin)
        say(f"{name}: gradcheck (fast mode)")
        fast_bug, fast_twin = run_gradcheck(buggy, True, time_cap), run_gradcheck(twin, True, time_cap)
        say(f"{name}: gradcheck (slow mode, capped at {time_cap:g}s)")
        slow_bug, slow_twin = run_gradcheck(buggy, False, time_cap), run_gradcheck(twin, False, time_cap)
        eval_s = eval_seconds(buggy)
        for tool, res in (("gradwatch", gw_bug), ("gradcheck-fast", fast_bug), ("gradcheck-slow", slow_bug)):
            out["time_to_verdict"].append({
                "model": name, "n_params": buggy.n_params, "tool": tool, "status": res["status"],
                "seconds": res["seconds"], "seconds_warm": res.get("seconds_warm"),
                "seconds_estimated": res.get("seconds_estimated"), "evaluations": res["evaluations"],
                "evaluations_needed": res.get("evaluations_needed", res["evaluations"]),
                "module_evaluations": res.get("module_evaluations", 0),
                "eval_seconds": eval_s,
            })
        for tool, bug_res, twin_res in (("gradwatch", gw_bug, gw_twin), ("gradcheck-fast", fast_bug, fast_twin),
                                        ("gradcheck-slow", slow_bug, slow_twin)):
            named = list(bug_res.get("named", []))
            modules = list(bug_res.get("modules", []))
            out["detection"].append({
                "model": name, "tool": tool, "planted": buggy.description, "planted_module": buggy.planted_module,
                "planted_function": buggy.planted_function,
                "caught": bug_res["caught"], "named_tensors": named, "named_modules": modules,
                "localized": bug_res.get("localized", []),
                "module_named": buggy.planted_module in modules,
                "tensor_named": any(t in named for t in buggy.planted_tensors),
                "false_alarm": twin_res["caught"], "twin_status": twin_res["status"],
            })
        say(f"{name}: time to a verdict against fast gradcheck (one thread)")
        out["verdict_speed"].extend([measure_verdict_speed(twin, repeats), measure_verdict_speed(buggy, repeats)])
        say(f"{name}: module form")
        out["module_form"].extend([run_module_form(buggy), run_module_form(twin)])
        say(f"{name}: efficiency")
        out["efficiency"].extend(measure_efficiency(twin, repeats))
        say(f"{name}: training part")
        out["training_part"].append(measure_training_part(twin, max(repeats, TRAINING_PART_REPEATS)))
        say(f"{name}: training overhead ({steps} steps)")
        out["training_overhead"].append(measure_overhead(twin, steps))
    if "mlp" in models:
        say("training part: a 1M-parameter MLP")
        big = scaling_case(max(_SIZES["scaling_widths"][size]))
        big.name = f"mlp {big.n_params:,} params"
        out["training_part"].append(measure_training_part(big, max(repeats, TRAINING_PART_REPEATS)))
        vocab = 64 if quick else 50257
        say(f"training part: a token LM (vocabulary {vocab:,}), 4 micro-batches of unequal token counts")
        cut = _load_beside("step_objective").measure_training_part(vocab, 4, max(repeats, 30))
        out["training_part"].append({"model": f"token LM, vocab {vocab:,}, 4 micro-batches", "repeats": max(repeats, 30),
                                     "forward_backward_seconds": cut["forward_backward_ms"] / 1e3,
                                     "training_part_seconds": cut["training_part_ms"] / 1e3, "ratio": cut["ratio"],
                                     "verdicts": cut["verdicts"]})
    if scaling:
        widths = _SIZES["scaling_widths"][size]
        say(f"scaling: widths {', '.join(map(str, widths))}")
        out["scaling"] = measure_scaling(widths, repeats)
    if memory:
        membench = _load_beside()
        out["memory"] = membench.measure_memory(membench.SIZES[size], progress=say)
    out["targets"] = evaluate_targets(out, quick=quick)
    out["meta"]["seconds"] = time.perf_counter() - started
    return out


#: Pass/fail targets set for the default (full) sizes; ``--quick`` models are too small for them to mean anything.
FULL_SIZE_TARGETS = ("overhead_at_most_1.02", "verdict_at_most_1.5x_fast_gradcheck",
                     "efficiency_loop_at_most_1.3", "efficiency_batched_below_1",
                     "at_least_100x_fewer_evaluations", "training_part_at_most_1.2")
NOT_APPLICABLE = "n/a (full size only)"


def evaluate_targets(result: Dict[str, Any], quick: bool = False) -> Dict[str, Any]:
    """The issue's targets, read off the figures (True/False/None when not measured).

    With ``quick``, the :data:`FULL_SIZE_TARGETS` read :data:`NOT_APPLICABLE` instead of a
    verdict (the measured figures beside them are kept).
    """
    targets = _targets(result)
    if quick:
        targets.update({k: NOT_APPLICABLE for k in FULL_SIZE_TARGETS})
    return targets


def _targets(result: Dict[str, Any]) -> Dict[str, Any]:
    over = result["training_overhead"]
    eff = result["efficiency"]
    det = result["detection"]
    ttv = result["time_to_verdict"]
    gw_det = [d for d in det if d["tool"] == "gradwatch"]
    ratios = []
    for model in {r["model"] for r in ttv}:
        gw = next((r for r in ttv if r["model"] == model and r["tool"] == "gradwatch"), None)
        slow = next((r for r in ttv if r["model"] == model and r["tool"] == "gradcheck-slow"), None)
        if gw and slow and gw["evaluations"]:
            ratios.append(slow["evaluations_needed"] / gw["evaluations"])
    loop = [e["efficiency"] for e in eff if e["path"] == "loop"]
    batched = [e["efficiency"] for e in eff if e["path"] == "batched"]
    scale = [r["check_over_forward"] for r in result.get("scaling", []) if r["path"] == "loop"]
    part = [t["ratio"] for t in result.get("training_part", [])]
    mem = [r["ratio"] for r in result.get("memory", []) if r.get("ratio") is not None]
    module = result.get("module_form", [])
    speed = [r["ratio"] for r in result.get("verdict_speed", [])]
    return {
        "verdict_ratio_max": max(speed, default=None),
        "verdict_at_most_1.5x_fast_gradcheck": all(r <= 1.5 for r in speed) if speed else None,
        "memory_ratio_max": max(mem, default=None),
        "memory_at_most_1.1": all(r <= 1.1 for r in mem) if mem else None,
        "module_form_catches_and_names_every_bug": all(r["caught"] and r["module_named"] for r in module if r["bug"])
        if module else None,
        "module_form_no_false_alarm": not any(r["caught"] for r in module if not r["bug"]) if module else None,
        "training_part_ratio_max": max(part, default=None),
        "training_part_at_most_1.2": all(r <= 1.2 for r in part) if part else None,
        "overhead_median_ratio_max": max((o["median_ratio"] for o in over), default=None),
        "overhead_at_most_1.02": all(o["median_ratio"] <= 1.02 for o in over) if over else None,
        "efficiency_loop_max": max(loop, default=None),
        "efficiency_loop_at_most_1.3": all(v <= 1.3 for v in loop) if loop else None,
        "efficiency_batched_max": max(batched, default=None),
        "efficiency_batched_below_1": all(v < 1.0 for v in batched) if batched else None,
        "every_bug_caught_and_named": all(d["caught"] and (d["module_named"] or d["tensor_named"]) for d in gw_det) if gw_det else None,
        "no_false_alarm": not any(d["false_alarm"] for d in gw_det) if gw_det else None,
        "evaluations_ratio_vs_slow_gradcheck_min": min(ratios, default=None),
        "at_least_100x_fewer_evaluations": all(r >= 100 for r in ratios) if ratios else None,
        "scaling_check_over_forward_spread": (max(scale) / min(scale)) if scale else None,
    }


# ============================================================================ printing


def _fmt_s(v: Optional[float]) -> str:
    if v is None:
        return "timeout"
    if isinstance(v, float) and math.isnan(v):
        return "-"
    return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"


def _table(header: Sequence[str], rows: List[Sequence[Any]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def format_result(result: Dict[str, Any]) -> str:
    """The readable tables of a :func:`run_benchmark` result."""
    parts = []
    m = result["meta"]
    parts.append(f"gradwatch {m['gradwatch']} bench, torch {m['torch']}, {m['threads']} threads, "
                 f"{'quick' if m['quick'] else 'default'} size, slow gradcheck capped at {m['time_cap_seconds']:g}s")
    rows = []
    for r in result["time_to_verdict"]:
        needed = r["evaluations_needed"]
        evals = f"{r['evaluations']}" if r["status"] != "timeout" else f"{needed} needed ({r['evaluations']} done)"
        if r["module_evaluations"]:
            evals += f" + {r['module_evaluations']} module fwd"
        if r["status"] == "timeout":
            shown = f"timeout (est. {_fmt_s(r['seconds_estimated'])})" if r.get("seconds_estimated") else "timeout"
        else:
            shown = _fmt_s(r["seconds"])
            if r.get("seconds_warm") is not None:
                shown += f" ({_fmt_s(r['seconds_warm'])} repeated)"
        rows.append((r["model"], r["n_params"], r["tool"], r["status"], shown, evals))
    parts.append("\n1. time and loss evaluations to a verdict (buggy models)\n"
                 + _table(("model", "params", "tool", "verdict", "time", "loss evaluations"), rows))
    rows = []
    for d in result["detection"]:
        caught = {True: "yes", False: "no", None: "n/a"}[d["caught"]]
        named = ", ".join(d["named_modules"]) or ", ".join(d["named_tensors"][:2]) or "-"
        alarm = {True: "YES", False: "no", None: "n/a"}[d["false_alarm"]]
        rows.append((d["model"], d["tool"], caught, named, alarm))
    speed = [(r["model"], "planted bug" if r["bug"] else "correct", _fmt_s(r["gradwatch_seconds"]),
              _fmt_s(r["gradcheck_fast_seconds"]), f"{r['ratio']:.2f}x",
              f"{_fmt_s(r['check_seconds'])} ({r['check_ratio']:.2f}x), {r['check_evaluations']} evals"
              if r.get("check_seconds") is not None else "-",
              f"{r['gradwatch_evaluations']} / {r['gradcheck_fast_evaluations']}",
              {True: "yes", False: "no", None: "n/a"}[r["gradwatch_caught"]],
              _fmt_s(r["localize_seconds"]) + " (" + (", ".join(r["modules"]) or "-") + ")"
              if r["localize_seconds"] is not None else "-")
             for r in result.get("verdict_speed", [])]
    if speed:
        parts.append("\n1b. time to a verdict, warm, one thread: check_model (detection first) vs gradcheck(fast_mode=True)\n"
                     + _table(("model", "twin", "gradwatch verdict", "gradcheck fast", "ratio", "whole call",
                               "evaluations to verdict", "caught", "localization (named)"), speed))
    parts.append("\n2. planted bug caught / named; false alarm on the correct twin\n"
                 + _table(("model", "tool", "caught", "named", "false alarm"), rows))
    for d in result["detection"]:
        for line in d.get("localized", []):
            parts.append(f"   {d['model']}: {line}")
    rows = []
    for e in result["efficiency"]:
        path = e["path"] + (f" (fallback: {e['fallback'][:60]})" if e.get("fallback") else "")
        rows.append((e["model"], path, _fmt_s(e["check_seconds"]), e["evaluations"], f"{e['eval_seconds'] * 1e6:.0f} us",
                     f"{e['efficiency']:.2f}"))
    parts.append("\n3. check efficiency = check time / (evaluations x one float64 evaluation)\n"
                 + _table(("model", "path", "check", "evaluations", "one eval", "efficiency"), rows))
    rows = [(t["model"], f"{t['forward_backward_seconds'] * 1e3:.2f} ms", f"{t['training_part_seconds'] * 1e3:.2f} ms",
             f"{t['ratio']:.2f}", ", ".join(t["verdicts"])) for t in result.get("training_part", [])]
    if rows:
        parts.append("\n3b. training part (live .grad vs the objective's gradient) against one forward+backward, correct twins\n"
                     + _table(("model", "forward+backward", "training part", "ratio", "verdicts"), rows))
    rows = [(o["model"], o["steps"], f"{o['median_step_seconds'] * 1e3:.2f} ms", f"{o['median_ratio']:.3f}x",
             f"{o['total_ratio']:.3f}x", o["checks"]) for o in result["training_overhead"]]
    parts.append("\n4. training overhead, GradWatch default config (ratio of median step times; total incl. checks)\n"
                 + _table(("model", "steps", "median step", "median ratio", "total ratio", "checks"), rows))
    if result.get("scaling"):
        rows = [(s["width"], s["n_params"], s["path"], f"{s['forward_seconds'] * 1e6:.0f} us", _fmt_s(s["check_seconds"]),
                 s["evaluations"], f"{s['check_over_forward']:.0f}") for s in result["scaling"]]
        parts.append("\n5. scaling at fixed sample size (MLP 64 -> w -> w -> 10, batch 64)\n"
                     + _table(("width", "params", "path", "forward", "check", "evaluations", "check / forward"), rows))
    rows = []
    for r in result.get("memory", []):
        plain, watched = r["plain"], r["watched"]
        if r.get("ratio") is None:
            rows.append((r.get("n_params"), "-", "-", "error: " + str(plain.get("error") or watched.get("error")), "-"))
            continue
        rows.append((f"{plain['n_params']:,}", f"{plain['peak_bytes'] / 2**20:.0f} MB", f"{watched['peak_bytes'] / 2**20:.0f} MB",
                     f"{r['ratio']:.3f}x", ", ".join(sorted(set(watched["forms"]))) or "-"))
    if rows:
        parts.append("\n6. peak memory, 7-layer MLP, batch 64, 3 SGD steps, without / with GradWatch(every=1) at default options\n"
                     + _table(("params", "without", "with", "ratio", "form"), rows))
    rows = [(r["model"], "buggy" if r["bug"] else "twin", "yes" if r["caught"] else "no", ", ".join(r["named_modules"]) or "-")
            for r in result.get("module_form", [])]
    if rows:
        parts.append("\n6b. the module form (form='module'): planted bugs caught and named\n"
                     + _table(("model", "case", "caught", "named"), rows))
    t = result.get("targets", {})
    if t:
        parts.append("\ntargets: " + ", ".join(f"{k}={_show(v)}" for k, v in t.items()))
    return "\n".join(parts)


def _show(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


# ============================================================================ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gradwatch bench``."""
    parser.add_argument("--quick", action="store_true", help="small models and few steps (for tests; well under a minute)")
    parser.add_argument("--out", metavar="FILE.json", default=None, help="write the result as JSON to this file")
    parser.add_argument("--models", metavar="NAMES", default=",".join(MODEL_NAMES),
                        help=f"comma-separated subset of {', '.join(MODEL_NAMES)} (default: all)")
    parser.add_argument("--time-cap", metavar="SECONDS", type=float, default=None,
                        help="time cap of each slow-mode gradcheck run (default 20; 2 with --quick)")
    parser.add_argument("--steps", metavar="N", type=int, default=None, help="training steps per model (default 300; 40 with --quick)")
    parser.add_argument("--repeats", metavar="N", type=int, default=None, help="repeats of each timed check (default 5; 3 with --quick)")
    parser.add_argument("--no-scaling", action="store_true", help="skip the scaling section")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory section (subprocesses)")
    parser.add_argument("--threads", metavar="N", type=int, default=None, help="torch threads (default: torch's choice)")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed flags; print the tables, write JSON. Returns the exit code."""
    models = [m.strip() for m in str(getattr(args, "models", None) or ",".join(MODEL_NAMES)).split(",") if m.strip()]
    unknown = [m for m in models if m not in MODEL_NAMES]
    if unknown:
        print(f"gradwatch bench: error: unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODEL_NAMES)}", file=sys.stderr)
        return 2
    if getattr(args, "threads", None):
        torch.set_num_threads(int(args.threads))
    quiet = logging.getLogger("gradwatch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the watched training run logs every check at INFO
    try:
        result = run_benchmark(models, quick=bool(getattr(args, "quick", False)), time_cap=getattr(args, "time_cap", None),
                               steps=getattr(args, "steps", None), repeats=getattr(args, "repeats", None),
                               scaling=not getattr(args, "no_scaling", False),
                               memory=not getattr(args, "no_memory", False),
                               progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
    finally:
        quiet.setLevel(level)
    cmd = ["gradwatch bench"] + (["--quick"] if result["meta"]["quick"] else [])
    if getattr(args, "models", None) and models != list(MODEL_NAMES):
        cmd.append(f"--models {','.join(models)}")
    result["meta"]["command"] = " ".join(cmd)
    print(format_result(result))
    out = getattr(args, "out", None)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(to_jsonable(result), fh, indent=2, allow_nan=False)
        print(f"\nwrote {out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python benchmarks/bench.py [flags]`` (the same as ``gradwatch bench [flags]`` in a source checkout)."""
    parser = argparse.ArgumentParser(prog="gradwatch bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
