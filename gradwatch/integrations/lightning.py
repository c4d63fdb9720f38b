"""Lightning adapter: :class:`GradWatchCallback`, a thin layer over :class:`gradwatch.GradWatch`.

The check runs in ``on_before_optimizer_step`` (gradients complete and
unscaled, not yet clipped, weights not yet updated; once per optimizer step
under gradient accumulation) on the batch kept from ``on_train_batch_start``.
Each micro-batch is handed to :meth:`GradWatch.accumulate` in
``on_after_backward``, so the training part compares ``.grad`` with the mean of
the objective's gradients over the step's micro-batches. Importing this module imports
``lightning``; ``import gradwatch`` alone never does.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Union

import torch

try:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.fabric.utilities.exceptions import MisconfigurationException
except ImportError as err:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "gradwatch.integrations.lightning needs the optional dependency 'lightning': "
        "pip install 'gradwatch[lightning]'"
    ) from err

from ..config import GradWatchConfig, load_config
from ..errors import ConfigError
from ..hook import GradWatch

LossFn = Callable[[LightningModule, Any], torch.Tensor]


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def silenced_logging(module: LightningModule) -> Iterator[None]:
    """Make ``self.log``/``self.log_dict`` no-ops on ``module`` for the duration."""
    had = {name: name in module.__dict__ for name in ("log", "log_dict")}
    saved = {name: module.__dict__.get(name) for name in had}
    module.log = _noop  # type: ignore[method-assign]
    module.log_dict = _noop  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, present in had.items():
            if present:
                setattr(module, name, saved[name])
            else:
                delattr(module, name)


def training_step_loss(module: LightningModule, batch: Any) -> torch.Tensor:
    """The loss ``training_step`` returns (a tensor, or the ``"loss"`` of a dict), with logging silenced.

    Example:
        >>> class M(LightningModule):
        ...     def __init__(self):
        ...         super().__init__(); self.lin = torch.nn.Linear(2, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         loss = self.lin(batch).pow(2).mean(); self.log("loss", loss); return {"loss": loss}
        >>> float(training_step_loss(M(), torch.zeros(3, 2)).detach()) >= 0
        True
    """
    with silenced_logging(module):
        out = module.training_step(batch, 0)
    if isinstance(out, dict):
        if "loss" not in out:
            raise ValueError(f"training_step returned a dict without 'loss' (keys: {sorted(out)}); pass loss_fn= to GradWatchCallback")
        out = out["loss"]
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"training_step returned {type(out).__name__}, not a loss tensor; pass loss_fn=(module, batch) -> loss "
            "to GradWatchCallback"
        )
    return out


@contextlib.contextmanager
def borrowed_trainer(module: LightningModule, live: LightningModule) -> Iterator[None]:
    """Give ``module`` (the float64 shadow copy of ``live``, made without a trainer) ``live``'s trainer for the duration.

    So a ``training_step`` that reads ``self.trainer``/``self.current_epoch`` works in a check.
    """
    if module is live or getattr(module, "_trainer", None) is not None or getattr(live, "_trainer", None) is None:
        yield
        return
    module.__dict__["_trainer"] = live._trainer
    try:
        yield
    finally:
        module.__dict__["_trainer"] = None


def check_loss_fn(loss_fn: LossFn, live: LightningModule) -> LossFn:
    """``loss_fn`` as a check runs it: ``self.log`` silenced, the live module's trainer reachable.

    The check evaluates ``loss_fn`` many times on a shadow copy of ``live``; logging from
    there would warn at every evaluation (the copy has no trainer) or log check values.
    """

    def loss_for_check(module: Any, batch: Any) -> torch.Tensor:
        if not isinstance(module, LightningModule):
            return loss_fn(module, batch)
        with silenced_logging(module), borrowed_trainer(module, live):
            return loss_fn(module, batch)

    loss_for_check.__wrapped__ = loss_fn  # type: ignore[attr-defined]
    return loss_for_check


class GradWatchCallback(Callback):
    """Watch a Lightning fit for wrong gradients.

    Args:
        loss_fn: ``loss_fn(pl_module, batch) -> scalar``; default: the loss returned by
            ``training_step``. ``self.log``/``self.log_dict`` are silenced during checks either way.
        config: Optional YAML file with GradWatch options; keyword options win.
        **options: Any :class:`~gradwatch.config.GradWatchConfig` option (``every``,
            ``coords``, ``raise_on``, ...) and ``on_alert``/``grad_fn``.

    Logs through the trainer's ``TensorBoardLogger`` (its writer, at
    ``trainer.global_step``; ``checks.jsonl`` in its ``log_dir``) when there is
    one, else to ``log_dir``. Its state is saved in checkpoints: a run resumed
    with ``ckpt_path=`` and a new callback continues the schedule, trends and
    coverage. Bad options raise ``MisconfigurationException`` naming the option.

    Example:
        >>> cb = GradWatchCallback(every=10, coords=4)
        >>> cb.config.every
        10
    """

    def __init__(self, loss_fn: Optional[LossFn] = None, *, config: Union[str, Path, None] = None, **options: Any) -> None:
        super().__init__()
        if loss_fn is not None and not callable(loss_fn):
            raise MisconfigurationException(
                f"GradWatchCallback: loss_fn must be callable loss_fn(pl_module, batch) -> loss, got {type(loss_fn).__name__}"
            )
        self.loss_fn = loss_fn if loss_fn is not None else training_step_loss
        self._objects = {k: options.pop(k) for k in ("on_alert", "grad_fn") if k in options}
        for key, value in self._objects.items():
            if value is not None and not callable(value):
                raise MisconfigurationException(f"GradWatchCallback: {key} must be callable, got {type(value).__name__}")
        self._config_path = config
        self._options = options
        self.config: Optional[GradWatchConfig] = None
        try:
            self.config = self._make_config()
        except (ConfigError, ValueError, TypeError) as err:
            raise MisconfigurationException(f"GradWatchCallback: {err}") from err
        self.watch: Optional[GradWatch] = None
        self._batch: Any = None
        self._pending_state: Optional[Dict[str, Any]] = None

    def _make_config(self) -> GradWatchConfig:
        base = load_config(self._config_path) if self._config_path is not None else GradWatchConfig()
        return base.replace(**self._options) if self._options else base

    @property
    def state_key(self) -> str:
        # Two callbacks watching different tensors or writing to different places keep separate state.
        return self._generate_state_key(tensors=self.config.tensors, log_dir=self.config.log_dir)

    # -- lifecycle -------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not callable(self.loss_fn):
            raise MisconfigurationException(f"GradWatchCallback: loss_fn must be callable, got {type(self.loss_fn).__name__}")
        if not any(p.requires_grad for p in pl_module.parameters()):
            raise MisconfigurationException(f"GradWatchCallback: {type(pl_module).__name__} has no trainable parameters to watch")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watch is not None:
            if not self.watch._closed and self.watch.model is pl_module:
                return
            # A second fit with this callback: its watch was closed at teardown; continue from its state.
            if self._pending_state is None:
                self._pending_state = self.watch.state_dict()
            self.watch.close()
            self.watch = None
        writer, log_dir = None, self.config.log_dir
        tb = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if tb is not None and trainer.is_global_zero:
            writer = tb.experiment
            log_dir = log_dir or tb.log_dir
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        try:
            self.watch = GradWatch(
                pl_module,
                check_loss_fn(self.loss_fn, pl_module),
                optimizer=optimizer,
                writer=writer,
                config=self.config.replace(log_dir=log_dir if trainer.is_global_zero else None),
                **self._objects,
            )
        except (ConfigError, ValueError, TypeError) as err:
            raise MisconfigurationException(f"GradWatchCallback: {err}") from err
        # training_step runs inside the precision plugin's context (autocast under "bf16-mixed"/"16-mixed"):
        # the training part replays it there too.
        self.watch.replay_context = trainer.precision_plugin.train_step_context
        self.watch.grad_scaler = getattr(trainer.precision_plugin, "scaler", None)  # "16-mixed": its GradScaler
        if self._pending_state is not None:
            self.watch.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = batch
        if self.watch is not None:
            self.watch.start_batch()  # training_step follows with no random draw in between: the replay starts here

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Every micro-batch (accumulate_grad_batches): the training part averages their gradients, as Lightning does.
        if self.watch is not None and self._batch is not None:
            self.watch.accumulate(self._batch)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer) -> None:
        # Before gradient clipping, after Lightning's AMP unscaling: .grad is the gradient of the training loss.
        if self.watch is None or self._batch is None:
            return
        self.watch.step(self._batch, global_step=trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watch is not None:
            self.watch.sinks.flush()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self.watch is not None:
            self.watch.close()

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        if self.watch is not None:
            return self.watch.state_dict()
        return dict(self._pending_state or {})

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.watch is not None:
            self.watch.load_state_dict(state_dict)
        else:
            self._pending_state = dict(state_dict)
