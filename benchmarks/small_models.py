"""``check_model`` against fast gradcheck on small models: MLPs, CNNs and transformer LMs, 5k to 1M parameters.

Where unit tests call ``check_model`` (models of thousands to a million parameters, a few milliseconds an
evaluation), its fixed costs (the float64 copy, planning, the analytic pass, the report) weigh as much as its
evaluations. This compares the whole call's wall time, at its defaults, with
``torch.autograd.gradcheck(fast_mode=True)`` on the same float64 objective (``bench.run_gradcheck``: the
parameters handed to it already in float64, its own time only), both warm, one thread, in interleaved pairs;
medians of ``--repeats``. One process, no subprocess. Per model it prints both times, their ratio, the
evaluations each made, and where ``check_model``'s time went (one profiled call, by stage).

Times are wall seconds (the comparison) and CPU seconds of this process (what a shared machine's load leaves
out). ``--bug`` plants a wrong backward (``bench.SiLUFunction`` dropping a term) in each model's first activation and
reports whether each tool caught it.

Run: ``python benchmarks/small_models.py [--repeats 9] [--models mlp-5k,cnn-50k] [--bug] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import importlib.util
import json
import math
import os
import pstats
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.gradcheck import GradcheckError

from gradwatch import check_model
from gradwatch.check.objective.shadow import cast_floats


def _load_bench() -> Any:
    """``benchmarks/bench.py`` beside this file (the benchmarks are files, not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")
    spec = importlib.util.spec_from_file_location("gradwatch_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


class _Act(nn.Module):
    """The model's activation, or ``bench.SiLUFunction`` with its planted bug (``--bug``)."""

    def __init__(self, plain: Callable[[torch.Tensor], torch.Tensor], bug: bool) -> None:
        super().__init__()
        self.plain, self.bug = plain, bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bench.SiLUFunction.apply(x, True) if self.bug else self.plain(x)


class MLP(nn.Module):
    """``d_in -> width -> width -> 10`` with ReLU."""

    def __init__(self, d_in: int, width: int, bug: bool) -> None:
        super().__init__()
        self.fc1, self.act1 = nn.Linear(d_in, width), _Act(F.relu, bug)
        self.fc2, self.fc3 = nn.Linear(width, width), nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(self.act1(self.fc1(x)))))


class CNN(nn.Module):
    """Three 3x3 convolutions (the second strided), BatchNorm, ReLU, global average pooling, a linear head."""

    def __init__(self, c: int, bug: bool) -> None:
        super().__init__()
        self.conv1, self.bn1, self.act1 = nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), _Act(F.relu, bug)
        self.conv2, self.bn2 = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.BatchNorm2d(2 * c)
        self.conv3, self.head = nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.Linear(2 * c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.conv1(x)))
        x = F.relu(self.conv3(F.relu(self.bn2(self.conv2(x)))))
        return self.head(x.mean(dim=(2, 3)))


class LM(nn.Module):
    """A causal LM: token and position embeddings, ``nn.TransformerEncoderLayer`` blocks (no dropout), a head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int, bug: bool) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(0.02 * torch.randn(seq, dim))
        act: Any = _Act(F.relu, True) if bug else "relu"
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation=act if i == 0 else "relu",
                                       batch_first=True, norm_first=True)
            for i in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(x))


def _xent(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


#: name -> (kind, size arguments); sizes chosen for about 5k, 50k, 300k and 1M parameters.
MODELS: Dict[str, Tuple[str, Tuple[int, ...]]] = {
    "mlp-5k": ("mlp", (32, 52)), "mlp-50k": ("mlp", (64, 192)),
    "mlp-300k": ("mlp", (128, 480)), "mlp-1m": ("mlp", (256, 900)),
    "cnn-5k": ("cnn", (9,)), "cnn-50k": ("cnn", (30,)), "cnn-300k": ("cnn", (74,)), "cnn-1m": ("cnn", (136,)),
    "lm-5k": ("lm", (32, 16, 1, 2)), "lm-50k": ("lm", (64, 40, 2, 4)),
    "lm-300k": ("lm", (256, 96, 2, 4)), "lm-1m": ("lm", (512, 128, 4, 4)),
}
SEQ = 16


def make_case(name: str, bug: bool = False) -> Any:
    """A ``bench.Case`` for ``name``: model, loss and batch, fixed seeds (the batch: 32 rows, 8 images, 4 sequences)."""
    kind, size = MODELS[name]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model: nn.Module
    if kind == "mlp":
        model = MLP(size[0], size[1], bug)
        batch: Any = (torch.randn(32, size[0], generator=gen), torch.randint(0, 10, (32,), generator=gen))
        loss: Callable[[nn.Module, Any], torch.Tensor] = _xent
    elif kind == "cnn":
        model = CNN(size[0], bug)
        batch = (torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen))
        loss = _xent
    else:
        vocab, dim, layers, heads = size
        model = LM(vocab, dim, layers, heads, SEQ, bug)
        batch = torch.randint(0, vocab, (4, SEQ + 1), generator=gen)
        loss = _lm_loss
    return bench.Case(name, model, loss, batch, bug, "act1", "SiLUFunction", (), f"{kind} {size}")


#: Where a call's time goes: (stage, file suffix, function, caller or ""); each stage's cumulative time in one
#: profiled call (with a caller: only the calls from it).
STAGES: Sequence[Tuple[str, str, str, str]] = (
    ("shadow copy", "objective/shadow.py", "__init__", ""),
    ("shadow refresh", "objective/shadow.py", "refresh", ""),
    ("analytic forward", "objective/terms.py", "terms", "run_model_check"),
    ("analytic backward", "check/model.py", "_analytic", ""),
    ("judging", "check/model.py", "_judge_all", ""),
    ("evaluations", "probes/lines.py", "__call__", ""),
    ("vmapped evaluations", "probes/batched.py", "__call__", ""),
    ("modules alone", "check/model.py", "judge_unseen_on_modules", ""),
    ("flat on leaves", "check/model.py", "_flat_on_leaves", ""),
)


def profile_stages(case: Any) -> Dict[str, float]:
    """One warm ``check_model`` call under cProfile: the cumulative seconds of each of :data:`STAGES`, and the call's.

    Evaluations are inside judging. ``other`` is the call less the copy, the refresh, the analytic passes, judging
    and the modules alone: the context (generators, guards, hooks), options, the report. The profiler's own cost
    inflates Python-heavy stages: read them as shares, not times.
    """
    prof = cProfile.Profile()
    prof.enable()
    check_model(case.model, case.loss_fn, case.batch)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    out: Dict[str, float] = {}
    for label, suffix, func, caller in STAGES:
        total = 0.0
        for key, (_, _, _, cumulative, callers) in stats.items():
            if key[0].endswith(suffix) and key[2] == func:
                total += cumulative if not caller else sum(v[3] for c, v in callers.items() if c[2] == caller)
        out[label] = total
    out["call"] = sum(v[3] for k, v in stats.items() if k[0].endswith("check/model.py") and k[2] == "check_model")
    out["other"] = out["call"] - sum(out[k] for k in ("shadow copy", "shadow refresh", "analytic forward",
                                                      "analytic backward", "judging", "modules alone"))
    return out


class _Clocks:
    """Wall and CPU seconds of a block (the CPU time of this process: what a shared machine's load leaves out)."""

    def __enter__(self) -> "_Clocks":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def run_fast_gradcheck(case: Any) -> Tuple[float, float, int, str]:
    """``gradcheck(fast_mode=True)`` over every parameter, as ``bench.run_gradcheck`` runs it (a float64 copy made
    before the clocks start, ``functional_call``, the slow-mode recompute of a mismatch's message skipped): wall
    seconds, CPU seconds, evaluations, and ``pass`` or ``mismatch``."""
    model = copy.deepcopy(case.model).double()
    wrapper = bench._LossModule(model, case.loss_fn)
    batch = cast_floats(case.batch, torch.float64)
    names = ["inner." + n for n, p in model.named_parameters() if p.requires_grad]
    inputs = tuple(p.detach().clone().requires_grad_(True) for p in model.parameters() if p.requires_grad)
    calls = [0]

    def fn(*params: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.func.functional_call(wrapper, dict(zip(names, params)), (batch,))

    module = importlib.import_module("torch.autograd.gradcheck")
    slow_message = module._run_slow_mode_and_get_error
    module._run_slow_mode_and_get_error = lambda *a, **k: "(slow-mode recompute skipped)"
    status = "pass"
    try:
        with _Clocks() as clocks:
            try:
                torch.autograd.gradcheck(fn, inputs, fast_mode=True, raise_exception=True)
            except GradcheckError:
                status = "mismatch"
    finally:
        module._run_slow_mode_and_get_error = slow_message
    return clocks.wall, clocks.cpu, calls[0], status


def measure(case: Any, repeats: int) -> Dict[str, Any]:
    """Interleaved pairs, one thread, warm: ``check_model``'s whole call and fast gradcheck's; medians."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_model(case.model, case.loss_fn, case.batch)  # warm
        run_fast_gradcheck(case)
        ours: List[Tuple[float, float]] = []
        theirs: List[Tuple[float, float]] = []
        verdicts: List[float] = []
        report: Any = None
        for _ in range(repeats):
            with _Clocks() as clocks:
                report = check_model(case.model, case.loss_fn, case.batch)
            ours.append((clocks.wall, clocks.cpu))
            verdicts.append(report.verdict_seconds)
            wall, cpu, evaluations, status = run_fast_gradcheck(case)
            theirs.append((wall, cpu))
        stages = profile_stages(case)
    finally:
        torch.set_num_threads(threads)
    gw, gc = statistics.median(w for w, _ in ours), statistics.median(w for w, _ in theirs)
    gw_cpu, gc_cpu = statistics.median(c for _, c in ours), statistics.median(c for _, c in theirs)
    ratios = [a[0] / b[0] for a, b in zip(ours, theirs)]
    return {
        "model": case.name, "params": case.n_params, "bug": case.bug, "gradwatch_seconds": gw,
        "gradwatch_verdict_seconds": statistics.median(verdicts), "gradcheck_fast_seconds": gc, "ratio": gw / gc,
        "ratio_spread": [min(ratios), max(ratios)], "pair_ratio_median": statistics.median(ratios),
        "gradwatch_cpu_seconds": gw_cpu, "gradcheck_fast_cpu_seconds": gc_cpu, "cpu_ratio": gw_cpu / gc_cpu,
        "gradwatch_evaluations": report.evaluations, "gradcheck_fast_evaluations": evaluations,
        "gradwatch_ok": report.ok, "gradcheck_fast_status": status,
        "failing": [t.name for t in report.failures], "stages": stages,
    }


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--bug", action="store_true", help="plant a wrong backward in each model's first activation")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    print(f"torch {torch.__version__}, one thread, medians of {args.repeats} interleaved pairs; load {os.getloadavg()}")
    print(f"{'model':9} {'params':>8} {'gradwatch':>10} {'gradcheck':>10} {'ratio':>6} {'pairs':>11} {'cpu ratio':>9} "
          f"{'evals':>9} {'ok/caught':>14}  where gradwatch's time went (ms, one profiled call)")
    for name in args.models.split(","):
        row = measure(make_case(name, args.bug), args.repeats)
        rows.append(row)
        st = row["stages"]
        where = ", ".join(f"{k} {_ms(v)}" for k, v in st.items() if v >= 5e-4 and k != "call")
        verdicts = f"{'ok' if row['gradwatch_ok'] else 'FAIL'}/{row['gradcheck_fast_status']}"
        lo, hi = row["ratio_spread"]
        print(f"{name:9} {row['params']:>8} {_ms(row['gradwatch_seconds']):>8}ms {_ms(row['gradcheck_fast_seconds']):>8}ms "
              f"{row['ratio']:>5.2f}x {lo:>5.2f}-{hi:<5.2f} {row['cpu_ratio']:>8.2f}x "
              f"{row['gradwatch_evaluations']:>4}/{row['gradcheck_fast_evaluations']:<4} {verdicts:>14}  "
              f"call {_ms(st['call'])}: {where}", flush=True)
    worst = max(r["ratio"] for r in rows)
    print(f"worst ratio {worst:.2f}x (wall), {max(r['cpu_ratio'] for r in rows):.2f}x (CPU); "
          f"under fast gradcheck's time on every model: {all(r['ratio'] < 1 for r in rows)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"load": os.getloadavg(), "repeats": args.repeats, "rows": rows}, fh, indent=1)
    return 0 if all(math.isfinite(r["ratio"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
