"""Several blocks of one Linear's or Embedding's rows checked in one piece, each block a tensor of its own.

A check takes about ``slices / K`` blocks of an LM head's or a token embedding's rows (25 of GPT-2's
50,257-row head a check): each block small, so that an error in a few rows stands above the noise of the
block's random directions (:mod:`gradwatch.plan.cycle`). Checked one piece each, every block pays a
piece's fixed cost (its copy, its cotangent, its analytic forward and backward, its detection probe), which
is most of its time. Rows of a plain ``nn.Linear`` or ``nn.Embedding`` are independent of each other (row
``i`` of the output depends on row ``i`` of the weight alone; a token's embedding on its own row), so
the blocks can share one copy, one forward and one random cotangent while each stays a tensor of its own:
the engine's joint detection probes them all along one line (two evaluations for the group when they
agree), and a block whose share disagrees is probed alone, where its verdict is its own. Only modules
whose forward is the library's own are grouped (:func:`gradwatch.plan.units.faithful_rows`): their
forward, given the concatenated blocks as its weight, computes what it computes on those rows.

Example:
    >>> lin = nn.Linear(3, 10)
    >>> group = LinearRowBlocks(lin, [(0, 2), (6, 9)], torch.float64)
    >>> sorted(group.tensors()), group(torch.ones(1, 3, dtype=torch.float64)).shape
    (['bias[0:2]', 'bias[6:9]', 'weight[0:2]', 'weight[6:9]'], torch.Size([1, 5]))
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch import nn

from gradwatch.check.modules.localize import ModuleCheck, check_module
from gradwatch.check.modules.own_code import fresh_shallow
from gradwatch.check.objective.rng import preserved_rng
from gradwatch.check.probes.experts import expert_of
from gradwatch.options import CheckOptions
from gradwatch.plan.cycle import Piece
from gradwatch.plan.units import Unit, faithful_rows, in_place_param
from gradwatch.trees import tensor_leaves

Block = Tuple[int, int]

#: Why an embedding slice was not checked: the batch uses none of its rows (they count as unreached).
NO_TOKEN = "the batch uses no token of these rows"


def block_key(param: str, block: Block) -> str:
    """The key a block's tensor is checked under (``"weight[256:512]"``); :func:`param_of` reads it back.

    Example:
        >>> block_key("weight", (0, 256)), param_of("weight[0:256]"), param_of("input")
        ('weight[0:256]', 'weight', 'input')
    """
    return f"{param}[{block[0]}:{block[1]}]"


def param_of(key: str) -> str:
    """The parameter a block's key names (``"weight"`` for ``"weight[0:256]"``); any other key (an expert's too,
    ``"gate_up_proj[expert 3]"``: judged on its own) as it is."""
    return key.split("[", 1)[0] if key.endswith("]") and not key.startswith("input") and expert_of(key) is None else key


class LinearRowBlocks(nn.Module):
    """Output rows ``blocks`` of a Linear (whose forward is ``nn.Linear``'s) as one module, one leaf per block.

    At each call the blocks are concatenated into the weight (and bias) of a shallow copy of the module, whose
    own forward then computes those rows' outputs, block after block along the last dimension.

    Args:
        module: The live Linear.
        blocks: ``(first, end)`` row ranges, disjoint.
        dtype: The check's dtype.
        offset: ``module`` holds rows ``offset:`` of the model's (one rank's shard); ``blocks`` and the keys stay
            the model's rows.
    """

    def __init__(self, module: nn.Module, blocks: Sequence[Block], dtype: torch.dtype, offset: int = 0) -> None:
        super().__init__()
        weight = cast(torch.Tensor, module.weight).detach()
        bias = module._parameters.get("bias")
        self.blocks = list(blocks)
        self.weights = nn.ParameterList([nn.Parameter(weight[a - offset:b - offset].to(dtype)) for a, b in self.blocks])
        self.biases = nn.ParameterList([nn.Parameter(bias.detach()[a - offset:b - offset].to(dtype))
                                        for a, b in self.blocks]) if isinstance(bias, torch.Tensor) else None
        inner = fresh_shallow(module)
        for key in ("weight", "bias"):
            inner._parameters.pop(key, None)
        inner.__dict__["bias"] = None
        vars(inner).update(out_features=sum(b - a for a, b in self.blocks))
        self.__dict__["inner"] = inner  # not a submodule: its weight is a plain tensor set at each call

    def tensors(self) -> Dict[str, nn.Parameter]:
        """Each block's weight (and bias) under :func:`block_key`."""
        out = {block_key("weight", blk): w for blk, w in zip(self.blocks, self.weights)}
        if self.biases is not None:
            out.update({block_key("bias", blk): b for blk, b in zip(self.blocks, self.biases)})
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.__dict__["inner"]
        inner.__dict__["weight"] = torch.cat(list(self.weights))
        if self.biases is not None:
            inner.__dict__["bias"] = torch.cat(list(self.biases))
        return inner(*args, **kwargs)


class EmbeddingRowBlocks(nn.Module):
    """The token rows of ``blocks`` that ``ids`` uses, of an Embedding (whose forward is ``nn.Embedding``'s), as
    one module, one leaf per block; called on :attr:`ids`, the positions whose token lies in a block, renumbered.

    Each occurrence is kept (per-token counts are the batch's, as ``scale_grad_by_freq`` needs). The padding
    row is not among the blocks' rows: by torch's contract it gets no gradient (a constant, as
    :func:`gradwatch.check.objective.padding_idx.padding_rows_constant` holds it elsewhere), so its positions
    are left out with the tokens of other blocks.

    Args:
        module: The live Embedding.
        ids: The token ids the module was called on.
        blocks: ``(first, end)`` token ranges, disjoint.
        dtype: The check's dtype.
        offset: ``module`` holds rows ``offset:`` of the model's (one rank's shard, its ``padding_idx`` counted from
            there); ``ids``, ``blocks`` and the keys stay the model's.

    Attributes:
        used: Per block, the rows the batch uses (empty where it uses none: that block has no tensor).
        ids: The local ids to call the module on (None when no block's row is used).

    Example:
        >>> emb = nn.Embedding(10, 2, padding_idx=0)
        >>> group = EmbeddingRowBlocks(emb, torch.tensor([[0, 1, 7, 7, 3]]), [(0, 2), (5, 10), (2, 3)], torch.float64)
        >>> [u.tolist() for u in group.used], group.ids.tolist(), sorted(group.tensors())
        ([[1], [7], []], [0, 1, 1], ['weight[0:2]', 'weight[5:10]'])
        >>> group(group.ids).shape
        torch.Size([3, 2])
    """

    def __init__(self, module: nn.Module, ids: torch.Tensor, blocks: Sequence[Block], dtype: torch.dtype,
                 offset: int = 0) -> None:
        super().__init__()
        flat = ids.reshape(-1)
        padding = getattr(module, "padding_idx", None)
        if padding is not None:
            padding = (padding + offset) % int(cast(int, module.num_embeddings))
        weight = cast(torch.Tensor, module.weight).detach()
        self.blocks = list(blocks)
        self.used: List[torch.Tensor] = []
        for a, b in self.blocks:
            rows = torch.unique(flat[(flat >= a) & (flat < b)])
            self.used.append(rows[rows != padding] if padding is not None else rows)
        kept = [(blk, rows) for blk, rows in zip(self.blocks, self.used) if rows.numel()]
        self.weights = nn.ParameterList([nn.Parameter(weight[rows - offset].to(dtype)) for _, rows in kept])
        self._keys = [block_key("weight", blk) for blk, _ in kept]
        self.ids: Optional[torch.Tensor] = None
        if kept:
            order = torch.cat([rows for _, rows in kept])
            sorted_rows, where = torch.sort(order)
            inside = flat[torch.isin(flat, sorted_rows)]
            self.ids = where[torch.searchsorted(sorted_rows, inside)]
        inner = fresh_shallow(module)
        inner._parameters.pop("weight", None)
        vars(inner).update(num_embeddings=sum(int(rows.numel()) for _, rows in kept), padding_idx=None, sparse=False)
        self.__dict__["inner"] = inner

    def tensors(self) -> Dict[str, nn.Parameter]:
        """Each used block's rows under :func:`block_key`."""
        return dict(zip(self._keys, self.weights))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inner = self.__dict__["inner"]
        inner.__dict__["weight"] = torch.cat(list(self.weights))
        return inner(ids)


#: Positions (rows of a Linear's input, its leading dimensions flattened) a group of a plain Linear's row blocks is
#: checked on, at most. A row's weight gradient sums over the positions: torch's own Linear, on any of them, shows
#: an error of its backward in that row; the arithmetic is a float64 product of positions x rows x width, which at
#: an LM head's 6,000 rows a check is most of a check's time.
GROUP_POSITIONS = 32


def _linear_input(args: Any, kwargs: Any) -> Optional[torch.Tensor]:
    """A Linear's input when it is called on one tensor alone (what a group may cut to fewer positions)."""
    if isinstance(args, tuple) and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and args[0].dim() > 1:
        return args[0]
    return None


def positions_kept(module: nn.Module, args: Any, kwargs: Any) -> float:
    """The share of its input's positions a group of ``module``'s row blocks is checked on (1 for an Embedding's).

    Example:
        >>> positions_kept(nn.Linear(8, 4), (torch.ones(4, 32, 8),), {}), positions_kept(nn.Linear(8, 4), (torch.ones(3, 8),), {})
        (0.25, 1.0)
    """
    x = _linear_input(args, kwargs) if isinstance(module, nn.Linear) else None
    return 1.0 if x is None else min(1.0, GROUP_POSITIONS / max(1, x.numel() // x.shape[-1]))


def fewer_positions(x: torch.Tensor, keep: int, seed: int) -> torch.Tensor:
    """``keep`` positions of a Linear's input drawn at random (a generator of ``seed``), as a ``(keep, width)``
    tensor; ``x`` as it is where it has no more.

    Example:
        >>> fewer_positions(torch.ones(4, 32, 8), 32, 0).shape, fewer_positions(torch.ones(3, 8), 32, 0).shape
        (torch.Size([32, 8]), torch.Size([3, 8]))
    """
    flat = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    if flat.shape[0] <= keep:
        return x
    gen = torch.Generator().manual_seed(int(seed) % (2**63))
    chosen = torch.randperm(flat.shape[0], generator=gen)[:keep].sort().values
    return flat[chosen.to(flat.device)]


def chunks(blocks: Sequence[Block], capacity: int) -> List[List[Block]]:
    """``blocks`` in order, cut into runs of at most ``capacity`` rows in all (a block over it alone in its run).

    Example:
        >>> chunks([(0, 4), (8, 12), (20, 26)], 10)
        [[(0, 4), (8, 12)], [(20, 26)]]
    """
    out: List[List[Block]] = []
    rows = 0
    for blk in blocks:
        size = blk[1] - blk[0]
        if out and rows + size <= capacity:
            out[-1].append(blk)
            rows += size
        else:
            out.append([blk])
            rows = size
    return out


def groupable(piece: Piece, unit: Unit) -> bool:
    """Whether ``piece`` is a row block of a plain Linear or Embedding (``unit``), or of an own code's big parameter
    (:mod:`~gradwatch.check.modules.own_rows`), checked in a group of its blocks.

    Example:
        >>> groupable(Piece("head", (0, 200)), Unit("head", nn.Linear(2, 600))), groupable(Piece("act"), Unit("act", nn.Tanh()))
        (True, False)
    """
    return piece.rows is not None and (unit.kind == "module" and faithful_rows(unit.module)
                                       or unit.kind == "own" and in_place_param(unit) is not None)


def grouped(pieces: Sequence[Piece], by_name: Dict[str, Unit]) -> List[List[Piece]]:
    """``pieces`` in order, one to a list, except the row blocks of each plain Linear or Embedding (whose forward is
    the library's own): those gathered into one list, at the place of the first (:mod:`~gradwatch.check.modules.row_groups`).

    Example:
        >>> units = {"head": Unit("head", nn.Linear(2, 600)), "act": Unit("act", nn.Tanh())}
        >>> [[str(p) for p in g] for g in grouped([Piece("head", (0, 200)), Piece("act"), Piece("head", (400, 600))], units)]
        [['head[0:200]', 'head[400:600]'], ['act']]
    """
    out: List[List[Piece]] = []
    at: Dict[str, int] = {}
    for piece in pieces:
        unit = by_name.get(piece.unit)
        if unit is not None and groupable(piece, unit):
            if piece.unit in at:
                out[at[piece.unit]].append(piece)
                continue
            at[piece.unit] = len(out)
        out.append([piece])
    return out


def check_group(unit: Unit, blocks: List[Tuple[int, int]], args: Any, kwargs: Any, opts: CheckOptions,
                 dtype: torch.dtype, canonical: Dict[int, str], constants: Set[int], screen: bool, offset: int = 0
                 ) -> Tuple[ModuleCheck, List[Tuple[str, Any]], int]:
    """Row blocks of a plain Linear or Embedding checked in one piece, each block a tensor of its own; returns the
    check, what it probed (parameter name, rows) and how many blocks held no token of the batch. ``offset``: the
    unit's weight holds rows ``offset:`` of the model's (one rank's shard); the blocks and what is reported stay the
    model's rows."""
    module = unit.module
    prefix = f"{unit.name}." if unit.name else ""
    weight = canonical.get(id(unit.params.get(prefix + "weight")), prefix + "weight")
    span = f"rows {blocks[0][0]}:{blocks[-1][1]}, {len(blocks)} blocks"
    probed: List[Tuple[str, Any]] = []
    local: "LinearRowBlocks | EmbeddingRowBlocks"
    if isinstance(module, nn.Embedding):
        ids = first_ids(args, kwargs)
        if ids is None:
            return ModuleCheck(name=unit.name, type=type(module).__name__, calls=unit.calls,
                               inconclusive="no token ids among its inputs"), [], 0
        local = EmbeddingRowBlocks(module, ids, blocks, dtype, offset)
        probed.append((weight, ("reached", torch.unique(ids.reshape(-1)))))
        probed.extend((weight, rows) for rows in local.used if rows.numel())
        empty = sum(1 for rows in local.used if not rows.numel())
        if local.ids is None:
            return ModuleCheck(name=unit.name, type=type(module).__name__, calls=unit.calls,
                               inconclusive=NO_TOKEN), probed, empty
        args, kwargs = (local.ids,), {}
        kind = f"{type(module).__name__} {span} ({sum(int(r.numel()) for r in local.used)} used)"
    else:
        local = LinearRowBlocks(module, blocks, dtype, offset)
        x = _linear_input(args, kwargs)
        if x is not None and x.numel() // x.shape[-1] > GROUP_POSITIONS:
            cut = fewer_positions(x, GROUP_POSITIONS, opts.seed)
            if id(x) in constants:
                constants.add(id(cut))
            args = (cut,)
            span += f", on {GROUP_POSITIONS} of its input's {x.numel() // x.shape[-1]} positions"
        bias = canonical.get(id(unit.params.get(prefix + "bias")), prefix + "bias")
        probed.extend((name, blk) for blk in blocks for name in ((weight, bias) if local.biases is not None else (weight,)))
        empty = 0
        kind = f"{type(module).__name__} {span}"
    params = local.tensors()
    with preserved_rng():  # torch's own Linear or Embedding on dtype copies: no constant of another dtype to keep out
        result = check_module(unit.name, local, args, kwargs, opts, unit.calls, params=params, restore=False,
                              constants=constants, screen=screen)
    result.type = kind
    return result, probed, empty


def first_ids(args: Any, kwargs: Any) -> Optional[torch.Tensor]:
    for t in tensor_leaves((args, kwargs)):
        if not t.is_floating_point() and not t.is_complex():
            return t
    return None
