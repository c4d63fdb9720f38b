"""What may depend on what: the four independence structures as probes over a (sample, position) grid.

Pure functions on small boolean tensors, no model. A *probe* is one vector-Jacobian product of
:func:`gradwatch.check_independence`: a random cotangent on the outputs of ``outputs`` (a boolean
``[B, T]`` grid of sample x position), and the inputs of ``forbidden`` that those outputs must not
depend on. The gradient at every forbidden input must then be exactly what it is with no
dependence: zero (an input may still get gradient through outputs outside the probe; those have
no cotangent).

- ``batch``: samples split by the bits of their index, both halves in turn: every pair of samples
  is separated by some probe (``2 * ceil(log2 B)`` probes).
- ``causal``: in each sample, the outputs up to a cut position ``c`` against the inputs after it;
  each probe puts its cut at a different place in each sample, spread over the sequence.
- ``documents``: in each sample, documents split by the bits of their index within the sample,
  both halves in turn (every pair of documents of a sample separated); where a packed call says its documents
  are: :func:`packed_documents`.
- ``padding``: every real position's output against every padded position's input (one probe).

Example:
    >>> probes = batch_probes(4, 3)
    >>> len(probes), probes[0].outputs.shape
    (4, torch.Size([4, 3]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import torch

#: The structures :func:`gradwatch.check_independence` checks.
STRUCTURES = ("batch", "causal", "documents", "padding")


@dataclass
class Probe:
    """One vector-Jacobian product: cotangent on ``outputs``, gradient that must vanish on ``forbidden``.

    Attributes:
        structure: Which structure it checks (one of :data:`STRUCTURES`).
        outputs: Boolean ``[B, T]``: the (sample, position) outputs given a random cotangent.
        forbidden: Boolean ``[B, T]``: the inputs those outputs must not depend on.
        same_sample: The dependence must be looked for within a sample (causal, documents,
            padding); False for ``batch``, where it is across samples.
    """

    structure: str
    outputs: torch.Tensor
    forbidden: torch.Tensor
    same_sample: bool = True


def parse_structures(structure: Union[str, Sequence[str]]) -> Tuple[str, ...]:
    """Structure names, validated, in the order given, each once.

    Raises:
        ValueError: An unknown name (the message lists the accepted ones).

    Example:
        >>> parse_structures(["causal", "padding"])
        ('causal', 'padding')
    """
    names = [structure] if isinstance(structure, str) else list(structure)
    if not names:
        raise ValueError(f"structure: got {structure!r}, expected one of {', '.join(STRUCTURES)} or a list of them")
    out: List[str] = []
    for name in names:
        key = name.lower() if isinstance(name, str) else name
        if key not in STRUCTURES:
            raise ValueError(f"structure: got {name!r}, expected one of {', '.join(STRUCTURES)} or a list of them")
        if key not in out:
            out.append(key)
    return tuple(out)


def documents_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Document index of each position of packed sequences whose position ids restart at 0.

    A document starts at position 0 of a row and wherever the position id is 0 again.

    Example:
        >>> documents_from_positions(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist()
        [[0, 0, 0, 1, 1, 2]]
    """
    pos = torch.as_tensor(position_ids)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    starts = (pos == 0).long()
    starts[:, 0] = 1
    return starts.cumsum(dim=1) - 1


def restarts(position_ids: Any) -> bool:
    """True when some row of ``position_ids`` restarts at 0 after its first position (packed documents).

    Example:
        >>> restarts(torch.tensor([[0, 1, 0, 1]])), restarts(torch.arange(4)[None])
        (True, False)
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2) or position_ids.shape[-1] < 2:
        return False
    return bool((position_ids[..., 1:] == 0).any())


#: Keyword arguments of a packed model call that say where its documents are, in the order they are read.
PACKED_KEYS = ("position_ids", "seq_idx", "cu_seq_lens_q")


def packed_documents(kwargs: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """Document index per position of a packed model call, from its keyword arguments (None: one document a row).

    Read from, in this order: ``position_ids`` that restart at 0 (``DataCollatorWithFlattening``'s default, TRL's
    padding-free batches); ``seq_idx``, the document of each position (``return_seq_idx=True``); ``cu_seq_lens_q``,
    the cumulative document lengths of flash-attention's variable-length kernels (``return_flash_attn_kwargs=True``:
    one row of all the documents).

    Example:
        >>> packed_documents({"cu_seq_lens_q": torch.tensor([0, 2, 5])}).tolist()
        [[0, 0, 1, 1, 1]]
        >>> packed_documents({"position_ids": torch.arange(4)[None]}) is None
        True
    """
    if restarts(kwargs.get("position_ids")):
        return documents_from_positions(kwargs["position_ids"])
    seq_idx = kwargs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor) and seq_idx.dim() in (1, 2) and seq_idx.numel() > 1:
        rows = seq_idx if seq_idx.dim() == 2 else seq_idx[None]
        if bool((rows[:, 1:] != rows[:, :-1]).any()):
            return rows.long()
    cu = kwargs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() > 2 and int(cu[0]) == 0:
        ends = cu[1:].long().cpu()
        return torch.bucketize(torch.arange(int(ends[-1])), ends, right=True)[None]
    return None


def _bit_splits(count: int) -> List[Tuple[List[int], List[int]]]:
    """Pairs (S, rest) of index sets that separate every pair of ``range(count)``, both directions."""
    out = []
    for bit in range(max(1, math.ceil(math.log2(count))) if count > 1 else 0):
        low = [i for i in range(count) if not (i >> bit) & 1]
        high = [i for i in range(count) if (i >> bit) & 1]
        out += [(low, high), (high, low)]
    return out


def batch_probes(batch: int, length: int) -> List[Probe]:
    """Probes of ``batch``: samples split by the bits of their index, both halves in turn.

    Example:
        >>> [p.outputs[:, 0].tolist() for p in batch_probes(2, 1)]
        [[True, False], [False, True]]
    """
    probes = []
    for s, rest in _bit_splits(batch):
        outputs = torch.zeros(batch, length, dtype=torch.bool)
        forbidden = torch.zeros(batch, length, dtype=torch.bool)
        outputs[s] = True
        forbidden[rest] = True
        probes.append(Probe("batch", outputs, forbidden, same_sample=False))
    return probes


def causal_cuts(batch: int, length: int, count: int, generator: Optional[torch.Generator] = None) -> List[List[int]]:
    """``count`` lists of one cut per sample (outputs ``<= cut`` against inputs ``> cut``), spread over the sequence.

    The ``count * batch`` cuts take evenly spaced places in ``[0, length - 2]`` (the first and the last
    pair of neighbours among them), shuffled between probes and samples.

    Example:
        >>> causal_cuts(2, 5, 2, torch.Generator().manual_seed(0))  # doctest: +SKIP
        [[0, 3], [1, 2]]
    """
    if length < 2:
        return []
    n = count * batch
    places = sorted({round(i * (length - 2) / max(1, n - 1)) for i in range(n)})
    while len(places) < n:
        places.append(places[len(places) % len(places)])
    order = torch.randperm(n, generator=generator).tolist()
    shuffled = [places[i] for i in order]
    return [shuffled[k * batch:(k + 1) * batch] for k in range(count)]


def causal_probes(batch: int, length: int, count: int = 2, generator: Optional[torch.Generator] = None) -> List[Probe]:
    """Probes of ``causal``: per sample, the outputs up to a cut against the inputs after it.

    Example:
        >>> p = causal_probes(1, 4, 1)[0]
        >>> p.outputs.tolist(), p.forbidden.tolist()
        ([[True, False, False, False]], [[False, True, True, True]])
    """
    probes = []
    for cuts in causal_cuts(batch, length, count, generator):
        pos = torch.arange(length)
        cut = torch.tensor(cuts)[:, None]
        probes.append(Probe("causal", pos[None, :] <= cut, pos[None, :] > cut))
    return probes


def document_probes(documents: torch.Tensor, valid: Optional[torch.Tensor] = None) -> List[Probe]:
    """Probes of ``documents``: in each sample, documents split by the bits of their index, both halves in turn.

    ``documents``: ``[B, T]`` document index per position (restarting at 0 in each sample or not);
    ``valid``: positions to leave out of both sides (padding), optional.

    Example:
        >>> p = document_probes(torch.tensor([[0, 0, 1]]))[0]
        >>> p.outputs.tolist(), p.forbidden.tolist()
        ([[True, True, False]], [[False, False, True]])
    """
    docs = torch.as_tensor(documents).long()
    if docs.dim() == 1:
        docs = docs.unsqueeze(0)
    local = docs - docs.min(dim=1, keepdim=True).values
    index = torch.zeros_like(local)
    for b in range(local.shape[0]):  # documents numbered 0, 1, ... in each sample, whatever ids they carry
        _, index[b] = torch.unique(local[b], return_inverse=True)
    keep = torch.ones_like(index, dtype=torch.bool) if valid is None else valid.bool()
    most = int(index.max()) + 1 if index.numel() else 0
    probes = []
    for bit in range(max(1, math.ceil(math.log2(most))) if most > 1 else 0):
        high = ((index >> bit) & 1).bool()
        for side in (~high, high):
            probes.append(Probe("documents", side & keep, ~side & keep))
    return probes


def padding_probes(mask: torch.Tensor) -> List[Probe]:
    """Probe of ``padding``: real positions' outputs against padded positions' inputs (none without padding).

    ``mask``: ``[B, T]``, nonzero at real positions (a Hugging Face ``attention_mask``).

    Example:
        >>> padding_probes(torch.tensor([[1, 1, 0]]))[0].forbidden.tolist()
        [[False, False, True]]
    """
    real = torch.as_tensor(mask) != 0
    if real.dim() == 1:
        real = real.unsqueeze(0)
    if bool(real.all()) or not bool(real.any()):
        return []
    return [Probe("padding", real, ~real)]


#: Values of the ``independence`` option besides structure names.
INDEPENDENCE_WORDS = ("auto", "off")


def parse_independence(value: Any) -> Union[None, str, List[str]]:
    """The ``independence`` option normalized: None (off), ``"auto"``, or a list of structures.

    Raises:
        ValueError: Neither ``auto``/``off``/null nor structure names (the message lists them).

    Example:
        >>> parse_independence("Causal"), parse_independence(None), parse_independence(["batch", "padding"])
        (['causal'], None, ['batch', 'padding'])
    """
    if value is None or value is False or (isinstance(value, str) and value.lower() == "off"):
        return None
    if isinstance(value, str) and value.lower() == "auto":
        return "auto"
    try:
        return list(parse_structures(value))
    except (ValueError, TypeError):
        raise ValueError(f"independence: got {value!r}, expected auto, off, null, or one or a list of "
                         "batch, causal, documents, padding") from None
