"""The step's objective, as the training part judges it: one loss over the step's whole batch, however it is cut.

Training with ``k`` micro-batches, or on ``W`` ranks, promises the gradient of the loss on the
step's whole batch. For a ``loss_fn`` that is a mean over items, each micro-batch (of each rank)
then weighs its items over the step's, ``n_i / N``; training that divides each micro-batch's own
mean by ``k``, or lets DDP average per-rank means, weighs items unequally (the 2024 gradient
accumulation bug). :class:`StepObjective` is the part of the watch that finds the weights:

1. **What is counted** (the ``items`` option): ``"auto"`` finds the rules the batch offers (target
   tokens of a label tensor holding ``-100``, with and without the next-token shift; masks;
   samples, :mod:`gradwatch.check.replay.items`) and, where one would weigh the step's micro-batches unequally,
   decides which one ``loss_fn`` follows by evaluating its gradient on two samples and their union
   (:mod:`gradwatch.check.replay.item_probe`), once per run, on the live model with its gradient checkpointing
   (:func:`~gradwatch.check.objective.checkpointed.grad_through_checkpoints`); ``"samples"`` or a callable
   ``items(batch) -> count`` declare it;
   ``"micro_batches"`` weighs each micro-batch alike (the mean of micro-batch means).
2. **Where the cut legitimately matters**: train-mode BatchNorm, or a probe that finds the samples
   of a batch coupled (an in-batch contrastive loss): the step is judged per micro-batch, each
   weighing ``1 / k``, and the report says why.
3. **Across ranks**: every rank's counts are exchanged (one gather, no batch travels), so every
   rank weighs its micro-batches by ``W * n_ri / N`` and the ranks' replays average to the step's
   objective, under DDP and FSDP2 alike.
4. **The diagnosis**: each micro-batch's replayed gradient is sketched (:mod:`gradwatch.check.numerics.sketch`);
   when training's gradient fails, :func:`gradwatch.check.replay.cut.explain_cut` names the weights it
   was put together with ("training weighs the 4 micro-batches equally, but they hold 5, 31, 12
   and 40 target tokens ...").

Example:
    >>> part = StepObjective("samples")
    >>> batches = [torch.zeros(2, 3), torch.zeros(6, 3)]  # two micro-batches of 2 and 6 samples
    >>> plan = part.plan(batches, None, None, {}, None, seed=0)
    >>> plan.weights, plan.note
    ([0.25, 0.75], "the step's objective: the mean over its 8 samples in 2 micro-batches (2 and 6), each micro-batch weighing its share")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn

from gradwatch.check.judging.report import TrainingCheck
from gradwatch.check.judging.training_judge import tolerance_for
from gradwatch.check.numerics.sketch import Sketch
from gradwatch.check.objective.checkpointed import grad_through_checkpoints
from gradwatch.check.objective.guards import grad_marks_kept
from gradwatch.check.objective.rng import Reseeder
from gradwatch.check.replay.cut import Part, describe_counts, explain_cut, explain_uncut
from gradwatch.check.replay.item_probe import ItemDecision, coupling_modules, decide
from gradwatch.check.replay.items import (
    ItemCountError,
    ItemRule,
    Path,
    candidates,
    counts_by_rule,
    equal_weights,
    label_shift,
    proportional,
    step_weights,
)
from gradwatch.errors import first_line
from gradwatch.plan.units import isolated

#: The rule of ``items="micro_batches"``: one per micro-batch, each weighing ``1 / k`` on its rank.
MICRO_BATCHES = ItemRule("micro_batches")
#: What :meth:`StepObjective._chosen` settles: the rule the micro-batches are weighed by (None where they weigh alike),
#: why they weigh alike (None where a rule weighs them), and what the plan's note adds.
_Choice = Tuple[Optional[ItemRule], Optional[str], str]


@dataclass
class StepPlan:
    """The step's objective for one check (every rank computes the same one).

    Attributes:
        weights: This rank's micro-batch weights in its replay (None: the training part is not judged, ``reason``).
        rule: What the objective averages over.
        parts: Every rank's micro-batches, in rank order, with their counts.
        first: The place of this rank's first micro-batch in ``parts``.
        others: ``{rule key: text}`` of the other rules the batch offers (for the diagnosis).
        world: Ranks whose ``.grad`` training averages.
        equal: Each micro-batch weighs ``1 / k`` on its rank (no count to weigh them by).
        note: What the report says of the step's objective (None where there is one micro-batch on one rank).
        reason: Why the training part is not judged.
        batch: The one micro-batch of an uncut step (its counts are read only where training's gradient fails).
    """

    weights: Optional[List[float]]
    rule: ItemRule = MICRO_BATCHES
    parts: List[Part] = field(default_factory=list)
    first: int = 0
    others: Dict[str, str] = field(default_factory=dict)
    world: int = 1
    equal: bool = True
    note: Optional[str] = None
    reason: Optional[str] = None
    batch: Any = field(default=None, repr=False, compare=False)

    @property
    def cut(self) -> bool:
        """True when the step is cut (several micro-batches, or several ranks)."""
        return len(self.parts) > 1 or self.world > 1

    def record(self) -> Optional[Dict[str, Any]]:
        """The step's objective as the JSONL record keeps it (None for an uncut step)."""
        if not self.cut or self.weights is None:
            return None
        counts: Dict[int, List[float]] = {}
        for p in self.parts:
            counts.setdefault(p.rank, []).append(p.count)
        return {"rule": self.rule.text, "equal": self.equal, "counts": [counts[r] for r in sorted(counts)]}


def _count_text(values: Sequence[float]) -> str:
    shown = [str(int(v)) if float(v).is_integer() else f"{v:.4g}" for v in values[:6]]
    return ", ".join(shown[:-1]) + " and " + shown[-1] if len(shown) > 1 else shown[0]


class StepObjective:
    """The part of :class:`gradwatch.GradWatch` that weighs a step's micro-batches and ranks (module docstring).

    Args:
        items: ``"auto"``, ``"samples"``, ``"micro_batches"`` or a callable ``items(batch) -> count``.
    """

    def __init__(self, items: Any = "auto") -> None:
        self.items = items
        #: The agreed decision of the probes (kept for the run while the batch offers the same rules).
        self.decision: Optional[ItemDecision] = None
        self._known: Dict[str, ItemRule] = {}  # rules seen in the run (a batch without -100 still counts its labels)
        self._decided_for: Optional[FrozenSet[str]] = None  # the rules an undecided probe saw
        self._shifts: Dict[Path, Optional[int]] = {}  # without a probe: each label tensor's shift, read off the data
        self._sketch: Optional[Sketch] = None
        self._seed = 0  # the check the sketch's coordinates were drawn for
        #: This check's sketches of each replayed micro-batch's own gradient (this rank's).
        self.rows: List[torch.Tensor] = []

    # ------------------------------------------------------------------ planning
    def plan(self, batches: Sequence[Any], model: Optional[nn.Module], loss: Any, params: Mapping[str, torch.Tensor],
             coord: Any, seed: int, probe: bool = True, shift_hint: Optional[int] = None) -> StepPlan:
        """The step's objective: this rank's weights, agreed with the other ranks (one exchange, on every rank).

        Args:
            batches: This rank's micro-batches of the step.
            model: The live model (probes evaluate it; None: no probe).
            loss: ``loss(model, batch) -> scalar``: ``loss_fn`` as the check evaluates it (no regularizer).
            params: The parameters a probe differentiates (their gradients sketched).
            coord: The :class:`~gradwatch.parallel.coordinator.DistributedCoordinator`, or None in one process.
            seed: The check's seed (probes reseed with it; sketches draw their coordinates from it).
            probe: Whether a probe may evaluate the model (not on a sharded model: its forwards are collectives).
            shift_hint: Where no probe can decide: 1 for a model known to shift its labels (a causal LM).
        """
        self.rows = []
        if coord is None and len(batches) == 1:  # one micro-batch in one process: nothing to weigh (the common case)
            return StepPlan([1.0], parts=[Part(0, 0, 1.0)], batch=batches[0])
        try:
            local = self._local(batches, model, probe and model is not None, coord is not None)
        except Exception as exc:  # noqa: BLE001 - the user's items= or batch: said in the report, training goes on
            local = {"error": first_line(exc)}  # (the note says "counting the step's items failed: ...")
        payloads = coord.everyone(local, "the step's item counts") if coord is not None else [local]
        rules = {r.key: r for p in payloads for r in p.get("rules", ())}
        self._known.update((k, r) for k, r in rules.items() if r.kind in ("tokens", "mask"))
        if coord is not None and any(k not in p.get("counts", {}) for p in payloads if "error" not in p for k in rules):
            # A rule another rank found (its labels held -100, this rank's did not): every rank counts every rule.
            more = counts_by_rule(list(rules.values()), batches) if "error" not in local else {}
            for p, counts in zip(payloads, coord.everyone(more, "the step's item counts under every rule")):
                p.setdefault("counts", {}).update(counts)
        if probe and model is not None and self._probe_wanted(payloads):
            # Once for the run, where some count would weigh the step's micro-batches (of any rank) unequally: which
            # one loss_fn follows, or whether it sums, or couples the samples (then 1/k each, as for BatchNorm).
            # Every rank probes its own batch (a rank whose batch cannot tell leaves it to another), and the
            # decisions are exchanged: the same payloads everywhere make the same exchanges everywhere.
            try:
                mine: Any = self._probe(model, loss, params, batches, local["rules"], seed, coord is not None)
            except Exception as exc:  # noqa: BLE001 - every rank must still reach the exchange below
                mine = ItemDecision(evidence=f"the probe of what loss_fn averages over failed ({first_line(exc)})")
            made = coord.everyone(mine, "what loss_fn averages over") if coord is not None else [mine]
            for p, decision in zip(payloads, made):
                p["decision"] = decision
        rank = coord.rank if coord is not None else 0
        return self._agreed(payloads, rank, probe and model is not None, shift_hint)

    def _probe_wanted(self, payloads: List[Dict[str, Any]]) -> bool:
        """A probe is wanted when no rank's payload carries a decision, nothing couples the samples already, and some
        count weighs the step's micro-batches unequally over every rank (a pure function of the payloads)."""
        if any("error" in p or p.get("decision") is not None or p.get("coupled") for p in payloads):
            return False
        if payloads[0]["mode"] != "auto" or not payloads[0].get("rules"):
            return False
        keys = set.intersection(*(set(p["counts"]) for p in payloads))
        return any(not proportional([1.0] * sum(len(p["counts"][k]) for p in payloads),
                                    [c for p in payloads for c in p["counts"][k]]) for k in keys)

    def _local(self, batches: Sequence[Any], model: Optional[nn.Module], probe: bool, distributed: bool) -> Dict[str, Any]:
        """What this rank knows: its micro-batches' counts under every rule, the modules that couple its samples, the
        decision kept from an earlier probe, and (without a probe) how its labels are shifted."""
        out: Dict[str, Any] = {"k": len(batches), "mode": self._mode()}
        if out["mode"] == "micro_batches":
            out["counts"] = {MICRO_BATCHES.key: [1.0] * len(batches)}
            out["rules"] = [MICRO_BATCHES]
            return out
        if out["mode"] in ("samples", "declared"):
            rule = ItemRule("samples") if out["mode"] == "samples" else ItemRule("declared", declared=self.items)
            out["counts"] = {rule.key: [rule.count(b) for b in batches]}
            out["rules"] = [dataclasses.replace(rule, declared=None)]
            return out
        decided = self.decision.rule if self.decision is not None else None
        if decided is not None and not distributed:
            # Decided for the run: count that rule and its twins of the same tensor (the other shift, for the
            # diagnosis of an off-by-one count), not every rule the batch could offer.
            rules = [decided] + [r for r in self._known.values() if r.path == decided.path and r.key != decided.key]
        else:
            found = candidates(batches)
            rules = found + [r for k, r in self._known.items() if all(k != f.key for f in found)]
        counts = counts_by_rule(rules, batches)
        rules = [r for r in rules if r.key in counts]
        out["counts"], out["rules"] = counts, rules
        coupled = coupling_modules(model) if model is not None else []
        if coupled:
            out["coupled"] = (f"BatchNorm in train mode ({', '.join(coupled[:3])}{', ...' if len(coupled) > 3 else ''}) "
                              "normalizes each micro-batch by its own statistics, so the whole batch's gradient differs "
                              "from the accumulated one by design")
            return out
        if self._reusable(self.decision, counts):
            out["decision"] = self.decision  # probed once for the run (what loss_fn averages over does not change)
            return out
        out["shifts"] = {} if probe else {r.path: label_shift(batches, r.path) for r in rules if r.kind == "tokens"}
        return out

    def _reusable(self, decision: Optional[ItemDecision], counts: Mapping[str, Any]) -> bool:
        """A decision holds while its rule counts the batch; one that left several rules, while the batch offers
        the same rules (a batch offering others may tell them apart)."""
        if decision is None:
            return False
        if decision.rule is not None:
            return decision.rule.key in counts
        return bool(decision.coupled or decision.sums) or self._decided_for == frozenset(counts)

    def _mode(self) -> str:
        return "declared" if callable(self.items) else str(self.items)

    def _probe(self, model: nn.Module, loss: Any, params: Mapping[str, torch.Tensor], batches: Sequence[Any],
               rules: List[ItemRule], seed: int, distributed: bool = False) -> ItemDecision:
        """Evaluate ``loss`` on probe batches (the live model, dropout off, nothing of it changed) and decide."""
        names = list(params)
        plist = tuple(params.values())
        if not plist:
            return ItemDecision(survivors=[r.key for r in rules])
        sketch = Sketch({n: tuple(p.shape) for n, p in params.items()}, seed=seed)
        reseed = Reseeder(seed)
        noise = max(tolerance_for(p.dtype) for p in plist)
        # The live model keeps its gradient checkpointing (a probe batch may be a whole micro-batch): its gradients
        # come through whatever checkpoints it holds, by backward() where autograd.grad cannot see into a reentrant
        # one, except where a backward() would act on training (DDP's hooks, an optimizer stepping in backward).
        owners = None if distributed or any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters()) \
            else [p for p in model.parameters() if p.requires_grad]

        def evaluate(batch: Any) -> torch.Tensor:
            reseed()
            with torch.enable_grad():
                value = loss(model, batch)
                grads = grad_through_checkpoints(value, plist, owners)
            return sketch({n: torch.zeros_like(p) if g is None else g for n, p, g in zip(names, plist, grads)})

        try:
            with grad_marks_kept(model), isolated(model):  # a reentrant checkpoint needs an input requiring grad
                return decide(evaluate, batches, rules, noise=noise)
        except ItemCountError as exc:
            return ItemDecision(survivors=[r.key for r in rules], evidence=str(exc))
        except Exception as exc:  # noqa: BLE001 - loss_fn refused a probe batch: no decision, said in the report
            return ItemDecision(survivors=[r.key for r in rules],
                                evidence=f"loss_fn refused a probe batch ({first_line(exc)})")

    def _agreed(self, payloads: List[Dict[str, Any]], rank: int, probe: bool, shift_hint: Optional[int]) -> StepPlan:
        """Every rank's payload to the same plan on every rank (the same payloads give the same plan everywhere; the
        probes' decision is kept for the next checks): which count loss_fn averages over (:meth:`_chosen`), then
        each micro-batch's weight under it (:meth:`_planned`)."""
        world = len(payloads)
        failed = [(r, p["error"]) for r, p in enumerate(payloads) if "error" in p]
        if failed:
            r, why = failed[0]
            where = f" on rank {r}" if world > 1 else ""
            return StepPlan(None, world=world, reason=f"not judged: counting the step's items failed{where}: {why}")
        ks = [int(p["k"]) for p in payloads]
        self._shifts = dict(payloads[0].get("shifts") or {})  # rank 0's reading of its labels (no probe)
        rules = {r.key: r for p in payloads for r in p["rules"]}
        common = [r for k, r in rules.items() if all(k in p["counts"] for p in payloads)]
        texts = {r.key: r.text for r in common}
        chosen = self._chosen(payloads, common, texts, probe, shift_hint)
        if isinstance(chosen, StepPlan):
            return chosen
        rule, equal_why, note_extra = chosen
        return self._planned(payloads, rank, ks, texts, rule, equal_why, note_extra)

    def _chosen(self, payloads: List[Dict[str, Any]], common: List[ItemRule], texts: Dict[str, str], probe: bool,
                shift_hint: Optional[int]) -> Union[StepPlan, _Choice]:
        """``(rule, equal_why, note_extra)``: the count the micro-batches are weighed by (the rule every rank counts
        under), or why they weigh alike; or the plan of a step not judged. Declared by ``items=``, else inferred from
        the counts, the probes' decision and the batch's structure."""
        mode = payloads[0]["mode"]
        if mode == "micro_batches":
            return None, "items='micro_batches': each micro-batch's mean weighs alike", ""
        if mode in ("samples", "declared"):
            return (common[0] if common else None), None, ""
        coupled = next((p["coupled"] for p in payloads if p.get("coupled")), None)
        decision = self._keep(payloads)
        if coupled:
            return None, coupled, ""
        if decision is not None and decision.coupled:
            return None, decision.coupled, ""
        if decision is not None and decision.sums:
            return None, "loss_fn sums over its items (a probe found no count it divides by): each micro-batch's sum weighs alike", ""
        if decision is not None and decision.rule is not None and decision.rule.key in texts:
            return next(r for r in common if r.key == decision.rule.key), None, ""
        if not common:  # a batch gradwatch cannot read (no tensor with a batch dimension): as before
            return None, ("the batch holds no tensor gradwatch counts items in: each micro-batch's mean weighs alike "
                          "(declare what loss_fn averages over with items= to weigh them)"), ""
        return self._among(payloads, common, decision, probe, shift_hint)

    def _among(self, payloads: List[Dict[str, Any]], common: List[ItemRule], decision: Optional[ItemDecision],
               probe: bool, shift_hint: Optional[int]) -> Union[StepPlan, _Choice]:
        """The rule among those no probe ruled out: any where they all give the micro-batches the same weights, else
        the batch's structure's where the model could not be probed; or the plan of a step not judged."""
        world = len(payloads)
        alive = [r for r in common if decision is None or r.key in decision.survivors]
        vectors = [[c for p in payloads for c in p["counts"][r.key]] for r in alive]
        if not alive:
            why = f" ({decision.evidence})" if decision is not None and decision.evidence else ""
            return StepPlan(None, world=world, reason=(
                f"not judged: loss_fn averages over no count gradwatch finds in the batch{why}: declare it "
                "with items= (a callable items(batch) -> count, 'samples', or 'micro_batches')"))
        if all(proportional(vectors[0], v) for v in vectors[1:]):
            # every rule still possible gives these micro-batches the same weights
            note_extra = f" (the same under each of the {len(alive)} counts the batch offers)" if len(alive) > 1 else ""
            return alive[0], None, note_extra
        if not probe:
            rule = _by_structure(alive, shift_hint, self._shifts)
            return rule, None, (f"; {rule.text} chosen from the batch's structure, not verified by a probe (a sharded "
                                "model's forwards are collectives): declare it with items= if loss_fn averages over "
                                "something else")
        listed = "; ".join(f"{r.text}: {_count_text(v)}" for r, v in zip(alive[:3], vectors[:3]))
        more = "; ..." if len(alive) > 3 else ""
        why = f" ({decision.evidence})" if decision is not None and decision.evidence else ""
        return StepPlan(None, world=world, reason=(
            f"not judged: the step's micro-batches hold unequal counts under rules loss_fn may follow "
            f"({listed}{more}), and no evaluation could tell which it follows{why}: declare it with items= "
            "(a callable items(batch) -> count, 'samples', or 'micro_batches')"))

    def _planned(self, payloads: List[Dict[str, Any]], rank: int, ks: List[int], texts: Dict[str, str],
                 rule: Optional[ItemRule], equal_why: Optional[str], note_extra: str) -> StepPlan:
        """The plan of the chosen ``rule`` (or of equal weights, ``equal_why``): this rank's weights, every rank's
        micro-batches with their counts under each rule, and the note that says how they were weighed."""
        world = len(payloads)
        if rule is None and equal_why is None:
            return StepPlan(None, world=world, reason="not judged: no item count of the step's micro-batches")
        if equal_why is not None:
            counts = [[1.0] * k for k in ks]
            weights = equal_weights(counts)[rank]
            rule = MICRO_BATCHES
        else:
            assert rule is not None
            counts = [p["counts"][rule.key] for p in payloads]
            try:
                weights = step_weights(counts, world)[rank]
            except ItemCountError as exc:
                return StepPlan(None, world=world, reason=f"not judged: {exc}")
        others = {k: t for k, t in texts.items() if k != rule.key}
        parts = [Part(r, i, counts[r][i], {k: payloads[r]["counts"][k][i] for k in others})
                 for r in range(world) for i in range(ks[r])]
        plan = StepPlan(weights, rule, parts, sum(ks[:rank]), others, world, equal=equal_why is not None)
        if not (world == 1 and ks[0] == 1):
            plan.note = self._note(plan, equal_why) + note_extra
        return plan

    def _keep(self, payloads: List[Dict[str, Any]]) -> Optional[ItemDecision]:
        """The ranks' probes as one decision, kept for the next checks: the first rank's that decided (by rank),
        else the rules no rank's probe ruled out."""
        made = [p["decision"] for p in payloads if p.get("decision") is not None]
        decisive = next((d for d in made if d.rule is not None or d.coupled or d.sums), None)
        if decisive is not None:
            self.decision, self._decided_for = decisive, None
            return decisive
        if not made:
            return None
        left = [k for k in made[0].survivors if all(k in d.survivors for d in made)]
        merged = ItemDecision(survivors=left, evidence=next((d.evidence for d in made if d.evidence), None),
                              evaluations=sum(d.evaluations for d in made))
        self.decision, self._decided_for = merged, frozenset(payloads[0]["counts"])
        return merged

    @staticmethod
    def _note(plan: StepPlan, equal_why: Optional[str]) -> str:
        n, world = len(plan.parts), plan.world
        where = f"{n} micro-batch{'es' if n > 1 else ''}" + (f" on {world} ranks" if world > 1 else "")
        if equal_why is not None:
            return f"the step's objective: each micro-batch's mean weighs 1/k on its rank, {where}, judged per micro-batch: {equal_why}"
        total = sum(p.count for p in plan.parts)
        counts = [p.count for p in plan.parts]
        held = _count_text(counts) if n <= 6 else f"{min(counts):g} to {max(counts):g}"
        return (f"the step's objective: the mean over its {total:g} {plan.rule.text} in {where} ({held}), each "
                f"micro-batch weighing its share")

    # ------------------------------------------------------------------ sketches and the diagnosis
    def each(self, seed: int) -> Callable[[int, Dict[str, torch.Tensor], float], None]:
        """The replay's ``each``: sketch every micro-batch's own gradient (its weighted one over its weight)."""

        def keep(i: int, grads: Dict[str, torch.Tensor], weight: float) -> None:
            if self._sketch is None or not self._sketch.matches(grads) or self._seed != seed:
                self._sketch, self._seed = Sketch({n: tuple(g.shape) for n, g in grads.items()}, seed=seed), seed
            self.rows.append(self._sketch(grads, 1.0 / weight if weight else 0.0))

        self._seed = seed
        return keep

    def explain(self, plan: StepPlan, training: Dict[str, TrainingCheck], lives: Mapping[str, Optional[torch.Tensor]],
                rows: Optional[List[torch.Tensor]] = None, folded: bool = False) -> Optional[str]:
        """When a tensor failed on a cut step: the words that name the cut, put in each failing tensor's diagnosis.

        Args:
            plan: The check's :class:`StepPlan`.
            training: The training verdicts (the failing ones get the words).
            lives: ``{name: training's gradient}`` in the shapes the replayed gradients had (None: no ``.grad``).
            rows: Every part's sketch, in ``plan.parts`` order (default: this rank's, in one process).
            folded: The replay summed the ranks (a sharded model): no fit per rank; the counts are said instead.
        """
        failing = [tc for tc in training.values() if tc.failed]
        if failing and not plan.cut and plan.batch is not None:
            return _uncut(plan.batch, failing)
        if not failing or not plan.cut or plan.equal or self._sketch is None:
            return None
        rows = self.rows if rows is None else rows
        text: Optional[str] = None
        if folded or len(rows) != len(plan.parts):
            if len({p.count for p in plan.parts}) > 1:
                text = (f"training's gradient is not the step's objective's, and {describe_counts(plan.parts, plan.rule, plan.world)}: "
                        "training that weighs micro-batches or ranks alike (each micro-batch's mean divided by k, "
                        "per-rank means averaged) gives this; divide each summed loss by the step's count, all-reduced "
                        "over the ranks")
        else:
            live = self._sketch({n: torch.zeros(s) if g is None else g for (n, s), g in
                                 zip(self._sketch.shapes.items(), (lives.get(n) for n in self._sketch.shapes))})
            text = explain_cut(plan.parts, torch.stack(rows), live, plan.rule, plan.world, plan.others)
        if text is not None:
            for tc in failing:
                tc.diagnosis, tc.ratio, tc.param_coef = text, None, None
        return text


def _uncut(batch: Any, failing: List[TrainingCheck]) -> Optional[str]:
    """One micro-batch, every failing tensor off by one constant ratio: a count that explains it, put in their diagnoses."""
    ratios = [tc.ratio for tc in failing]
    if any(r is None or r <= 0 for r in ratios):
        return None
    ratio = sorted(cast(float, r) for r in ratios)[len(ratios) // 2]
    if any(abs(cast(float, r) - ratio) > 1e-2 * ratio for r in ratios):
        return None
    try:
        text = explain_uncut(batch, ratio)
    except Exception:  # noqa: BLE001 - a batch the counting rules cannot read: the judge's own diagnosis stands
        return None
    for tc in failing if text is not None else ():
        tc.diagnosis, tc.ratio, tc.param_coef = text, None, None
    return text


def _by_structure(rules: Sequence[ItemRule], shift_hint: Optional[int], shifts: Mapping[Path, Optional[int]]) -> ItemRule:
    """Where no probe can decide: target tokens, shifted as the data says (labels equal to the ids: the model shifts
    them; equal to the next ids: the data did), else as the model is known to (a causal LM), else a mask, else
    samples."""
    order = {"declared": 0, "tokens": 1, "mask": 2, "samples": 3}

    def shift(r: ItemRule) -> int:
        said = shifts.get(r.path)
        return said if said is not None else 1 if shift_hint is None else shift_hint

    return min(rules, key=lambda r: (order.get(r.kind, 4), r.shift != shift(r), str(r.path)))


__all__ = ["MICRO_BATCHES", "StepObjective", "StepPlan"]
