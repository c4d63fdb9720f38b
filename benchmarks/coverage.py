"""Does :class:`gradwatch.GradWatch` catch gradient bugs planted in realistically sized models, and what does it cost?

Every configuration runs in its own interpreter (``--worker CASE --bug BUG``), so its peak RSS (``VmHWM``) is its own,
and watches its model the way a user would::

    watch = gradwatch.GradWatch(model, loss_fn, optimizer=opt, every=1, tensorboard=False, jsonl=False)
    for step in range(checks):
        opt.zero_grad(); loss = loss_fn(model, batch); loss.backward(); watch.step(batch); opt.step()

Cases (each without a bug, ``--bug none``, and with each of its bugs; AdamW, fixed seeds, a fresh batch per step):

- ``gpt2``: Hugging Face ``GPT2LMHeadModel`` (2 layers, width 64, 4 heads, eager attention) with GPT-2's real
  50,257-token vocabulary, batch 4 x 32 random ids, ``model(input_ids=ids, labels=ids).loss``. Bug ``softmax``: the
  attention softmax's backward 10% too large in ``transformer.h.0.attn`` only (that module's class is swapped for a
  subclass whose ``forward`` calls an eager attention with a custom ``autograd.Function`` softmax). 10 checks.
- ``nanogpt``: a nanoGPT written here (tied ``lm_head``, ``CausalSelfAttention`` with one ``c_attn`` and the softmax
  in its own ``forward``), vocabulary 50,304, 2 layers, width 64, 4 heads, block 64, batch 4 x 32. Bug ``softmax``
  in ``transformer.h.0.attn``. 10 checks.
- ``handwritten15m``: a pre-norm transformer (width 384, 6 layers, 8 heads, MLP 4x with GELU, untied ``lm_head``,
  vocabulary 8,000; about 16.8M parameters) with hand-written attention, batch 4 x 64 tokens, 90% Zipf-distributed
  and 10% uniform over the vocabulary, so ids near 8,000 are rare but appear. Bugs: ``softmax`` (``blocks.3.attn``),
  ``embedding_rare`` (``tok_emb``, an ``nn.Embedding`` subclass whose backward zeroes the gradient rows of ids
  7,900 and up) and ``linear_rows`` (``lm_head``, an ``nn.Linear`` subclass whose weight gradient is 20% too large
  in its last 4 output rows). 30 checks.
- ``transformer100m``: 12 ``nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.1, batch_first=True,
  norm_first=True)`` with a causal mask, a 32,000-token embedding, learned positions and an untied head, batch
  2 x 64, no bug; one thread. Two workers, unwatched and watched, side by side: peak RSS and median step time and
  their ratios, and the tensors whose coverage is 0. 30 steps: each watched step holds a check, and a worker
  prints its estimate after its first steps (say, one that exceeds 10 minutes; ``--checks`` lowers it).

A bug is *caught* when at least one alert of kind ``threshold`` or ``drift`` names the planted module or one of its
parameters (in the alert's ``tensor`` or ``message``); ``first_check`` is the 0-based index of the first check with
such an alert. Every other alert (all of them with ``--bug none``) is counted in ``other_alerts``.

Output: one JSON line per case (its runs and their summary) as each case ends, then a table for people. Lines that
start with ``{`` are the JSON. Workers' progress and the library's warnings go to stderr.

Example::

    python benchmarks/coverage.py --quick                               # every case, a few checks each
    python benchmarks/coverage.py --case gpt2 --case nanogpt            # 10 checks each
    python benchmarks/coverage.py --case handwritten15m --bug softmax --checks 8
    python benchmarks/coverage.py --worker handwritten15m --bug embedding_rare --checks 30   # one configuration
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import inspect
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
#: A watched run expected to take longer than this is flagged in its output (seconds).
LONG_RUN_SECONDS = 600.0
#: Rare ids of ``handwritten15m``'s ``embedding_rare`` bug: ``RARE_FROM`` and up get no gradient.
RARE_FROM = 7900


@dataclasses.dataclass(frozen=True)
class Case:
    """One model of the benchmark.

    Attributes:
        bugs: Planted bug -> the module it is planted in (its name in ``model.named_modules()``).
        checks: Checks (steps at ``every=1``) per run by default.
        quick: Checks per run with ``--quick``.
        threads: ``torch.set_num_threads`` of its workers.
        compare_unwatched: Also run the loop without the watch and report the ratios of peak RSS and step time.
    """

    bugs: Dict[str, str]
    checks: int
    quick: int
    threads: int = 2
    compare_unwatched: bool = False


CASES: Dict[str, Case] = {
    "gpt2": Case({"softmax": "transformer.h.0.attn"}, checks=10, quick=3),
    "nanogpt": Case({"softmax": "transformer.h.0.attn"}, checks=10, quick=3),
    "handwritten15m": Case({"softmax": "blocks.3.attn", "embedding_rare": "tok_emb", "linear_rows": "lm_head"}, checks=30, quick=2),
    "transformer100m": Case({}, checks=30, quick=2, threads=1, compare_unwatched=True),
}


# ---------------------------------------------------------------------------------------------------- planted bugs
class BadSoftmax(torch.autograd.Function):
    """Softmax over the last dimension whose backward is 10% too large."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        y = torch.softmax(a, dim=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return 1.1 * y * (g - (g * y).sum(-1, keepdim=True))


def softmax(att: torch.Tensor, bug: bool) -> torch.Tensor:
    """``att.softmax(-1)``, through :class:`BadSoftmax` when ``bug``."""
    return BadSoftmax.apply(att) if bug else F.softmax(att, dim=-1)


class _RareDropLookup(torch.autograd.Function):
    """``weight[ids]`` whose backward drops the gradient of ids ``rare_from`` and up."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, rare_from: int) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows, ctx.rare_from = weight.shape[0], rare_from
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[None, torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        grad = torch.zeros(ctx.rows, g.shape[-1], dtype=g.dtype, device=g.device)
        grad.index_add_(0, ids.reshape(-1), g.reshape(-1, g.shape[-1]))
        grad[ctx.rare_from:] = 0
        return None, grad, None


class RareDropEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose backward gives no gradient to ids ``rare_from`` and up (the rarest tokens)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, rare_from: int = RARE_FROM) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.rare_from = rare_from

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _RareDropLookup.apply(ids, self.weight, self.rare_from)


class _RowBugLinear(torch.autograd.Function):
    """``F.linear`` whose weight gradient is 20% too large in its last 4 output rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        x, weight = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_w = g2.t() @ x2
        grad_w[-4:] *= 1.2
        return g @ weight, grad_w, g2.sum(0) if ctx.has_bias else None


class RowBugLinear(nn.Linear):
    """An ``nn.Linear`` whose backward makes the weight gradient of its last 4 output rows 20% too large."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RowBugLinear.apply(x, self.weight, self.bias)


# ---------------------------------------------------------------------------------------------------- models
class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one ``c_attn`` projection, the causal mask and softmax written out in ``forward``."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))
        self.softmax_bug = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(softmax(att, self.softmax_bug))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), NanoMLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT (Karpathy): token and position embeddings, blocks, ``ln_f``, an ``lm_head`` tied to ``wte``."""

    def __init__(self, vocab_size: int = 50304, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, block_size: int = 64) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(0.0),
            h=nn.ModuleList(NanoBlock(n_embd, n_head, block_size) for _ in range(n_layer)), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


class Attention(nn.Module):
    """Hand-written attention: q, k, v, o projections, the causal mask, softmax and ``@ v`` in ``forward``."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads, self.softmax_bug = heads, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        return self.o((softmax(att, self.softmax_bug) @ v).transpose(1, 2).reshape(b, t, d))


class PreNormBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Handwritten15M(nn.Module):
    """Pre-norm transformer, width 384, 6 layers, 8 heads, vocabulary 8,000, untied ``lm_head``; ``bug`` plants one."""

    def __init__(self, bug: str = "none", vocab: int = 8000, d: int = 384, layers: int = 6, heads: int = 8, block: int = 64) -> None:
        super().__init__()
        self.tok_emb = RareDropEmbedding(vocab, d) if bug == "embedding_rare" else nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(PreNormBlock(d, heads) for _ in range(layers))
        self.blocks[3].attn.softmax_bug = bug == "softmax"
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = (RowBugLinear if bug == "linear_rows" else nn.Linear)(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Transformer100M(nn.Module):
    """12 ``nn.TransformerEncoderLayer`` (width 768, norm first, causal), vocabulary 32,000, learned positions, untied head."""

    def __init__(self, vocab: int = 32000, d: int = 768, layers: int = 12, heads: int = 12, block: int = 64) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(t, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.lm_head(self.ln_f(x))


def _planted_eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                             **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers' GPT-2 ``eager_attention_forward`` with its softmax through :class:`BadSoftmax`."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    attn_weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = BadSoftmax.apply(attn_weights)
    attn_weights = attn_weights.type(value.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    return torch.matmul(attn_weights, value).transpose(1, 2), attn_weights


def plant_gpt2_softmax(attn: nn.Module) -> None:
    """Give this one ``GPT2Attention`` the buggy softmax: its class becomes a subclass whose ``forward`` is a copy of
    ``GPT2Attention.forward`` calling :func:`_planted_eager_attention` (a class, unlike an instance attribute,
    survives ``copy.deepcopy``; every other layer keeps transformers' code)."""
    from transformers.models.gpt2 import modeling_gpt2

    base = type(attn)
    original = inspect.unwrap(base.forward)  # under transformers' @deprecate_kwarg
    scope = dict(original.__globals__, eager_attention_forward=_planted_eager_attention)
    forward = types.FunctionType(original.__code__, scope, original.__name__, original.__defaults__, original.__closure__)
    forward.__kwdefaults__ = original.__kwdefaults__
    assert modeling_gpt2.eager_attention_forward is not _planted_eager_attention
    attn.__class__ = type("PlantedGPT2Attention", (base,), {"forward": forward, "__module__": __name__})


def _gpt2(bug: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=50257, n_positions=128, attn_implementation="eager")
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config)
    if bug == "softmax":
        plant_gpt2_softmax(model.transformer.h[0].attn)
    return model


Batch = Any


def build(case: str, bug: str) -> Tuple[nn.Module, Callable[[nn.Module, Batch], torch.Tensor], Callable[[], Batch]]:
    """``(model, loss_fn, next_batch)`` of a case with ``bug`` planted (``"none"``: no bug); seeds are fixed."""
    if bug != "none" and bug not in CASES[case].bugs:
        raise ValueError(f"case {case} has no bug {bug!r}; its bugs: none, {', '.join(CASES[case].bugs) or '-'}")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if case == "gpt2":
        model = _gpt2(bug)

        def gpt2_loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            return m(input_ids=ids, labels=ids).loss

        return model, gpt2_loss, lambda: torch.randint(0, 50257, (4, 32), generator=gen)
    if case == "nanogpt":
        nano = NanoGPT()
        nano.transformer.h[0].attn.softmax_bug = bug == "softmax"

        def nano_loss(m: nn.Module, b: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return m(b[0], b[1])[1]

        def nano_batch() -> Tuple[torch.Tensor, torch.Tensor]:
            ids = torch.randint(0, 50304, (4, 33), generator=gen)
            return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

        return nano, nano_loss, nano_batch

    def lm_loss(m: nn.Module, b: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = m(b[0])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[1].reshape(-1))

    if case == "handwritten15m":
        zipf = 1.0 / torch.arange(1, 8001, dtype=torch.float64)
        zipf /= zipf.sum()

        def zipf_batch() -> Tuple[torch.Tensor, torch.Tensor]:
            ids = torch.multinomial(zipf, 4 * 65, replacement=True, generator=gen).view(4, 65)
            uniform = torch.randint(0, 8000, (4, 65), generator=gen)
            ids = torch.where(torch.rand(4, 65, generator=gen) < 0.1, uniform, ids)
            return ids[:, :-1], ids[:, 1:]

        return Handwritten15M(bug), lm_loss, zipf_batch
    if case == "transformer100m":

        def random_batch() -> Tuple[torch.Tensor, torch.Tensor]:
            ids = torch.randint(0, 32000, (2, 65), generator=gen)
            return ids[:, :-1], ids[:, 1:]

        return Transformer100M(), lm_loss, random_batch
    raise ValueError(f"unknown case {case!r}; expected one of {', '.join(CASES)}")


# ---------------------------------------------------------------------------------------------------- one configuration
def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM``; ``ru_maxrss`` would carry a parent's peak across ``exec``)."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def names_module(text: str, module: str) -> bool:
    """Whether ``text`` names ``module`` or something inside it (``module.weight``, ``module.c_attn:output``).

    Example:
        >>> names_module("transformer.h.0.attn.c_attn:output", "transformer.h.0.attn")
        True
        >>> names_module("own code of transformer.h.0.attn_dropout", "transformer.h.0.attn"), names_module("tokens", "tok")
        (False, False)
    """
    return re.search(r"(?<![\w.])" + re.escape(module) + r"(?![\w])", text or "") is not None


def zero_coverage(coverage: Any) -> Dict[str, Any]:
    """The tensors a run never covered, from ``watch.coverage`` in either of its forms.

    ``{name: {"backward": fraction, "training": fraction}}`` gives the tensors whose backward or training share is 0;
    the older ``{name: count}`` the tensors counted 0 times (listed as ``backward``).

    Example:
        >>> zero_coverage({"a": {"backward": 0.0, "training": 1.0}, "b": {"backward": 0.5, "training": 0.0}})
        {'format': 'fractions', 'backward': ['a'], 'training': ['b'], 'partial_backward': {'b': 0.5}}
        >>> zero_coverage({"a": 0, "b": 3})
        {'format': 'counts', 'backward': ['a'], 'training': None, 'partial_backward': {}}
    """
    if not isinstance(coverage, dict):
        return {"format": "absent", "backward": None, "training": None, "partial_backward": {}}
    if all(isinstance(v, dict) for v in coverage.values()):
        backward = {n: float(v.get("backward", 0) or 0) for n, v in coverage.items()}
        return {"format": "fractions", "backward": sorted(n for n, v in backward.items() if v == 0),
                "training": sorted(n for n, v in coverage.items() if not v.get("training")),
                "partial_backward": {n: round(v, 4) for n, v in backward.items() if 0 < v < 1}}
    return {"format": "counts", "backward": sorted(n for n, v in coverage.items() if not v), "training": None, "partial_backward": {}}


def _progress(label: str, text: str) -> None:
    print(f"[{label}] {text}", file=sys.stderr, flush=True)


def worker(case: str, bug: str, checks: int, watch: bool = True, threads: Optional[int] = None,
           max_minutes: Optional[float] = None) -> Dict[str, Any]:
    """Run one configuration in this process and return its figures.

    Args:
        case: A key of :data:`CASES`.
        bug: ``"none"`` or one of the case's bugs.
        checks: Training steps; with ``watch`` each one is a check (``every=1``).
        watch: Watch the loop with ``GradWatch``; without, the same loop unwatched.
        threads: ``torch.set_num_threads``; the case's own by default.
        max_minutes: Stop before a step that would end past this many minutes of loop time (``stopped_early`` says so).

    Returns:
        A JSON-ready dict: alerts and whether the planted module was named, coverage, K, forms, notes, peak RSS, times.
    """
    spec = CASES[case]
    threads = threads or spec.threads
    torch.set_num_threads(threads)
    label = f"{case}/{bug}/{'watched' if watch else 'unwatched'}"
    git = git_state()  # the code this run imports: gradwatch/ may be changing under the benchmark
    start = time.perf_counter()
    model, loss_fn, next_batch = build(case, bug)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    gw: Any = None
    if watch:
        import gradwatch

        gw = gradwatch.GradWatch(model, loss_fn, optimizer=opt, every=1, tensorboard=False, jsonl=False)
    setup_seconds = time.perf_counter() - start
    planted = spec.bugs.get(bug)
    step_seconds: List[float] = []
    check_seconds: List[float] = []
    check_of_step: Dict[int, int] = {}
    forms: collections.Counter[str] = collections.Counter()
    notes: collections.Counter[str] = collections.Counter()
    wording: Dict[str, str] = {}
    estimate: Optional[float] = None
    long_note: Optional[str] = None
    stopped_early: Optional[str] = None
    loop_start = time.perf_counter()
    for i in range(checks):
        elapsed = time.perf_counter() - loop_start
        if max_minutes is not None and step_seconds and elapsed + statistics.median(step_seconds) > 60 * max_minutes:
            stopped_early = f"after {i} of {checks} steps: the next would end past --max-minutes {max_minutes:g}"
            break
        batch = next_batch()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        report = gw.step(batch) if gw is not None else None
        opt.step()
        step_seconds.append(time.perf_counter() - t0)
        if report is not None:
            check_of_step[i] = len(check_of_step)
            check_seconds.append(float(getattr(report, "seconds", float("nan"))))
            forms[str(getattr(report, "form", "?"))] += 1
            for note in getattr(report, "notes", []) or []:  # counted by their words, the first wording kept
                key = re.sub(r"\d+(\.\d+)?", "#", str(note))
                notes[key] += 1
                wording.setdefault(key, str(note)[:400])
        if i == min(1, checks - 1):  # after two steps (the first check carries one-time costs)
            estimate = time.perf_counter() - loop_start + statistics.median(step_seconds) * (checks - i - 1)
            per_step = statistics.median(step_seconds)
            n = max(checks, spec.checks)  # the requested run, or the full one when fewer were asked for
            if per_step * n > LONG_RUN_SECONDS:
                long_note = (f"{n} {'watched' if watch else 'unwatched'} steps take about {per_step * n / 60:.1f} min at "
                             f"{per_step:.1f} s a step (> {LONG_RUN_SECONDS / 60:.0f} min on {threads} thread(s)); --checks N lowers it")
                _progress(label, long_note)
        if gw is not None or i == 0 or (i + 1) % 10 == 0:
            _progress(label, f"step {i + 1}/{checks}: {step_seconds[-1]:.2f} s (loss {loss.item():.3f}, "
                      f"alerts so far {len(gw.alerts) if gw is not None else 0})")
    loop_seconds = time.perf_counter() - loop_start
    out: Dict[str, Any] = {
        "case": case, "bug": bug, "watch": watch, "planted": planted, "threads": threads, "git": git,
        "n_params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        "steps": len(step_seconds), "steps_requested": checks, "stopped_early": stopped_early,
        "peak_rss_bytes": peak_rss_bytes(), "setup_seconds": round(setup_seconds, 3), "loop_seconds": round(loop_seconds, 3),
        "median_step_seconds": statistics.median(step_seconds) if step_seconds else None,
        "estimated_loop_seconds": None if estimate is None else round(estimate, 1), "long_run_note": long_note,
    }
    if gw is None:
        return out
    alerts = list(gw.alerts)
    hits = [a for a in alerts if a.kind in ("threshold", "drift") and planted is not None
            and (names_module(a.tensor, planted) or names_module(a.message, planted))]
    others = [a for a in alerts if planted is None or not (names_module(a.tensor, planted) or names_module(a.message, planted))]
    first = min((check_of_step.get(a.step, a.step) for a in hits), default=None)
    coverage = getattr(gw, "coverage", None)
    modules_checked = getattr(gw, "modules_checked", None) or {}
    out.update({
        "checks": len(check_of_step),
        "alerts": len(alerts),
        "alert_kinds": dict(collections.Counter(f"{getattr(a, 'part', 'backward')}/{a.kind}" for a in alerts)),
        "caught": bool(hits) if planted is not None else None,
        "first_check": first,
        "named": sorted({a.tensor for a in hits}),
        "named_in_tensor": any(names_module(a.tensor, planted) for a in hits) if planted is not None else None,
        "other_alerts": len(others),
        "other_alert_tensors": sorted({a.tensor for a in others}),
        "alerts_detail": [{"step": a.step, "kind": a.kind, "part": getattr(a, "part", None), "tensor": a.tensor,
                           "message": str(a.message)[:300]} for a in alerts[:12]],
        "cycle_length": getattr(gw, "cycle_length", None),
        "coverage": zero_coverage(coverage),
        "planted_module_checks": ({m: n for m, n in modules_checked.items() if names_module(m, planted)}
                                  if planted is not None and isinstance(modules_checked, dict) else None),
        "forms": dict(forms),
        "notes": [{"count": n, "note": wording[key]} for key, n in notes.most_common(12)],
        "median_check_seconds": statistics.median(check_seconds) if check_seconds else None,
    })
    out["coverage_zero_backward"] = out["coverage"]["backward"]
    out["coverage_zero_training"] = out["coverage"]["training"]
    gw.close()
    return out


# ---------------------------------------------------------------------------------------------------- the driver
def git_state() -> Dict[str, Any]:
    """The checkout's ``HEAD`` and whether ``gradwatch/`` differs from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    modified = bool(git("status", "--porcelain", "--", "gradwatch"))
    return {"head": git("rev-parse", "--short", "HEAD") or None, "gradwatch_modified": modified}


def spawn(case: str, bug: str, checks: int, watch: bool = True, threads: Optional[int] = None,
          max_minutes: Optional[float] = None) -> Dict[str, Any]:
    """Run :func:`worker` in a fresh interpreter; its stderr is passed through, its last stdout line is the result."""
    cmd = [sys.executable, HERE, "--worker", case, "--bug", bug, "--checks", str(checks)]
    cmd += ([] if watch else ["--unwatched"]) + ([] if threads is None else ["--threads", str(threads)])
    cmd += [] if max_minutes is None else ["--max-minutes", repr(max_minutes)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tail: Deque[str] = collections.deque(maxlen=20)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line.rstrip())
        rc = proc.wait()
        stdout.seek(0)
        lines = [ln for ln in stdout.read().splitlines() if ln.startswith("{")]
    wall = round(time.perf_counter() - start, 1)
    if rc != 0 or not lines:
        errors = [ln for ln in tail if ln and not ln.startswith("[")]
        return {"case": case, "bug": bug, "watch": watch, "error": f"worker exited {rc}: {(errors or ['?'])[-1][:300]}",
                "wall_seconds": wall, "command": " ".join(cmd[1:])}
    row = json.loads(lines[-1])
    row["wall_seconds"] = wall
    return row


def run_case(case: str, checks: int, bugs: Optional[Sequence[str]] = None, threads: Optional[int] = None,
             max_minutes: Optional[float] = None) -> Dict[str, Any]:
    """Every configuration of ``case`` (without a bug, then each bug; unwatched beside watched where the case says),
    one subprocess each; returns the case's JSON record."""
    spec = CASES[case]
    bugs = list(bugs) if bugs is not None else ["none", *spec.bugs]
    runs = []
    if spec.compare_unwatched:
        runs.append(spawn(case, "none", checks, watch=False, threads=threads, max_minutes=max_minutes))
    for bug in bugs:
        runs.append(spawn(case, bug, checks, threads=threads, max_minutes=max_minutes))
    heads = {json.dumps(r.get("git"), sort_keys=True) for r in runs if r.get("git")}
    record: Dict[str, Any] = {"case": case, "checks": checks, "git": [json.loads(h) for h in sorted(heads)], "runs": runs}
    caught = {r["bug"]: {"caught": r.get("caught"), "first_check": r.get("first_check"), "named": r.get("named"),
                         "cycle_length": r.get("cycle_length")} for r in runs if r.get("watch") and r["bug"] != "none"}
    clean = next((r for r in runs if r.get("watch") and r["bug"] == "none"), None)
    record["summary"] = {"bugs": caught, "false_alarms_without_bug": None if clean is None else clean.get("alerts")}
    plain = next((r for r in runs if not r.get("watch")), None)
    if plain is not None and clean is not None:
        ok = all(isinstance(r.get(k), (int, float)) and r[k] for r in (plain, clean) for k in ("peak_rss_bytes", "median_step_seconds"))
        record["summary"].update({
            "peak_rss_mb": None if not ok else {"unwatched": plain["peak_rss_bytes"] / 2**20, "watched": clean["peak_rss_bytes"] / 2**20},
            "peak_rss_ratio": clean["peak_rss_bytes"] / plain["peak_rss_bytes"] if ok else None,
            "median_step_seconds": None if not ok else {"unwatched": plain["median_step_seconds"], "watched": clean["median_step_seconds"]},
            "median_step_ratio": clean["median_step_seconds"] / plain["median_step_seconds"] if ok else None,
            "coverage_zero_backward": clean.get("coverage_zero_backward"), "coverage_zero_training": clean.get("coverage_zero_training"),
        })
    return record


def _fmt(x: Any, spec: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return format(x, spec) if spec else str(x)


def _names(names: Optional[Sequence[str]], shown: int = 3) -> str:
    if names is None:
        return "-"
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return f"{len(names)} [" + ", ".join(names[:shown]) + more + "]" if names else "0"


def table(records: Sequence[Dict[str, Any]]) -> str:
    """The records as a table for people: one row per run, then the unwatched/watched ratios."""
    head = ("case", "bug", "watch", "checks", "alerts", "other", "caught", "first", "named", "K", "forms", "cov0 b/t",
            "peak MB", "step s", "wall s")
    rows: List[Tuple[str, ...]] = []
    ratios = []
    for rec in records:
        for r in rec["runs"]:
            if "error" in r:
                rows.append((r["case"], r["bug"], "yes" if r.get("watch") else "no", "ERROR", r["error"][:90]))
                continue
            named = ",".join(r.get("named") or []) or "-"
            cov = r.get("coverage") or {}
            zeros = (cov.get("backward"), cov.get("training"))
            cov0 = "-" if not r.get("watch") else "/".join(_fmt(None if v is None else len(v)) for v in zeros)
            rows.append((r["case"], r["bug"], _fmt(r["watch"]), f"{r['steps']}/{r['steps_requested']}", _fmt(r.get("alerts")),
                         _fmt(r.get("other_alerts")), _fmt(r.get("caught")), _fmt(r.get("first_check")),
                         named if len(named) <= 40 else named[:37] + "...", _fmt(r.get("cycle_length")),
                         ",".join(f"{k}x{v}" for k, v in (r.get("forms") or {}).items()) or "-", cov0,
                         f"{r['peak_rss_bytes'] / 2**20:.0f}", _fmt(r.get("median_step_seconds"), ".2f"), _fmt(r.get("wall_seconds"))))
        s = rec.get("summary", {})
        if s.get("peak_rss_ratio") is not None:
            ratios.append(f"{rec['case']}: peak RSS {s['peak_rss_mb']['unwatched']:.0f} -> {s['peak_rss_mb']['watched']:.0f} MB "
                          f"({s['peak_rss_ratio']:.2f}x); median step {s['median_step_seconds']['unwatched']:.2f} -> "
                          f"{s['median_step_seconds']['watched']:.2f} s ({s['median_step_ratio']:.1f}x); coverage 0: "
                          f"backward {_names(s['coverage_zero_backward'])}, training {_names(s['coverage_zero_training'])}")
    widths = [max(len(row[i]) for row in (head, *rows) if i < len(row)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *rows)]
    return "\n".join(lines + ratios)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python benchmarks/coverage.py [--case NAME] [--checks N] [--quick]``, or ``--worker CASE --bug BUG``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/coverage.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--case", action="append", help=f"a case to run (repeat, or comma-separate); default: all of {', '.join(CASES)}")
    parser.add_argument("--bug", help="only this bug ('none' for the run without one); with --worker, the bug to plant (default none)")
    parser.add_argument("--checks", type=int, help="checks (steps at every=1) per run; default per case (10, 10, 30, 30)")
    parser.add_argument("--quick", action="store_true", help="a few checks per run (3, 3, 2, 2): a smoke test of the harness")
    parser.add_argument("--threads", type=int, help="torch threads of the workers; default per case (2; 1 for transformer100m)")
    parser.add_argument("--max-minutes", type=float, help="stop each run's loop before a step that would end past this many minutes")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--worker", choices=sorted(CASES), help="run one configuration in this process and print its JSON line")
    parser.add_argument("--unwatched", action="store_true", help="with --worker: the same loop without the watch")
    args = parser.parse_args(argv)
    if args.checks is not None and args.checks < 1:
        parser.error("--checks must be at least 1")
    if args.worker:
        spec = CASES[args.worker]
        bug = args.bug or "none"
        if bug != "none" and bug not in spec.bugs:
            parser.error(f"--bug: {args.worker} has the bugs none, {', '.join(spec.bugs) or '(none other)'}")
        checks = args.checks or (spec.quick if args.quick else spec.checks)
        print(json.dumps(worker(args.worker, bug, checks, watch=not args.unwatched, threads=args.threads, max_minutes=args.max_minutes)))
        return 0
    cases = [c.strip() for arg in (args.case or [",".join(CASES)]) for c in arg.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--case: unknown {', '.join(unknown)}; expected some of {', '.join(CASES)}")
    records = []
    for case in cases:
        spec = CASES[case]
        bugs = None
        if args.bug is not None:
            if args.bug != "none" and args.bug not in spec.bugs:
                parser.error(f"--bug: {case} has the bugs none, {', '.join(spec.bugs) or '(none other)'}")
            bugs = [args.bug]
        checks = args.checks or (spec.quick if args.quick else spec.checks)
        record = run_case(case, checks, bugs, threads=args.threads, max_minutes=args.max_minutes)
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(line + "\n")
        records.append(record)
    print()
    print(table(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
