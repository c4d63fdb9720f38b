"""Small token models with planted dependence leaks, and the brute-force ground truth they are judged against.

``TinyLM(mixer)``: embedding -> 2 pre-norm blocks (``mixer``, then an MLP) -> head. Block 0's mixer is
always correct; block 1's is the one named, so a leak starts in ``blocks.1.mixer``. Every mixer takes
``(x, mask, docs)``: hidden states ``[B, T, D]``, the padding mask ``[B, T]`` (1 real, 0 pad) or None,
document ids ``[B, T]`` or None.

``leaks(model, inputs, structure, ...)`` is the ground truth by brute force: the forbidden inputs are
replaced by other token ids and the outputs that must not move are compared, for every sample, cut,
document or padded position.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH = 40, 16


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    a = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if allowed is not None:
        a = a.masked_fill(~allowed, float("-inf"))
    return a.softmax(-1) @ v


class Attention(nn.Module):
    """Self-attention whose mask comes from ``rule(T, mask, docs) -> allowed [B or 1, T, T]`` (own code)."""

    def __init__(self, rule: Callable[..., Optional[torch.Tensor]]) -> None:
        super().__init__()
        self.qkv, self.out, self.rule = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH), rule

    def forward(self, x: torch.Tensor, mask: Any = None, docs: Any = None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out(_attend(q, k, v, self.rule(x.shape[1], mask, docs)))


def causal(t: int, mask: Any = None, docs: Any = None, diagonal: int = 1) -> torch.Tensor:
    return ~torch.ones(t, t, dtype=torch.bool).triu(diagonal)[None]


def block_causal(t: int, mask: Any, docs: torch.Tensor, shift: int = 0) -> torch.Tensor:
    d = docs if not shift else torch.cat([docs[:, :1], docs[:, :-1]], 1)  # boundaries one position late
    return causal(t) & (d[:, :, None] == d[:, None, :])


def keys_masked(t: int, mask: torch.Tensor, docs: Any = None) -> torch.Tensor:
    real = mask.bool()
    return real[:, None, :] | ~real[:, :, None]  # a padded query may look anywhere: its output is not guarded


class Conv(nn.Module):
    """A depthwise causal convolution: left padding ``k - 1`` (correct) or symmetric padding (a leak)."""

    def __init__(self, symmetric: bool) -> None:
        super().__init__()
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, groups=WIDTH, padding=1 if symmetric else 0)
        self.symmetric = symmetric

    def forward(self, x: torch.Tensor, mask: Any = None, docs: Any = None) -> torch.Tensor:
        h = x.transpose(1, 2)
        if not self.symmetric:
            h = F.pad(h, (2, 0))
        return self.conv(h).transpose(1, 2)


class Lambda(nn.Module):
    """A mixer written as a function of ``(self, x, mask, docs)`` (own code, a Linear child)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.proj, self.fn = nn.Linear(WIDTH, WIDTH), fn

    def forward(self, x: torch.Tensor, mask: Any = None, docs: Any = None) -> torch.Tensor:
        return self.fn(self, x, mask, docs)


def _sdpa(is_causal: bool) -> Callable[..., torch.Tensor]:
    def fn(m: Lambda, x: torch.Tensor, mask: Any, docs: Any) -> torch.Tensor:
        h = m.proj(x)
        return F.scaled_dot_product_attention(h, h, h, is_causal=is_causal)
    return fn


def _flat_batch(bug: bool) -> Callable[..., torch.Tensor]:
    def fn(m: Lambda, x: torch.Tensor, mask: Any, docs: Any) -> torch.Tensor:
        h = m.proj(x)
        if bug:  # the batch flattened into one sequence: a later sample attends to the earlier ones
            b, t, d = h.shape
            flat = h.reshape(1, b * t, d)
            return F.scaled_dot_product_attention(flat, flat, flat, is_causal=True).reshape(b, t, d)
        return F.scaled_dot_product_attention(h, h, h, is_causal=True)
    return fn


def _seq_first(bug: bool) -> Callable[..., torch.Tensor]:
    def fn(m: Lambda, x: torch.Tensor, mask: Any, docs: Any) -> torch.Tensor:
        b, t, d = x.shape
        h = m.proj(x)
        s = h.reshape(t, b, d) if bug else h.transpose(0, 1)  # a view where a transpose was meant
        s = s.cumsum(0) / torch.arange(1, t + 1, dtype=s.dtype)[:, None, None]  # causal running mean over time
        return s.reshape(b, t, d) if bug else s.transpose(0, 1)
    return fn


def _pad_queries(m: Attention, x: torch.Tensor, mask: torch.Tensor, docs: Any) -> torch.Tensor:
    q, k, v = m.qkv(x).chunk(3, -1)
    real = mask.bool()
    allowed = real[:, :, None] | ~real[:, None, :]  # the mask on the queries' axis instead of the keys'
    return m.out(_attend(q, k, v, allowed))


class PadQueries(Attention):
    def __init__(self) -> None:
        super().__init__(lambda *a: None)

    def forward(self, x: torch.Tensor, mask: Any = None, docs: Any = None) -> torch.Tensor:
        return _pad_queries(self, x, mask, docs)


def _mean_context(masked: bool) -> Callable[..., torch.Tensor]:
    def fn(m: Lambda, x: torch.Tensor, mask: Any, docs: Any) -> torch.Tensor:
        h = m.proj(x)
        if masked:
            w = mask.to(h.dtype)[..., None]
            ctx = (h * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)
        else:
            ctx = h.mean(1, keepdim=True)  # pads included in the sequence's mean
        return h + ctx
    return fn


#: name -> (mixer factory for block 1, the structure it breaks or None for a correct twin)
MIXERS: Dict[str, Any] = {
    # causal
    "causal_ok": (lambda: Attention(causal), None),
    "causal_off_by_one": (lambda: Attention(lambda t, m, d: causal(t, diagonal=2)), "causal"),
    "causal_mask_forgotten": (lambda: Attention(lambda t, m, d: None), "causal"),
    "sdpa_ok": (lambda: Lambda(_sdpa(True)), None),
    "sdpa_is_causal_forgotten": (lambda: Lambda(_sdpa(False)), "causal"),
    "conv_causal_ok": (lambda: Conv(symmetric=False), None),
    "conv_symmetric_padding": (lambda: Conv(symmetric=True), "causal"),
    "norm_over_sequence": (lambda: Lambda(lambda m, x, k, d: m.proj(x - x.mean(1, keepdim=True))), "causal"),
    # batch
    "norm_over_features_ok": (lambda: Lambda(lambda m, x, k, d: m.proj(x / x.norm(dim=-1, keepdim=True))), None),
    "norm_over_batch": (lambda: Lambda(lambda m, x, k, d: m.proj(x / x.norm(dim=0, keepdim=True))), "batch"),
    "flat_batch_attention_ok": (lambda: Lambda(_flat_batch(False)), None),
    "flat_batch_attention": (lambda: Lambda(_flat_batch(True)), "batch"),
    "seq_first_transpose_ok": (lambda: Lambda(_seq_first(False)), None),
    "seq_first_view": (lambda: Lambda(_seq_first(True)), "batch"),
    "roll_over_batch": (lambda: Lambda(lambda m, x, k, d: m.proj(x + 0.5 * x.roll(1, 0))), "batch"),
    # documents
    "documents_ok": (lambda: Attention(block_causal), None),
    "documents_ignored": (lambda: Attention(causal), "documents"),
    "documents_boundary_late": (lambda: Attention(lambda t, m, d: block_causal(t, m, d, shift=1)), "documents"),
    # padding
    "padding_ok": (lambda: Attention(keys_masked), None),
    "padding_ignored": (lambda: Attention(lambda t, m, d: None), "padding"),
    "padding_on_queries": (lambda: PadQueries(), "padding"),
    "mean_context_ok": (lambda: Lambda(_mean_context(True)), None),
    "mean_context_with_pads": (lambda: Lambda(_mean_context(False)), "padding"),
}


class Block(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.ln, self.mixer = nn.LayerNorm(WIDTH), mixer
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, mask: Any, docs: Any) -> torch.Tensor:
        x = x + self.mixer(self.ln(x), mask, docs)
        return x + self.mlp(x)


class TinyLM(nn.Module):
    """Embedding, two blocks (block 1's mixer planted), head; ``forward(input_ids, attention_mask, document_ids)``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        factory, self.breaks = MIXERS[kind]
        first = (Attention(block_causal) if kind.startswith("documents") else
                 Attention(keys_masked) if kind.startswith(("padding", "mean_context")) else Attention(causal))
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(first), Block(factory())])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, document_ids: Any = None) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x, attention_mask, document_ids)
        return self.head(x)


def inputs_for(structure: str, batch: int = 3, length: int = 9, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Token ids, plus the padding mask (right padding of 3 in the last sample) or packed documents."""
    g = torch.Generator().manual_seed(seed)
    out = {"input_ids": torch.randint(0, VOCAB, (batch, length), generator=g)}
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, -3:] = 0
    out["attention_mask"] = mask
    docs = torch.zeros(batch, length, dtype=torch.long)
    docs[:, 4:] = 1
    docs[0, 7:] = 2
    out["document_ids"] = docs
    if structure != "padding":
        out["attention_mask"] = torch.ones(batch, length, dtype=torch.long)
    return out


def _moved(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() > 1e-5 * (a.abs().max() + 1e-12))


@torch.no_grad()
def leaks(model: nn.Module, inputs: Dict[str, torch.Tensor], structure: str, trials: int = 3) -> bool:
    """Ground truth: does changing forbidden input ids move an output that must not move?"""
    model.eval()
    ids = inputs["input_ids"]
    base = model(**inputs)
    b, t = ids.shape
    g = torch.Generator().manual_seed(123)

    def changed(where: torch.Tensor) -> torch.Tensor:
        new = ids.clone()
        new[where] = (ids[where] + torch.randint(1, VOCAB, ids[where].shape, generator=g)) % VOCAB
        return model(**{**inputs, "input_ids": new})

    for _ in range(trials):
        if structure == "batch":
            for j in range(b):
                where = torch.zeros(b, t, dtype=torch.bool)
                where[j] = True
                out = changed(where)
                if any(_moved(base[i], out[i]) for i in range(b) if i != j):
                    return True
        elif structure == "causal":
            for c in range(t - 1):
                where = torch.zeros(b, t, dtype=torch.bool)
                where[:, c + 1:] = True
                if _moved(base[:, :c + 1], changed(where)[:, :c + 1]):
                    return True
        elif structure == "documents":
            docs = inputs["document_ids"]
            for s in range(b):
                for d in docs[s].unique():
                    where = torch.zeros(b, t, dtype=torch.bool)
                    where[s] = docs[s] != d
                    if _moved(base[s][docs[s] == d], changed(where)[s][docs[s] == d]):
                        return True
        elif structure == "padding":
            real = inputs["attention_mask"].bool()
            if _moved(base[real], changed(~real)[real]):
                return True
    return False
