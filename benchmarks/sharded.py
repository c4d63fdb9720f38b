"""FSDP2 checked shard by shard: per-rank peak memory and check time, watched against unwatched, 2 gloo ranks.

Each configuration is one ``torchrun`` launch of 2 CPU ranks per arm (peak RSS is per process,
so every figure comes from its own processes), SGD, ``steps`` steps, and the watch
``GradWatch(model, loss_fn, optimizer=opt, every=1)`` at its default options otherwise:

- ``mlp``: ``512 -> h -> h -> h -> h -> 10`` (tanh), each Linear and the root ``fully_shard``-ed;
- ``mlp-bf16``: the same with ``MixedPrecisionPolicy(param_dtype=bfloat16)``;
- ``transformer``: a pre-norm transformer with hand-written causal attention (width ``d``, 4 heads,
  vocabulary 8,000, sequence 64, batch 8 per rank), each block and the root sharded.

``--bug`` plants a 10% error in one block's attention softmax backward (in the transformer) or in
the second tanh (in the MLP); the summary then names the alerted tensors. ``--one`` also times the
same transformer's checks in one process (the same model and batch, not sharded), for the time
ratio 2 ranks / 1 process.

Example::

    python benchmarks/sharded.py --config mlp --params 17e6
    python benchmarks/sharded.py --config transformer --params 5e6 --one
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from ddp_memory import _port  # benchmarks/ beside this file: the same MLP width and free port as the DDP benchmark
from ddp_memory import width as mlp_width

VOCAB, SEQ, BATCH = 8000, 64, 8


def lm_layers(n_params: float, d: int) -> int:
    """Blocks of width ``d`` (12 d^2 each) that, with the tied-free embedding and head, make about ``n_params``.

    Example:
        >>> lm_layers(5e6, 128)
        4
    """
    return max(1, round((n_params - 2 * VOCAB * d) / (12 * d * d)))


def build(config: str, n_params: float, bug: bool) -> Any:
    """The model (not sharded) and its loss."""
    import torch
    import torch.nn.functional as F
    from real_size import BadSoftmax as Softmax10  # softmax whose backward is 10% too large
    from torch import nn

    class Tanh10(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (y,) = ctx.saved_tensors
            return 1.1 * g * (1 - y * y)

    class Act(nn.Module):
        def __init__(self, wrong: bool) -> None:
            super().__init__()
            self.wrong = wrong

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Tanh10.apply(x) if self.wrong else torch.tanh(x)

    class Attention(nn.Module):
        def __init__(self, d: int, wrong: bool) -> None:
            super().__init__()
            self.qkv, self.out, self.heads, self.wrong = nn.Linear(d, 3 * d), nn.Linear(d, d), 4, wrong

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            s = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            a = Softmax10.apply(s) if self.wrong else torch.softmax(s, -1)
            return self.out((a @ v).transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self, d: int, wrong: bool) -> None:
            super().__init__()
            self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, wrong), nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class LM(nn.Module):
        def __init__(self, d: int, layers: int, wrong_block: int) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, d)
            self.blocks = nn.ModuleList([Block(d, i == wrong_block) for i in range(layers)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    if config == "transformer":
        d = 128 if n_params < 20e6 else 512
        layers = lm_layers(n_params, d)
        model = LM(d, layers, layers // 2 if bug else -1)

        def lm_loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            logits = m(ids[:, :-1])
            return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

        return model, lm_loss, list(model.blocks)
    h = mlp_width(n_params)
    layers: List[nn.Module] = [nn.Linear(512, h), Act(False)]
    for i in range(3):
        layers += [nn.Linear(h, h), Act(bug and i == 0)]
    model = nn.Sequential(*layers, nn.Linear(h, 10))

    def mlp_loss(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    return model, mlp_loss, [m for m in model if isinstance(m, nn.Linear)]


def batch(config: str, gen: Any) -> Any:
    import torch

    if config == "transformer":
        return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return torch.randn(64, 512, generator=gen), torch.randint(0, 10, (64,), generator=gen)


def worker(config: str, n_params: float, watch: bool, bug: bool, steps: int, sharded: bool = True,
           options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One rank of one arm (under ``torchrun``), or with ``sharded=False`` one plain process; returns its figures."""
    import resource

    import torch

    torch.set_num_threads(1)
    rank = 0
    if sharded:
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    model, loss_fn, units = build(config, n_params, bug)
    if sharded:
        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) if config == "mlp-bf16" else {}
        for unit in units:
            fully_shard(unit, **kw)
        fully_shard(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw = None
    if watch:
        from gradwatch import GradWatch

        gw = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None, **(options or {}))
    gen = torch.Generator().manual_seed(rank)
    check_seconds: List[float] = []
    for _ in range(steps):
        b = batch(config, gen)
        opt.zero_grad()
        loss_fn(model, b).backward()
        if gw is not None:
            t0 = time.perf_counter()
            gw.step(b)
            check_seconds.append(time.perf_counter() - t0)
        opt.step()
    out: Dict[str, Any] = {"rank": rank, "watch": watch, "sharded": sharded,
                           "n_params": sum(p.numel() for p in model.parameters()),
                           "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                           "check_seconds": check_seconds}
    if gw is not None:
        cov = gw.coverage
        out.update(alerts=sorted({a.tensor for a in gw.alerts}), k=gw.cycle_length,
                   backward_min=min(v["backward"] for v in cov.values()),
                   training_min=min(v["training"] for v in cov.values()),
                   never=sorted(n for n, v in cov.items() if v["backward"] == 0 or v["training"] == 0))
        gw.close()
    if sharded:
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def launch(args: argparse.Namespace, watch: bool, ranks: int = 2) -> List[Dict[str, Any]]:
    """Every rank's figures of one arm (one ``torchrun`` launch), or of one plain process with ``ranks=0``."""
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    tail = ["--worker", "--config", args.config, "--params", str(args.params), "--steps", str(args.steps),
            "--options", args.options] \
        + (["--watch"] if watch else []) + (["--bug"] if args.bug else [])
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
               "127.0.0.1", "--master_port", str(_port()), here] + tail
    else:
        cmd = [sys.executable, here] + tail + ["--plain"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(rows) != max(ranks, 1):
        raise RuntimeError(f"run failed ({done.returncode}): {done.stderr.strip()[-3000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python benchmarks/sharded.py --config C --params N [--bug] [--one]``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/sharded.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("mlp", "mlp-bf16", "transformer"), default="mlp")
    parser.add_argument("--params", type=float, default=17e6, help="parameters (default 17e6)")
    parser.add_argument("--steps", type=int, default=4, help="steps, each checked (default 4)")
    parser.add_argument("--bug", action="store_true", help="plant a 10%% backward error")
    parser.add_argument("--one", action="store_true", help="also time the checks in one plain process")
    parser.add_argument("--options", default="{}", help="GradWatch options as JSON (default: none)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--watch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        row = worker(args.config, args.params, args.watch, args.bug, args.steps, not args.plain, json.loads(args.options))
        sys.stdout.write(json.dumps(row) + "\n")  # one write: the ranks share torchrun's stdout
        sys.stdout.flush()
        return 0
    plain, watched = launch(args, False), launch(args, True)
    for row in plain + watched:
        print(json.dumps(row), flush=True)
    summary: Dict[str, Any] = {
        "config": args.config, "params": watched[0]["n_params"], "ranks": 2, "bug": args.bug,
        "peak_mb_per_rank": [[round(p["peak_mb"]), round(w["peak_mb"])] for p, w in zip(plain, watched)],
        "peak_ratio_per_rank": [round(w["peak_mb"] / p["peak_mb"], 3) for w, p in zip(watched, plain)],
        "check_s_median": round(_median(watched[0]["check_seconds"][1:] or watched[0]["check_seconds"]), 3),
        "alerts": watched[0]["alerts"], "K": watched[0]["k"], "backward_min": watched[0]["backward_min"],
        "training_min": watched[0]["training_min"], "never": watched[0]["never"]}
    if args.one:
        one = launch(args, True, ranks=0)[0]
        summary["one_process_check_s_median"] = round(_median(one["check_seconds"][1:] or one["check_seconds"]), 3)
        summary["time_ratio_2_ranks_over_1"] = round(summary["check_s_median"] / summary["one_process_check_s_median"], 3)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
