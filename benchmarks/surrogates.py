"""Surrogate gradients by design, watched over 20 checks: alerts on correct models, a planted bug caught and named.

Three models whose gradient is deliberately not the derivative (``tests/check/objective/test_surrogate.py``), trained with SGD
under ``GradWatch(every=1)`` in the objective form and in the module form:

- ``vq``: a VQ-VAE-style autoencoder with a straight-through vector quantizer, declared ``surrogates=["quant"]``;
- ``qat``: quantization-aware training with ``torch.ao.quantization.FakeQuantize`` (moving-average observer),
  undeclared (torch's fake quantizers are recognized);
- ``spiking``: a Heaviside spike with a sigmoid surrogate derivative, declared by class.

For each, the correct model (any alert is a false alarm) and the same model whose last Linear computes its
weight gradient 20% too large (caught: the first check whose alerts name that weight). Then the VQ-VAE and the
spiking network again with nothing declared: one alert for the run, naming the module and the option.

Example::

    python benchmarks/surrogates.py --checks 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_surrogates import VQ, OffWeight, SpikeLayer, loss  # noqa: E402

from gradwatch import GradWatch  # noqa: E402

torch.set_num_threads(1)


def build(name: str, bug: bool) -> tuple:
    """``(model, options, the planted weight's name)``."""
    last = OffWeight if bug else nn.Linear
    if name == "vq":
        model = VQ()
        model.dec = last(8, 6)
        return model, {"surrogates": ["quant"]}, "dec.weight"
    if name == "qat":
        from torch.ao.quantization import FakeQuantize

        return nn.Sequential(nn.Linear(6, 8), FakeQuantize(), nn.Tanh(), last(8, 6)), {}, "3.weight"
    return nn.Sequential(nn.Linear(6, 8), SpikeLayer(), last(8, 6)), {"surrogates": [SpikeLayer]}, "2.weight"


def run(name: str, form: str, bug: bool, checks: int, declared: bool = True) -> Dict[str, Any]:
    torch.manual_seed(0)
    model, options, planted = build(name, bug)
    options = options if declared else {}
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = GradWatch(model, loss, optimizer=opt, every=1, log_dir=None, form=form, **options)
    gen = torch.Generator().manual_seed(0)
    caught = None
    for i in range(checks):
        x = torch.randn(32, 6, generator=gen)
        opt.zero_grad()
        loss(model, x).backward()
        watch.step(x)
        opt.step()
        if bug and caught is None and any(a.tensor == planted for a in watch.alerts):
            caught = i + 1
    alerts = list(watch.alerts)
    watch.close()
    return {"model": name, "form": form, "bug": bug, "declared": declared, "checks": checks, "alerts": len(alerts),
            "alerted": sorted({a.tensor for a in alerts}), "kinds": sorted({a.kind for a in alerts}),
            "caught_at_check": caught if bug else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=20)
    args = parser.parse_args()
    rows = [run(name, form, bug, args.checks) for name in ("vq", "qat", "spiking") for form in ("objective", "module")
            for bug in (False, True)]
    for row in rows:
        print(json.dumps(row))
    correct = [r for r in rows if not r["bug"]]
    bugs = [r for r in rows if r["bug"]]
    print(f"correct: {sum(r['alerts'] for r in correct)} alerts in {len(correct)} runs of {args.checks} checks; "
          f"planted bugs caught and named: {sum(r['caught_at_check'] is not None for r in bugs)}/{len(bugs)}, "
          f"at check {sorted({r['caught_at_check'] for r in bugs if r['caught_at_check']})}; "
          f"other tensors alerted in bug runs: {sorted({t for r in bugs for t in r['alerted']})}")
    undeclared = [run(name, form, False, args.checks, declared=False) for name in ("vq", "spiking")
                  for form in ("objective", "module")]
    for row in undeclared:
        print(json.dumps(row))
    print(f"undeclared straight-through / surrogate: alerts per run of {args.checks} checks "
          f"{[r['alerts'] for r in undeclared]}, naming {sorted({t for r in undeclared for t in r['alerted']})}, "
          f"kinds {sorted({k for r in undeclared for k in r['kinds']})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
