"""Hugging Face adapter: :class:`GradWatchCallback` for ``transformers.Trainer``, a thin layer over :class:`gradwatch.GradWatch`.

What the Trainer does not hand a callback, the callback finds itself:

- **The batch.** Callbacks never receive it; a forward pre-hook on the model keeps the
  inputs of the latest training forward (under gradient accumulation: the last
  micro-batch of the optimizer step). The check objective is the model's loss on them
  (:class:`TrainerLoss`: ``outputs.loss``, without the Trainer's ``num_items_in_batch``), or
  ``loss_fn(model, inputs)``. A Trainer subclass that overrides ``compute_loss`` (TRL's trainers) is
  checked on that ``compute_loss``, on the inputs it was given (:mod:`gradwatch.integrations.hf_loss`);
  the training verdict weighs the step's micro-batches and ranks by their share of its items
  (:mod:`gradwatch.parallel.step_objective`), so the Trainer's own scaling is judged, not copied.
- **Once per optimizer step.** The check runs in ``on_pre_optimizer_step`` at
  ``state.global_step``, after all micro-batches of the step.
- **Clipping.** The Trainer clips ``.grad`` (``max_grad_norm``, on by default) right after
  the last backward, before any callback runs. When clipping is on and a check is due,
  the gradients are copied at the end of that backward (an autograd callback queued after
  DDP's and FSDP's own, so the copy holds the reduced gradients) and put
  back in ``.grad`` for the duration of the check, so the check reads them as backprop
  left them; the clipped tensors are restored untouched before the optimizer steps.
- **Reporting.** With ``report_to`` including TensorBoard, the check scalars, the
  custom-scalars layout and the alert text go through the ``TensorBoardCallback``'s
  writer (its ``logging_dir``); every other reporting integration (wandb, MLflow, ...)
  gets the scalars through its ``on_log``. ``checks.jsonl`` goes next to the TensorBoard
  events, else to ``args.logging_dir`` or ``args.output_dir``.
- **Checkpoints.** The watch state is written as ``gradwatch_state.json`` in each
  ``checkpoint-N`` folder and read back on ``train(resume_from_checkpoint=...)``: the
  schedule, trends, coverage and run id go on, so ``gradwatch report OUTPUT_DIR`` reads
  one run.
- **Ranks.** Every rank checks (see :mod:`gradwatch.parallel.coordinator`); files, reporting and the
  state file are written on the world's process zero only.
- **DeepSpeed.** With ``TrainingArguments(deepspeed=...)`` the watch is given the engine (ZeRO's partitions are
  read through :mod:`gradwatch.parallel.zero`). Accelerate runs ``engine.backward`` and ``engine.step`` in one call,
  before any callback, and DeepSpeed clips inside ``engine.step``: the check runs at the start of the engine's
  ``step`` at the accumulation boundary (a wrapper set on the engine for the run), where ZeRO's gradients are the
  step's, unclipped; ``on_pre_optimizer_step`` then does nothing.

The Trainer is not passed to callbacks either: it is found once, in ``on_train_begin``,
as the caller of the callback handler (for its reporting callbacks and the checkpoint it
resumes from). Importing this module imports ``transformers``; ``import gradwatch`` alone never does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

try:
    import transformers
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "gradwatch.integrations.transformers needs the optional dependency 'transformers': "
        "pip install 'gradwatch[hf]'"
    ) from err

from gradwatch.config import GradWatchConfig, resolve_config
from gradwatch.errors import ConfigError, GradWatchError, ObjectiveError, say
from gradwatch.integrations.hf_loss import (
    ComputeLoss,
    batch_keys,
    capture_inputs,
    forward_failed,
    output_keys,
    overrides_compute_loss,
    pops_labels,
    trainer_kept,
)
from gradwatch.integrations.pre_clip import PreClip
from gradwatch.io.records import ALERTS_COUNT_TAG, scalars_from_check
from gradwatch.io.sinks import Sink
from gradwatch.parallel.zero import is_engine
from gradwatch.watch.gradwatch import GradWatch

logger = logging.getLogger("gradwatch")

#: Runs callbacks at the end of a backward (after the strategy's own, when queued from one of them).
_ENGINE = torch.autograd.Variable._execution_engine

#: File holding the watch state in each ``checkpoint-N`` folder.
STATE_NAME = "gradwatch_state.json"

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class ModelCall:
    """The positional and keyword inputs of one model call (when there are positional ones).

    Example:
        >>> ModelCall((1,), {"a": 2}).kwargs
        {'a': 2}
    """

    def __init__(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss a Hugging Face model returns for ``batch`` (the inputs the Trainer passed it).

    Example:
        >>> class M(nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.lin = nn.Linear(2, 1)
        ...     def forward(self, x, labels=None):
        ...         return {"loss": (self.lin(x).squeeze(-1) - labels).pow(2).mean()}
        >>> float(model_loss(M(), {"x": torch.zeros(3, 2), "labels": torch.zeros(3)}).detach()) >= 0
        True
    """
    try:
        if isinstance(batch, ModelCall):
            out = model(*batch.args, **batch.kwargs)
        elif isinstance(batch, Mapping):
            out = model(**batch)
        else:
            out = model(batch)
    except Exception as err:  # the model's own forward on the check's copy: said in the model's and batch's terms
        if not isinstance(err, GradWatchError):
            say(err, forward_failed(f"{type(model).__name__}'s forward", model, batch, err))
        raise
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if not isinstance(loss, torch.Tensor):
        keys = batch_keys(batch)
        labelled = keys is not None and any("label" in k for k in keys)
        why = (f"its output has no loss (fields: {', '.join(output_keys(out))}) although the batch has labels"
               if labelled else f"the batch has no labels (keys: {', '.join(keys or ['?'])}): the model computes its "
               "loss only when it is given labels")
        raise ObjectiveError(f"{type(model).__name__} returned no loss on the watched batch", why,
                             "give the batch labels, or pass GradWatchCallback(loss_fn=(model, inputs) -> loss) "
                             "computing the loss training computes")
    return loss


class ReportingSink(Sink):
    """Sends each check's scalars to Trainer reporting callbacks (wandb, MLflow, ...) through their ``on_log``.

    Example:
        >>> class Printer:  # any reporting callback
        ...     def on_log(self, args, state, control, logs=None):
        ...         print(sorted(logs))
        >>> sink = ReportingSink([Printer()], lambda: (None, None, None))
        >>> sink.write_check({"step": 0, "tensors": {"w": {"rel_diff": 1e-9}}, "summary": {}}, 0)
        ['gradwatch/alerts/count', 'gradwatch/rel_diff/w']
    """

    def __init__(self, callbacks: List[Any], context: Callable[[], Tuple[Any, Any, Any]]) -> None:
        self.callbacks = callbacks
        self._context = context  # () -> (args, state, control) of the running Trainer

    def write_check(self, record: Mapping[str, Any], alert_count: int) -> None:
        logs = dict(scalars_from_check(record))
        logs[ALERTS_COUNT_TAG] = float(alert_count)
        args, state, control = self._context()
        for cb in self.callbacks:
            cb.on_log(args, state, control, logs=dict(logs))

    def __repr__(self) -> str:
        return f"ReportingSink({[type(cb).__name__ for cb in self.callbacks]})"


class TrainerLoss:
    """The default objective: the model's own ``loss`` for one micro-batch (:func:`model_loss`).

    The callback captures the model's inputs without the Trainer's ``num_items_in_batch`` (its forward
    pre-hook leaves it out), so a model that takes it computes the mean over the micro-batch's own items
    here; the step's objective then weighs each micro-batch (and rank) by its share of the step's items
    (:mod:`gradwatch.parallel.step_objective`): how the Trainer scales each micro-batch is what is judged,
    not reproduced.

    Example:
        >>> class M(nn.Module):
        ...     def forward(self, x, labels=None, num_items_in_batch=None):
        ...         return {"loss": (x - labels).pow(2).sum() / (num_items_in_batch or x.numel())}
        >>> float(TrainerLoss()(M(), {"x": torch.ones(3), "labels": torch.zeros(3)}))
        1.0
    """

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return model_loss(model, batch)

    def __repr__(self) -> str:
        return "TrainerLoss()"


def _find_trainer() -> Tuple[Any, Optional[Union[str, os.PathLike]]]:
    """The ``transformers.Trainer`` up the call stack, and its ``resume_from_checkpoint`` there."""
    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(12):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            break
        obj = frame.f_locals.get("self")
        if isinstance(obj, transformers.Trainer):
            resume = frame.f_locals.get("resume_from_checkpoint")
            return obj, resume if isinstance(resume, (str, os.PathLike)) else None
    return None, None


class GradWatchCallback(TrainerCallback):
    """Watch a Hugging Face ``Trainer`` run for wrong gradients.

    Args:
        loss_fn: ``loss_fn(model, inputs) -> scalar`` on the inputs the Trainer passed the
            model (without its ``num_items_in_batch``: the loss of that micro-batch alone); default: the
            ``loss`` the model returns (the batch needs labels), or, under a Trainer that overrides
            ``compute_loss``, that ``compute_loss`` on its inputs (:class:`~gradwatch.integrations.hf_loss.ComputeLoss`).
        config: The watch's configuration, as :class:`~gradwatch.GradWatch` takes it: a
            :class:`~gradwatch.config.GradWatchConfig` or the path of a YAML config; keyword options override it.
        **options: Any :class:`~gradwatch.config.GradWatchConfig` option (``every``, ``coords``, ``raise_on``,
            ...), flat or in its group (``schedule={"every": 50}``), and ``on_alert``/``grad_fn``.

    ``callback.watch`` is the :class:`~gradwatch.GradWatch` it drives (from the start of
    training). Bad options raise ``ValueError`` naming the option. See the module
    docstring for where it checks, logs and keeps its state.

    Example:
        >>> cb = GradWatchCallback(every=10, coords=4)
        >>> cb.config.every, cb.watch
        (10, None)
    """

    def __init__(self, loss_fn: Optional[LossFn] = None, *, config: Union[GradWatchConfig, str, os.PathLike, None] = None,
                 **options: Any) -> None:
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"GradWatchCallback: loss_fn must be callable loss_fn(model, inputs) -> loss, got {type(loss_fn).__name__}")
        self.loss_fn: LossFn = loss_fn if loss_fn is not None else TrainerLoss()
        self._default_loss = loss_fn is None
        self._objects = {k: options.pop(k) for k in ("on_alert", "grad_fn") if k in options}
        for key, value in self._objects.items():
            if value is not None and not callable(value):
                raise ValueError(f"GradWatchCallback: {key} must be callable, got {type(value).__name__}")
        try:
            self.config: GradWatchConfig = resolve_config(config, options)
        except ConfigError as err:
            raise ValueError(f"GradWatchCallback: {err}") from err
        self.watch: Optional[GradWatch] = None
        self._model: Optional[nn.Module] = None
        self._batch: Any = None
        self._hooks: List[Any] = []
        self._checking = False
        self._snapshot_wanted = False
        self._accumulated = False  # micro-batches of this step given to the watch before its last
        self._pre_clip: Optional[List[Tuple[nn.Parameter, torch.Tensor]]] = None
        self._context: Tuple[Any, Any, Any] = (None, None, None)
        self._step_args: Optional[Tuple[Any, Any, Any]] = None  # (args, state, control) of the step (DeepSpeed)
        self._engine: Any = None  # DeepSpeed's engine, whose step() runs the check
        self._trainer: Any = None
        self._uncapture: Optional[Callable[[], None]] = None  # takes the compute_loss wrapper off the trainer

    # -- lifecycle -------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Optional[nn.Module] = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        trainer, resume = _find_trainer()
        pending = None
        if self.watch is not None:  # a second train() with this callback: go on from its state
            pending = self.watch.state_dict()
            self._close()
        if resume is not None and (Path(resume) / STATE_NAME).is_file():
            pending = json.loads((Path(resume) / STATE_NAME).read_text(encoding="utf-8"))
        if model is None:
            raise ValueError("GradWatchCallback: the Trainer passed no model to on_train_begin")
        zero = bool(state.is_world_process_zero)
        reporters = [cb for cb in (trainer.callback_handler.callbacks if trainer is not None else [])
                     if type(cb).__module__.startswith("transformers.integrations") and hasattr(cb, "on_log")]
        tb = next((cb for cb in reporters if type(cb).__name__ == "TensorBoardCallback"), None)
        writer = getattr(tb, "tb_writer", None) if zero and self.config.tensorboard else None
        log_dir = (self.config.log_dir or (getattr(tb, "logging_dir", None) if writer is not None else None)
                   or getattr(args, "logging_dir", None) or args.output_dir)
        tensorboard = self.config.tensorboard and (writer is not None or self.config.log_dir is not None)
        self._model, self._trainer = model, trainer
        loss_fn = self.loss_fn
        if self._default_loss and trainer is not None and (overrides_compute_loss(trainer, transformers.Trainer)
                                                             or pops_labels(trainer)):
            # TRL's trainers and other subclasses computing their own loss, and a Trainer that takes the labels out of
            # the model's inputs to compute the loss itself (label smoothing, compute_loss_func): the check's objective
            # is that loss, on the inputs compute_loss was given (captured there, not at the model's forward)
            loss_fn = ComputeLoss(trainer)
            self._uncapture = capture_inputs(trainer, self._keep_inputs)
        wrapped = getattr(trainer, "model_wrapped", None)
        self._engine = wrapped if is_engine(wrapped) and getattr(wrapped, "module", None) is model else None
        self.watch = GradWatch(
            self._engine if self._engine is not None else model, loss_fn,
            optimizer=getattr(optimizer, "optimizer", optimizer), writer=writer,
            config=self.config.replace(log_dir=log_dir if zero else None, tensorboard=tensorboard), **self._objects,
        )
        others = [cb for cb in reporters if cb is not tb or writer is None and self.config.tensorboard]
        if zero and others:
            self.watch.sinks.add(ReportingSink(others, lambda: self._context))
        if pending is not None:
            self.watch.load_state_dict(pending)
        self.watch.update.asked = float(getattr(args, "max_grad_norm", 0) or 0)  # the clipping the step is judged by
        self._hooks.append(model.register_forward_pre_hook(self._capture_hook(), with_kwargs=True))
        if self._engine is not None:
            self._check_in_engine_step(self._engine)
        elif getattr(args, "max_grad_norm", 0) and args.max_grad_norm > 0:
            self._hooks.append(model.register_forward_hook(self._pre_clip_hook()))

    def _check_in_engine_step(self, engine: Any) -> None:
        """DeepSpeed: the check runs at the start of ``engine.step()`` at the accumulation boundary (between
        ``engine.backward`` and the step, which accelerate calls together); the wrapper goes at :meth:`_close`."""
        original = engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if self._step_args is not None and engine.is_gradient_accumulation_boundary():
                self._check(*self._step_args)
            return original(*args, **kwargs)

        engine.__dict__["step"] = step  # an instance attribute: the engine's own method is untouched

        class _Unwrap:
            def remove(self) -> None:
                engine.__dict__.pop("step", None)

        self._hooks.append(_Unwrap())

    def _keep_inputs(self, model: nn.Module, inputs: Any) -> None:
        """``compute_loss``'s inputs, under a trainer computing its own loss (:class:`ComputeLoss`)."""
        if model.training and torch.is_grad_enabled() and not self._checking and isinstance(inputs, Mapping):
            self._batch = dict(inputs)

    def _capture_hook(self) -> Callable[..., None]:
        # A plain function, not a bound method: copy.deepcopy (the check's shadow model) keeps functions as they are.
        def capture(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
            if self._uncapture is not None:
                return  # the batch is compute_loss's inputs (_keep_inputs)
            if module is self._model and module.training and torch.is_grad_enabled() and not self._checking:
                # Without the Trainer's num_items_in_batch: a loss_fn gets its batch's own loss, and the step's
                # objective weighs the micro-batches by their items (gradwatch.parallel.step_objective).
                inputs = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
                self._batch = ModelCall(tuple(args), inputs) if args else inputs

        capture._gradwatch_hook = True  # type: ignore[attr-defined]  # gradwatch's own: it ignores check forwards
        return capture

    def _pre_clip_hook(self) -> Callable[..., None]:
        def after_forward(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
            if module is not self._model or not self._snapshot_wanted or self._checking or not torch.is_grad_enabled():
                return
            queued = [False]

            def queue(grad: torch.Tensor) -> None:
                if not queued[0]:  # once per backward, from whichever output it runs through first
                    queued[0] = True
                    _ENGINE.queue_callback(after_backward)

            # Every output needing a gradient: the loss the Trainer backpropagates need not be the model's ``loss``
            # (TRL's SFTTrainer sums the ``log_probs`` of its fused LM head itself).
            for tensor in _grad_tensors(output):
                tensor.register_hook(queue)

        def after_backward() -> None:
            # DDP and FSDP queue the callback that writes their reduced gradients into .grad during the backward,
            # after this one (queued at its start): queued again, the snapshot runs after theirs.
            _ENGINE.queue_callback(snapshot)

        def snapshot() -> None:  # the backward and the strategy's reduction have finished; nothing clipped yet
            model = self._model
            if model is not None:
                self._pre_clip = [(p, p.grad.detach().clone()) for p in model.parameters() if p.grad is not None]

        after_forward._gradwatch_hook = True  # type: ignore[attr-defined]
        return after_forward

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        watch = self.watch
        self._pre_clip = None
        self._step_args = (args, state, control)
        self._snapshot_wanted = bool(
            watch is not None and watch.paused is None and len(self._hooks) > 1
            and (watch.dist is not None or watch.schedule.due(int(state.global_step)))
        )

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A micro-batch that is not the step's last: its backward is done; the watch keeps it."""
        if self.watch is not None and self._batch is not None and not self._checking:
            self.watch.accumulate(self._batch)
            self._accumulated = True

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._engine is None:  # DeepSpeed: checked in the engine's step, before it (_check_in_engine_step)
            self._check(args, state, control)

    def _check(self, args: Any, state: Any, control: Any) -> None:
        """The step's check: ``.grad`` as backprop left it (before clipping), every micro-batch handed to the watch."""
        if self.watch is None or self._batch is None or self._checking:
            return
        self._context = (args, state, control)
        swapped = [(p, p.grad) for p, _ in self._pre_clip or ()]
        held = PreClip(self._pre_clip or ())
        self._pre_clip = None
        self._checking = True
        try:
            held.fold()  # the copies written into the clipped tensors where one factor gives their bits back after
            for p, grad in held.pairs:
                p.grad = grad  # the check reads .grad as backprop left it, before the Trainer clipped it
            batch = self._batch
            if self._accumulated:  # every micro-batch of the step given to the watch, this last one too
                self.watch.accumulate(batch)
                batch = None
            if isinstance(self.watch.loss_fn, ComputeLoss):
                self.watch.loss_fn.new_check()
            with trainer_kept(self._trainer) if self._trainer is not None else contextlib.nullcontext():
                self.watch.step(batch, global_step=int(state.global_step))
        finally:
            for p, clipped in swapped:
                p.grad = clipped  # the very tensors the optimizer would have stepped with
            held.restore()  # and their clipped bits
            self._checking = False
            self._accumulated = False

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is None or not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            (folder / STATE_NAME).write_text(json.dumps(self.watch.state_dict(), allow_nan=False), encoding="utf-8")
        else:
            logger.debug("gradwatch: no checkpoint folder %s to save the watch state in", folder)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is not None:
            self._context = (args, state, control)
            self._close()

    def _close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._uncapture is not None:
            self._uncapture()
            self._uncapture = None
        self._batch = None
        self._pre_clip = None
        self._step_args = self._engine = None
        if self.watch is not None:
            self.watch.close()


def _grad_tensors(output: Any) -> List[torch.Tensor]:
    """The tensors of a model output that need a gradient: its values (a mapping, a ``ModelOutput``, a sequence) or itself.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> [t.shape for t in _grad_tensors({"loss": w.sum(), "logits": w * 2, "n": torch.ones(1)})]
        [torch.Size([]), torch.Size([2])]
    """
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else [output]
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
