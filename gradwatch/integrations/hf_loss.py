"""The objective of a ``transformers.Trainer`` subclass that computes its own loss (TRL's trainers, ...).

Trainers built on the Hugging Face ``Trainer`` (TRL's ``SFTTrainer``, ``DPOTrainer``, ...) override
``compute_loss``: the loss is not the model's ``outputs.loss`` (TRL sums the log-probabilities of its fused LM
head; DPO compares two forwards of the policy with a reference model). :class:`ComputeLoss` is the check's
objective there: the trainer's own ``compute_loss`` on the inputs it was given, for that micro-batch alone
(``num_items_in_batch`` left out, so a trainer dividing by it divides by the micro-batch's own count; the step's
objective then weighs the micro-batches by their items, :mod:`gradwatch.parallel.step_objective`).

``compute_loss`` has effects beyond its value: TRL appends metrics and counts tokens at every call, and gathers
them across ranks. A check calls it hundreds of times, so :func:`trainer_kept` puts the trainer's plain-data
state back after the check, and while the check runs :class:`ComputeLoss` keeps ``accelerator.gather`` and
``gather_for_metrics`` to this rank (a check's evaluations are not in step across ranks).

Example:
    >>> import torch
    >>> class Trainer:  # stands for a Trainer subclass: a loss of its own, and a metric it appends to
    ...     def __init__(self):
    ...         self.metrics, self.accelerator = [], None
    ...     def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    ...         self.metrics.append(1.0)
    ...         return (model(inputs["x"]) ** 2).sum()
    >>> trainer = Trainer()
    >>> loss = ComputeLoss(trainer)
    >>> with trainer_kept(trainer):
    ...     value = loss(torch.nn.Identity(), {"x": torch.ones(3)})
    >>> float(value), trainer.metrics
    (3.0, [])
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from gradwatch.errors import GradWatchError, ObjectiveError, first_line, say

#: A policy-gradient trainer's per-token log-probabilities, and the batch key of an earlier policy's (TRL's GRPO).
_LOGPS, _OLD = "_get_per_token_logps_and_entropies", "old_per_token_logps"
#: Largest plain-data attribute (items, recursively) :func:`trainer_kept` copies; larger ones are left as they are.
_MOST_ITEMS = 100_000
_PLAIN = (int, float, bool, str, type(None))


def batch_keys(batch: Any) -> Optional[List[str]]:
    """The keys of the inputs a model was given (None: a batch without keys).

    Example:
        >>> batch_keys({"labels": 1, "input_ids": 2}), batch_keys(3)
        (['input_ids', 'labels'], None)
    """
    if isinstance(batch, Mapping):
        return sorted(map(str, batch))
    kwargs = getattr(batch, "kwargs", None)  # the model call of positional inputs (ModelCall)
    return sorted(map(str, kwargs)) if isinstance(kwargs, Mapping) else None


def output_keys(out: Any) -> List[str]:
    """The fields of a model's output (its class where it has none)."""
    if isinstance(out, Mapping):
        return [str(k) for k in out] or ["none"]
    return [type(out).__name__]


def forward_failed(what: str, model: nn.Module, batch: Any, err: BaseException) -> ObjectiveError:
    """The error of gradwatch's default objective whose call of ``what`` (the model's forward, a Trainer's
    ``compute_loss``) raised on the watched batch: which batch, in which copy of the model, the words it raised.

    Example:
        >>> err = forward_failed("M's forward", nn.Linear(2, 2).double(), {"x": 1}, RuntimeError("no Double kernel"))
        >>> err.what
        "M's forward failed on the watched batch"
        >>> err.why
        "called on the inputs of the step's last forward (keys: x) in the check's float64 copy, it raised: no Double kernel"
    """
    keys = batch_keys(batch)
    param = next(model.parameters(), None)
    copy = param is not None and param.dtype == torch.float64
    where = " in the check's float64 copy" if copy else ""
    why = (f"called on the inputs of the step's last forward (keys: {', '.join(keys or ['?'])}){where}, it raised: "
           f"{first_line(err)}")
    todo = ("where it fails in float64 only (a kernel or a cast of its own), GradWatchCallback(dtype=None) checks in "
            "place; else " if copy else "") + "pass GradWatchCallback(loss_fn=(model, inputs) -> loss)"
    return ObjectiveError(f"{what} failed on the watched batch", why, todo)


def pops_labels(trainer: Any) -> bool:
    """True when ``trainer`` takes the labels out of the model's inputs and computes the loss itself (the Trainer's
    label smoothing, ``compute_loss_func``): the model, called without labels, returns no loss of its own.

    Example:
        >>> class T:
        ...     label_smoother, compute_loss_func = None, None
        >>> t = T()
        >>> pops_labels(t), (setattr(t, "label_smoother", object()) or pops_labels(t))
        (False, True)
    """
    return getattr(trainer, "label_smoother", None) is not None or getattr(trainer, "compute_loss_func", None) is not None


def overrides_compute_loss(trainer: Any, base: type) -> bool:
    """True when ``trainer``'s class computes its loss itself (``compute_loss`` is not ``base``'s).

    Example:
        >>> class Base:
        ...     def compute_loss(self): ...
        >>> class Own(Base):
        ...     def compute_loss(self): ...
        >>> overrides_compute_loss(Own(), Base), overrides_compute_loss(Base(), Base)
        (True, False)
    """
    own = getattr(type(trainer), "compute_loss", None)
    return own is not None and own is not getattr(base, "compute_loss", None)


class ComputeLoss:
    """The default objective under a Trainer that overrides ``compute_loss``: that ``compute_loss`` on one micro-batch.

    Args:
        trainer: The running trainer; its class's ``compute_loss`` is called (not a wrapper on the instance).

    Example:
        >>> class T:
        ...     accelerator = None
        ...     def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ...         return (inputs["x"].sum(), None) if return_outputs else inputs["x"].sum()
        >>> float(ComputeLoss(T())(nn.Identity(), {"x": torch.ones(2)}))
        2.0
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._compute: Callable[..., Any] = type(trainer).compute_loss
        self._anchors: Dict[Tuple[int, int], torch.Tensor] = {}

    def new_check(self) -> None:
        """Forget the log-probabilities held as the policy's of the batch (:meth:`_anchor`): a new check, a new point."""
        self._anchors.clear()

    def __call__(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        # The check's float64 copy computes without autocast (GRPO opens accelerator.autocast() around its forwards,
        # and TRL's kernel then makes its buffers in bfloat16); the training part's replay of the live model keeps it.
        copy = self._is_copy(model)
        with _accelerator_local(getattr(self.trainer, "accelerator", None), no_autocast=copy):
            # a copy: compute_loss may set keys of its inputs (TRL's use_cache)
            batch = dict(inputs) if isinstance(inputs, Mapping) else inputs
            if copy and isinstance(batch, dict) and _OLD not in batch and "completion_ids" in batch \
                    and callable(getattr(self.trainer, _LOGPS, None)):
                batch[_OLD] = self._anchor(model, batch)
            try:
                out = self._compute(self.trainer, model, batch)
            except Exception as err:  # the trainer's own loss on the check's copy: said in the model's and batch's terms
                if not isinstance(err, GradWatchError):
                    say(err, forward_failed(f"{type(self.trainer).__name__}.compute_loss", model, inputs, err))
                raise
        return out[0] if isinstance(out, tuple) else out

    def _is_copy(self, model: nn.Module) -> bool:
        """True for a copy of the trainer's model (the check's float64 shadow), False for the model training runs (or
        a module sharing its parameters: the one inside DDP that the watch replays).

        Example:
            >>> import copy
            >>> class T:
            ...     def compute_loss(self, model, inputs, **kwargs): ...
            >>> trainer = T()
            >>> trainer.model = nn.Linear(2, 1)
            >>> loss = ComputeLoss(trainer)
            >>> [loss._is_copy(m) for m in (trainer.model, nn.Sequential(trainer.model), copy.deepcopy(trainer.model))]
            [False, False, True]
        """
        live = getattr(self.trainer, "model", None)
        if model is live or model is getattr(self.trainer, "model_wrapped", None):
            return False
        try:
            return next(model.parameters()) is not next(live.parameters())  # type: ignore[union-attr]
        except (StopIteration, AttributeError, TypeError):
            return True

    def _anchor(self, model: nn.Module, batch: Dict[str, Any]) -> torch.Tensor:
        """The per-token log-probabilities of the batch's completions at the check's point, held fixed.

        On-policy, TRL's GRPO compares the policy's log-probabilities with themselves detached
        (``exp(logp - logp.detach())`` times the advantages): its value never moves with the parameters while its
        gradient is the policy gradient, so finite differences of it are zero. Held at their value at the
        check's point, as an earlier policy's (``old_per_token_logps``), the loss is the clipped surrogate whose
        gradient there is the one training applies, and its value moves. Made once per model and batch in a check
        (the check's first evaluation is at its point).
        """
        key = (id(model), id(batch["completion_ids"]))
        if key not in self._anchors:
            seen: List[torch.Tensor] = []
            original = getattr(self.trainer, _LOGPS)

            def logps(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                seen.append(out[0].detach())
                return out

            setattr(self.trainer, _LOGPS, logps)
            try:
                with torch.no_grad():
                    self._compute(self.trainer, model, dict(batch))
            finally:
                delattr(self.trainer, _LOGPS)
            self._anchors[key] = seen[0]
        return self._anchors[key]

    def __repr__(self) -> str:
        return f"ComputeLoss({type(self.trainer).__name__}.compute_loss)"


@contextlib.contextmanager
def _accelerator_local(accelerator: Any, no_autocast: bool) -> Iterator[None]:
    """``accelerator.gather`` and ``gather_for_metrics`` return this rank's tensor while active (and, with
    ``no_autocast``, ``accelerator.autocast()`` opens nothing)."""
    keys = ("gather", "gather_for_metrics") + (("autocast",) if no_autocast else ())
    if accelerator is None:
        yield
        return
    saved = {k: accelerator.__dict__[k] for k in keys if k in accelerator.__dict__}
    for key in keys:
        setattr(accelerator, key, _no_autocast if key == "autocast" else _local)
    try:
        yield
    finally:
        for key in keys:
            if key in saved:
                setattr(accelerator, key, saved[key])
            else:
                delattr(accelerator, key)


def _no_autocast(*args: Any, **kwargs: Any) -> Any:
    return contextlib.nullcontext()


def _local(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


@contextlib.contextmanager
def trainer_kept(trainer: Any) -> Iterator[None]:
    """Put the trainer's plain-data attributes (numbers, and containers of them: metrics, token counts) back on exit.

    Containers are restored in place (their identity kept), so references held elsewhere see the restored values.
    """
    saved: Dict[str, Any] = {}
    for key, value in vars(trainer).items():
        if _is_plain(value, [0]):
            saved[key] = copy.deepcopy(value)
    try:
        yield
    finally:
        for key, value in saved.items():
            current = trainer.__dict__.get(key)
            if isinstance(current, dict) and isinstance(value, dict) and type(current) is type(value):
                current.clear()
                current.update(value)
            elif isinstance(current, list) and isinstance(value, list):
                current[:] = value
            else:
                trainer.__dict__[key] = value


def _is_plain(value: Any, seen: list, depth: int = 0) -> bool:
    """Numbers, strings and dicts/lists of them (at most :data:`_MOST_ITEMS` items, 4 levels)."""
    if isinstance(value, _PLAIN):
        return True
    if depth > 4 or not isinstance(value, (dict, list)):
        return False
    seen[0] += len(value)
    if seen[0] > _MOST_ITEMS:
        return False
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return all(isinstance(k, _PLAIN) and _is_plain(v, seen, depth + 1) for k, v in items)


def capture_inputs(trainer: Any, keep: Callable[[nn.Module, Any], None]) -> Optional[Callable[[], None]]:
    """Wrap ``trainer.compute_loss`` (on the instance) so that ``keep(model, inputs)`` sees each call's inputs first.

    Returns the function that takes the wrapper off again (None if the instance already had its own attribute).
    """
    if "compute_loss" in vars(trainer):
        return None
    original = trainer.compute_loss

    def compute_loss(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        keep(model, inputs)
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss

    def remove() -> None:
        if vars(trainer).get("compute_loss") is compute_loss:
            del trainer.compute_loss

    return remove


__all__ = ["ComputeLoss", "batch_keys", "capture_inputs", "forward_failed", "output_keys", "overrides_compute_loss",
           "pops_labels", "trainer_kept"]
