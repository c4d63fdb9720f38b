"""Tensors differences of the whole objective could not resolve, judged on their modules alone.

At weights near zero a layer's gradient is tiny against the objective: differences of the whole objective lose it
in rounding (``below_resolution``; ``flat`` where the objective does not move at all at the widest step, as for a
bias before a normalization), or cannot tell a kink from an error at a step small enough (``unresolved``). Each
module alone differences outputs whose size follows the weights', and resolves them at every scale.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from gradwatch.check.judging.report import CheckReport, InconclusiveKind
from gradwatch.check.objective.terms import Objective
from gradwatch.check.probes.experts import tensor_of
from gradwatch.check.probes.prefix import PrefixCache
from gradwatch.options import CheckOptions
from gradwatch.trees import tensor_leaves

#: What differences of the whole objective could not judge, and each module alone can (see below).
UNSEEN = (InconclusiveKind.BELOW_RESOLUTION, InconclusiveKind.UNRESOLVED, InconclusiveKind.FLAT)


def judge_unseen_on_modules(report: CheckReport, model: nn.Module, objective: Objective, batch: Any,
                            opts: CheckOptions, screen: bool) -> None:
    """Tensors the whole objective could not resolve, judged on their modules alone (the module form).

    Each module alone, ``<module(x), c>`` on its inputs from the batch
    (:func:`gradwatch.check.modules.module_form.run_module_check`), judges them at every scale (see the module's
    docstring). Such a tensor takes its module's verdict; an input gradient that fails there (a unit's backward
    wrong where the objective could not see it) joins the report under ``"<module>:input"``. Only on the float64
    copy (the default ``dtype``).
    """
    unseen = [n for n, t in report.tensors.items() if t.inconclusive_kind in UNSEEN]
    if not unseen or opts.torch_dtype != torch.float64:
        return  # in a lower precision (dtype=None on a float32 model) modules alone cannot resolve kinks either
    from gradwatch.check.modules.module_form import run_module_check
    from gradwatch.plan.units import plan_units

    start = time.perf_counter()
    units = plan_units(model, objective.loss, batch, opts.seed)
    if all(report.tensors[n].inconclusive_kind is InconclusiveKind.FLAT for n in unseen):
        # The objective is bit-for-bit flat in each of them (a bias before a normalization, or a gradient far
        # below rounding): what can still be wrong is their own module's backward, so only it is checked.
        units = [u for u in units if any(tensor_of(n) in u.params for n in unseen)]
    modular = run_module_check(model, objective, batch, opts, units=units, screen=screen)
    judged = []
    for n in unseen:
        check = modular.tensors.get(n)
        if check is not None and check.inconclusive is None:
            report.tensors[n] = check
            judged.append(n)
    for n, check in modular.tensors.items():
        if n not in report.tensors and check.failed:
            report.tensors[n] = check
    spent = time.perf_counter() - start
    report.evaluations += modular.evaluations
    report.seconds += spent
    # Their verdicts need none of the failing tensors' diagnosis, which ran before them: the work to a verdict.
    report.verdict_seconds += spent
    report.verdict_evaluations += modular.evaluations
    if judged:
        report.notes.append(alone_note(judged))


def alone_note(judged: Sequence[str]) -> str:
    """The note naming the tensors judged on their modules alone."""
    return (f"judged on their modules alone (each module on its inputs from the batch), since differences of the "
            f"whole objective could not resolve their gradient (weights near zero): {', '.join(judged)}")


def flat_on_leaves(report: CheckReport, target: nn.Module, prefix: PrefixCache, opts: CheckOptions,
                   screen: bool) -> int:
    """Tensors the objective is flat in (a bias before a normalization) whose module is a leaf that ran once:
    judged on that module alone, on the inputs the first evaluation kept, with no forward of the model more
    (:func:`judge_unseen_on_modules` judges the others). Returns the evaluations of those modules made."""
    from gradwatch.check.modules.localize import check_module

    flat = [n for n, t in report.tensors.items() if t.inconclusive_kind is InconclusiveKind.FLAT]
    evaluations = 0
    if not flat:
        return 0
    owners = {(f"{m_name}.{local}" if m_name else local): (m_name, m, local, p)
              for m_name, m in target.named_modules() for local, p in m.named_parameters(recurse=False)}
    judged = []
    for n in flat:
        if n not in owners:
            continue
        m_name, module, local, p = owners[n]
        got = prefix.inputs_of(module)
        if got is None:
            continue
        constants = {id(t) for t in tensor_leaves(got)}  # only the parameter's verdict is wanted here
        result = check_module(m_name, module, got[0], got[1], opts, params={local: p}, constants=constants,
                              screen=screen)
        evaluations += result.evaluations
        check = result.tensors.get(local)
        if check is not None and check.inconclusive is None:
            check.name = n
            report.tensors[n] = check
            judged.append(n)
    if judged:
        report.notes.append(alone_note(judged))
    return evaluations
