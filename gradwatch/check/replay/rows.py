"""The training part for a weight too big to replay whole: the gradient of some of its rows only.

(``nn.Embedding`` weights too: the term is ``F.embedding`` of the ids remapped into the block, masked to the
ids inside it, ``padding_idx`` remapped; its gradient is those token rows' gradient.)

The training verdict replays training's forward and backward and holds the objective's gradient of
each judged tensor beside the live ``.grad``. A weight whose gradient does not fit the room
``memory_budget`` leaves (the LM head of a model with a real vocabulary) is judged by rows instead,
a different block of rows at each check. During the replay the weight does not require grad, so the
backward never forms its whole gradient; a forward hook on its ``nn.Linear`` adds

    F.linear(x.detach(), S) - F.linear(x.detach(), S).detach()

to the output's columns ``rows``, where ``S`` is a copy of those rows only. The term is exactly zero,
so the forward (and the loss) are bit for bit training's; its gradient reaches ``S`` alone, and is
the gradient of those rows of the weight (``x.detach()``: nothing else receives it twice). Only
exact ``nn.Linear`` modules whose weight no other module uses are sliced this way (a subclass may
compute its weight's gradient differently). A weight whose module never ran in the replay (:meth:`RowGrads.unran`)
may still have been read by other code (TRL's fused LM head multiplies by ``lm_head.weight`` itself): its rows'
zero gradient then says nothing, and the training part judges it whole instead.

Example:
    >>> lin = nn.Linear(3, 4)
    >>> x = torch.randn(5, 3)
    >>> with RowGrads({"weight": (lin, lin.weight, (1, 3))}) as rows:
    ...     total = lin(x).pow(2).sum()
    ...     got = rows.grads(total)["weight"]
    >>> full = torch.autograd.grad(lin(x).pow(2).sum(), lin.weight)[0]
    >>> torch.allclose(got, full[1:3]), lin.weight.requires_grad
    (True, True)
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn

#: name -> (the Linear module, its weight, (first row, end row))
RowPlan = Mapping[str, Tuple[nn.Module, torch.Tensor, Tuple[int, int]]]


def sliceable_linears(model: nn.Module) -> Dict[str, nn.Module]:
    """Parameter name -> its module, for the weights of exact ``nn.Linear`` and plain ``nn.Embedding`` modules
    (no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``) that no other module uses.

    Example:
        >>> sorted(sliceable_linears(nn.Sequential(nn.Embedding(5, 2), nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))))
        ['0.weight', '1.weight', '3.weight']
    """
    uses: Dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    out: Dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear and type(module) is not nn.Embedding:
            continue  # (before reading ``weight``: a parametrized module's computes it, spectral_norm's iterating)
        weight = module._parameters.get("weight")
        plain_embedding = (type(module) is nn.Embedding and module.max_norm is None  # max_norm rewrites the weight
                           and not module.scale_grad_by_freq and not module.sparse)
        if ((type(module) is nn.Linear or plain_embedding) and isinstance(weight, nn.Parameter)
                and uses.get(id(weight)) == 1):
            out[f"{name}.weight" if name else "weight"] = module
    return out


class RowGrads:
    """A replay's gradients of some rows of some Linear weights (see the module's docstring).

    Use as a context manager around the replay; :meth:`grads` after each evaluation's total.
    """

    def __init__(self, plan: RowPlan) -> None:
        self.plan = dict(plan)
        self._pending: List[Tuple[str, torch.Tensor]] = []
        self._handles: List[Any] = []
        self._flags: List[Tuple[torch.Tensor, bool]] = []
        self._ran: Set[str] = set()

    def __enter__(self) -> "RowGrads":
        for name, (module, weight, rows) in self.plan.items():
            self._flags.append((weight, weight.requires_grad))
            weight.requires_grad_(False)
            self._handles.append(module.register_forward_hook(self._hook(name, rows)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        for weight, flag in self._flags:
            weight.requires_grad_(flag)
        self._handles, self._flags, self._pending = [], [], []

    def unran(self) -> List[str]:
        """The planned weights whose module no forward called since the context opened (read there: before it
        closes)."""
        return [n for n in self.plan if n not in self._ran]

    def _hook(self, name: str, rows: Tuple[int, int]) -> Any:
        first, end = rows

        def hook(module: nn.Module, args: tuple, out: Any) -> Any:
            if not torch.is_grad_enabled() or not args or not isinstance(out, torch.Tensor):
                return None
            self._ran.add(name)
            x = args[0].detach()
            part = cast(torch.Tensor, module.weight).detach()[first:end].clone().requires_grad_(True)
            self._pending.append((name, part))
            if isinstance(module, nn.Embedding):  # the block's token rows: ids outside it get no gradient (masked)
                inside = (x >= first) & (x < end)
                pad = module.padding_idx
                local_pad = pad - first if pad is not None and first <= pad < end else None
                y = F.embedding((x - first).clamp(0, end - first - 1), part, padding_idx=local_pad)
                y = y * inside.unsqueeze(-1).to(y.dtype)
                return out + (y - y.detach()).to(out.dtype)
            y = F.linear(x, part)  # in the forward's own autocast region, as the module computed its output
            zero = y - y.detach()
            # One copy of the output, not two (a padded zero and the sum: an LM head's logits twice over), and none in
            # the backward (index_add's gradient of ``out`` is the output's own)
            return out.index_add(-1, torch.arange(first, end, device=out.device), zero.to(out.dtype))
        hook._gradwatch_hook = True  # type: ignore[attr-defined]  # gradwatch's own: a replay keeps it on the model
        return hook

    def leaves(self) -> Tuple[torch.Tensor, ...]:
        """The row copies the forwards since the last :meth:`grads` made (one per call of a module)."""
        return tuple(p for _, p in self._pending)

    def split(self, grads: Sequence[Optional[torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """The gradients of :meth:`leaves` summed per weight (zeros where unused); forgets the leaves."""
        out = self.summed(grads)
        self._pending = []
        return out

    def summed(self, grads: Sequence[Optional[torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """The gradients of :meth:`leaves` summed per weight (zeros where unused); the leaves kept (another value of
        the same forwards may be differentiated)."""
        out: Dict[str, torch.Tensor] = {}
        for (name, part), g in zip(self._pending, grads):
            g = torch.zeros_like(part) if g is None else g
            out[name] = g if name not in out else out[name] + g
        for name, (_, weight, (first, end)) in self.plan.items():
            if name not in out:
                out[name] = torch.zeros_like(weight[first:end])
        return out

    def grads(self, total: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The rows' gradients of ``total`` (for one evaluation)."""
        leaves = self.leaves()
        got = torch.autograd.grad(total, leaves, allow_unused=True) if leaves else ()
        return self.split(list(got))


class Differentiated:
    """``{name: gradient}`` of a value for some whole tensors and, inside :meth:`opened` (around a replay), for some
    weights' rows (a :class:`RowGrads` of ``plan``): the tensors a training verdict judged, differentiated alike again.

    Example:
        >>> lin, bias = nn.Linear(3, 4), torch.zeros(4, requires_grad=True)
        >>> judged = Differentiated({"bias": bias}, {"weight": (lin, lin.weight, (1, 3))})
        >>> with judged.opened():
        ...     got = judged((lin(torch.ones(2, 3)) + bias).sum(), retain=False)
        >>> {n: tuple(g.shape) for n, g in got.items()}, {n: tuple(t.shape) for n, t in judged.tensors().items()}
        ({'bias': (4,), 'weight': (2, 3)}, {'bias': (4,), 'weight': (2, 3)})
    """

    def __init__(self, whole: Mapping[str, torch.Tensor], plan: Optional[RowPlan] = None) -> None:
        self.whole = dict(whole)
        self.plan = dict(plan or {})
        self.rows: Optional[RowGrads] = None

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Each judged tensor: whole, or the weight's judged rows (detached)."""
        return {**self.whole, **{n: w.detach()[first:end] for n, (_, w, (first, end)) in self.plan.items()}}

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        """The rows' copies made at each forward of the module (their gradients are the rows')."""
        if not self.plan:
            yield
            return
        with RowGrads(self.plan) as rows:
            self.rows = rows
            try:
                yield
            finally:
                self.rows = None

    def __call__(self, value: torch.Tensor, retain: bool) -> Dict[str, torch.Tensor]:
        """The gradients of ``value``; without ``retain``, its graph freed and the rows' copies forgotten."""
        plist = tuple(self.whole.values())
        leaves = self.rows.leaves() if self.rows is not None else ()
        gs: Sequence[Optional[torch.Tensor]] = torch.autograd.grad(
            value, plist + leaves, retain_graph=retain, allow_unused=True) if value.requires_grad \
            else (None,) * (len(plist) + len(leaves))
        out = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(self.whole.items(), gs)}
        if self.rows is not None:
            rest = list(gs[len(plist):])
            out.update(self.rows.summed(rest) if retain else self.rows.split(rest))
        return out
