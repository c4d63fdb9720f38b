"""What to look at: coordinates, directions and the rotating subset of tensors.

Pure functions of a seed; the same seed samples the same points.
"""

from __future__ import annotations

import fnmatch
import sys
import zlib
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import torch

_LITTLE_ENDIAN = sys.byteorder == "little"
#: Row ``b``: the 8 bits of byte ``b`` as signs ``±1`` (bit set -> +1).
_SIGN_TABLE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.int8) * 2 - 1
_SIGN_TABLES: Dict[torch.dtype, torch.Tensor] = {torch.int8: _SIGN_TABLE}


def tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed: stable across processes (no Python ``hash``).

    Example:
        >>> tensor_seed(0, "fc.weight") == tensor_seed(0, "fc.weight")
        True
    """
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (never touches the global RNG)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


def choose_coords(grad: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """Flat indices to check: the ``k // 2`` largest ``|grad|`` plus random ones, ``k`` in all.

    All coordinates when the tensor has at most ``k`` elements. Returned sorted.

    Example:
        >>> g = torch.tensor([0.0, 5.0, 0.1, -7.0])
        >>> choose_coords(g, 8, generator(0)).tolist()
        [0, 1, 2, 3]
        >>> 3 in choose_coords(g, 2, generator(0)).tolist()
        True
    """
    n = grad.numel()
    if n <= k:
        return torch.arange(n)
    n_top = k // 2
    # Top-k on the gradient's own device: only k indices cross to the host, not the whole gradient.
    flat = grad.detach().reshape(-1).abs()
    if not flat.is_floating_point() or flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.to(torch.float64)
    top = _top_indices(flat, n_top).cpu() if n_top else torch.empty(0, dtype=torch.long)
    taken = set(top.tolist())
    n_rand = k - n_top
    # Random distinct indices not already taken: draw a few extra and filter.
    picks: List[int] = []
    while len(picks) < n_rand:
        cand = torch.randint(0, n, (2 * (n_rand - len(picks)) + 4,), generator=gen)
        for c in cand.tolist():
            if c not in taken:
                taken.add(c)
                picks.append(c)
                if len(picks) == n_rand:
                    break
    idx = torch.cat([top, torch.tensor(picks, dtype=torch.long)])
    return torch.sort(idx).values


#: Block size of :func:`_top_indices`; tensors under ``_BLOCKWISE_MIN`` entries use one ``torch.topk``.
_BLOCK = 256
_BLOCKWISE_MIN = 32768


def _top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of the 1-D ``values`` (any order).

    ``torch.topk`` on the CPU costs about 2 ns per entry even for a handful of
    indices. On large tensors, the maxima of blocks of 256 entries come first
    (a reduction, ~10x cheaper): the ``k`` largest entries lie in the ``k``
    blocks with the largest maxima, since a block holding one of them has a
    maximum at least that large, and at most ``k - 1`` entries are larger.

    Example:
        >>> v = torch.zeros(40000); v[123] = 5.0; v[39999] = 7.0
        >>> sorted(_top_indices(v, 2).tolist())
        [123, 39999]
    """
    n = values.numel()
    if n < _BLOCKWISE_MIN:
        return torch.topk(values, k).indices
    whole = n - n % _BLOCK
    maxima = values[:whole].view(-1, _BLOCK).amax(1)
    if whole < n:
        maxima = torch.cat([maxima, values[whole:].amax().reshape(1)])
    blocks = torch.topk(maxima, min(k, maxima.numel())).indices
    cand = (blocks.unsqueeze(1) * _BLOCK + torch.arange(_BLOCK, device=values.device)).reshape(-1)
    cand = cand[cand < n]
    return cand[torch.topk(values[cand], k).indices]


def rademacher_signs(numel: int, count: int, gen: torch.Generator, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """``count`` rows of ``numel`` random signs ``±1`` in ``dtype`` (int8 by default), shape ``(count, numel)``.

    The same ``gen`` state gives the same signs in every dtype.

    Drawn 56 signs per random 64-bit word and expanded through a byte table:
    a per-element draw costs ~5 ns per entry, too much for million-entry tensors.

    Example:
        >>> s = rademacher_signs(10, 2, generator(0))
        >>> s.shape, s.dtype, sorted(set(s.flatten().tolist())) in ([-1, 1], [-1], [1])
        (torch.Size([2, 10]), torch.int8, True)
    """
    n_bytes = (numel + 7) // 8
    words = torch.randint(0, 2**62, (count, (n_bytes + 6) // 7), generator=gen)
    # The low 7 bytes of a 62-bit uniform word are uniform random bytes.
    raw = words.view(torch.uint8).reshape(count, -1, 8)
    low = raw[:, :, :7] if _LITTLE_ENDIAN else raw[:, :, 1:]
    data = low.reshape(count, -1)[:, :n_bytes]
    # index_select: a plain gather, several times cheaper than advanced indexing with the same result.
    table = _SIGN_TABLES.get(dtype)
    if table is None:
        table = _SIGN_TABLES[dtype] = _SIGN_TABLE.to(dtype)
    rows = table.index_select(0, data.reshape(-1).long())
    return rows.reshape(count, -1)[:, :numel].contiguous()


def match_names(names: Sequence[str], patterns: Optional[Iterable[str]], strict: bool = True) -> List[str]:
    """Names matching any glob pattern (``None`` keeps all).

    With ``strict`` (the default), a pattern matching nothing raises ValueError (a typo); without,
    it is ignored (the tensors it matched were frozen since).

    Example:
        >>> match_names(["fc1.weight", "fc1.bias", "fc2.weight"], ["*.weight"])
        ['fc1.weight', 'fc2.weight']
    """
    if patterns is None:
        return list(names)
    if isinstance(patterns, str):
        patterns = [patterns]
    patterns = list(patterns)
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    for p in patterns if strict else ():
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ValueError(f"tensors: pattern {p!r} matches no trainable parameter; parameters are: {shown}")
    return chosen


def rotate(names: Sequence[str], per_check: int, counts: Mapping[str, int]) -> List[str]:
    """The next subset of tensors to check, least-checked first (ties in model order).

    Every tensor is checked ``c + 1`` times before any is checked ``c + 2`` times.
    ``per_check=0`` means all tensors.

    Example:
        >>> rotate(["a", "b", "c"], 2, {"a": 1})
        ['b', 'c']
        >>> rotate(["a", "b", "c"], 2, {"a": 1, "b": 1, "c": 1})
        ['a', 'b']
    """
    if per_check <= 0 or per_check >= len(names):
        return list(names)
    order = sorted(range(len(names)), key=lambda i: (counts.get(names[i], 0), i))
    chosen = sorted(order[:per_check])
    return [names[i] for i in chosen]


def coverage(counts: Mapping[str, int], names: Sequence[str]) -> Dict[str, int]:
    """How often each trainable tensor has been checked (0 for never)."""
    return {n: int(counts.get(n, 0)) for n in names}
