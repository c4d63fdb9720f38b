"""``check_backward`` against PyTorch's own operator database (OpInfo), next to ``torch.autograd.gradcheck``.

Walks ``torch.testing._internal.common_methods_invocations.op_db`` and takes, for
every operator that supports backward in float64 on the CPU, its first float64
sample input (drawn under a seed made from the operator's name, so the subset is
the same on every run of one torch version). Left out: random operators
(dropout, ``rrelu``, ``normal``, ``bernoulli``, fractional max pooling, the
low-rank SVDs), operators with complex inputs or outputs (``fft.*``,
``view_as_complex``, ``polar``, ``linalg.eig``, ...), sparse ones, dtype casts
(``float``, ``half``, ...), operators whose own gradient test in PyTorch
(``test_fn_grad``) is skipped or expected to fail on CPU float64 (e.g.
``as_strided_scatter``, ``max_unpool3d`` with repeated indices: their backward
does not match their forward), samples with no float64 input that requires
grad or that cannot run on fresh copies of their inputs, and outputs that are
not differentiable (compared only over the differentiable outputs, as gradcheck
does). On each sample it runs:

* ``gradwatch.check_backward`` at its defaults on the correct operator: any
  ``GradientCheckError`` is a false alarm, any other exception an error;
* the same on two kinds of mutant (``--mutants gradient,jacobian``, default both):

  - *gradient*: an ``autograd.Function`` whose backward computes the true
    vector-Jacobian product and multiplies one element of one input's
    gradient by 1.01 (the input and element drawn at random among elements
    whose gradient for the benchmark's ``y_grad`` is at least 1e-3 and at least
    1% of that input's largest, so that a 1% error exceeds gradcheck's default
    tolerances there);
  - *jacobian*: one Jacobian element (output element ``k``, input element
    ``i``) 1% off whatever the output gradient: the backward returns the true
    vector-Jacobian product plus ``0.01 * J[k, i] * gy[k]`` on element ``i``
    (``k`` drawn at random, seeded by the operator's name, among the
    differentiable outputs' elements; ``i`` among the entries of Jacobian row
    ``k``, found by one vector-Jacobian product with the one-hot ``e_k``, of at
    least 1e-3 and 1% of the row's largest);
* ``torch.autograd.gradcheck`` in fast mode and in slow mode on all three
  (defaults, ``check_batched_grad=False``, the operator's own
  ``gradcheck_nondet_tol`` and ``gradcheck_wrapper``).

It prints false alarms, errors and mutants caught per kind for each tool, the
mutants slow gradcheck catches that ``check_backward`` misses, and the time
each tool took (all three runs of each sample). Not part of the test run.

Measured (one run, one thread, 2 shared CPU cores, torch 2.13; the figures and
their history are in docs/getting-started/check-backward-opinfo.md): 460
samples, 422 gradient and 421 Jacobian mutants; ``check_backward`` 0 false
alarms, 0 errors, 422/422 and 421/421 caught, 90 s; fast gradcheck 167/422 and
152/421, 10 s; slow gradcheck 422/422 and 421/421, 553 s. With
``--any-element``: ``check_backward`` 416/424 and 417/423, each miss 1% of a
Jacobian entry of at most 5.2e-5 (below its float64 ``atol`` of 1e-6).

Run: ``.venv/bin/python benchmarks/opinfo.py`` (needs the ``bench`` extra:
``expecttest``; 10 to 15 minutes on 2 shared CPU cores). ``--only NAME``
restricts to operators whose name contains NAME; ``--samples K`` takes the
first K samples of each operator (named ``op#1``, ``op#2``, ...);
``--any-element`` draws the mutated element among every element with a nonzero
gradient (every nonzero Jacobian entry of the row, for the jacobian kind);
``--mutants KINDS`` runs some kinds only; ``--json PATH`` writes every row with
its times (a gradient mutant's results under ``mutant``, a Jacobian one's under
``jacobian``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
import zlib
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # measure the checkout this script sits in
import gradwatch  # noqa: E402

#: Operators left out by name (substring match on the full name ``name.variant``): random, complex,
#: sparse, dtype casts.
SKIP = (
    "dropout", "rrelu", "normal", "bernoulli", "fractional_max_pool", "svd_lowrank", "pca_lowrank",
    "sparse", "fft.", "stft", "view_as_complex", "complex", "polar", "linalg.eig", "linalg.eigvals",
    "cdouble", "cfloat", "chalf", "bfloat16", "half",
)
#: Left out of the complex run (``--complex``): random, sparse, dtype casts (complex operators are its subject).
SKIP_COMPLEX = ("dropout", "rrelu", "normal", "bernoulli", "fractional_max_pool", "svd_lowrank", "pca_lowrank",
                "sparse", "bfloat16", "half", "chalf")
#: Exact names left out: dtype casts (their outputs are not float64).
SKIP_EXACT = ("float", "double", "to")


def full_name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _tensors_requiring_grad(sample) -> List[torch.Tensor]:
    from torch.testing._internal.common_utils import is_iterable_of_tensors

    inp = list(sample.input) if is_iterable_of_tensors(sample.input) else [sample.input]
    return [x for x in chain(inp, sample.args, sample.kwargs.values()) if isinstance(x, torch.Tensor) and x.requires_grad]


def make_fn(op, sample) -> Callable[..., Any]:
    """The op as a function of the sample's tensors that require grad (as torch's own gradient tests build it)."""
    from torch.testing._internal.common_utils import is_iterable_of_tensors

    variant = op.get_op()

    def recompose(inputs, inp, k):
        if is_iterable_of_tensors(inp):
            out = []
            for x in inp:
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    out.append(inputs[k])
                    k += 1
                else:
                    out.append(x)
            return out, k
        if isinstance(inp, torch.Tensor) and inp.requires_grad:
            return inputs[k], k + 1
        return inp, k

    def fn(*inputs):
        args, k = [], 0
        for x in (sample.input, *sample.args):
            v, k = recompose(inputs, x, k)
            args.append(v)
        kwargs = {}
        for key, x in sample.kwargs.items():
            kwargs[key], k = recompose(inputs, x, k)
        out = op.gradcheck_wrapper(variant, *args, **kwargs)
        if sample.output_process_fn_grad is not None:
            out = sample.output_process_fn_grad(out)
        return out

    return fn


def float_outputs(out: Any) -> Tuple[torch.Tensor, ...]:
    """The floating and complex tensors among an op's outputs (integer outputs such as indices get no gradient)."""
    if isinstance(out, torch.Tensor):
        out = (out,)
    flat = []
    for o in out:
        if isinstance(o, torch.Tensor):
            flat.append(o)
        elif isinstance(o, (tuple, list)):
            flat.extend(t for t in o if isinstance(t, torch.Tensor))
    return tuple(o for o in flat if o.is_floating_point() or o.is_complex())


def _grad_test_disabled(op, dtype: torch.dtype = torch.float64) -> bool:
    """True when PyTorch's own gradient test (``test_fn_grad``) skips or expects a failure on CPU in ``dtype``."""
    from torch.testing._internal.opinfo.core import DecorateInfo

    return any(isinstance(d, DecorateInfo) and d.is_active("TestBwdGradients", "test_fn_grad", "cpu", dtype, {})
               for d in op.decorators)


def collect(only: Optional[str] = None, per_op: int = 1, dtype: torch.dtype = torch.float64) -> List[Dict[str, Any]]:
    """The deterministic subset: the first ``per_op`` samples in ``dtype`` (float64, or complex128 for the
    complex run) of each operator that supports backward in that dtype on the CPU."""
    from torch.testing._internal.common_methods_invocations import op_db

    skip = SKIP if not dtype.is_complex else SKIP_COMPLEX
    cases = []
    for op in sorted(op_db, key=full_name):
        name = full_name(op)
        if only is not None and only not in name:
            continue
        if not op.supports_autograd or dtype not in op.supported_backward_dtypes("cpu"):
            continue
        if name in SKIP_EXACT or any(s in name for s in skip):
            continue
        if _grad_test_disabled(op, dtype):
            continue
        torch.manual_seed(zlib.crc32(name.encode()))
        for k, sample in enumerate(op.sample_inputs("cpu", dtype, requires_grad=True)):
            if k >= per_op:
                break
            case = _case(op, name if k == 0 else f"{name}#{k}", sample, dtype)
            if case is not None:
                cases.append(case)
    return cases


def _case(op, name: str, sample, dtype: torch.dtype = torch.float64) -> Optional[Dict[str, Any]]:
    """One benchmark case from a sample, or None when it has no input of ``dtype`` to check (complex outputs
    only in the complex run)."""
    xs = _tensors_requiring_grad(sample)
    if not xs or any(x.dtype != dtype for x in xs):
        return None
    fn = make_fn(op, sample)
    try:  # on fresh copies, as every tool gets them (as_strided samples that rely on a larger storage fail)
        outs = fn(*[x.detach().clone().requires_grad_(True) for x in xs])
    except RuntimeError:
        return None
    flat = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    if not dtype.is_complex and any(isinstance(o, torch.Tensor) and o.is_complex() for o in flat):
        return None
    # Only the differentiable outputs are compared (as gradcheck does): e.g. native_layer_norm's
    # mean and rstd are outputs its backward ignores by design.
    keep = [k for k, o in enumerate(float_outputs(outs)) if o.requires_grad]
    if not keep:
        return None
    return {"name": name, "op": op, "sample": sample, "xs": [x.detach() for x in xs], "fn": _select(fn, keep)}


def _select(fn: Callable[..., Any], keep: Sequence[int]) -> Callable[..., Any]:
    def selected(*xs):
        outs = float_outputs(fn(*xs))
        return tuple(outs[k] for k in keep)

    return selected


def _mutated(fn: Callable[..., Any], adjust: Callable[[List[torch.Tensor], Sequence[torch.Tensor]], None]) -> Callable[..., Any]:
    """``fn`` (floating outputs only) as an ``autograd.Function`` whose backward is the true vector-Jacobian
    product, then ``adjust(grads, gys)`` (in place: contiguous copies, one per input)."""

    class Mutant(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            ctx.save_for_backward(*xs)
            return tuple(o.detach().clone() for o in float_outputs(fn(*xs)))

        @staticmethod
        def backward(ctx, *gys):
            grads = _true_vjp(fn, ctx.saved_tensors, gys)
            adjust(grads, gys)
            return tuple(grads)

    return lambda *xs: Mutant.apply(*xs)


def mutant(fn: Callable[..., Any], which: int, index: int, factor: float = 1.01) -> Callable[..., Any]:
    """``fn`` (floating outputs only) whose backward multiplies element ``index`` of input ``which``'s gradient."""

    def adjust(grads: List[torch.Tensor], gys: Sequence[torch.Tensor]) -> None:
        grads[which].view(-1)[index] *= factor

    return _mutated(fn, adjust)


def jacobian_mutant(fn: Callable[..., Any], output: int, element: int, which: int, index: int,
                    entry: complex, factor: float = 0.01) -> Callable[..., Any]:
    """``fn`` (floating outputs only) whose Jacobian entry (output ``output`` element ``element``, input ``which``
    element ``index``), ``entry``, is ``factor`` off: its backward returns the true vector-Jacobian product plus
    ``factor * entry * gy[output][element]`` on that input element (whatever the output gradient ``gy``)."""

    def adjust(grads: List[torch.Tensor], gys: Sequence[torch.Tensor]) -> None:
        grads[which].view(-1)[index] += factor * entry * gys[output].reshape(-1)[element]

    return _mutated(fn, adjust)


def _true_vjp(fn: Callable[..., Any], saved: Sequence[torch.Tensor], gys: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """The true vector-Jacobian product of ``fn`` at ``saved`` (contiguous copies: one element can be written)."""
    xs = [x.detach().requires_grad_(True) for x in saved]
    with torch.enable_grad():
        outs = float_outputs(fn(*xs))
        pairs = [(o, g) for o, g in zip(outs, gys) if o.requires_grad and g is not None]
        grads = (torch.autograd.grad([o for o, _ in pairs], xs, [g for _, g in pairs], allow_unused=True)
                 if pairs else [None] * len(xs))
    # contiguous copies: a transposed gradient (``T``, ``H``) has no flat view to mutate
    return [torch.zeros_like(x, memory_format=torch.contiguous_format) if g is None
            else g.clone(memory_format=torch.contiguous_format) for g, x in zip(grads, xs)]


def choose_jacobian_mutation(name: str, fn: Callable[..., Any], xs: Sequence[torch.Tensor],
                             any_element: bool = False) -> Optional[Tuple[int, int, int, int, complex]]:
    """(output, output element, input, input element, Jacobian entry) to make 1% off: the output element drawn at
    random among the differentiable outputs' elements (seeded by ``name``; up to 20 draws until its Jacobian row
    has a candidate), the input element among that row's entries of at least 1e-3 and 1% of the row's largest
    (``any_element``: among its nonzero entries)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    outs = float_outputs(fn(*leaves))
    elements = [(o, e) for o, out in enumerate(outs) if out.requires_grad for e in range(out.numel())]
    if not elements:
        return None
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 3)
    for _ in range(20):
        o, e = elements[int(torch.randint(len(elements), (1,), generator=gen))]
        onehot = torch.zeros_like(outs[o]).reshape(-1)
        onehot[e] = 1
        pairs = [(out, onehot.reshape(out.shape) if k == o else torch.zeros_like(out))
                 for k, out in enumerate(outs) if out.requires_grad]
        row = torch.autograd.grad([q for q, _ in pairs], leaves, [g for _, g in pairs], retain_graph=True,
                                  allow_unused=True)
        flat = [None if r is None else r.detach().reshape(-1) for r in row]
        largest = max((float(r.abs().max()) for r in flat if r is not None and r.numel()), default=0.0)
        candidates = [(k, int(i)) for k, r in enumerate(flat) if r is not None
                      for i in torch.nonzero(((r.abs() > 0) if any_element else (r.abs() >= 1e-3) & (r.abs() >= 1e-2 * largest))
                                             & torch.isfinite(r.abs())).reshape(-1).tolist()]
        if candidates:
            k, i = candidates[int(torch.randint(len(candidates), (1,), generator=gen))]
            entry = flat[k][i].item()  # type: ignore[index]
            return o, e, k, i, entry
    return None


def y_grads(name: str, outs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1)
    return [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]


def choose_mutation(name: str, fn: Callable[..., Any], xs: Sequence[torch.Tensor],
                    gys: Sequence[torch.Tensor], any_element: bool = False) -> Optional[Tuple[int, int]]:
    """(input, flat element) to make 1% off: drawn among elements whose gradient is >= 1e-3 and >= 1% of the
    largest (``any_element``: among every element with a nonzero gradient)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    outs = float_outputs(fn(*leaves))
    pairs = [(o, g) for o, g in zip(outs, gys) if o.requires_grad]
    if not pairs:
        return None
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    candidates = []
    for k, g in enumerate(grads):
        if g is None:
            continue
        a = g.detach().abs().reshape(-1)
        if a.numel() == 0:
            continue
        ok = (a > 0) if any_element else (a >= 1e-3) & (a >= 1e-2 * a.max())
        ok = ok & torch.isfinite(a)
        candidates += [(k, int(i)) for i in torch.nonzero(ok).reshape(-1).tolist()]
    if not candidates:
        return None
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 2)
    return candidates[int(torch.randint(len(candidates), (1,), generator=gen))]


def _float_fn(fn):
    return lambda *xs: float_outputs(fn(*xs))


def run_check_backward(fn, xs, gys) -> str:
    """'ok', 'alarm' (GradientCheckError) or 'error: ...'."""
    try:
        gradwatch.check_backward(fn, tuple(x.clone() for x in xs), tuple(gys))
        return "ok"
    except gradwatch.GradientCheckError:
        return "alarm"
    except Exception as e:  # noqa: BLE001 - an error is a result here
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"


def run_gradcheck(fn, xs, fast: bool, nondet_tol: float) -> str:
    inputs = tuple(x.detach().clone().requires_grad_(True) for x in xs)
    try:
        ok = torch.autograd.gradcheck(fn, inputs, fast_mode=fast, raise_exception=False, check_batched_grad=False,
                                      nondet_tol=nondet_tol)
        return "ok" if ok else "alarm"
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"


TOOLS = ("check_backward", "gradcheck_fast", "gradcheck_slow")
#: Mutant kinds: one element of the input gradient for the given y_grad 1% off (``mutant``), one Jacobian
#: element 1% off whatever the output gradient (``jacobian``).
MUTANTS = ("gradient", "jacobian")
#: The row key each kind's results are kept under.
KIND_KEY = {"gradient": "mutant", "jacobian": "jacobian"}


def run_case(case: Dict[str, Any], tools: Sequence[str], times: Dict[str, float],
             any_element: bool = False, mutants: Sequence[str] = MUTANTS) -> Dict[str, Any]:
    name, xs, fn = case["name"], case["xs"], _float_fn(case["fn"])
    with torch.no_grad():
        outs = fn(*xs)
    gys = y_grads(name, outs)
    row: Dict[str, Any] = {"name": name, "numel": sum(x.numel() for x in xs), "correct": {}, "mutant": {},
                           "jacobian": {}, "seconds": {}}
    mutation = choose_mutation(name, fn, xs, gys, any_element) if "gradient" in mutants else None
    jacobian = choose_jacobian_mutation(name, fn, xs, any_element) if "jacobian" in mutants else None
    row["mutation"], row["jacobian_mutation"] = mutation, jacobian
    functions: Dict[str, Callable[..., Any]] = {"correct": fn}
    if mutation is not None:
        functions["mutant"] = mutant(fn, *mutation)
    if jacobian is not None:
        functions["jacobian"] = jacobian_mutant(fn, *jacobian)
    nondet = case["op"].gradcheck_nondet_tol
    for tool in tools:
        for kind, f in functions.items():
            t0 = time.perf_counter()
            torch.manual_seed(0)
            if tool == "check_backward":
                res = run_check_backward(f, xs, gys)
            else:
                res = run_gradcheck(f, xs, tool == "gradcheck_fast", nondet)
            seconds = time.perf_counter() - t0
            times[tool] += seconds
            row["seconds"][f"{kind}/{tool}"] = round(seconds, 4)
            row[kind][tool] = res
    return row


def summarize(rows: List[Dict[str, Any]], times: Dict[str, float], tools: Sequence[str],
              mutants: Sequence[str] = MUTANTS) -> str:
    n = len(rows)
    mutated = {kind: [r for r in rows if r[_mutation_key(kind)] is not None] for kind in mutants}
    what = {"gradient": "backward 1% off in one element of the input gradient for the given y_grad",
            "jacobian": "one Jacobian element 1% off"}
    lines = [f"{n} samples ({len({r['name'].split('#')[0] for r in rows})} operators); mutants: "
             + "; ".join(f"{len(mutated[k])} {k} ({what[k]})" for k in mutants), ""]
    lines.append(f"{'tool':<16} {'false alarms':>12} {'errors':>7} "
                 + " ".join(f"{k + ' caught':>16}" for k in mutants) + f" {'seconds':>8}")
    for tool in tools:
        alarms = sum(r["correct"].get(tool) == "alarm" for r in rows)
        errors = sum(str(r["correct"].get(tool, "")).startswith("error") for r in rows)
        caught = [f"{sum(_caught(r[KIND_KEY[k]].get(tool)) for r in mutated[k])}/{len(mutated[k])}" for k in mutants]
        lines.append(f"{tool:<16} {alarms:>12} {errors:>7} " + " ".join(f"{c:>16}" for c in caught)
                     + f" {times[tool]:>8.1f}")
    lines.append("")
    if "check_backward" in tools:
        for r in rows:
            if r["correct"].get("check_backward") != "ok":
                lines.append(f"  check_backward on correct {r['name']}: {r['correct']['check_backward']}")
        slow = "gradcheck_slow" in tools
        for k in mutants:
            missed = [r for r in mutated[k] if r[KIND_KEY[k]].get("check_backward") == "ok"
                      and (not slow or r[KIND_KEY[k]].get("gradcheck_slow") != "ok")]
            lines.append(f"{k} mutants {'slow gradcheck catches and ' if slow else ''}check_backward misses: "
                         f"{len(missed)}")
            for r in missed:
                lines.append(f"  {r['name']} ({_where(k, r[_mutation_key(k)])}, {r['numel']} elements)")
    if "gradcheck_slow" in tools:
        for r in rows:
            if r["correct"].get("gradcheck_slow") != "ok":
                lines.append(f"  slow gradcheck on correct {r['name']}: {r['correct']['gradcheck_slow']}")
    return "\n".join(lines)


def _mutation_key(kind: str) -> str:
    return "mutation" if kind == "gradient" else "jacobian_mutation"


def _caught(result: Optional[str]) -> bool:
    return result == "alarm" or str(result or "").startswith("error")


def _where(kind: str, mutation: Sequence[Any]) -> str:
    if kind == "gradient":
        return f"input {mutation[0]}, element {mutation[1]}"
    return f"output {mutation[0]} element {mutation[1]}, input {mutation[2]} element {mutation[3]}, J {mutation[4]:.3g}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", help="only operators whose full name contains this")
    p.add_argument("--samples", type=int, default=1, help="samples per operator (default 1: the first)")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    p.add_argument("--any-element", action="store_true",
                   help="draw each mutant's element among every element with a nonzero gradient, or nonzero Jacobian "
                        "entry (a 1%% error there can be inside the tools' atol)")
    p.add_argument("--complex", action="store_true",
                   help="complex128 samples of the operators that support complex backward (torch's convention: the "
                        "conjugate Wirtinger derivative), instead of float64")
    p.add_argument("--mutants", default=",".join(MUTANTS),
                   help=f"comma-separated mutant kinds among {','.join(MUTANTS)} (default both): one element of the "
                        "input gradient for the given y_grad 1%% off, or one Jacobian element 1%% off")
    p.add_argument("--json", help="write every row to this file")
    p.add_argument("-v", "--verbose", action="store_true", help="print each sample as it runs")
    args = p.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    for t in tools:
        if t not in TOOLS:
            p.error(f"--tools: unknown tool {t!r}; expected some of {', '.join(TOOLS)}")
    mutants = [m for m in args.mutants.split(",") if m]
    for m in mutants:
        if m not in MUTANTS:
            p.error(f"--mutants: unknown kind {m!r}; expected some of {', '.join(MUTANTS)}")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cases = collect(args.only, args.samples, torch.complex128 if args.complex else torch.float64)
    times = {t: 0.0 for t in tools}
    rows = []
    for case in cases:
        row = run_case(case, tools, times, args.any_element, mutants)
        rows.append(row)
        if args.verbose:
            print(row["name"], row["numel"], row["correct"], row["mutant"], row["jacobian"], flush=True)
    print(f"torch {torch.__version__}, gradwatch {gradwatch.__version__}, {'complex128' if args.complex else 'float64'} samples")
    print(summarize(rows, times, tools, mutants))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "seconds": times}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
