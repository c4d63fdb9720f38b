"""Tensor, sequence and 2-D parallel, DeepSpeed ZeRO-3: per-rank peak memory and check time, watched against unwatched.

Run: ``python benchmarks/parallel.py`` (about 12 minutes on 2 CPU cores; ``--quick``: about 2). Measured 2026-11-27
on the shared 2-core AMD EPYC VM, quiet, torch 2.13 CPU, deepspeed 0.19.8. "1 process" is the same check in one
process: the same model, options and step, on the step's whole batch (for the data-parallel ``2d21`` and ZeRO, both
ranks' batches in one); beside it, for those, one process on one rank's batch alone (its check's seconds, and the
ratio to it); peaks in MB, unwatched / watched; the check in unwatched training steps. Default sizes (4.19M
parameters, 16 MB in fp32), 8 steps, ``--repeat 2`` at commit aef4e2c:

| engine | peak MB r0 | r1 | peak ratio r0, r1 | check s 2 ranks | 1 process | ratio | one rank's batch | steps, 2 / 1 |
|---|---|---|---|---|---|---|---|---|
| tensor parallel | 361 / 387 | 360 / 387 | 1.072, 1.076 | 0.579 | 0.389 | 1.50 (1.60, 1.40) | the same | 2.6 / 2.9 |
| sequence parallel | 366 / 390 | 368 / 388 | 1.066, 1.056 | 0.787 | 0.340 | 2.32 (2.28, 2.35) | the same | 3.4 / 2.9 |
| FSDP2 x TP 2x1 | 445 / 444 | 442 / 463 | 0.999, 1.048 | 0.815 | 0.580 | 1.41 (1.44, 1.37) | 0.337 (2.42) | 3.2 / 2.5 |
| FSDP2 x TP 1x2 | 384 / 407 | 383 / 409 | 1.060, 1.067 | 0.848 | 0.376 | 2.25 (2.17, 2.34) | the same | 4.6 / 3.1 |
| ZeRO-3 | 602 / 606 | 605 / 607 | 1.005, 1.003 | 1.002 | 0.683 | 1.48 (1.64, 1.32) | 0.446 (2.25) | 3.5 / 2.4 |
| ZeRO-2 | 555 / 563 | 561 / 564 | 1.014, 1.004 | 0.635 | 0.676 | 0.95 (0.83, 1.08) | 0.349 (1.82) | 3.0 / 2.6 |

and at 20.8M (``--width 512 --vocab 8000 --seq 128 --steps 10``) at commit ad7788d with ``--repeat 3``, tensor parallel
and the 1x2 mesh again at 9a4fb54 (the same library code) with ``--repeat 5``: each repetition launches its own
unwatched 2-rank run, watched run and one-process run, side by side; each rank's peak ratio is the median of its paired
ratios (the pairs' range in brackets), the time ratio the median of the paired ratios of the mean of a run's checks
(and, after it, of their median); ZeRO-2's row at commit 23daf56 (the median check, the largest peak):

| engine | peak MB r0 | r1 | peak ratio r0; r1 (pairs) | checks' mean s, 2 / 1 | ratio (pairs) | median check | one rank's batch |
|---|---|---|---|---|---|---|---|
| tensor parallel | 558 / 598 | 561 / 594 | 1.081 (0.984-1.176); 1.059 (1.037-1.132) | 1.854 / 2.184 | 0.85 (0.81-0.86) | 1.06 | the same |
| (5 pairs) | 564 / 604 | 558 / 609 | 1.067 (1.057-1.105); 1.093 (1.043-1.188) | 1.874 / 2.144 | 0.87 (0.82-0.93) | 1.02 | the same |
| seq. parallel | 598 / 631 | 590 / 626 | 1.056 (1.043-1.066); 1.069 (1.041-1.100) | 1.934 / 2.234 | 0.86 (0.85-0.86) | 0.91 | the same |
| 2-D 2x1 | 963 / 918 | 989 / 937 | 0.953 (0.931-0.980); 0.947 (0.912-0.974) | 2.756 / 4.682 | 0.59 (0.57-0.60) | 0.69 | 1.705 (1.47) |
| 2-D 1x2 | 688 / 760 | 696 / 760 | 1.118 (1.072-1.122); 1.098 (1.091-1.111) | 2.085 / 2.243 | 0.93 (0.88-0.94) | 1.01 | the same |
| (5 pairs) | 680 / 747 | 687 / 753 | 1.088 (1.055-1.102); 1.095 (1.034-1.123) | 2.036 / 2.239 | 0.91 (0.89-0.98) | 1.04 | the same |
| ZeRO-3 | 1242 / 1178 | 1225 / 1192 | 0.946 (0.946-0.979); 0.974 (0.955-0.987) | 2.976 / 4.273 | 0.70 (0.68-0.70) | 0.72 | 1.568 (1.72) |
| ZeRO-2 | 960 / 1031 | 977 / 986 | 1.074, 1.009 | | | 0.37 (0.34-0.41) | 1.981 (1.12) |

Again at commit 066c329 (``--repeat 3``, 2026-11-28, a noisier machine: one process's mean check moved by up to 31%
between pairs), peak ratio r0; r1 and the checks' mean ratio: tensor parallel 1.117; 1.096, 1.03 (0.77-1.26); sequence
parallel 1.062; 1.019, 1.03; 2x1 0.960; 0.937, 0.62; 1x2 1.080; 1.046, 0.98; ZeRO-3 0.961; 0.976, 0.80 (the median
check 1.16, 1.17, 0.72, 1.11, 0.80); at 302fc54 (a rank's one block checked as a group) tensor parallel 1.024; 1.066,
0.79 (0.75-0.93), the median check 0.98, and the 1x2 mesh 1.038; 1.084, 1.04 (0.98-1.75), 1.32.

At be10a1b (fewer agreement points), ``--repeat 3``, and the 1x2 mesh in 5 more pairs: peak ratio r0; r1 and the
checks' mean ratio: tensor parallel 1.096; 1.085, 0.76 (0.74-1.01); sequence parallel 1.063; 1.054, 0.96; 2x1 0.951;
0.959, 0.75; 1x2 1.101; 1.111, 0.96 and 1.088; 1.083, 0.90 (0.83-1.04); ZeRO-3 0.950; 0.970, 0.63.

At d60374a (a check's forwards that run to the logits on the samples that fit), ``--repeat 3``: peak ratio r0; r1,
the checks' mean ratio and the median check's: tensor parallel 1.088; 1.039, 0.71, 0.80; sequence parallel 1.037;
1.014, 0.82, 1.09; 2x1 0.969; 0.922, 0.79, 0.92; 1x2 1.091; 1.085, 0.94, 1.16; ZeRO-3 0.976; 0.973, 0.69, 0.79 (the
last three on the working tree one change before d60374a, which does the same for them). With
``--mmap-threshold 1048576``: tensor parallel 1.095; 1.084, the 1x2 mesh 1.077; 1.028 (the checks' mean 0.58, 0.64).
Again at a7cd995 (the same code): sequence parallel 1.032; 1.022, 0.74, 0.88; the 1x2 mesh 1.073; 1.118, 0.90, 1.04.
At dbc0eb7 (each replayed gradient taken as the backward accumulates it; a replay above the check's ceiling makes
the later ones checkpoint for less room), ``--repeat 3``: tensor parallel 1.009; 1.018, 0.89, 0.98; sequence parallel
1.003; 1.042, 0.74, 0.90; 2x1 0.979; 0.964, 0.62, 0.78; 1x2 1.101; 1.082, 0.89, 1.03, and with ``--repeat 5`` 1.054;
1.056, 0.84, 1.09 (over the eight pairs 1.065; 1.075, 0.87, 1.07).
At bad1703 (each agreement point made by the wrapped collective operators, not a dispatch mode), the pairs of
three runs pooled: tensor parallel 1.075; 1.055, 0.74, 0.90 (3 pairs); sequence parallel 1.029; 1.053, 0.80, 0.96
(7); 2x1 0.945; 0.928, 0.67, 0.83 (3); 1x2 1.068; 1.086, 0.80, 0.90 (8). At 4.2M (``--steps 8 --repeat 2``): the
checks' mean 1.50, 1.73, 1.31, 1.70 and ZeRO-3 1.55, a tensor parallel engine's 2-rank training step 1.5 to 2.4
times one process's. At 4.2M again, four runs each of de496f5 and of the agreement points through shared memory
(e6488f6, b601724: two runs each), alternately: the 2-rank checks' mean (the runs' median) tensor parallel 0.560 s
to 0.487 s, sequence parallel 0.607 to 0.575, 2x1 0.766 to 0.694, 1x2 0.661 to 0.564, ZeRO-3 0.988 to 0.902; over
one process, the runs' median ratio 1.20, 1.28, 1.01, 1.28 and 1.23 (1.14, 1.29, 1.02, 1.37, 1.66 before): one
process's own check moved from 0.355 s to 0.735 s between runs of the same code. At ef4e95e (a check's collectives
through that shared memory too), two runs alternating with four of b45eec1: the 2-rank checks' mean 0.529 s to 0.371
s, 0.619 to 0.427, 0.778 to 0.623, 0.634 to 0.513 and ZeRO-3 0.746 to 0.509; over one process 1.10, 1.28, 1.09, 1.53
and 0.86 (1.54, 1.68, 1.28, 2.01, 1.20 before), one process's check between 0.301 s and 0.435 s. At 20.8M at ef4e95e
(one pair each): the checks' mean ratio 0.66, 0.60, 0.61, 0.67 and ZeRO-3 0.53 (the median check 0.85, 0.71, 0.75,
0.95, 0.57), peaks r0; r1 1.014; 1.008, 1.064; 1.038, 0.903; 0.898, 1.073; 1.146 (that unwatched rank 1 at 655 MB,
where earlier pairs gave 680 MB to 696 MB) and 0.968; 0.998. At 7490085 (the replay's forward is the capture's, torch's
own modules outside the refusing mode, better piece estimates, replicas' turns over every unit), two 4.2M runs: the
checks' mean ratio 0.71, 0.72; 0.74, 0.78; 0.54, 0.71; 0.68, 0.94 and ZeRO-3 0.78, 0.86 (0.77 to 1.27 for 68a5351
in four runs of the same sitting), peaks 0.898 to 1.082, no alert.

Every check ``ok``, module form, 0 alerts. Not met on this machine: every single pair's peak within 1.10x (at bad1703
pairs up to 1.144; the medians are within it), and a 2-rank check no slower than one process's at every size: at
20.8M by the mean and by the median check every engine is (single pairs up to 1.50), but a check whose costly whole
piece one rank takes alone (``loss_fn``'s own code) is slower, and at 4.2M every engine but ZeRO-2 was slower
until 7490085.
``--mmap-threshold 1048576`` (glibc's threshold fixed at 1 MiB in every arm, commit c8c596e) lowers the unwatched
peaks by 12% to 25% (ZeRO-3's from 1,216 MB, DeepSpeed's initialization, to 909 MB), and the watched ones less.
At bf15136 with ``--mmap-threshold 1048576 --repeat 3``: tensor parallel 1.131; 1.103, sequence parallel 1.097;
1.099, the 1x2 mesh 1.094; 1.061 (the checks' mean 0.70, 0.73, 0.77).

Every figure comes from its own processes: one ``torchrun`` launch of 2 gloo CPU ranks per arm (peak RSS,
``ru_maxrss``, is per process, as in ``benchmarks/sharded.py``), SGD (Adam under ZeRO), ``steps`` training
steps, and the watch ``GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None)`` at its default
options otherwise, given ``watch.step(batch)`` after backward. The model is a pre-norm transformer with
hand-written causal attention (``--layers`` blocks of width ``--width``, 4 heads, vocabulary ``--vocab``,
batch ``--batch`` x ``--seq``), parallelized as torchtitan does with torch's ``parallelize_module``:

- ``tp``: each block's q, k, v and first MLP Linear ``ColwiseParallel``, o and the second ``RowwiseParallel``
  on a mesh of 2 (both ranks the same batch);
- ``sp``: the same plus ``SequenceParallel`` norms and ``PrepareModuleInput`` before the attention, the final
  norm on the sequence shards and the head gathering them (each rank half of the sequence);
- ``2d21``, ``2d12``: FSDP2 ``fully_shard`` (each block and the root) over the TP model on a ``dp x tp``
  mesh of 2x1 (each rank its own batch) and 1x2 (one batch);
- ``zero3``: the plain model under DeepSpeed ZeRO-3 (``stage3_param_persistence_threshold: 0``: every
  parameter partitioned), ``DS_ACCELERATOR=cpu``, the watch given the engine and the ZeRO optimizer,
  ``watch.step(batch)`` between ``engine.backward(loss)`` and ``engine.step()``;
- ``zero2``: the same under ZeRO-2 (parameters whole on every rank, gradients and Adam's state partitioned).

The memory ratio is each rank's watched peak over the same rank's unwatched peak. The time ratio is the
mean (and, beside it, the median) of the whole ``watch.step`` at a checking step (every step checks; the first left
out as warm-up) on 2 ranks (the slower rank) over the same in one plain process: the same model, not parallelized, the
same options and step (the ranks' batches in one where each rank trains its own: ``2d21``, ZeRO). A training step's
time (forward, backward, optimizer) is the unwatched arm's median on 2 ranks (the slower rank) and the one-process
arm's (that of the step's whole batch).

Example::

    python benchmarks/parallel.py --quick            # a tiny model, every engine: under 2 minutes
    python benchmarks/parallel.py                    # 4 blocks, width 256, vocabulary 2000, batch 4 x 64
    python benchmarks/parallel.py --configs tp,zero3 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ddp_memory import _port  # benchmarks/ beside this file: a free port, as the DDP benchmark finds it

CONFIGS = ("tp", "sp", "2d21", "2d12", "zero3", "zero2")
#: The configurations whose ranks each train their own batch (the step's whole batch is both ranks').
DATA_PARALLEL = ("2d21", "zero3", "zero2")
#: What each configuration is, in the table.
ENGINES = {"tp": "tensor parallel", "sp": "sequence parallel", "2d21": "FSDP2 x TP 2x1",
           "2d12": "FSDP2 x TP 1x2", "zero3": "ZeRO-3", "zero2": "ZeRO-2"}


def models() -> Tuple[Any, Any, Dict[str, Any], Dict[str, Any]]:
    """``LM`` (a pre-norm transformer), ``SPLM`` (the same on this rank's half of the sequence), the TP and SP plans."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):  # q, k, v column-parallel (this rank's heads), o row-parallel
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.head_dim = d // heads

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
            s = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            return self.o((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, t, -1))

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, 4), nn.LayerNorm(d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class LM(nn.Module):
        def __init__(self, vocab: int, d: int, layers: int) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def body(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.body(self.emb(ids))

    class SPLM(LM):  # the blocks and the final norm see this rank's half of the sequence (torchtitan's plan)
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            import torch.distributed as dist

            return self.body(self.emb(ids).chunk(2, dim=1)[dist.get_rank()])

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    tp = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
          "attn.o": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    sp = {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
          "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
          "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
          "attn.o": RowwiseParallel(output_layouts=Shard(1)),
          "fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel(output_layouts=Shard(1))}
    return LM, SPLM, tp, sp


def lm_loss(m: Any, ids: Any) -> Any:
    """Next-token cross entropy of ``m`` on ``ids`` (batch x (seq + 1))."""
    import torch.nn.functional as F

    logits = m(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def build(config: str, size: Dict[str, int], parallel: bool) -> Tuple[Any, Any, Any]:
    """(the model as trained, the optimizer, the engine under ZeRO-3 or None): parallelized unless ``parallel`` is
    False (the one-process arm: the same model and initial weights, plain)."""
    import torch

    lm, splm, tp, sp = models()
    torch.manual_seed(0)  # the same initial weights on every rank and in the one-process arm
    net = (splm if parallel and config == "sp" else lm)(size["vocab"], size["width"], size["layers"])
    if config.startswith("zero"):
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        if not parallel:
            return net, opt, None
        import deepspeed

        ds = {"train_micro_batch_size_per_gpu": size["batch"], "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": int(config[-1]), "stage3_param_persistence_threshold": 0},
              "steps_per_print": 10 ** 9}
        engine, zopt, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=ds)
        return engine, zopt, engine
    if parallel:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

        mesh2 = None
        if config.startswith("2d"):
            mesh2 = init_device_mesh("cpu", (2, 1) if config == "2d21" else (1, 2), mesh_dim_names=("dp", "tp"))
            mesh = mesh2["tp"]
        else:
            mesh = init_device_mesh("cpu", (2,))
        for block in net.blocks:
            parallelize_module(block, mesh, sp if config == "sp" else tp)
        if config == "sp":  # the final norm on the sequence shards, the head gathering them
            parallelize_module(net, mesh, {"ln": SequenceParallel(),
                                           "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
        if mesh2 is not None:
            for block in net.blocks:
                fully_shard(block, mesh=mesh2["dp"])
            fully_shard(net, mesh=mesh2["dp"])
    return net, torch.optim.SGD(net.parameters(), lr=0.01), None


def worker(config: str, size: Dict[str, int], watch: bool, steps: int, parallel: bool = True,
           whole: bool = False) -> Dict[str, Any]:
    """One rank of one arm (under ``torchrun``), or with ``parallel=False`` one plain process; returns its figures.
    ``whole`` (one process, a data-parallel configuration): each step's batch is both ranks' batches in one, the
    step's whole batch, as the 2 ranks train it."""
    import resource
    import time
    import warnings

    if config.startswith("zero"):
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rank = 0
    if parallel:
        import torch.distributed as dist

        if config.startswith("zero"):
            import logging

            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
            logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        else:
            dist.init_process_group("gloo")
        rank = dist.get_rank()
    model, opt, engine = build(config, size, parallel)
    gw = None
    if watch:
        from gradwatch import GradWatch

        gw = GradWatch(model, lm_loss, optimizer=opt, every=1, log_dir=None)
    data_parallel = config in DATA_PARALLEL
    gen = torch.Generator().manual_seed(100 + rank if data_parallel else 100)  # TP ranks share a batch
    other = torch.Generator().manual_seed(101) if whole and not parallel else None  # rank 1's
    check_seconds: List[float] = []
    step_seconds: List[float] = []
    oks: List[bool] = []
    forms: List[str] = []
    evaluations: List[int] = []
    train_seconds: List[float] = []
    full: Optional[int] = None  # K checks in steps, as the watch says it
    for _ in range(steps):
        b = torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=gen)
        if other is not None:  # the step's whole batch: rank 0's then rank 1's, drawn as the ranks draw them
            b = torch.cat([b, torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=other)])
        t_train = time.perf_counter()
        if engine is not None:
            engine.backward(lm_loss(engine, b))
        else:
            opt.zero_grad()
            lm_loss(model, b).backward()
        trained = time.perf_counter() - t_train
        if gw is not None:
            t0 = time.perf_counter()
            report = gw.step(b)
            step_seconds.append(time.perf_counter() - t0)
            if report is not None:
                check_seconds.append(report.seconds)
                oks.append(report.ok)
                forms.append(report.form)
                evaluations.append(report.evaluations)
                full = report.steps_to_full if report.steps_to_full is not None else full
        t_opt = time.perf_counter()
        if engine is not None:
            engine.step()
        else:
            opt.step()
        train_seconds.append(trained + time.perf_counter() - t_opt)
    out: Dict[str, Any] = {"config": config + ("+whole" if other is not None else ""), "rank": rank, "watch": watch,
                           "parallel": parallel,
                           "n_params": sum(p.numel() for p in model.parameters()) if engine is None
                           else sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
                           "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "vmhwm_mb": vmhwm_mb(),
                           "check_seconds": check_seconds, "step_seconds": step_seconds, "train_seconds": train_seconds, "ok": oks,
                           "forms": sorted(set(forms)), "evaluations": evaluations, "steps_to_full": full}
    if gw is not None:
        cov = gw.coverage
        out.update(alerts=[f"{a.kind}: {a.tensor}: {a.message[:300]}" for a in gw.alerts],
                   backward_min=min(v["backward"] for v in cov.values()),
                   training_min=min(v["training"] for v in cov.values()),
                   never=sorted(n for n, v in cov.items() if v["backward"] == 0 or v["training"] == 0))
        gw.close()
    if parallel:
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def vmhwm_mb() -> float:
    """This process image's peak RSS, ``VmHWM`` (Linux keeps ``ru_maxrss`` across ``exec``: a check on it), or NaN."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return float("nan")


def launch(args: argparse.Namespace, config: str, watch: bool, ranks: int = 2) -> List[Dict[str, Any]]:
    """Every rank's figures of one arm (one ``torchrun`` launch), or with ``ranks=0`` one plain process's figures
    of each configuration in ``config`` (comma-separated; run in turn: only its check times are read)."""
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    if args.mmap_threshold is not None:  # glibc's, every arm alike (read at each process's start)
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    tail = ["--worker", "--configs", config, "--size", json.dumps(size_of(args)), "--steps", str(args.steps)] \
        + (["--watch"] if watch else [])
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
               "127.0.0.1", "--master_port", str(_port()), here] + tail
    else:
        cmd = [sys.executable, here] + tail + ["--plain"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(rows) != (ranks or len(config.split(","))):
        raised = [ln for ln in done.stderr.splitlines() if re.match(r"(\[rank\d\]: )?\w+(Error|Exception): ", ln)]
        raise RuntimeError(f"{config} ({'watched' if watch else 'unwatched'}, {ranks or 1} process(es)) failed "
                           f"({done.returncode}): {raised[0] if raised else ''}\n{done.stderr.strip()[-4000:]}")
    return sorted(rows, key=lambda r: r["rank"]) if ranks else rows


def one_process(config: str) -> Tuple[str, str]:
    """The one-process runs ``config``'s check time is compared with: ``(the same check, one rank's batch)``.

    The same check is that of the same training step: the same model, optimizer, options and the step's whole
    batch (both ranks' batches in one where each rank trains its own: ``2d21`` and ZeRO, ``+whole``). The second
    is the same on one rank's batch alone (for tensor parallel and ``2d12`` the same run: the ranks share a batch).
    Every TP engine's plain model is the same model, batch, optimizer and options (run once, as ``tp``); ZeRO's
    has Adam.

    Example:
        >>> [one_process(c)[0] for c in CONFIGS]
        ['tp', 'tp', 'tp+whole', 'tp', 'zero3+whole', 'zero3+whole']
        >>> one_process("zero2")[1]
        'zero3'
    """
    plain = "zero3" if config.startswith("zero") else "tp"
    return (plain + "+whole" if config in DATA_PARALLEL else plain), plain


def size_of(args: argparse.Namespace) -> Dict[str, int]:
    """The model and batch sizes the flags ask for."""
    return {"layers": args.layers, "width": args.width, "vocab": args.vocab, "batch": args.batch, "seq": args.seq}


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs[1:] or xs)  # the first check left out: warm-up
    return s[len(s) // 2] if s else float("nan")


def _mean(xs: Sequence[float]) -> float:
    """The mean of a run's checks, the first left out (what the run's checks cost in all, per check)."""
    s = list(xs[1:] or xs)
    return sum(s) / len(s) if s else float("nan")


def measure(args: argparse.Namespace, config: str, ones: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """One configuration, side by side: unwatched and watched on 2 ranks, against the same check's watched run in one
    process (the step's whole batch) and the same on one rank's batch alone (:func:`one_process`; ``ones``: those
    runs, by name, made before). With ``--repeat N`` the watched arms run N times, each right after its own
    one-process runs and its own unwatched 2-rank run: the time ratio is the median of the N paired ratios (the
    machine's speed drifts by 10-20% over minutes), each rank's peak ratio the median of its N paired ratios (a
    process's peak moves by 20-40 MB from launch to launch, watched or not), beside the largest of them."""
    same, per = one_process(config)
    passes = []  # (the one-process runs, the watched 2-rank runs, the unwatched ones) of each repetition
    for _ in range(args.repeat):
        fresh: List[Dict[str, Any]] = []  # repeated: this repetition's own one-process runs
        if args.repeat > 1:
            fresh = [r for run in dict.fromkeys((same, per)) for r in launch(args, run, True, ranks=0)]
            ones = {r["config"]: r for r in fresh}
        unwatched = launch(args, config, False)
        watched = launch(args, config, True)
        for row in unwatched + watched + fresh:
            print(json.dumps(row), flush=True)
        passes.append((ones, watched, unwatched))
    plain = passes[0][2]
    # the whole watch.step of a checking step (the slower rank), paired with the one-process run beside it
    two = [max(_median(w["step_seconds"]) for w in watched) for _, watched, _ in passes]
    one = [_median(o[same]["step_seconds"]) for o, _, _ in passes]
    rank = [_median(o[per]["step_seconds"]) for o, _, _ in passes]
    ratios = [t / o for t, o in zip(two, one)]
    # the checks' mean: a pass of K checks mixes light checks and heavy ones (a pass's first), which the median hides
    two_mean = [max(_mean(w["step_seconds"]) for w in watched) for _, watched, _ in passes]
    one_mean = [_mean(o[same]["step_seconds"]) for o, _, _ in passes]
    mean_ratios = [t / o for t, o in zip(two_mean, one_mean)]
    two_s, one_s, rank_s = statistics.median(two), statistics.median(one), statistics.median(rank)
    two_train = statistics.median(max(_median(p["train_seconds"]) for p in ps) for _, _, ps in passes)  # 2 ranks
    one_train = statistics.median(_median(o[same]["train_seconds"]) for o, _, _ in passes)
    runs = [w for _, watched, _ in passes for w in watched]  # every rank's watched run of every repetition
    ranks_ = range(len(plain))
    # each rank's peak ratios, one per repetition: its watched run over the unwatched run launched just before it
    paired = [[ws[i]["peak_mb"] / ps[i]["peak_mb"] for _, ws, ps in passes] for i in ranks_]
    vmhwm = [[ws[i]["vmhwm_mb"] / ps[i]["vmhwm_mb"] for _, ws, ps in passes] for i in ranks_]
    mb_ = [[statistics.median(ps[i]["peak_mb"] for _, _, ps in passes), statistics.median(ws[i]["peak_mb"] for _, ws, _ in passes)]
           for i in ranks_]
    return {"config": config, "params": runs[0]["n_params"],
            "peak_mb_per_rank": [[round(p), round(w)] for p, w in mb_],
            "peak_ratio_per_rank": [round(statistics.median(r), 3) for r in paired],
            "peak_ratios": [[round(x, 3) for x in r] for r in paired],
            "vmhwm_ratio_per_rank": [round(statistics.median(r), 3) for r in vmhwm],
            "forms": sorted({f for w in runs for f in w["forms"]}),
            "check_s_2_ranks": round(two_s, 3), "check_s_1_process": round(one_s, 3),
            "time_ratio_2_over_1": round(statistics.median(ratios), 3), "time_ratios": [round(r, 3) for r in ratios],
            "check_s_2_ranks_mean": round(statistics.median(two_mean), 3),
            "check_s_1_process_mean": round(statistics.median(one_mean), 3),
            "time_ratio_2_over_1_mean": round(statistics.median(mean_ratios), 3),
            "time_ratios_mean": [round(r, 3) for r in mean_ratios],
            "check_s_1_process_rank_batch": round(rank_s, 3), "time_ratio_2_over_1_rank_batch": round(two_s / rank_s, 3),
            "train_step_s_2_ranks": round(two_train, 3), "train_step_s_1_process": round(one_train, 3),
            "check_in_steps_2_ranks": round(two_s / two_train, 2), "check_in_steps_1_process": round(one_s / one_train, 2),
            "steps_to_full": max((w["steps_to_full"] or 0) for w in runs),
            "alerts": sorted({a for w in runs for a in w["alerts"]}),
            "backward_min": min(w["backward_min"] for w in runs),
            "training_min": min(w["training_min"] for w in runs),
            "never": sorted({n for w in runs for n in w["never"]})}


def table(rows: List[Dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    lines = ["| engine | params (fp32 MB) | peak MB r0 unwatched / watched | r1 | peak ratio r0, r1 (each pair's) | "
             "check s 2 ranks | check s 1 process | time ratio 2/1 | the checks' mean: s 2 ranks, 1 process, ratio | "
             "1 process on one rank's batch: s (ratio) | "
             "training step s 2 ranks, 1 process | check in steps 2 ranks, 1 process | alerts | "
             "coverage min (backward, training) | K in steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {ENGINES[r['config']]} | failed: {r['error']} ||||||||||||||")
            continue
        (p0, w0), (p1, w1) = r["peak_mb_per_rank"]
        lines.append(f"| {ENGINES[r['config']]} | {r['params'] / 1e6:.2f}M ({r['params'] * 4 / 2 ** 20:.0f}) | "
                     f"{p0} / {w0} | {p1} / {w1} | "
                     f"{r['peak_ratio_per_rank'][0]:.3f}, {r['peak_ratio_per_rank'][1]:.3f}"
                     + (f" ({'; '.join(', '.join(f'{x:.3f}' for x in rs) for rs in r['peak_ratios'])})"
                        if len(r["peak_ratios"][0]) > 1 else "") + " | "
                     f"{r['check_s_2_ranks']:.3f} | {r['check_s_1_process']:.3f} | {r['time_ratio_2_over_1']:.2f}"
                     + (f" ({', '.join(f'{x:.2f}' for x in r['time_ratios'])})" if len(r["time_ratios"]) > 1 else "")
                     + f" | {r['check_s_2_ranks_mean']:.3f}, {r['check_s_1_process_mean']:.3f}, "
                     f"{r['time_ratio_2_over_1_mean']:.2f}"
                     + (f" ({', '.join(f'{x:.2f}' for x in r['time_ratios_mean'])})" if len(r["time_ratios_mean"]) > 1 else "")
                     + " | "
                     + (f"{r['check_s_1_process_rank_batch']:.3f} ({r['time_ratio_2_over_1_rank_batch']:.2f}) | "
                        if r["config"] in DATA_PARALLEL else "the same | ")
                     + f"{r['train_step_s_2_ranks']:.3f}, {r['train_step_s_1_process']:.3f} | "
                     f"{r['check_in_steps_2_ranks']:.1f}, {r['check_in_steps_1_process']:.1f} | {len(r['alerts'])} | "
                     f"{r['backward_min']:.3g}, {r['training_min']:.3g} | {r['steps_to_full']} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python benchmarks/parallel.py [--quick] [--configs tp,sp,2d21,2d12,zero3,zero2] [--steps N]``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/parallel.py", description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 2 steps: a smoke run")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--width", type=int, default=256, help="model width, 4 heads (default 256)")
    parser.add_argument("--vocab", type=int, default=2000, help="vocabulary (default 2000)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence, even (default 64)")
    parser.add_argument("--steps", type=int, default=8, help="training steps, each checked (default 8)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch (default 900)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="watched arms per engine, each paired with a one-process run just before it; the time "
                             "ratio is their median (default 1)")
    parser.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="glibc's mmap threshold in every arm (MALLOC_MMAP_THRESHOLD_), fixed instead of glibc's "
                             "dynamic one, which moves a process's peak by up to 20%% from launch to launch "
                             "(default: glibc's own)")
    parser.add_argument("--size", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--watch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # one rank of one configuration, or one plain process running every configuration in turn
        for config in args.configs.split(","):
            name, _, whole = config.partition("+")
            row = worker(name, json.loads(args.size), args.watch, args.steps, not args.plain, whole == "whole")
            sys.stdout.write(json.dumps(row) + "\n")  # one write: the ranks share torchrun's stdout
            sys.stdout.flush()
        return 0
    if args.quick:
        args.layers, args.width, args.vocab, args.batch, args.seq, args.steps = 1, 32, 100, 2, 16, 2
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs {args.configs!r}: {', '.join(unknown)} unknown; accepted: {', '.join(CONFIGS)}")
    rows: List[Dict[str, Any]] = []
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: accepted: 1 or more")
    if args.mmap_threshold is not None and not 0 <= args.mmap_threshold <= 32 * 2 ** 20:
        parser.error(f"--mmap-threshold {args.mmap_threshold}: accepted: 0 to {32 * 2 ** 20} bytes (glibc's bounds)")
    plain_runs = list(dict.fromkeys(run for c in configs for run in one_process(c))) if args.repeat == 1 else []
    # the one-process arms first, one launch each (a process of its own: its peak and heap are its own); repeated,
    # each repetition's beside its watched arms instead
    ones = {r["config"]: r for run in plain_runs for r in launch(args, run, True, ranks=0)}
    for row in ones.values():
        print(json.dumps(row), flush=True)
    for config in configs:
        try:
            rows.append(measure(args, config, ones))
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # one engine failing leaves the others' figures
            print(f"{config}: {e}", file=sys.stderr, flush=True)
            rows.append({"config": config, "error": str(e).splitlines()[0][:200]})
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows), flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
