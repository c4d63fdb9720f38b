"""The call of a checked model: where the input is, what the output is, the (sample, position) grid of both,
and the model run again with its input changed (:class:`Runner`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from gradwatch.check.objective.generators import HeldGenerators
from gradwatch.check.objective.rng import seed_everything

#: Keyword arguments of a Hugging Face model call that may hold the input, in order of preference.
INPUT_KEYS = ("input_ids", "inputs_embeds", "input_values", "pixel_values", "x", "input")


@dataclass
class ModelCall:
    """Positional and keyword arguments of one model call together (what a watch captures from ``loss_fn``)."""

    args: tuple
    kwargs: Dict[str, Any]


def call_of(inputs: Any) -> Tuple[list, dict]:
    """``(args, kwargs)`` of the model call: a tensor, a tuple/list of arguments, a dict of keyword arguments."""
    if isinstance(inputs, ModelCall):
        return list(inputs.args), dict(inputs.kwargs)
    if isinstance(inputs, torch.Tensor):
        return [inputs], {}
    if isinstance(inputs, Mapping):
        return [], dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return list(inputs), {}
    raise TypeError(f"inputs: got {type(inputs).__name__}, expected a tensor, a tuple of arguments or a dict of "
                    "keyword arguments (a Hugging Face model's input_ids, attention_mask, position_ids)")


def primary_input(args: list, kwargs: dict) -> Tuple[Tuple[str, Any], torch.Tensor]:
    """Where the input is (``("arg", i)`` or ``("kw", key)``) and the tensor."""
    for key in INPUT_KEYS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return ("kw", key), kwargs[key]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return ("arg", i), a
    for key, v in kwargs.items():
        if isinstance(v, torch.Tensor) and key not in ("attention_mask", "position_ids", "token_type_ids"):
            return ("kw", key), v
    raise TypeError("inputs: no tensor to check independence of (give a tensor, or input_ids / inputs_embeds)")


#: Keywords of a training call that turn the output into a loss, left out of the checked call (and why).
LOSS_ONLY = {
    "labels": "the outputs are checked, not the loss",
    # TRL's fused LM head: with it a causal LM returns per-token log-probabilities of the labels, not its logits
    "fused_lm_head": "the logits are checked (TRL's fused LM head returns the labels' log-probabilities)",
    "num_items_in_batch": "the outputs are checked, not the loss",
}


def output_tensor(out: Any) -> torch.Tensor:
    """The model output to check: a tensor; a ``ModelOutput``'s ``logits`` or ``last_hidden_state``; a tuple's first.

    Example:
        >>> output_tensor((torch.ones(2), None)).shape
        torch.Size([2])
    """
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = out.get(key) if isinstance(out, Mapping) else getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    values = list(out.values()) if isinstance(out, Mapping) else list(out) if isinstance(out, (tuple, list)) else []
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise TypeError(f"the model returned {type(out).__name__}; check_independence needs a tensor, a tuple whose first "
                    "floating tensor is the output, or a ModelOutput with logits or last_hidden_state")


@dataclass
class Layout:
    """How a ``[B, T]`` grid maps onto a tensor: which dims are the batch and the sequence (None: no sequence)."""

    batch_dim: int
    seq_dim: Optional[int]

    def fits(self, t: torch.Tensor, batch: int, length: int) -> bool:
        dims = t.dim()
        if dims <= self.batch_dim or t.shape[self.batch_dim] != batch:
            return False
        if self.seq_dim is None:
            return True
        return dims > self.seq_dim and t.shape[self.seq_dim] == length

    def grid(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, T, F]`` view/copy of ``t`` (T = 1 without a sequence)."""
        if self.seq_dim is None:
            moved = t.movedim(self.batch_dim, 0)
            return moved.reshape(moved.shape[0], 1, -1)
        moved = t.movedim((self.batch_dim, self.seq_dim), (0, 1))
        return moved.reshape(moved.shape[0], moved.shape[1], -1)

    def spread(self, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A ``[B, T]`` mask broadcast to ``like``'s shape."""
        shape = [1] * like.dim()
        shape[self.batch_dim] = mask.shape[0]
        if self.seq_dim is None:
            mask = mask[:, 0]
        else:
            shape[self.seq_dim] = mask.shape[1]
        return mask.reshape(shape).expand(like.shape)


class Runner:
    """Runs the model with the input replaced by ``variable + delta``, in eval mode, seeded alike each time."""

    def __init__(self, model: nn.Module, args: list, kwargs: dict, where: Tuple[str, Any], primary: torch.Tensor,
                 seed: int) -> None:
        self.model, self.args, self.kwargs, self.where, self.seed = model, args, kwargs, where, seed
        self.site: Optional[nn.Module] = None  # the module embedding integer ids
        self.site_name: Optional[str] = None
        self.variable: Optional[torch.Tensor] = None
        self.forwards = 0
        self._delta: Optional[torch.Tensor] = None
        self._taken = False
        self.held: Optional[HeldGenerators] = None
        if primary.is_floating_point() or primary.is_complex():
            self.variable = primary.detach().clone().requires_grad_(True)
        else:
            self.primary = primary

    def _set(self, value: torch.Tensor) -> Tuple[list, dict]:
        args, kwargs = list(self.args), dict(self.kwargs)
        kind, key = self.where
        if kind == "arg":
            args[key] = value
        else:
            kwargs[key] = value
        return args, kwargs

    def _site_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._taken:
            return None  # a second call of the embedding (a tied head, say) is the model's own use
        if self.variable is None:  # discovery: the first module to finish that took the integer ids
            ids = self.primary
            first = args[0] if args else None
            if not (isinstance(first, torch.Tensor) and isinstance(output, torch.Tensor) and output.is_floating_point()
                    and first.shape == ids.shape and output.shape[:ids.dim()] == ids.shape
                    and (first is ids or (first.dtype == ids.dtype and torch.equal(first, ids)))):
                return None  # the ids as given, or a view of them (GPT-2 reshapes input_ids before embedding them)
            self.site = module
            self.variable = output.detach().clone().requires_grad_(True)
        elif module is not self.site:
            return None
        self._taken = True
        return self.variable if self._delta is None else self.variable + self._delta

    def run(self, delta: Optional[torch.Tensor] = None, grad: bool = False,
            hooks: Sequence[Tuple[nn.Module, Callable]] = ()) -> torch.Tensor:
        """The output tensor (detached unless ``grad``)."""
        self._delta, self._taken = delta, False
        handles = []
        try:
            if self.variable is None or self.site is not None:
                sites = [self.site] if self.site is not None else list(self.model.modules())
                handles += [m.register_forward_hook(self._site_hook) for m in sites]
            handles += [m.register_forward_hook(h, with_kwargs=True) for m, h in hooks]
            if self.site is None and self.variable is not None:
                value = self.variable if delta is None else self.variable + delta
                args, kwargs = self._set(value if grad else value.detach())
            else:
                args, kwargs = self.args, self.kwargs
            seed_everything(self.seed)
            if self.held is not None:
                self.held.reset()
            with torch.set_grad_enabled(grad):
                out = output_tensor(self.model(*args, **kwargs))
            self.forwards += 1
        finally:
            for h in handles:
                h.remove()
        if self.variable is None:
            raise ValueError(f"check_independence: no module of {type(self.model).__name__} took the integer input "
                             f"(shape {tuple(self.primary.shape)}) as its first argument and returned floating "
                             "embeddings; pass the embeddings instead (inputs_embeds, or a floating input)")
        return out if grad else out.detach()


def packed_call_remedy(model: nn.Module, kwargs: Mapping[str, Any]) -> Optional[Tuple[Dict[str, Any], str]]:
    """The packed call as a Hugging Face model masks its documents, and the change in words; None when it is that already.

    transformers' ``create_causal_mask`` reads packed documents from ``position_ids`` only when it is given no 2-D
    ``attention_mask`` and no cache; a causal LM makes a cache whenever ``use_cache`` is true (``config.use_cache``
    by default), in training too.

    Example:
        >>> from types import SimpleNamespace
        >>> m = nn.Linear(1, 1); m.config = SimpleNamespace(use_cache=True)
        >>> packed_call_remedy(m, {"position_ids": torch.tensor([[0, 1, 0]]), "attention_mask": torch.ones(1, 3)})[1]
        'without its all-ones attention_mask and with use_cache=False'
    """
    config = getattr(model, "config", None)
    if config is None or not isinstance(kwargs.get("position_ids"), torch.Tensor):
        return None
    call, words = dict(kwargs), []
    mask = call.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask != 0).all()):  # no padding it would lose
        call.pop("attention_mask")
        words.append("without its all-ones attention_mask")
    if call.get("use_cache", getattr(config, "use_cache", None)):
        call["use_cache"] = False
        words.append("with use_cache=False")
    return (call, " and ".join(words)) if words else None
