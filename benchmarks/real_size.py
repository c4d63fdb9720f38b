"""Coverage at real size: planted bugs in real-vocabulary language models, and what a watch of a ~100M model costs.

Each configuration runs in a fresh interpreter (peak RSS is per process) and prints one JSON line.
A user's loop, ``GradWatch(model, loss_fn, optimizer=opt, every=1)`` at default options otherwise:

- ``gpt2``: Hugging Face ``GPT2LMHeadModel`` (eager attention, 2 layers, width 64) with its real
  50,257-token vocabulary, batch 4 x 32. Bug ``softmax``: layer 0's attention softmax backward 10% too
  large (``transformer.h.0.attn``).
- ``gpt2lora``: the same GPT-2 under ``peft`` LoRA (rank 8 on ``c_attn``, the base frozen: only the adapters
  train). Bug ``softmax`` as for ``gpt2``: it reaches the adapters through the frozen attention code, which is
  checked for what it passes back to them.
- ``nanogpt``: a nanoGPT-style model written here (tied embedding, causal self-attention with an explicit
  softmax in its ``forward``), vocabulary 50,304, 2 layers, width 64, batch 4 x 32. Bug ``softmax`` in
  ``transformer.h.0.attn``.
- ``hand15m``: a ~15M pre-norm transformer (width 384, 6 layers, 8 heads, vocabulary 8,000, untied head)
  with hand-written attention; batch 4 x 64, 90% of the tokens Zipf-distributed and 10% uniform, so the
  last ids are rare. Bugs: ``softmax`` in ``blocks.3.attn``; ``embedding_rare``, the token embedding's
  backward drops the gradient of the tokens seen once in the batch (``tok``); ``embedding_rare_index``, it
  drops that of ids 7,990 and up (the rarest, at the end of the vocabulary); ``linear_rows``,
  the head's weight gradient 20% too large in the last 4 output rows of the weight its backward is given
  (``head``, a Linear subclass with its own forward: its blocks of rows are checked in place at its full size,
  one float64 copy of its weight, 23 MB, so only the block holding rows 7,996:8,000 shows it). All at the default
  options.
- ``gpt2small``: HF ``GPT2LMHeadModel`` in GPT-2 small's configuration (12 layers, width 768, vocabulary 50,257,
  124M parameters), batch 2 x 256. No bug: coverage, peak RSS and check time against the same loop unwatched.
- ``t100m``: width 768, 12 ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention``, norm first), vocabulary
  32,000, learned positions, untied head (~100M parameters), batch 2 x 64. No bug: every tensor's coverage,
  peak RSS and median step time against the same loop unwatched.

Each case also runs its loop unwatched (the same batches, in a subprocess of its own): every run's median check (the
whole ``watch.step`` call that checked: backward, training and independence parts and planning;
``median_backward_part_seconds`` is the backward part alone, the report's ``seconds``) is printed in that loop's median
training steps (``check_in_steps``), and for ``t100m`` and ``gpt2small`` the peak
RSS watched against unwatched (``peak_ratio``).

A run with a bug stops at the first check whose alerts name the planted module ("caught"); a run without
one runs all its checks and counts alerts (false alarms).

Example::

    python benchmarks/real_size.py                     # every case (long: tens of minutes on 2 cores)
    python benchmarks/real_size.py --cases gpt2,nanogpt --checks 10
    python benchmarks/real_size.py --worker hand15m --bug softmax --checks 30   # one configuration
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

#: Options of the watch other than the defaults, per bug (none now: a subclass's block checked in place, which a
#: backward that depends on the absolute row index needs, fits the default memory_budget since its one float64 copy).
OPTIONS: Dict[str, Dict[str, Any]] = {}
#: case -> (bugs, planted module per bug, checks by default)
CASES: Dict[str, Tuple[Tuple[str, ...], Dict[str, str], int]] = {
    "gpt2": (("softmax",), {"softmax": "transformer.h.0.attn"}, 10),
    "gpt2lora": (("softmax",), {"softmax": "base_model.model.transformer.h.0.attn"}, 10),
    "nanogpt": (("softmax",), {"softmax": "transformer.h.0.attn"}, 10),
    "hand15m": (("softmax", "embedding_rare", "embedding_rare_index", "linear_rows"),
                {"softmax": "blocks.3.attn", "embedding_rare": "tok", "embedding_rare_index": "tok", "linear_rows": "head"}, 30),
    "t100m": ((), {}, 30),
    "gpt2small": ((), {}, 4),
}
#: Cases whose watched and unwatched peak memory and step time are compared (the big ones).
MEASURED = ("t100m", "gpt2small")


class BadSoftmax(torch.autograd.Function):
    """Softmax over the last dimension whose backward is 10% too large (the planted attention bug)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        y = a.softmax(-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return 1.1 * y * (g - (g * y).sum(-1, keepdim=True))


def softmax(a: torch.Tensor, bug: bool) -> torch.Tensor:
    """``a.softmax(-1)``, or with the planted bug."""
    return BadSoftmax.apply(a) if bug else a.softmax(-1)


class _RareDrop(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, w: torch.Tensor, rare_from: Optional[int]) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows, ctx.rare_from = w.shape[0], rare_from
        return w[ids]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[None, torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        gw = torch.zeros(ctx.rows, g.shape[-1], dtype=g.dtype, device=g.device)
        gw.index_add_(0, ids.flatten(), g.flatten(0, -2))
        if ctx.rare_from is None:  # the tokens seen once in the batch get no gradient
            gw[torch.bincount(ids.flatten(), minlength=ctx.rows) == 1] = 0
        else:  # the rarest ids (the end of a frequency-sorted vocabulary) get no gradient
            gw[ctx.rare_from:] = 0
        return None, gw, None


class RareDropEmbedding(nn.Embedding):
    """An Embedding whose custom backward drops the gradient of rare tokens: ids ``rare_from`` and up, or
    (``rare_from=None``) the tokens seen once in the batch."""

    def __init__(self, *args: Any, rare_from: Optional[int] = 7990, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rare_from = rare_from

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _RareDrop.apply(ids, self.weight, self.rare_from)


class _RowBug(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        gw = g.flatten(0, -2).t() @ x.flatten(0, -2)
        gw[-4:] *= 1.2  # the last 4 output rows of the weight
        return g @ w, gw, g.flatten(0, -2).sum(0)


class RowBugLinear(nn.Linear):
    """A Linear whose custom backward makes the weight gradient of its last 4 output rows 20% too large."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RowBug.apply(x, self.weight, self.bias)


def _peak_bytes() -> int:
    with open("/proc/self/status", "rb") as fh:
        for line in fh:
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _models() -> Any:
    """The model classes."""
    class CausalSelfAttention(nn.Module):
        """nanoGPT's attention: one c_attn projection, the softmax written out in forward."""

        def __init__(self, d: int, heads: int, bug: bool = False) -> None:
            super().__init__()
            self.c_attn, self.c_proj, self.heads, self.bug = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, bug

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.c_attn(x).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
            att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1), float("-inf"))
            att = softmax(att, self.bug)
            return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, d))

    class MLP(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, bug: bool = False) -> None:
            super().__init__()
            self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), CausalSelfAttention(d, heads, bug), nn.LayerNorm(d), MLP(d)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class NanoGPT(nn.Module):
        def __init__(self, vocab: int = 50304, d: int = 64, layers: int = 2, heads: int = 4, block: int = 64,
                     bug: bool = False) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
                h=nn.ModuleList(Block(d, heads, bug and i == 0) for i in range(layers)), ln_f=nn.LayerNorm(d)))
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT

        def forward(self, idx, targets):
            t = idx.shape[1]
            x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t, device=idx.device))
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    class Attention(nn.Module):
        """Hand-written attention: q, k, v, o projections, the causal mask and softmax in forward."""

        def __init__(self, d: int, heads: int, bug: bool = False) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.heads, self.bug = heads, bug

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (f(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1), float("-inf"))
            return self.o((softmax(att, self.bug) @ v).transpose(1, 2).reshape(b, t, d))

    class PreNorm(nn.Module):
        def __init__(self, d: int, heads: int, bug: bool = False) -> None:
            super().__init__()
            self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads, bug), nn.LayerNorm(d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Hand15M(nn.Module):
        def __init__(self, bug: str = "none", vocab: int = 8000, d: int = 384, layers: int = 6, heads: int = 8,
                     block: int = 64) -> None:
            super().__init__()
            if bug.startswith("embedding_rare"):
                self.tok: nn.Embedding = RareDropEmbedding(vocab, d, rare_from=7990 if bug.endswith("index") else None)
            else:
                self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(block, d)
            self.blocks = nn.ModuleList(PreNorm(d, heads, bug == "softmax" and i == 3) for i in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = (RowBugLinear if bug == "linear_rows" else nn.Linear)(d, vocab)

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    class T100M(nn.Module):
        def __init__(self, vocab: int = 32000, d: int = 768, layers: int = 12, block: int = 64) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 12, 4 * d, dropout=0.1, batch_first=True,
                                                                   norm_first=True) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, ids):
            t = ids.shape[1]
            x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
            mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
            for layer in self.layers:
                x = layer(x, src_mask=mask, is_causal=True)
            return self.head(self.ln(x))

    return dict(NanoGPT=NanoGPT, Hand15M=Hand15M, T100M=T100M)


def _gpt2(bug: bool, small: bool = False) -> Any:
    """HF GPT-2 (eager attention, real vocabulary), the softmax of layer 0 planted with ``BadSoftmax``; ``small``:
    GPT-2 small's configuration (12 layers, width 768, 124M parameters, context 256) instead of 2 layers of 64."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2 import modeling_gpt2

    if bug:
        original = modeling_gpt2.eager_attention_forward

        def planted(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            if module.layer_idx != 0:
                return original(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            scaling = query.size(-1) ** -0.5 if scaling is None else scaling
            w = torch.matmul(query, key.transpose(-1, -2)) * scaling
            if attention_mask is not None:
                w = w + attention_mask
            w = BadSoftmax.apply(w)
            return torch.matmul(w, value).transpose(1, 2), w

        modeling_gpt2.eager_attention_forward = planted
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=256) if small \
        else GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=50257, n_positions=128)
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


def _setup(case: str, bug: str) -> Tuple[Any, Any, Any]:
    """``(model, loss_fn, batch maker)`` of a case."""
    models = _models()
    gen = torch.Generator().manual_seed(1)
    if case in ("gpt2", "gpt2lora"):
        model = _gpt2(bug == "softmax")
        if case == "gpt2lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["c_attn"],
                                                     fan_in_fan_out=True))

        def batch(i: int) -> Any:
            return torch.randint(0, 50257, (4, 32), generator=gen)

        return model, (lambda m, b: m(input_ids=b, labels=b).loss), batch
    if case == "gpt2small":
        model = _gpt2(False, small=True)

        def batch(i: int) -> Any:
            return torch.randint(0, 50257, (2, 256), generator=gen)

        return model, (lambda m, b: m(input_ids=b, labels=b).loss), batch
    if case == "nanogpt":
        model = models["NanoGPT"](bug=bug == "softmax")

        def batch(i: int) -> Any:
            ids = torch.randint(0, 50304, (4, 33), generator=gen)
            return ids[:, :-1], ids[:, 1:]

        return model, (lambda m, b: m(b[0], b[1])), batch
    if case == "hand15m":
        model = models["Hand15M"](bug)
        zipf = 1.0 / torch.arange(1, 8001, dtype=torch.float64)

        def batch(i: int) -> Any:
            ids = torch.multinomial(zipf / zipf.sum(), 4 * 65, replacement=True, generator=gen).view(4, 65)
            uniform = torch.randint(0, 8000, (4, 65), generator=gen)
            ids = torch.where(torch.rand(4, 65, generator=gen) < 0.1, uniform, ids)
            return ids[:, :-1], ids[:, 1:]

        return model, (lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())), batch
    model = models["T100M"]()

    def batch(i: int) -> Any:
        ids = torch.randint(0, 32000, (2, 65), generator=gen)
        return ids[:, :-1], ids[:, 1:]

    return model, (lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())), batch


def worker(case: str, bug: str, checks: int, watch: bool = True, threads: int = 2, covered: bool = False,
           options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One configuration in this process (see the module docstring); returns its figures. It stops at the check that
    catches the planted bug, or with ``covered``, at the first check after it where every watched tensor has had both
    verdicts once (a paced cycle spreads the units of a slow check over the next ones), ``checks`` at most.
    ``options``: GradWatch options over the case's own (``{"pace": None}``: a test's K that the load cannot move)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, loss_fn, make_batch = _setup(case, bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    planted = CASES[case][1].get(bug)
    options = {**OPTIONS.get(bug, {}), **(options or {})}
    gw = None
    if watch:
        from gradwatch import GradWatch

        gw = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None, **options)
    steps, caught_at, named, forms, check_seconds, unchecked = [], None, [], [], [], []
    training: List[float] = []  # each step's own seconds, its check left out (the update part's judging in opt.step stays)
    backward_seconds: List[float] = []
    for i in range(checks):
        b = make_batch(i)
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model, b).backward()
        at = time.perf_counter()
        report = gw.step(b) if gw is not None else None
        watched = time.perf_counter() - at  # the whole check: backward, training and independence parts, planning
        opt.step()
        steps.append(time.perf_counter() - start)
        training.append(steps[-1] - watched)
        if report is not None:
            print(f"{case}/{bug}: check {i} took {watched:.2f} s (backward part {report.seconds:.2f} s), "
                  f"{len(report.pieces)} pieces, {len(gw.alerts) if gw is not None else 0} alerts so far",
                  file=sys.stderr, flush=True)
            forms.append(report.form)
            check_seconds.append(watched)
            backward_seconds.append(report.seconds)
            unchecked = [n for n in report.notes if "not checked" in n]
        if gw is not None and planted is not None:
            hits = [a for a in gw.alerts if a.kind in ("threshold", "drift") and a.tensor.startswith(planted)]
            if hits and caught_at is None:
                caught_at = i
                named = sorted({a.tensor for a in hits})
            if caught_at is not None and (not covered or all(v["backward"] and v["training"]
                                                                 for v in gw.coverage.values())):
                break
    out: Dict[str, Any] = {"case": case, "bug": bug, "watch": watch, "steps": len(steps), "options": options,
                           "n_params": sum(p.numel() for p in model.parameters()),
                           "peak_bytes": _peak_bytes(), "median_step_seconds": statistics.median(steps),
                           "median_training_seconds": statistics.median(training)}
    if gw is not None:
        coverage = gw.coverage
        out.update({
            "planted": planted, "caught_at_check": caught_at, "named": named,
            "alerts": len(gw.alerts),
            "alerts_on_other_modules": sorted({a.tensor for a in gw.alerts if planted is None or not a.tensor.startswith(planted)}),
            "alert_messages": [f"{a.kind} {a.severity} step {a.step}: {a.message}"[:600] for a in gw.alerts[:5]],
            "cycle_length": gw.cycle_length, "forms": sorted(set(forms)),
            "median_check_seconds": statistics.median(check_seconds) if check_seconds else None,
            "median_backward_part_seconds": statistics.median(backward_seconds) if backward_seconds else None,
            "backward_coverage_zero": [n for n, v in coverage.items() if not v["backward"]],
            "training_coverage_zero": [n for n, v in coverage.items() if not v["training"]],
            "backward_coverage_below_1": {n: v["backward"] for n, v in coverage.items() if 0 < v["backward"] < 1},
            "unreached_rows": {n: gw.planner.coverage.unreached(n) for n in coverage if gw.planner.coverage.unreached(n)},
            "not_checked": unchecked,
        })
        gw.close()
    return out


def _spawn(case: str, bug: str, checks: int, watch: bool = True, threads: int = 2, covered: bool = False,
           options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One configuration in a subprocess of its own (its peak memory is its own), on ``threads`` torch threads
    (``covered``, ``options``: :func:`worker`'s)."""
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, here, "--worker", case, "--bug", bug, "--checks", str(checks), "--threads", str(threads)] \
        + ([] if watch else ["--unwatched"]) + (["--covered"] if covered else []) \
        + (["--options", json.dumps(options)] if options else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"case": case, "bug": bug, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(cases: Sequence[str], checks: Optional[int]) -> List[Dict[str, Any]]:
    """Every configuration of ``cases``, side by side, one subprocess each; prints one JSON line per configuration."""
    rows = []
    for case in cases:
        bugs, _, default = CASES[case]
        n = checks or default
        for bug in ("none",) + bugs:
            row = _spawn(case, bug, n)
            print(json.dumps(row), flush=True)
            rows.append(row)
        watched = [r for r in rows if r.get("case") == case and "median_step_seconds" in r]
        plain = _spawn(case, "none", n if case in MEASURED else min(n, 6), watch=False)
        print(json.dumps(plain), flush=True)
        if "median_step_seconds" not in plain or not watched:
            continue
        # A check in training steps: each run's median check against the unwatched loop's median step, same run.
        ratios: Dict[str, Any] = {"case": case, "unwatched_step_seconds": plain["median_step_seconds"],
                                  "check_in_steps": {r["bug"]: r["median_check_seconds"] / plain["median_step_seconds"]
                                                     for r in watched if r.get("median_check_seconds")},
                                  # the same, against the watched run's own steps (its check left out): the two runs'
                                  # machine speeds do not enter it
                                  "check_in_own_steps": {r["bug"]: r["median_check_seconds"] / r["median_training_seconds"]
                                                         for r in watched if r.get("median_check_seconds")}}
        if case in MEASURED:
            ratios["peak_ratio"] = watched[0]["peak_bytes"] / plain["peak_bytes"]
        print(json.dumps(ratios), flush=True)
        rows.append(ratios)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python benchmarks/real_size.py [--cases A,B] [--checks N]`` or ``--worker CASE --bug BUG``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/real_size.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--checks", type=int, default=None, help="checks (steps at every=1) per run; default per case")
    parser.add_argument("--worker", choices=sorted(CASES), help="run one configuration in this process")
    parser.add_argument("--bug", default="none")
    parser.add_argument("--unwatched", action="store_true", help="with --worker: the same loop without the watch")
    parser.add_argument("--threads", type=int, default=2, help="with --worker: torch threads (default 2)")
    parser.add_argument("--covered", action="store_true",
                        help="with --worker: after the catch, go on until every tensor has had both verdicts")
    parser.add_argument("--options", type=json.loads, default=None,
                        help='with --worker: GradWatch options as JSON over the case\'s own (e.g. \'{"pace": null}\')')
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.bug, args.checks or CASES[args.worker][2], watch=not args.unwatched,
                                threads=args.threads, covered=args.covered, options=args.options)))
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; expected some of {', '.join(CASES)}")
    run(cases, args.checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
