"""The inner-derivatives part of a watch: the double backward an objective that differentiates relies on.

An objective that differentiates through the model (a gradient penalty) trains on the model's double
backward. At each check a few leaf modules (least-checked first, only those whose float64 copy fits
``memory_budget``, chosen by :meth:`~gradwatch.watch.parts.planning.CheckPlanner.inner_modules`) get their
double backward checked (:mod:`gradwatch.check.higher_order.inner`), as report entries
``"<module>:double_backward"``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from gradwatch import GradWatch
    >>> def penalty(m, x):  # the gradient's norm joins the loss: the objective differentiates
    ...     x = x.requires_grad_()
    ...     out = m(x).sum()
    ...     (g,) = torch.autograd.grad(out, x, create_graph=True)
    ...     return out + g.pow(2).sum()
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    >>> watch = GradWatch(model, penalty, every=1, training=False, log_dir=None)
    >>> report = watch.step(torch.randn(5, 3))
    >>> sorted(n for n in report.tensors if n.endswith(":double_backward"))
    ['0:double_backward', '1:double_backward', '2:double_backward']
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Dict, List, Optional, cast

import torch
from torch import nn

from gradwatch.check.higher_order.inner import capture_inner_inputs, check_inner_derivatives, check_module_double_backward
from gradwatch.check.judging.report import CheckReport, TensorCheck
from gradwatch.check.model import run_model_check
from gradwatch.check.modules.localize import map_tensors
from gradwatch.errors import first_line
from gradwatch.parallel.lockstep import Lockstep
from gradwatch.parallel.shard_check import ShardView, gather_wholes, held_by, reshard
from gradwatch.parallel.zero import is_partitioned, partition_span
from gradwatch.plan.cycle import next_pass
from gradwatch.plan.shards import rows_held
from gradwatch.plan.units import Unit, isolated_forward
from gradwatch.watch.parts.context import CheckContext, TrendAlerting, WatchContext
from gradwatch.watch.parts.planning import CheckPlanner

logger = logging.getLogger("gradwatch")


class InnerPart(TrendAlerting):
    """Checks a few leaf modules' double backward per check when the objective differentiates.

    Args:
        watch: The watch's setting.
        planner: Chooses the modules under ``memory_budget``.

    Example:
        See the module's example.
    """

    name = "inner"
    #: Modules whose double backward a check of an objective that differentiates inside checks (least-checked first).
    PER_CHECK = 8

    def __init__(self, watch: WatchContext, planner: CheckPlanner) -> None:
        self.watch = watch
        self.planner = planner
        #: Modules whose double backward was checked, and how often.
        self.counts: Dict[str, int] = {}
        #: The check (``watch.checks``) at which ``loss_fn`` was last seen reading no parameter directly (on every
        #: rank), with neither ``regularizers`` nor coupled weight decay: the terms are looked for once a pass then.
        self.no_terms_at: Optional[int] = None

    @property
    def enabled(self) -> bool:
        """Whether the objective differentiates through the model (known after the first check)."""
        return bool(self.watch.objective.differentiates)

    def run(self, check: CheckContext) -> Dict[str, Any]:
        """The chosen modules' checks, added to ``check.report.tensors`` (and returned); notes say what was not.

        Under DDP rank 0 checks them on its batch; a model sharded with FSDP2 is checked by every rank
        (:meth:`on_shards`).
        """
        report = check.report
        if report is None:
            return {}
        coord = self.watch.dist
        terms: Dict[str, Any] = {}
        if self.watch.by_shard or (check.plan is not None and check.plan.form_name == "module"):
            terms = self.parameter_terms(check)
        if not self.enabled:
            return terms
        if self.watch.by_shard:
            return {**terms, **self.on_shards(check)}
        if coord is not None and not coord.is_main:
            return {}
        chosen, leaves = self.planner.inner_modules(check.target, report, self.counts, self.PER_CHECK)
        with self.watch.recorder_paused():
            checks = check_inner_derivatives(check.target, self.watch.objective.loss, check.batch,
                                             names=sorted(chosen, key=leaves.index), seed=check.opts.seed,
                                             fail_at=report.fail_at)
        return {**terms, **self._record(report, chosen, checks)}

    def _record(self, report: CheckReport, chosen: List[str], checks: Dict[str, TensorCheck]) -> Dict[str, Any]:
        for name in chosen:
            self.counts[name] = self.counts.get(name, 0) + 1
        report.tensors.update(checks)
        return dict(checks)

    def on_shards(self, check: CheckContext) -> Dict[str, Any]:
        """Shard by shard: every rank captures the chosen modules' inputs from its own batch (one forward of the live
        sharded model, its all-gathers, between agreement points), gathers each chosen module's parameters (in
        the same order on every rank, keeping those of its share) and checks its round-robin share of the
        modules on a float64 copy; the ranks' entries are merged. A rank that raises stops the others at their
        next point: a note on every rank, the other parts' verdicts stand.
        """
        report, coord, model = check.report, self.watch.dist, check.target
        assert report is not None
        chosen, leaves = self.planner.inner_modules(model, report, self.counts, self.PER_CHECK)
        names = sorted(chosen, key=leaves.index)
        rank, world = (coord.rank, coord.world_size) if coord is not None else (0, 1)
        if coord is not None:  # the room each rank measured may differ: rank 0's choice for every rank
            names = coord.main_decision(names, "the modules whose double backward is checked")
        modules = dict(model.named_modules())
        checks: Dict[str, TensorCheck] = {}
        try:
            with Lockstep(coord, model) if coord is not None else contextlib.nullcontext(), \
                    self.watch.recorder_paused():
                seen = capture_inner_inputs(model, self.watch.objective.loss, check.batch, names, check.opts.seed)
                reshard(model)
                order = [n for n in names if n in seen]
                own = set(order[rank::world])
                # every rank, in the same order: each parameter's all-gather
                gathered = gather_wholes([(name in own, list(modules[name].parameters())) for name in names])
                view = ShardView(model, gathered, {})
                for i, name in enumerate(order):
                    if name not in own:
                        continue
                    module = modules[name]
                    with view(Unit(name, module, dict(module.named_parameters())), None) as (unit, _):
                        entry = check_module_double_backward(name, unit.module, seen[name], check.opts.seed + i)
                    if entry is not None:
                        entry.failed = entry.verdict is not None and entry.verdict.is_failure(report.fail_at)
                        checks[entry.name] = entry
        except Exception as exc:  # noqa: BLE001 - every rank stopped at the same point: a note, the rest stands
            return _not_checked(report, "double backward", "running each module's double backward alone on the inputs "
                                "the objective gave it", exc)
        finally:
            reshard(model)
        return self._record(report, names, checks)


    def parameter_terms(self, check: CheckContext) -> Dict[str, Any]:
        """What the module form leaves out: the objective's terms that read the parameters directly (a regularizer
        inside ``loss_fn``, ``regularizers=``, coupled weight decay), checked with the model's outputs held fixed.

        One forward of the live model (its all-gathers on every rank, between agreement points, when sharded)
        records the outputs ``loss_fn`` receives, held as the forward made them (no copy: a float64 copy of a language
        model's logits over its whole vocabulary would be large); the objective is then evaluated on a copy of the model's tree
        whose forward hands back those outputs and whose parameters are this rank's (its shards, as plain
        tensors: no collective), in float64 (:func:`~gradwatch.check.model.run_model_check` on the tensors it
        reads directly; the held outputs are constants of that function, so their precision cancels out of the
        differences). Entries ``"<tensor>:terms"`` (``"<tensor>[rows]:terms"`` for a shard); the terms' values
        go to ``report.terms``. Under DDP rank 0 checks them (every rank holds the same parameters).

        Where neither ``regularizers`` nor coupled weight decay adds a term and ``loss_fn`` was seen reading no
        parameter directly (on every rank), they are looked for again at the first check of each pass of K checks
        (:meth:`looked_for_at`), not at every check: the forward costs about half a training step under tensor
        parallel.
        """
        report, coord, ctx = check.report, self.watch.dist, self.watch
        assert report is not None
        if coord is not None and not ctx.by_shard and not coord.is_main:
            return {}
        declared = bool(ctx.objective.regularizers or ctx.objective.weight_decay)
        later = None if declared else self.looked_for_at(ctx.checks)
        if later is not None:
            report.notes.append(f"terms that read the parameters directly: loss_fn read none at check "
                                f"{cast(int, self.no_terms_at) + 1}; looked for again at check {later + 1} (once "
                                f"a pass of K = {self.planner.cycle_length} checks)")
            return {}
        found = self._terms(check)
        if not declared:
            seen = [bool(found)] if coord is None or not ctx.by_shard else coord.everyone(bool(found), "terms found")
            self.no_terms_at = None if any(seen) else ctx.checks
        return found

    def looked_for_at(self, checks: int) -> Optional[int]:
        """None when the check after ``checks`` checks looks for terms that read the parameters directly, else the
        number of the check that next does: every check until one found none, then the first of each pass.

        Example:
            >>> part = InnerPart.__new__(InnerPart)
            >>> part.planner = type("Planner", (), {"cycle_length": 4})()
            >>> part.no_terms_at = None
            >>> part.looked_for_at(1) is None
            True
            >>> part.no_terms_at = 1
            >>> [part.looked_for_at(n) for n in (2, 3, 4, 5)]
            [4, 4, None, 8]
        """
        return None if self.no_terms_at is None else next_pass(checks, self.planner.cycle_length)

    def _terms(self, check: CheckContext) -> Dict[str, Any]:
        """:meth:`parameter_terms`' check itself (one forward of the live model, then the terms on the held outputs)."""
        report, coord, ctx, model = check.report, self.watch.dist, self.watch, check.target
        assert report is not None
        outputs: List[Any] = []

        def record(module: nn.Module, args: Any, output: Any) -> None:
            outputs.append(map_tensors(output, lambda t: t.detach()))

        try:
            with Lockstep(coord, model) if coord is not None and ctx.by_shard else contextlib.nullcontext(), \
                    ctx.recorder_paused():
                isolated_forward(model, ctx.objective.loss, check.batch, check.opts.seed, post={"": record})
            reshard(model)
            if not outputs:  # loss_fn calls submodules, never the model itself: no output to hold fixed
                report.notes.append("terms that read the parameters directly: not looked for, loss_fn never calls the "
                                    "model it is given (only its submodules), whose outputs the check would hold fixed")
                return {}
            with ShardView(model, {}, {})(Unit("", model, dict(model.named_parameters())), None) as (unit, _):
                proxy = unit.module
            calls = {"n": 0}

            def fixed(*args: Any, **kwargs: Any) -> Any:  # the model's outputs, held fixed
                calls["n"] += 1
                return outputs[(calls["n"] - 1) % len(outputs)]

            vars(proxy)["forward"] = fixed
            names = _direct(proxy, ctx.objective, check.batch)
            if not names:
                return {}
            opts = dataclasses.replace(check.opts, dtype=torch.float64)
            with ctx.recorder_paused():
                found = run_model_check(proxy, ctx.objective, check.batch, opts, names=names)
        except Exception as exc:  # noqa: BLE001 - the user's loss_fn on the held outputs: a note, the rest stands
            return _not_checked(report, "terms that read the parameters directly", "loss_fn on the model's held outputs",
                                exc)
        finally:
            reshard(model)
        live = dict(model.named_parameters())
        checks = {}
        for name, entry in found.tensors.items():
            label = f"{name}{_rows(live.get(name))}:terms"
            checks[label] = dataclasses.replace(entry, name=label)
        report.tensors.update(checks)
        for term, value in found.terms.items():
            if term != "loss":
                report.terms[term] = value
        held = [t for t in found.terms if t != "loss"]
        report.notes.append(f"the terms that read the parameters directly ({', '.join(['loss_fn', *held])}) checked on "
                            f"{len(checks)} tensor{'' if len(checks) == 1 else 's'}, the model's outputs held fixed")
        return checks


def _not_checked(report: CheckReport, what: str, attempt: str, exc: Exception) -> Dict[str, Any]:
    """What a part of the check that raised returns (no verdicts): a note naming ``what`` was not checked and the
    ``attempt`` that failed; the rest of the check stands."""
    logger.debug("gradwatch: %s not checked: %s raised", what, attempt, exc_info=exc)
    report.notes.append(f"{what} not checked: {attempt} failed ({first_line(exc)}); the rest of the check stands")
    return {}


def _direct(proxy: nn.Module, objective: Any, batch: Any) -> List[str]:
    """The parameters the objective reads directly (a nonzero gradient with the model's outputs held fixed)."""
    named = [(n, p) for n, p in proxy.named_parameters() if p.requires_grad]
    with torch.enable_grad():
        total = objective.loss(proxy, batch)
        for value in objective.param_terms(proxy).values():
            total = total + value
        if not total.requires_grad:
            return []
        grads = torch.autograd.grad(total, [p for _, p in named], allow_unused=True)
    return [n for (n, _), g in zip(named, grads) if g is not None and bool(g.detach().ne(0).any())]


def _rows(p: Any) -> str:
    """``"[first:end]"``: the rows of a parameter sharded on dim 0 this rank holds, ``"[flat first:end]"`` the entries
    of its flattened whole a ZeRO-3 partition holds (``""`` for a whole one, or one laid out otherwise)."""
    if p is not None and is_partitioned(p):
        return "[flat {}:{}]".format(*partition_span(p))
    where = None if p is None else held_by(p)
    if where is None or where[1] < 2:
        return ""
    first, end = rows_held(int(p.shape[0]), *where)
    return f"[{first}:{end}]"


__all__ = ["InnerPart"]
