"""Copies that the module form checks: a module's own code with the modules it calls stubbed, and row slices.

Own code. A module whose ``forward`` calls other modules (an attention block that computes
``softmax(q kᵀ) v`` between its projections) is checked as a function of its inputs, its own
parameters and the outputs of the modules it calls. :func:`own_code_copy` makes a shallow copy
of it in float64 in which each called module is a :class:`~gradwatch.check.modules.stubs.Stub`:
the stub hands back, call by call, the output that module gave in the live forward, as a leaf the
check perturbs, and keeps what it was given; what the own code reads of it (flags, submodules, the
dtype of a weight) reads as the live module's, without running or changing it. :class:`OwnCode`
runs the copy and returns its output together with every stub's inputs, so the vector-Jacobian
product covers both directions of the own code: from the module's inputs to its output and to its
children's inputs, and from its children's outputs on.
The called modules are checked as units of their own.

Slices. A parameter too big to check whole is checked a block of rows at a time, and only the
block is copied: a Linear by output rows (:func:`rows_copy`), an Embedding by the rows of the
token ids the batch uses within a range (:func:`embedding_rows_copy`).

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         return x + torch.tanh(self.fc(x))
    >>> block = Block()
    >>> local, stubs, params = own_code_copy(block, "", ["fc"], {"fc": [torch.ones(1, 2, dtype=torch.float64)]}, {})
    >>> with torch.no_grad():  # (with grad, the first call keeps only what depends on the leaves)
    ...     out, given = OwnCode(local, stubs)(torch.zeros(1, 2, dtype=torch.float64))
    >>> out.tolist(), given.dtype, sorted(params)
    ([[0.7615941559557649, 0.7615941559557649]], torch.float64, ['fc:output'])
"""

from __future__ import annotations

import copy
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from gradwatch.check.modules.stubs import LiveReads, ModelStub, Stub
from gradwatch.check.objective.shadow import drop_autocast_forward
from gradwatch.trees import tensor_leaves

#: Per-module hook dictionaries a shallow copy gets fresh (the check runs no hook of the live module).
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def fresh_shallow(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with its own (empty) hook dictionaries and its own parameter,
    buffer and submodule dictionaries (holding the same objects until replaced)."""
    new = copy.copy(module)
    for attr in HOOK_DICTS:
        if attr in new.__dict__:
            new.__dict__[attr] = type(module.__dict__[attr])()
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    new._modules = dict(module._modules)
    for key, value in module.__dict__.items():  # a method patched onto the instance (a forward) runs on the copy
        if isinstance(value, types.MethodType) and value.__self__ is module:
            new.__dict__[key] = types.MethodType(value.__func__, new)
    drop_autocast_forward(new)  # accelerate's autocast around the forward: a float64 copy computes without it
    return new


class LossCode(nn.Module):
    """``loss_fn(model_stub, batch)`` as a module (its own code, the model stubbed).

    Example:
        >>> code = LossCode(lambda m, b: (m(b) - 1).pow(2).sum(), ModelStub(nn.Linear(2, 1), [torch.zeros(3, 1)]))
        >>> float(code(torch.ones(3, 2)).detach())
        3.0
    """

    def __init__(self, loss_fn: Callable[[Any, Any], Any], model: ModelStub) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.model = model

    def forward(self, batch: Any) -> Any:
        return self.loss_fn(self.model, batch)


class OwnCode(nn.Module):
    """Runs an own-code copy: the floating tensors of its output, then those every stub was given (in call
    order), less those that depend on nothing the check perturbs or are not finite (decided at the first call
    with grad enabled).

    Example:
        >>> x = torch.ones(1, requires_grad=True)
        >>> [t.tolist() for t in OwnCode(nn.Identity(), [])(x)]
        [[1.0]]
    """

    def __init__(self, inner: nn.Module, stubs: Sequence[Stub]) -> None:
        super().__init__()
        self.inner = inner
        self.stubs = list(stubs)
        self.keep: Optional[List[bool]] = None  # which results depend on what the check perturbs

    def forward(self, *args: Any, **kwargs: Any) -> List[torch.Tensor]:
        for s in self.stubs:
            s.reset()
        out = self.inner(*args, **kwargs)
        results = [t for t in tensor_leaves(out) if t.is_floating_point()] + [t for s in self.stubs for t in s.given]
        if self.keep is None:
            if not torch.is_grad_enabled():
                return results
            # Decided at the first call with grad (the check's vector-Jacobian product): a result that depends
            # on nothing the check perturbs (an attention mask built inside) adds nothing, and one that is not
            # finite (a mask of -inf) would make every difference NaN.
            self.keep = [t.requires_grad and bool(torch.isfinite(t).all()) for t in results]
        if len(results) != len(self.keep):
            raise RuntimeError(f"the own code gave {len(results)} tensors, {len(self.keep)} at its first call")
        return [t for t, k in zip(results, self.keep) if k]

    def release(self) -> None:
        """Drop what the copy holds (its stubs' outputs and inputs, its parameters' and buffers' copies, the tensors
        its modules hold as attributes) once its check is done: a library's module may hold itself in a cycle (a PEFT
        model's shallow copy does, a Hugging Face model's too), which would keep them (float64 logits of a window, a
        frozen embedding's copy, a fused head's weight taken out for its rows) until Python's full collection came
        round.

        Example:
            >>> code = OwnCode(nn.Linear(2, 2), [])
            >>> code.release(); list(code.parameters())
            []
        """
        for s in self.stubs:
            s.outputs, s.stub_templates, s.given = [], [], []
            s._parameters = {}
        for m in self.inner.modules():
            m._parameters, m._buffers = {}, {}
            for k, v in list(vars(m).items()):  # tensors held as attributes: a parameter taken out (take_out), its rows
                if isinstance(v, torch.Tensor):
                    del m.__dict__[k]
                elif isinstance(v, dict) and any(isinstance(t, torch.Tensor) for t in v.values()):
                    m.__dict__[k] = {}


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(dtype) if t.is_floating_point() else t.detach().clone()


def _submodule(module: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return module.get_submodule(name) if name else module
    except AttributeError:
        return None


def own_code_copy(module: nn.Module, name: str, stubbed: Sequence[str], outputs: Mapping[str, Sequence[Any]],
                  params: Mapping[str, nn.Parameter], dtype: torch.dtype = torch.float64,
                  ) -> Tuple[nn.Module, List[Stub], Dict[str, nn.Parameter]]:
    """A shallow ``dtype`` copy of ``module`` whose called submodules are stubs.

    Args:
        module: The live module (nothing of it is changed or shared with the copy but plain attributes).
        name: Its full name (``""`` for the model).
        stubbed: The submodules its forward calls, by name relative to ``module``.
        outputs: Relative name -> that module's output at each call, in the check's dtype.
        params: Full name -> live parameter, of the parameters the own code uses (:func:`owned`).
        dtype: The check's dtype.

    Returns:
        ``(copy, stubs, parameters)``: the parameters to check, by name relative to ``module`` for its
        own (``"weight"``, ``"out_proj.weight"``) and ``"<submodule>:output"`` (``"...:output[k][i]"``
        for several calls or tensors) for what a stub hands back.
    """
    prefix = f"{name}." if name else ""
    memo: Dict[int, Any] = {}
    for p in params.values():
        memo[id(p)] = nn.Parameter(_cast(p, dtype), requires_grad=True)
    reads = LiveReads(module, dtype=dtype)  # what the own code reads of the modules it calls (stubs.py)
    stubs = {s: Stub(prefix + s, outputs.get(s, ()), _submodule(module, s), dtype, reads) for s in stubbed}
    reads.stubs.update(stubs)

    def cast_param(p: Optional[nn.Parameter]) -> Any:
        if p is None:
            return None
        if id(p) not in memo:  # a frozen or integer parameter: a constant copy
            memo[id(p)] = nn.Parameter(_cast(p, dtype), requires_grad=False)
        return memo[id(p)]

    def build(m: nn.Module, at: str) -> nn.Module:
        new = fresh_shallow(m)
        new._parameters = {k: cast_param(p) for k, p in m._parameters.items()}
        new._buffers = {k: None if b is None else _cast(b, dtype) for k, b in m._buffers.items()}
        for k, child in m._modules.items():
            rel = at + k
            if child is None:
                continue
            if rel in stubs:
                new._modules[k] = stubs[rel]
            elif any(s.startswith(rel + ".") for s in stubs):
                new._modules[k] = build(child, rel + ".")  # noqa: F821 - deleted once built (below)
            else:  # not called as a module (its weights are used directly) or not called at all
                for p in child.parameters():
                    cast_param(p)
                for b in child.buffers():
                    memo.setdefault(id(b), _cast(b, dtype))
                new._modules[k] = copy.deepcopy(child, memo)
        return new

    local = build(module, "")
    del build  # a recursive closure holds itself: the copy, the stubs and their outputs with it, until a full collection
    checked: Dict[str, nn.Parameter] = {}
    for full, p in params.items():
        checked[full[len(prefix):]] = memo[id(p)]
    for rel, stub in stubs.items():
        several = len(stub.outputs) > 1 or any(len(leaves) > 1 for leaves in stub.outputs)
        for k, leaves in enumerate(stub.outputs):
            for i, leaf in enumerate(leaves):
                checked[f"{rel}:output[{k}][{i}]" if several else f"{rel}:output"] = leaf
    return local, list(stubs.values()), checked


class RowsInPlace(nn.Module):
    """A copy of a module (an Embedding subclass) at its full size, of which only some rows are checked.

    Its ``weight`` is a ``dtype`` copy of the live weight into whose ``rows`` the leaf :attr:`block` is written
    at each call (and ``bias`` likewise from :attr:`bias_block`), so the module's own forward and backward see
    every row at its real index: a custom backward that treats some rows apart is checked as it runs in
    training. The rows are written in place, through a view of the copy (the gradient reaches :attr:`block`
    through the write): one full-size ``dtype`` copy of the weight, not a fresh one per call.

    Example:
        >>> local = RowsInPlace(nn.Linear(3, 10), torch.tensor([8, 9]), torch.float64)
        >>> local(torch.ones(1, 3, dtype=torch.float64)).shape, local.block.shape
        (torch.Size([1, 10]), torch.Size([2, 3]))
    """

    def __init__(self, module: nn.Module, rows: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        inner = fresh_shallow(module)
        weight = cast(torch.Tensor, module.weight)
        self.rows = rows
        self.base = weight.detach().to(dtype)
        self.block = nn.Parameter(self.base[rows].clone(), requires_grad=True)
        del inner._parameters["weight"]
        bias = module._parameters.get("bias")
        self.bias_base: Optional[torch.Tensor] = None
        if isinstance(bias, torch.Tensor) and bias.dim() == 1 and bias.shape[0] == weight.shape[0]:
            self.bias_base = bias.detach().to(dtype)
            self.bias_block = nn.Parameter(self.bias_base[rows].clone(), requires_grad=True)
            del inner._parameters["bias"]
        inner._buffers = {k: None if b is None else _cast(b, dtype) for k, b in module._buffers.items()}
        self.__dict__["inner"] = inner  # not a submodule: its weight is a plain tensor set at each call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.__dict__["inner"]
        inner.__dict__["weight"] = self.base.detach().index_copy_(0, self.rows, self.block)
        if self.bias_base is not None:
            inner.__dict__["bias"] = self.bias_base.detach().index_copy_(0, self.rows, self.bias_block)
        return inner(*args, **kwargs)


def rows_copy(module: nn.Module, first: int, end: int, dtype: torch.dtype) -> nn.Module:
    """Output rows ``first:end`` of a Linear (or a subclass whose forward uses ``self.weight`` and
    ``self.bias``) as a shallow copy holding only those rows, in ``dtype``.

    Example:
        >>> rows_copy(nn.Linear(3, 10), 2, 5, torch.float64).weight.shape
        torch.Size([3, 3])
    """
    new = fresh_shallow(module)
    weight = cast(torch.Tensor, module.weight)
    new._parameters["weight"] = nn.Parameter(weight.detach()[first:end].to(dtype), requires_grad=weight.requires_grad)
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        new._parameters["bias"] = nn.Parameter(bias.detach()[first:end].to(dtype), requires_grad=bias.requires_grad)
    new._buffers = {k: None if b is None else _cast(b, dtype) for k, b in module._buffers.items()}
    if hasattr(module, "out_features"):
        vars(new).update(out_features=end - first)
    return new


def embedding_rows_copy(module: nn.Module, ids: torch.Tensor, first: int, end: int, dtype: torch.dtype,
                        ) -> Optional[Tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    """The rows of token ids in ``first:end`` that ``ids`` uses, as a shallow copy of an Embedding (or a
    subclass whose forward uses ``self.weight``) holding only those rows, in ``dtype``.

    Returns ``(copy, local ids, the rows)``: the positions whose id lies in the range, their ids
    renumbered into the copy (each occurrence kept, so per-id counts are as in the batch); None when
    the batch uses no id of the range.

    Example:
        >>> emb = nn.Embedding(10, 2)
        >>> local, ids, rows = embedding_rows_copy(emb, torch.tensor([[1, 7, 7]]), 5, 10, torch.float64)
        >>> local.weight.shape, ids.tolist(), rows.tolist()
        (torch.Size([1, 2]), [0, 0], [7])
    """
    flat = ids.reshape(-1)
    inside = flat[(flat >= first) & (flat < end)]
    if inside.numel() == 0:
        return None
    rows = torch.unique(inside)
    local_ids = torch.searchsorted(rows, inside)
    new = fresh_shallow(module)
    weight = cast(torch.Tensor, module.weight)
    new._parameters["weight"] = nn.Parameter(weight.detach()[rows].to(dtype), requires_grad=weight.requires_grad)
    vars(new).update(num_embeddings=int(rows.numel()), sparse=False)  # the check differentiates densely
    padding = getattr(module, "padding_idx", None)
    if padding is not None:
        hit = (rows == padding).nonzero()
        vars(new).update(padding_idx=int(hit[0, 0]) if hit.numel() else None)
    return new, local_ids, rows
