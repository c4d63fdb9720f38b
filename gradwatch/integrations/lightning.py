"""Lightning adapter: :class:`GradWatchCallback`, a thin layer over :class:`gradwatch.GradWatch`.

The check runs in ``on_before_optimizer_step`` (gradients complete, weights
not yet updated; once per optimizer step under gradient accumulation, once per
batch under manual optimization) on the batch kept from
``on_train_batch_start``. While it runs, the trainer's optimizers refuse
``step()``/``zero_grad()``, and afterwards ``global_step``, the live weights,
their ``.grad`` and ``requires_grad`` are compared with their state before: a
check objective that would change training pauses the watch instead.
Scalars go through every logger of the trainer (``log_metrics``);
``checks.jsonl`` goes to ``trainer.log_dir``. Under automatic optimization each
micro-batch is handed to :meth:`GradWatch.accumulate` in ``on_after_backward``, so the
training part compares ``.grad`` (unscaled, not yet clipped) with the mean of the
objective's gradients over the step's micro-batches. Under manual optimization
with one ``loss_fn`` the training part is off (one objective cannot stand for what
several optimizers apply); with ``loss_fn={optimizer_index: loss_fn}`` each
optimizer's parameters get their own watch, checked when that optimizer steps,
with both verdicts against their own objective (a GAN's critic and generator).
Importing this module imports ``lightning``; ``import gradwatch`` alone never does.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union, cast

import torch
from torch import nn

try:
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import Logger, TensorBoardLogger
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError as err:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "gradwatch.integrations.lightning needs the optional dependency 'lightning': "
        "pip install 'gradwatch[lightning]'"
    ) from err

from gradwatch.config import GradWatchConfig, resolve_config
from gradwatch.errors import ConfigError, GradWatchError, ObjectiveError, blame
from gradwatch.io.records import ALERTS_COUNT_TAG, scalars_from_check
from gradwatch.io.sinks import JsonlSink, Sink, TensorBoardSink
from gradwatch.watch.gradwatch import GradWatch

LossFn = Callable[[LightningModule, Any], torch.Tensor]
#: ``loss_fn`` as the callback takes it: one objective, or one per optimizer index (manual optimization).
LossFns = Union[LossFn, Mapping[int, LossFn]]


def _validate_loss_fns(loss_fn: Any) -> Any:
    """``loss_fn`` checked: None, a callable, or a mapping of optimizer indices (ints >= 0) to callables."""
    if loss_fn is None or callable(loss_fn):
        return loss_fn
    if isinstance(loss_fn, Mapping):
        if not loss_fn:
            raise MisconfigurationException("GradWatchCallback: loss_fn={} names no optimizer; expected "
                                            "{optimizer_index: loss_fn(pl_module, batch) -> loss, ...}")
        for key, fn in loss_fn.items():
            if isinstance(key, bool) or not isinstance(key, int) or key < 0:
                raise MisconfigurationException(f"GradWatchCallback: loss_fn key {key!r} is not an optimizer index "
                                                "(an integer >= 0, the position in configure_optimizers)")
            if not callable(fn):
                raise MisconfigurationException(f"GradWatchCallback: loss_fn[{key}] must be callable "
                                                f"loss_fn(pl_module, batch) -> loss, got {type(fn).__name__}")
        return dict(loss_fn)
    raise MisconfigurationException(
        f"GradWatchCallback: loss_fn must be callable loss_fn(pl_module, batch) -> loss, or "
        f"{{optimizer_index: loss_fn}}, got {type(loss_fn).__name__}")


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
    try:
        with silenced_logging(module):
            out = module.training_step(batch, 0)
    except Exception as exc:
        blame(exc, "training_step")  # the user's training_step, not a loss_fn they wrote
        raise
    todo = "return the loss from training_step, or pass GradWatchCallback(loss_fn=(module, batch) -> loss)"
    if isinstance(out, dict):
        if "loss" not in out:
            raise ObjectiveError("training_step returned no loss on the watched batch",
                                 f"it returned a dict without 'loss' (keys: {', '.join(map(str, out))})", todo)
        out = out["loss"]
    if not isinstance(out, torch.Tensor):
        why = ("it returned None (Lightning skips such a batch; the check needs its loss)" if out is None else
               f"it returned a {type(out).__name__}, not a loss tensor")
        raise ObjectiveError("training_step returned no loss on the watched batch", why, todo)
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


class CheckTouchedTraining(GradWatchError, RuntimeError):
    """The check objective tried to change training (step an optimizer, zero its gradients, run a backward).

    Example:
        >>> isinstance(CheckTouchedTraining("SGD.step()"), RuntimeError)
        True
    """


def _refuse(what: str, refused: Optional[List[str]] = None) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        if refused is not None:
            refused.append(what)
        raise CheckTouchedTraining(
            f"the check objective called {what}, which would change training; gradwatch refused it. "
            "Pass GradWatchCallback(loss_fn=(module, batch) -> loss) that only computes the loss "
            "(no manual_backward, no optimizer calls)"
        )

    return refuse


@contextlib.contextmanager
def no_backward(module: LightningModule, refused: Optional[List[str]] = None) -> Iterator[None]:
    """Make ``module.manual_backward`` raise :class:`CheckTouchedTraining` for the duration."""
    had = "manual_backward" in module.__dict__
    saved = module.__dict__.get("manual_backward")
    module.manual_backward = _refuse(f"{type(module).__name__}.manual_backward()", refused)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            module.manual_backward = saved  # type: ignore[method-assign,assignment]  # the module's own, put back
        else:
            del module.manual_backward


@contextlib.contextmanager
def optimizers_locked(trainer: Trainer, refused: Optional[List[str]] = None) -> Iterator[None]:
    """While a check runs, ``step()`` and ``zero_grad()`` of the trainer's optimizers (and their
    ``LightningOptimizer`` wrappers) raise :class:`CheckTouchedTraining` instead of acting.

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
        >>> class FakeTrainer: optimizers = [opt]; strategy = None
        >>> with optimizers_locked(FakeTrainer()):
        ...     try:
        ...         opt.step()
        ...     except CheckTouchedTraining as err:
        ...         print("refused:", str(err).split(",")[0])
        refused: the check objective called SGD.step()
        >>> "step" in vars(opt)
        False
    """
    targets = list(trainer.optimizers) + list(getattr(trainer.strategy, "_lightning_optimizers", None) or [])
    saved: List[Tuple[Any, str, bool, Any]] = []
    try:
        for opt in targets:
            name = type(getattr(opt, "_optimizer", opt)).__name__
            for method in ("step", "zero_grad"):
                saved.append((opt, method, method in vars(opt), vars(opt).get(method)))
                setattr(opt, method, _refuse(f"{name}.{method}()", refused))
        yield
    finally:
        for opt, method, had, old in reversed(saved):
            if had:
                setattr(opt, method, old)
            else:
                delattr(opt, method)


def training_state(trainer: Trainer, module: LightningModule) -> Tuple[Any, ...]:
    """What a check must leave as it found it: ``global_step``, and per parameter its in-place version
    counter, its ``.grad`` (object and version) and ``requires_grad``. Cheap: no tensor is read.
    """
    params = tuple(
        (p._version, p.requires_grad, id(p.grad), -1 if p.grad is None else p.grad._version) for p in module.parameters()
    )
    return (trainer.global_step, params)


def _changes(before: Tuple[Any, ...], after: Tuple[Any, ...], module: LightningModule) -> List[str]:
    changes = []
    if before[0] != after[0]:
        changes.append(f"global_step {before[0]} -> {after[0]}")
    names = [n for n, _ in module.named_parameters()]
    for name, b, a in zip(names, before[1], after[1]):
        if b != a:
            what = ("weights" if a[0] != b[0] else "requires_grad" if a[1] != b[1] else ".grad")
            changes.append(f"{name} {what}")
    return changes


def check_loss_fn(loss_fn: LossFn, live: LightningModule, refused: Optional[List[str]] = None) -> LossFn:
    """``loss_fn`` as a check runs it: ``self.log`` silenced, ``manual_backward`` refused, the
    live module's trainer reachable.

    The check evaluates ``loss_fn`` many times on a shadow copy of ``live``; logging from
    there would warn at every evaluation (the copy has no trainer) or log check values.
    """

    def loss_for_check(module: Any, batch: Any) -> torch.Tensor:
        if not isinstance(module, LightningModule):
            return loss_fn(module, batch)
        with silenced_logging(module), no_backward(module, refused), borrowed_trainer(module, live):
            return loss_fn(module, batch)

    loss_for_check.__wrapped__ = loss_fn  # type: ignore[attr-defined]
    return loss_for_check


class LoggerSink(Sink):
    """Sends each check's scalars through a Lightning logger's ``log_metrics`` (then ``save()``), so they
    land in ``metrics.csv``, wandb, MLflow, TensorBoard... like the trainer's own metrics.

    Example:
        >>> import tempfile
        >>> from lightning.pytorch.loggers import CSVLogger
        >>> lg = CSVLogger(tempfile.mkdtemp())
        >>> LoggerSink(lg).write_check({"step": 3, "tensors": {"w": {"rel_diff": 1e-9}}, "summary": {}}, 0)
        >>> "gradwatch/rel_diff/w" in open(lg.experiment.metrics_file_path).readline()
        True
    """

    def __init__(self, logger: Logger, prefix: str = "") -> None:
        self.logger = logger
        self.prefix = prefix  # "optimizer_1/": tags "gradwatch/optimizer_1/..." (one objective per optimizer)

    def write_check(self, record: Mapping[str, Any], alert_count: int) -> None:
        metrics = dict(scalars_from_check(record))
        metrics[ALERTS_COUNT_TAG] = float(alert_count)
        if self.prefix:
            metrics = {k.replace("gradwatch/", "gradwatch/" + self.prefix, 1): v for k, v in metrics.items()}
        self.logger.log_metrics(metrics, step=int(record["step"]))
        self.logger.save()

    def __repr__(self) -> str:
        return f"LoggerSink({type(self.logger).__name__})"


class GradWatchCallback(Callback):
    """Watch a Lightning fit for wrong gradients.

    Args:
        loss_fn: ``loss_fn(pl_module, batch) -> scalar``, the training loss of ``batch`` computed
            without backward or optimizer calls; default: the loss returned by ``training_step``
            (automatic optimization only: a module with ``automatic_optimization = False`` must
            pass one). Or ``{optimizer_index: loss_fn}`` (manual optimization, a GAN): each optimizer's
            parameters are watched against their own objective, checked when that optimizer steps,
            both verdicts, records under ``log_dir/optimizer_<index>`` (computed, as in training, after
            the optimizers stepped before it). ``self.log``/``self.log_dict`` are silenced during checks.
        config: The watch's configuration, as :class:`~gradwatch.GradWatch` takes it: a
            :class:`~gradwatch.config.GradWatchConfig` or the path of a YAML config; keyword options override it.
        **options: Any :class:`~gradwatch.config.GradWatchConfig` option (``every``, ``coords``, ``raise_on``,
            ...), flat or in its group (``schedule={"every": 50}``), and ``on_alert``/``grad_fn``.

    Scalars go through every logger of the trainer (``log_metrics`` at
    ``trainer.global_step``, rank zero): ``metrics.csv``, wandb, MLflow alike.
    A ``TensorBoardLogger`` is written through its own writer, with the
    custom-scalars layout and the alert text. ``checks.jsonl`` goes to
    ``log_dir`` when set, else to ``trainer.log_dir`` (``default_root_dir``
    with ``logger=False``). The check never steps an optimizer, never re-enters
    itself and never moves ``global_step``; a check objective that tries pauses
    the watch with one warning. Its state is saved in checkpoints: a run resumed
    with ``ckpt_path=`` and a new callback continues the schedule, trends and
    coverage. Bad options raise ``MisconfigurationException`` naming the option.

    Example:
        >>> cb = GradWatchCallback(every=10, coords=4)
        >>> cb.config.every
        10
    """

    def __init__(self, loss_fn: Optional[LossFns] = None, *, config: Union[GradWatchConfig, str, os.PathLike, None] = None,
                 **options: Any) -> None:
        super().__init__()
        loss_fn = _validate_loss_fns(loss_fn)
        self.loss_fn: Any = loss_fn if loss_fn is not None else training_step_loss
        self._objects = {k: options.pop(k) for k in ("on_alert", "grad_fn") if k in options}
        for key, value in self._objects.items():
            if value is not None and not callable(value):
                raise MisconfigurationException(f"GradWatchCallback: {key} must be callable, got {type(value).__name__}")
        try:
            made = resolve_config(config, options)
        except (ConfigError, ValueError, TypeError) as err:
            raise MisconfigurationException(f"GradWatchCallback: {err}") from err
        self.config: GradWatchConfig = made
        self.watch: Optional[GradWatch] = None
        #: With ``loss_fn={optimizer_index: fn}``: one watch per optimizer index (``watch`` is the first of them).
        self.watches: Dict[int, GradWatch] = {}
        self._batch: Any = None
        self._batch_checked = False
        self._checked_indices: set = set()  # loss_fn per optimizer: the indices checked on this batch
        self._checking = False
        self._refused: List[str] = []  # what the check objective tried and was refused, during one check
        self._pending_state: Optional[Dict[str, Any]] = None

    @property
    def state_key(self) -> str:
        # Two callbacks watching different tensors or writing to different places keep separate state.
        return self._generate_state_key(tensors=self.config.tensors, log_dir=self.config.log_dir)

    # -- lifecycle -------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _validate_loss_fns(self.loss_fn)  # it may have been replaced since __init__
        if isinstance(self.loss_fn, dict):
            self._setup_checks(pl_module)
            return
        if not pl_module.automatic_optimization and self.loss_fn is training_step_loss:
            raise MisconfigurationException(
                f"GradWatchCallback: {type(pl_module).__name__} optimizes manually (automatic_optimization = False): "
                "its training_step runs backward and steps the optimizers, so it cannot be the check objective. "
                "Pass loss_fn=(module, batch) -> loss that computes the same loss without manual_backward or "
                "optimizer calls, e.g. GradWatchCallback(loss_fn=lambda module, batch: module.compute_loss(batch))"
            )
        self._setup_checks(pl_module)

    def _setup_checks(self, pl_module: LightningModule) -> None:
        if not any(p.requires_grad for p in pl_module.parameters()):
            raise MisconfigurationException(f"GradWatchCallback: {type(pl_module).__name__} has no trainable parameters to watch")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watch is not None:
            if not self.watch._closed and self.watch.model is pl_module:
                return
            # A second fit with this callback: its watches were closed at teardown; continue from their state.
            if self._pending_state is None:
                self._pending_state = self.state_dict()
            for w in self._all_watches():
                w.close()
            self.watch, self.watches = None, {}
        log_dir = self.config.log_dir or trainer.log_dir or trainer.default_root_dir  # every rank: log_dir broadcasts
        if isinstance(self.loss_fn, dict):
            count = len(trainer.optimizers)
            for index in sorted(self.loss_fn):
                if index >= count:
                    raise MisconfigurationException(
                        f"GradWatchCallback: loss_fn has optimizer index {index}, but {type(pl_module).__name__} "
                        f"configures {count} optimizer{'s' if count != 1 else ''} (indices 0 to {count - 1})")
                self.watches[index] = self._build_watch(trainer, pl_module, self.loss_fn[index], index,
                                                        os.path.join(str(log_dir), f"optimizer_{index}"))
            self.watch = self.watches[min(self.watches)]
        else:
            self.watch = self._build_watch(trainer, pl_module, self.loss_fn, None, str(log_dir))
        if self._pending_state is not None:
            self._load_states(self._pending_state)
            self._pending_state = None

    def _all_watches(self) -> List[GradWatch]:
        return list(self.watches.values()) if self.watches else ([self.watch] if self.watch is not None else [])

    def _build_watch(self, trainer: Trainer, pl_module: LightningModule, loss_fn: LossFn, index: Optional[int],
                     log_dir: str) -> GradWatch:
        """The watch of one objective: the whole module's (``index`` None), or optimizer ``index``'s parameters."""
        zero = trainer.is_global_zero
        tb = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if index is None:
            writer = tb.experiment if tb is not None and zero and self.config.tensorboard else None
            # TensorBoard events through the logger's writer, or in a log_dir the user named; never a new event file
            # in another logger's folder.
            tensorboard = self.config.tensorboard and (writer is not None or self.config.log_dir is not None)
            optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
            # Manual optimization: what each optimizer applies is the module's own business (a GAN's two losses),
            # so with one objective the training part (live .grad against the objective's gradient) is off.
            training = self.config.training and pl_module.automatic_optimization
            options: Dict[str, Any] = {}
        else:  # one objective per optimizer: its parameters, its records and events in a folder of their own
            writer, tensorboard, optimizer, training = None, self.config.tensorboard, trainer.optimizers[index], \
                self.config.training
            mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
            options = {"tensors": [n for n, p in pl_module.named_parameters() if id(p) in mine and p.requires_grad]}
        try:
            watch = GradWatch(
                pl_module,
                cast(Callable[[nn.Module, Any], torch.Tensor], check_loss_fn(loss_fn, pl_module, self._refused)),
                optimizer=optimizer,
                writer=writer,
                config=self.config.replace(log_dir=log_dir if zero else None, tensorboard=tensorboard,
                                           training=training, **options),
                **self._objects,
            )
        except (ConfigError, ValueError, TypeError) as err:
            raise MisconfigurationException(f"GradWatchCallback: {err}") from err
        if zero:
            prefix = "" if index is None else f"optimizer_{index}/"
            for lg in trainer.loggers:
                if lg is not tb or index is not None or (writer is None and self.config.tensorboard):
                    watch.sinks.add(LoggerSink(lg, prefix))
            kept = [s for s in watch.sinks if isinstance(s, (JsonlSink, TensorBoardSink, LoggerSink))]
            if not kept and watch.dist is None:
                rank_zero_warn(
                    "GradWatchCallback: nothing of the checks will be kept (jsonl and tensorboard are off and the "
                    "trainer has no logger); alerts go to the 'gradwatch' Python logger only. Set jsonl=True, "
                    "log_dir=..., or give the Trainer a logger."
                )
        algorithm = getattr(trainer, "gradient_clip_algorithm", None)  # an enum of "norm" and "value", or None
        by_norm = str(getattr(algorithm, "value", algorithm) or "norm") == "norm"
        watch.update.asked = float(trainer.gradient_clip_val or 0) if by_norm else None  # the clipping asked for
        # training_step runs inside the precision plugin's context (autocast under "bf16-mixed"/"16-mixed"):
        # the training part replays it there too.
        watch.replay_context = trainer.precision_plugin.train_step_context
        watch.grad_scaler = getattr(trainer.precision_plugin, "scaler", None)  # "16-mixed": its GradScaler
        return watch

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = batch
        self._batch_checked = False
        self._checked_indices.clear()
        for watch in self._all_watches():
            watch.start_batch()  # training_step follows with no random draw in between: the replay starts here

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Every micro-batch (accumulate_grad_batches): the training part averages their gradients, as Lightning does.
        if self.watch is not None and self._batch is not None and pl_module.automatic_optimization:
            self.watch.accumulate(self._batch)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer) -> None:
        # Once per batch: several optimizers (manual optimization) step on one batch, and a check is never re-entered;
        # with an objective per optimizer, once per batch and optimizer, when that optimizer steps.
        # Before gradient clipping, after Lightning's AMP unscaling: .grad is the gradient of the training loss.
        if self.watch is None or self._batch is None or self._checking:
            return
        watch = self.watch
        if self.watches:
            index = _optimizer_index(trainer, optimizer)
            if index is None or index not in self.watches or index in self._checked_indices:
                return
            self._checked_indices.add(index)
            watch = self.watches[index]
        elif self._batch_checked:
            return
        self._batch_checked = True
        before = training_state(trainer, pl_module)
        self._checking = True
        self._refused.clear()
        try:
            with optimizers_locked(trainer, self._refused):
                watch.step(self._batch, global_step=trainer.global_step)
        finally:
            self._checking = False
        changes = _changes(before, training_state(trainer, pl_module), pl_module)
        if self._refused or changes:
            what = f"called {self._refused[0]} (refused)" if self._refused else f"changed training ({', '.join(changes[:5])})"
            watch.pause(
                f"the check objective {what}; pass GradWatchCallback(loss_fn=(module, batch) -> loss) "
                "that only computes the loss",
                step=trainer.global_step,
            )

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for watch in self._all_watches():
            watch.sinks.flush()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            for watch in self._all_watches():
                watch.close()

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        if self.watches:
            return {"optimizers": {str(i): w.state_dict() for i, w in self.watches.items()}}
        if self.watch is not None:
            return self.watch.state_dict()
        return dict(self._pending_state or {})

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.watch is not None:
            self._load_states(state_dict)
        else:
            self._pending_state = dict(state_dict)

    def _load_states(self, state: Mapping[str, Any]) -> None:
        if self.watches and "optimizers" in state:
            for key, sub in state["optimizers"].items():
                if int(key) in self.watches:
                    self.watches[int(key)].load_state_dict(sub)
        elif not self.watches and "optimizers" not in state and self.watch is not None:
            self.watch.load_state_dict(state)
        else:
            rank_zero_warn("GradWatchCallback: the checkpoint's gradwatch state was written with another loss_fn "
                           "(one objective vs one per optimizer); the watch starts afresh")


def _optimizer_index(trainer: Trainer, optimizer: Any) -> Optional[int]:
    """The position of ``optimizer`` (or the one a ``LightningOptimizer`` wraps) in ``trainer.optimizers``."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    for i, opt in enumerate(trainer.optimizers):
        if opt is inner or opt is optimizer or getattr(opt, "_optimizer", None) is inner:
            return i
    return None
