"""The ``gradwatch demo`` story: data, model, a custom activation with a latent bug, and the training loop.

A small classifier learns three interleaved 2-D spirals (generated here,
deterministically: no download). The network has BatchNorm, dropout, an L2
term in the loss (passed to :class:`~gradwatch.GradWatch` as
``regularizers``) and SGD weight decay (coupled, so it joins the check
objective through ``optimizer=``). Its first activation is a hand-written
``torch.autograd.Function`` (SiLU, ``x * sigmoid(x)``) whose backward is
chosen by ``bug``:

- ``"late"``: right for ``|x| < 3``, wrong beyond (it forgets the
  ``x * s * (1 - s)`` term). Small weights keep the activation's inputs
  below 3, so early checks pass. At ``grow_at`` (half-way by default) the
  first layer's weights are multiplied by ``grow_factor``: the weights grow,
  as they do in long runs, the inputs cross 3 and the gradients of the
  tensors feeding the activation (``fc1.weight``, ``fc1.bias``) go wrong.
- ``"scale"``: off by a constant factor (1.5) from the first step.
- ``"none"``: correct.
- ``"missing-l2"``: the activation is correct, but the training loop has two
  slips the training part of a check catches: its loss adds an L2 term
  (``0.05 * ||p||^2``) that the watch's objective lacks, and it multiplies
  ``fc1.weight.grad`` by 3 after ``backward()`` (a loss-scaling slip).

This module does no argument parsing and prints nothing: :func:`run_demo`
reports progress through callbacks and returns a :class:`DemoResult`;
:mod:`gradwatch.cli.commands` does the talking.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gradwatch.check.judging.report import CheckReport
from gradwatch.check.objective.terms import Regularizer, parse_regularizers
from gradwatch.config import GradWatchConfig
from gradwatch.errors import GradientDriftError
from gradwatch.watch.gradwatch import GradWatch
from gradwatch.watch.trend import Alert

#: The stories ``--bug`` can tell.
BUGS = ("late", "none", "scale", "missing-l2")
#: Stories whose bug is in the training loop, not in the activation's backward.
TRAINING_BUGS = ("missing-l2",)
#: ``bug="missing-l2"``: the coefficient of the L2 term only the training loss has.
MISSING_L2 = 0.05
#: ``bug="missing-l2"``: the factor training applies to ``fc1.weight.grad`` after backward.
GRAD_FACTOR = 3.0
#: ``bug="late"``: the backward is wrong where ``|x| >=`` this.
LATE_THRESHOLD = 3.0
#: ``bug="scale"``: the backward is this many times the true derivative.
SCALE_FACTOR = 1.5

#: GradWatch options of the demo; ``--config`` and option flags override them.
DEMO_OPTIONS: Dict[str, Any] = {
    "every": 10,
    "coords": 8,
    "directions": 4,
    "regularizers": {"l2": 1e-5},
}


# --------------------------------------------------------------------- data

def make_spirals(points_per_class: int = 200, classes: int = 3, noise: float = 0.2, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Interleaved 2-D spirals, one arm per class (the CS231n toy set), deterministic in ``seed``.

    Returns:
        ``(x, y)``: float32 ``(classes * points_per_class, 2)`` points with radius in ``[0, 1]``
        and int64 labels.

    Example:
        >>> x, y = make_spirals(10, seed=0)
        >>> tuple(x.shape), sorted(set(y.tolist()))
        ((30, 2), [0, 1, 2])
    """
    rng = np.random.RandomState(seed)
    xs, ys = [], []
    for label in range(classes):
        r = np.linspace(0.0, 1.0, points_per_class)
        t = np.linspace(label * 4.0, (label + 1) * 4.0, points_per_class) + rng.randn(points_per_class) * noise
        xs.append(np.stack([r * np.sin(t), r * np.cos(t)], axis=1))
        ys.append(np.full(points_per_class, label))
    x = torch.from_numpy(np.concatenate(xs).astype(np.float32))
    y = torch.from_numpy(np.concatenate(ys).astype(np.int64))
    return x, y


# --------------------------------------------------------------------- the activation

class SiLUFunction(torch.autograd.Function):
    """``x * sigmoid(x)`` with a hand-written backward, correct or buggy (see the module docstring).

    Example:
        >>> x = torch.tensor([1.0, 4.0], requires_grad=True)
        >>> SiLUFunction.apply(x, "late").sum().backward()
        >>> [round(v, 3) for v in x.grad.tolist()]  # right at 1, wrong at 4 (true value 1.053)
        [0.928, 0.982]
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bug: str = "none") -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.bug = bug
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        d = s + x * s * (1 - s)
        if ctx.bug == "late":
            d = torch.where(x.abs() < LATE_THRESHOLD, d, s)  # the bug: forgets x*s*(1-s) beyond |x| = 3
        elif ctx.bug == "scale":
            d = d * SCALE_FACTOR  # the bug: a stray constant factor
        return grad * d, None


class CustomSiLU(nn.Module):
    """Module wrapper of :class:`SiLUFunction`; remembers the largest ``|x|`` of its last input."""

    def __init__(self, bug: str = "none") -> None:
        super().__init__()
        if bug not in BUGS:
            raise ValueError(f"bug: got {bug!r}, expected one of {', '.join(BUGS)}")
        self.bug = bug
        self.last_max_abs_input = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_max_abs_input = float(x.detach().abs().max()) if x.numel() else 0.0
        return SiLUFunction.apply(x, self.bug)

    def extra_repr(self) -> str:
        return f"bug={self.bug!r}"


class SpiralNet(nn.Module):
    """``fc1 -> CustomSiLU -> fc2 -> BatchNorm -> tanh -> dropout -> out``.

    Only ``fc1.weight`` and ``fc1.bias`` sit upstream of the custom
    activation, so only their gradients can be hurt by its backward.

    Example:
        >>> [n for n, _ in SpiralNet(hidden=4).named_parameters()][:3]
        ['fc1.weight', 'fc1.bias', 'fc2.weight']
    """

    def __init__(self, hidden: int = 64, classes: int = 3, dropout: float = 0.1, bug: str = "none") -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, hidden)
        self.act = CustomSiLU("none" if bug in TRAINING_BUGS else bug)
        self.fc2 = nn.Linear(hidden, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        h = self.drop(torch.tanh(self.bn(self.fc2(h))))
        return self.out(h)


def cross_entropy(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The data loss: ``loss_fn(model, batch)`` as GradWatch expects it."""
    x, y = batch
    return F.cross_entropy(model(x), y)


# --------------------------------------------------------------------- the run

@dataclass
class DemoSettings:
    """Everything about the demo's training run that is not a GradWatch option.

    Attributes:
        bug: ``"late"``, ``"scale"``, ``"none"`` or ``"missing-l2"``.
        steps: Optimizer steps.
        seed: Seeds the data, the initialization and the batches.
        grow_at: Step at which the first layer's weights are multiplied by
            ``grow_factor`` ("weights grow"); None: ``steps // 2``; a negative value: never.
    """

    bug: str = "late"
    steps: int = 200
    seed: int = 0
    batch_size: int = 128
    hidden: int = 64
    points_per_class: int = 200
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 1e-4
    dropout: float = 0.1
    grow_at: Optional[int] = None
    grow_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.bug not in BUGS:
            raise ValueError(f"bug: got {self.bug!r}, expected one of {', '.join(BUGS)}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps: got {self.steps!r}, expected an integer >= 1")
        if self.grow_at is None:
            self.grow_at = self.steps // 2


@dataclass
class CheckEvent:
    """One GradWatch check during the demo (given to ``on_check``)."""

    step: int
    loss: float
    accuracy: float
    max_abs_input: float
    report: Optional[CheckReport]  # None when the check raised, or raise_on stopped the run at it
    alerts: List[Alert]
    index: int  # 0 for the first check
    stopped: bool = False  # raise_on matched: training stops here


@dataclass
class GrowEvent:
    """The "weights grow" moment (given to ``on_grow``)."""

    step: int
    factor: float
    tensors: List[str]
    max_abs_before: float
    max_abs_after: float


@dataclass
class DemoResult:
    """What :func:`run_demo` hands back."""

    watch: GradWatch
    steps: int
    seconds: float
    final_loss: float
    final_accuracy: float
    checks: int
    alerts: List[Alert] = field(default_factory=list)
    stopped_early: Optional[BaseException] = None


def demo_config(overrides: Optional[Dict[str, Any]] = None, base: Optional[GradWatchConfig] = None) -> GradWatchConfig:
    """The demo's GradWatch config: :data:`DEMO_OPTIONS` over ``base`` (default options), then ``overrides``.

    Example:
        >>> cfg = demo_config({"coords": 4})
        >>> cfg.every, cfg.coords, cfg.regularizers
        (10, 4, {'l2': 1e-05})
    """
    cfg = (base or GradWatchConfig()).replace(**DEMO_OPTIONS)
    return cfg.replace(**overrides) if overrides else cfg


@torch.no_grad()
def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was = model.training
    model.eval()
    try:
        return float((model(x).argmax(1) == y).float().mean())
    finally:
        model.train(was)


@torch.no_grad()
def _max_abs_preactivation(model: SpiralNet, x: torch.Tensor) -> float:
    return float(model.fc1(x).abs().max())


def _grow_weights(model: SpiralNet, step: int, factor: float, x_all: torch.Tensor,
                  on_grow: Optional[Callable[[GrowEvent], None]]) -> None:
    """The "weights grow" moment: multiply the first layer's weights by ``factor`` and tell ``on_grow``."""
    before = _max_abs_preactivation(model, x_all)
    with torch.no_grad():
        model.fc1.weight.mul_(factor)
        model.fc1.bias.mul_(factor)
    if on_grow is not None:
        on_grow(GrowEvent(step, factor, ["fc1.weight", "fc1.bias"], before, _max_abs_preactivation(model, x_all)))


def _loss_and_backward(model: SpiralNet, batch: Tuple[torch.Tensor, torch.Tensor], regularizers: Mapping[str, Regularizer],
                       bug: str) -> Tuple[torch.Tensor, float]:
    """One step's training loss and its backward, with the story's training-loop slips.

    Returns:
        ``(loss, max_abs)``: the loss (data loss plus regularizers) and the largest ``|x|`` the custom
        activation saw in the forward.
    """
    loss = cross_entropy(model, batch)
    max_abs = model.act.last_max_abs_input
    for reg in regularizers.values():
        loss = loss + reg(model)
    if bug == "missing-l2":  # slip 1: an L2 term the watch's objective lacks
        loss = loss + MISSING_L2 * sum(p.pow(2).sum() for p in model.parameters())
    loss.backward()
    grad = model.fc1.weight.grad
    if bug == "missing-l2" and grad is not None:  # slip 2: a loss-scaling slip on one gradient
        grad.mul_(GRAD_FACTOR)
    return loss, max_abs


def run_demo(
    settings: DemoSettings,
    config: GradWatchConfig,
    *,
    on_check: Optional[Callable[[CheckEvent], None]] = None,
    on_grow: Optional[Callable[[GrowEvent], None]] = None,
) -> DemoResult:
    """Train :class:`SpiralNet` on the spirals under a :class:`~gradwatch.GradWatch` built from ``config``.

    The training loss is the cross-entropy plus ``config.regularizers`` (the
    same terms GradWatch adds to its check objective); SGD applies coupled
    weight decay, which GradWatch reads from the optimizer. The
    :class:`~gradwatch.GradWatch` is closed before returning. A
    :class:`~gradwatch.GradientDriftError` (``raise_on``) stops training and
    is returned in ``stopped_early``.

    Example:
        >>> res = run_demo(DemoSettings(bug="none", steps=3), demo_config({"every": 1, "jsonl": False,
        ...                                                                "tensorboard": False}))
        >>> res.checks, res.alerts
        (3, [])
    """
    start = time.perf_counter()
    torch.manual_seed(settings.seed)
    x_all, y_all = make_spirals(settings.points_per_class, seed=settings.seed)
    model = SpiralNet(settings.hidden, dropout=settings.dropout, bug=settings.bug)
    opt = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay)
    regularizers = parse_regularizers(config.regularizers)
    batches = torch.Generator().manual_seed(settings.seed)
    watch = GradWatch(model, cross_entropy, optimizer=opt, config=config)
    loss_value, checks, stopped = math.nan, 0, None
    try:
        for step in range(settings.steps):
            if step == settings.grow_at and settings.grow_factor != 1.0:
                _grow_weights(model, step, settings.grow_factor, x_all, on_grow)
            idx = torch.randint(0, x_all.shape[0], (settings.batch_size,), generator=batches)
            batch = (x_all[idx], y_all[idx])
            opt.zero_grad()
            loss, max_abs = _loss_and_backward(model, batch, regularizers, settings.bug)
            loss_value = float(loss.detach())
            seen = len(watch.alerts)
            try:
                report = watch.step(batch, global_step=step, loss=loss)
            except GradientDriftError as err:  # raise_on matched: the alerts are logged, training stops
                stopped = err
                checks += 1
                if on_check is not None:
                    on_check(CheckEvent(step, loss_value, _accuracy(model, x_all, y_all), max_abs, None,
                                        list(watch.alerts[seen:]), checks - 1, stopped=True))
                break
            if report is not None or len(watch.alerts) > seen:  # a check ran (or raised: an "error" alert)
                checks += 1
                if on_check is not None:
                    on_check(CheckEvent(step, loss_value, _accuracy(model, x_all, y_all), max_abs, report,
                                        list(watch.alerts[seen:]), checks - 1))
            opt.step()
    finally:
        watch.close()
    return DemoResult(
        watch=watch,
        steps=settings.steps,
        seconds=time.perf_counter() - start,
        final_loss=loss_value,
        final_accuracy=_accuracy(model, x_all, y_all),
        checks=checks,
        alerts=list(watch.alerts),
        stopped_early=stopped,
    )
