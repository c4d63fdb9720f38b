"""Per-rank peak memory of a DDP training loop with and without :class:`gradwatch.GradWatch`, 2 gloo ranks.

Each configuration is one ``torchrun`` launch of 2 CPU ranks (peak RSS is per process): an MLP
``512 -> h -> h -> h -> h -> 10`` (tanh, ``h`` chosen for the parameter count) wrapped in
``DistributedDataParallel``, batch 64 per rank, SGD, 4 steps, and with the watch
``GradWatch(model, loss_fn, optimizer=opt, every=1)`` at its default options otherwise
(``memory_budget=0.1``). Every rank prints one JSON line: its peak RSS, the forms its checks ran,
its alerts. The summary line gives, per rank, the watched peak over the unwatched one.

Example::

    python benchmarks/ddp_memory.py                 # ~17M parameters
    python benchmarks/ddp_memory.py --params 50e6
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence


def width(n_params: float, d_in: int = 512, d_out: int = 10, hidden: int = 3) -> int:
    """``h`` of the MLP ``d_in -> h (x hidden+1) -> d_out`` with about ``n_params`` parameters.

    Example:
        >>> width(17e6)
        2294
    """
    b = d_in + d_out + hidden + 1
    return int((-b + math.sqrt(b * b + 4 * hidden * n_params)) / (2 * hidden))


def worker(h: int, watch: bool, steps: int = 4) -> Dict[str, Any]:
    """One rank of one configuration (under ``torchrun``); returns its figures."""
    import resource

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(512, h), nn.Tanh()]
    for _ in range(3):
        layers += [nn.Linear(h, h), nn.Tanh()]
    model = DDP(nn.Sequential(*layers, nn.Linear(h, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    gw = None
    if watch:
        from gradwatch import GradWatch

        gw = GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None)
    gen = torch.Generator().manual_seed(rank)
    forms = []
    for _ in range(steps):
        b = (torch.randn(64, 512, generator=gen), torch.randint(0, 10, (64,), generator=gen))
        opt.zero_grad()
        loss_fn(model, b).backward()
        report = gw.step(b) if gw is not None else None
        if report is not None:
            forms.append(report.form)
        opt.step()
    out = {"rank": rank, "watch": watch, "n_params": sum(p.numel() for p in model.parameters()),
           "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "forms": sorted(set(forms)),
           "alerts": 0 if gw is None else len(gw.alerts),
           "training_verdicts": 0 if gw is None else sum(v["training"] > 0 for v in gw.coverage.values()),
           "backward_coverage": None if gw is None else min(v["backward"] for v in gw.coverage.values())}
    if gw is not None:
        gw.close()
    dist.destroy_process_group()
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(h: int, watch: bool) -> List[Dict[str, Any]]:
    """Both ranks' figures of one configuration (one ``torchrun`` launch)."""
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_port()), here, "--worker", str(h)] + (["--watch"] if watch else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(rows) != 2:
        raise RuntimeError(f"torchrun failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python benchmarks/ddp_memory.py [--params N]`` (or ``--worker H [--watch]`` under torchrun)."""
    parser = argparse.ArgumentParser(prog="python benchmarks/ddp_memory.py", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=17e6, help="parameters of the MLP (default 17e6)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--watch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.watch)), flush=True)
        return 0
    h = width(args.params)
    plain, watched = launch(h, False), launch(h, True)
    for row in plain + watched:
        print(json.dumps(row), flush=True)
    ratios = [w["peak_mb"] / p["peak_mb"] for w, p in zip(watched, plain)]
    print(json.dumps({"params": watched[0]["n_params"], "ranks": 2, "forms": watched[0]["forms"],
                      "peak_ratio_per_rank": [round(r, 3) for r in ratios], "alerts": watched[0]["alerts"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
