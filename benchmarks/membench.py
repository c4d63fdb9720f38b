"""Peak memory of a training loop with and without :class:`gradwatch.GradWatch`, one process per configuration.

A process's peak RSS (``VmHWM``) is per process, so each configuration runs in a fresh interpreter: a 7-layer MLP
(``1024 -> h -> h -> h -> h -> h -> h -> 10``, tanh, ``h`` chosen for the parameter count),
batch 64, SGD, 3 steps, and with ``--watch`` a ``GradWatch(every=1)`` at its default options.
The worker prints one JSON line: the peak (RSS on the CPU, peak allocated on CUDA), the forms
the checks ran and what they checked. :func:`measure_memory` runs both configurations side by side.

Example (the worker, as ``gradwatch bench`` runs it)::

    python benchmarks/membench.py --params 25e6 --watch
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

#: Parameter counts of the memory section: (default, quick).
SIZES = ((25e6, 100e6), (4e6,))


def mlp_width(n_params: float, d_in: int = 1024, d_out: int = 10, hidden_layers: int = 5) -> int:
    """The width ``h`` of a 7-layer MLP ``d_in -> h (x6) -> d_out`` with about ``n_params`` parameters.

    Example:
        >>> mlp_width(25e6)
        2134
    """
    b = d_in + d_out + hidden_layers + 1
    return int((-b + math.sqrt(b * b + 4 * hidden_layers * n_params)) / (2 * hidden_layers))


def worker(n_params: float, watch: bool, steps: int = 3, batch: int = 64) -> Dict[str, Any]:
    """One configuration in this process; returns its figures (see the module docstring)."""

    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.set_num_threads(1)
    d_in, h = 1024, mlp_width(n_params)
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(d_in, h), nn.Tanh()]
    for _ in range(5):
        layers += [nn.Linear(h, h), nn.Tanh()]
    layers.append(nn.Linear(h, 10))
    model = nn.Sequential(*layers)
    cuda = torch.cuda.is_available()
    if cuda:
        model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, d_in, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    if cuda:
        x, y = x.cuda(), y.cuda()

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    w = None
    if watch:
        from gradwatch import GradWatch

        w = GradWatch(model, loss_fn, every=1, log_dir=None)
    forms, checked, judged, notes = [], [], [], []
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, (x, y))
        loss.backward()
        if w is not None:
            report = w.step((x, y), loss=loss)
            if report is not None:
                forms.append(report.form)
                checked.append(len(report.tensors))
                judged.append(len(report.training))
                notes = [n for n in report.notes if n.startswith(("form", "module form"))]
        opt.step()
    seconds = time.perf_counter() - start
    if cuda:
        peak = int(torch.cuda.max_memory_allocated())
    else:
        from gradwatch.plan.memory import peak_bytes

        peak = peak_bytes(torch.device("cpu"))  # VmHWM: ru_maxrss would carry the parent's peak across exec
    return {"n_params": sum(p.numel() for p in model.parameters()), "width": h, "watch": watch,
            "device": "cuda" if cuda else "cpu", "peak_bytes": int(peak), "seconds": seconds,
            "checks": len(forms), "forms": forms, "checked": checked, "judged": judged,
            "alerts": len(w.alerts) if w is not None else 0, "notes": notes}


def _spawn(n_params: float, watch: bool) -> Dict[str, Any]:
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, here, "--params", repr(float(n_params))] + (["--watch"] if watch else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:200], "watch": watch}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_memory(sizes: Sequence[float], progress: Optional[Any] = None) -> List[Dict[str, Any]]:
    """Peak memory without and with the watch, side by side, one subprocess per configuration."""
    rows = []
    for n in sizes:
        if progress:
            progress(f"memory: {n:.3g}-parameter MLP, without and with the watch")
        plain, watched = _spawn(n, False), _spawn(n, True)
        row = {"n_params": plain.get("n_params"), "device": plain.get("device"), "plain": plain, "watched": watched}
        if "peak_bytes" in plain and "peak_bytes" in watched:
            row["ratio"] = watched["peak_bytes"] / plain["peak_bytes"]
        else:
            row["ratio"] = None
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python benchmarks/membench.py --params N [--watch]``: one configuration, one JSON line."""
    parser = argparse.ArgumentParser(prog="python benchmarks/membench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--watch", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(worker(args.params, args.watch, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
