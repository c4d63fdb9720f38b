"""The update, verified: what training does between ``.grad`` at a check and the weights after the next step.

At each check, with the optimizer known (``optimizer=``; the HF Trainer's and Lightning's own), :class:`UpdatePart`
draws a few coordinates of every watched tensor and reads there ``.grad`` as backprop left it, the parameter and the
optimizer's state (the step is the first to change them), and the whole gradient's norm in float64. A one-shot hook
on the optimizer reads, right after its step, ``.grad`` as the step took it (after clipping), the group's
hyperparameters (the learning rate the scheduler set) and the parameter. Nothing is written: training is bit for bit
as unwatched.

Three verdicts follow, each said once for the run as an alert of part ``"update"``:

- **clipping** (:mod:`gradwatch.check.update.clipping`): every tensor scaled by one factor, at one threshold
  (the asked one where known: ``max_grad_norm``);
- **update** (:mod:`gradwatch.check.update.optimizer_replay`): for torch's own optimizers (a subclass as its base),
  the update each tensor got against the algorithm's, replayed in float64; and for any optimizer, a step that moved
  no sampled coordinate of any tensor whose gradient was not zero;
- **structure**: a watched tensor the optimizer does not hold (it was built before the parameters were replaced:
  ``load_state_dict(assign=True)``, ``to_empty``), and tied parameters (a Hugging Face config's
  ``tie_word_embeddings``, or one parameter met twice when the watch was built) that no longer share one tensor.

Sharded parameters (FSDP2, tensor and sequence parallel, 2-D meshes: DTensors) are read on each rank's shard, the
whole gradient's norm and the clipping factors made with the ranks together, and an optimizer with no elementwise
form compared with its own class stepped on the gathered tensor (:mod:`gradwatch.parallel.update_shards`). DDP's
replicas are compared across ranks by their hashes (:class:`Replicas`). Not yet: ZeRO (DeepSpeed's optimizer holds
flat partitions) and pipeline stages.

Example:
    >>> model = nn.Linear(3, 2)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    >>> part = UpdatePart(model, opt, seed=0)
    >>> model(torch.ones(4, 3)).pow(2).sum().backward()
    >>> part.arm(0); opt.step()
    >>> part.last["update"]["weight"]["verdict"], part.alerts
    ('excellent', [])
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from gradwatch.check.numerics.sampling import generator, tensor_seed
from gradwatch.check.update.clipping import factors, judge_clipping, value_bound
from gradwatch.check.update.optimizer_replay import algorithm, judge_update, replay
from gradwatch.io.headlines import line
from gradwatch.parallel.update_shards import (
    Layout,
    aligned,
    all_reduce_cpu,
    gathered_factors,
    is_dtensor,
    local,
    misplaced,
    refusal,
    replica_key,
    world_norm,
)
from gradwatch.parallel.update_zero import draw, inner, zero_of
from gradwatch.trees import param_names
from gradwatch.watch.trend import WHOLE_CHECK, Alert

#: Coordinates drawn from each tensor at a check.
COORDS = 16
#: Tensors named in words, at most.
NAMED = 3
#: Sharded, an optimizer with no elementwise form: its update departs from its class's on the gathered tensor when
#: their relative difference is over this (the same float32 arithmetic in another order: 1e-6 to 1e-5; a step run per
#: shard where the algorithm needs the whole matrix: tens of percent).
LAYOUT_TOLERANCE = 1e-3


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")


def torch_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` that steps the parameters, through the wrappers training hands over (accelerate's
    ``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer``, whose ``step`` steps it when the step is due);
    None where there is none.

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
        >>> class Wrapper:
        ...     def __init__(self, inner): self.optimizer = inner
        >>> torch_optimizer(Wrapper(opt)) is opt, torch_optimizer(None)
        (True, None)
    """
    seen = 0
    while optimizer is not None and seen < 4:
        if type(optimizer).__module__.startswith("deepspeed"):
            return None  # ZeRO's: its groups hold flat partitions, not the model's tensors (not verified yet)
        if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        seen += 1
    return None


#: Entries a replica's hash reads at a time (its multipliers' memory: 8 bytes each).
HASH_BLOCK = 1 << 20


def tensor_hash(t: torch.Tensor) -> int:
    """A 64-bit hash of a tensor's bits: equal for equal tensors (bit for bit), different, but for a 2^-64 chance, for
    any other (a sum of each entry's bits times a multiplier of its position, wrapping in int64).

    Example:
        >>> a = torch.randn(5)
        >>> b = a.clone(); b[3] = torch.nextafter(b[3], torch.tensor(9.0))
        >>> tensor_hash(a) == tensor_hash(a.clone()), tensor_hash(a) == tensor_hash(b)
        (True, False)
    """
    flat = t.detach().contiguous().reshape(-1)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    flat = flat.view(bits)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), HASH_BLOCK):
        block = flat[start:start + HASH_BLOCK].to(torch.int64)
        where = torch.arange(start, start + block.numel(), dtype=torch.int64, device=flat.device)
        total += (block * (where * 2654435761 + 40503) + (block ^ where)).sum()
    return int(total)


def replica_hashes(model: nn.Module) -> Dict[str, int]:
    """``{key: tensor_hash}`` of the parameters this rank holds as a replica, read at a check: plain tensors (DDP's,
    or a tensor parallel model's modules left whole) by name; DTensors replicated over a mesh dimension (``Replicate``
    placements, FSDP2's replicas on a 2-D mesh) or on a mesh of some ranks only (held alike by the ranks of the other
    dimensions) by name and the shard they hold (``"w [shard 1]"``: compared among the ranks that hold that shard).

    Example:
        >>> sorted(replica_hashes(nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    out: Dict[str, int] = {}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    for name, p in model.named_parameters():
        if not is_dtensor(p):
            if type(p.data) is torch.Tensor:
                out[name] = tensor_hash(p)
            continue
        shard = replica_key(p, world)
        if shard is not None:
            out[name + shard] = tensor_hash(local(p.detach()))
    return out


class Replicas:
    """Replicated parameters (DDP's) compared across ranks at each check, by their hashes: a tensor whose bits differ
    between ranks (one rank edited its replica, or a step reduced it on some ranks only) is one alert for the run,
    naming the tensors and the ranks that differ from the most.

    Each key is compared among the ranks that sent it (a DTensor's shard: the ranks that hold that shard).

    Example:
        >>> r = Replicas()
        >>> [a.kind for a in r.alerts(4, [{"w": 1, "b": 2}, {"w": 1, "b": 3}])], r.alerts(5, [{"w": 1}, {"w": 5}])
        (['replica'], [])
    """

    def __init__(self) -> None:
        self.said = False

    def alerts(self, step: int, by_rank: Sequence[Optional[Mapping[str, int]]]) -> List[Alert]:
        """This check's replica alert (once for the run), from each rank's hashes (None: that rank sent none)."""
        got = [(rank, h) for rank, h in enumerate(by_rank) if h is not None]
        if self.said or len(got) < 2:
            return []
        apart: Dict[str, List[int]] = {}
        for name in dict.fromkeys(k for _, h in got for k in h):
            holders = [(rank, h[name]) for rank, h in got if name in h]
            values = [v for _, v in holders]
            common = max(values, key=values.count)  # (a tie: the lowest rank's, rank 0 the reference)
            odd = [rank for rank, v in holders if v != common]
            if odd and len(holders) > 1:
                apart[name] = odd
        if not apart:
            return []
        self.said = True
        ranks = sorted({r for odd in apart.values() for r in odd})
        names = list(apart)
        return [Alert(int(step), WHOLE_CHECK, "replica", "error", math.nan, None, (
            f"step {step} (update): {len(names)} replicated tensor{'s' if len(names) > 1 else ''} ({_listed(names)}) "
            f"differ{'s' if len(names) == 1 else ''} bit for bit on rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))} from the other ranks: the replicas drifted apart — look for what changes "
            "weights on some ranks only: an edit outside the step, a step or a reduction run on some ranks only, a "
            "buffer broadcast that replaced them. Said once for the run"), "update",
            headline=line("replicas differ between ranks", f"{len(names)} tensor{'s' if len(names) > 1 else ''}",
                          f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}", step))]


#: What to do about a clipping that is not what training asked for.
_CLIPPING_TODO = ("look at the clipping between backward and optimizer.step(): one clip_grad_norm_ over all the model's "
                  "parameters with the threshold asked (max_grad_norm, gradient_clip_val), no hook or edit of .grad")
#: What to do when watching the step raised: gradwatch's own failure.
_OWN_FAILURE = "nothing in training: it goes on, the step unverified; please report it with this message"


def _clipping_headline(clipping: Any, step: int) -> str:
    """What is wrong with a step's clipping, in a headline."""
    if clipping.kind == "groups":
        what = f"{clipping.by}s" if clipping.by else "sets of tensors"
        return line("clipping", f"{len(clipping.groups)} {what} scaled differently", "", step)
    if clipping.kind == "not_scaling":
        return line("clipping", ".grad changed between the check and the step, not by one factor", "", step)
    if clipping.kind == "unasked":
        return line("clipping where none was asked", "", f".grad scaled by {clipping.factor:.4g}", step)
    return line("clipping not as asked", "", "" if clipping.factor is None else f".grad scaled by {clipping.factor:.4g}",
                step)


def declared_ties(model: nn.Module) -> List[Tuple[str, ...]]:
    """Names of the parameters that are one parameter now (met twice in the module tree), and of a Hugging Face
    model's input and output embeddings where its config says ``tie_word_embeddings``.

    Example:
        >>> m = nn.Sequential(nn.Embedding(5, 2), nn.Linear(2, 5, bias=False)); m[1].weight = m[0].weight
        >>> declared_ties(m)
        [('0.weight', '1.weight')]
    """
    shared: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    ties = [tuple(names) for names in shared.values() if len(names) > 1]
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "get_output_embeddings"):
        try:
            hf: Any = model  # a transformers PreTrainedModel
            inp, out = hf.get_input_embeddings(), hf.get_output_embeddings()
        except Exception:  # noqa: BLE001 - a model without the accessors: nothing declared this way
            return ties
        names = param_names(model, remove_duplicate=False)
        pair = tuple(names.get(id(getattr(m, "weight", None)), "") for m in (inp, out))
        if all(pair) and pair[0] != pair[1] and not any(set(pair) <= set(t) for t in ties):
            ties.append(pair)
    return ties


class UpdatePart:
    """Watches the optimizer step that follows each check (the module's docstring).

    Args:
        model: The user's module.
        optimizer: The optimizer training steps (None: nothing is watched).
        seed: The watch's seed (the coordinates drawn follow it and the step).
        asked: The clipping threshold training asked for (``max_grad_norm``; 0: none; None: not known).
        emit: ``emit(step, alerts)``: where the alerts go (the watch's records and policy); default: kept only.

    Attributes:
        alerts: Every alert raised, in order.
        last: The last step's verdicts: ``{"step", "clipping", "update": {name: ...}}`` (None before one).
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], seed: int = 0,
                 asked: Optional[float] = None, emit: Optional[Callable[[int, List[Alert]], None]] = None) -> None:
        self.model, self.optimizer, self.seed, self.asked = model, torch_optimizer(optimizer), int(seed), asked
        #: DeepSpeed ZeRO stage 1 or 2: its optimizer (the torch optimizer inside it steps its flat partitions).
        self.zero = zero_of(optimizer)
        if self.zero is not None:
            self.optimizer = inner(self.zero)
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            self.optimizer = None  # ZeRO-3: DeepSpeed's partitions of the parameters, not verified yet
        #: Why this sharded model's update is not verified (said once at the first check), None where it is.
        self.refused: Optional[str] = None  # (known at the first check: the ranks compared then)
        self.sharded = self.optimizer is not None and any(is_dtensor(p) for p in model.parameters())
        self._compared = not self.sharded
        self.layout = Layout()
        self._checks = 0
        self.emit = emit
        #: ``write(last)``: where each step's verdicts are recorded (the watch's sinks); None: kept in :attr:`last` only.
        self.write: Optional[Callable[[Dict[str, Any]], Any]] = None
        self.ties = declared_ties(model)
        self.alerts: List[Alert] = []
        self.last: Optional[Dict[str, Any]] = None
        self.thresholds: List[float] = []
        self._said: Set[str] = set()
        self._hooks: List[Any] = []
        self._depth = 0  # steps begun and not ended (a subclass's step around its base's)
        self._at: Dict[str, Any] = {}

    @property
    def enabled(self) -> bool:
        return self.optimizer is not None

    # ------------------------------------------------------------------ at the check
    def arm(self, step: int) -> None:
        """At a check (``.grad`` as backprop left it): the structure judged now, the next step watched. What raises
        here (gradwatch's own failure) is said once, as this part's ``not_checked``, and the part stops."""
        if not self._compared:  # once, on every rank (a collective): the ranks hold the same parameters
            self._compared, self.refused = True, refusal(self.model)
        if self.refused is not None and self.optimizer is not None:
            self.optimizer = None
            self._deliver(step, self._once(step, "not_checked", "refused", "warning", (
                f"step {step} (update): the optimizer's step is not verified in this run: {self.refused}"),
                line("optimizer step not verified", "", "ranks hold other parameters", step)))
        if not self.enabled:
            return
        self.disarm()
        try:
            self._arm(step)
        except Exception as exc:  # noqa: BLE001 - never the check's failure, never training's
            self.disarm()
            self.optimizer = None
            self._deliver(step, self._once(step, "not_checked", "raised", "warning", (
                f"step {step} (update): the optimizer's step is not verified in this run: watching it raised "
                f"{type(exc).__name__}: {exc} — {_OWN_FAILURE}"), line("optimizer step not verified", "",
                                                                        f"watching it raised {type(exc).__name__}", step)))

    def _arm(self, step: int) -> None:
        alerts = self._structure(step)
        if self.zero is not None:
            self._arm_zero(step, alerts)
            return
        params = dict(self.model.named_parameters())
        drawn: Dict[str, torch.Tensor] = {}
        before: Dict[str, torch.Tensor] = {}
        grads: Dict[str, torch.Tensor] = {}
        rank = torch.distributed.get_rank() if self.sharded else 0
        for name, p in params.items():
            g = p.grad
            if g is None or g.is_sparse or (type(g) is not torch.Tensor and not is_dtensor(g)):
                continue
            grads[name] = g
            g = aligned(p, g)  # (laid out otherwise, redistributed: a collective, every rank alike)
            if g.numel() and g.is_floating_point():  # (a complex tensor's update is not replayed yet: its norm counts)
                gen = generator(tensor_seed(self.seed + step + 7919 * rank, name))  # each rank's own coordinates
                drawn[name] = torch.unique(torch.randint(0, g.numel(), (min(COORDS, g.numel()),), generator=gen)).to(g.device)
                before[name] = g.detach().reshape(-1)[drawn[name]].to(torch.float64)
        # sharded: collectives, the same on every rank (every rank's check armed the step alike)
        norm = world_norm(grads)
        self._at = {"step": int(step), "drawn": drawn, "before": before, "norm": norm, "params": params,
                    "pending": [n for n, g in grads.items() if misplaced(params[n], g)]}
        assert self.optimizer is not None
        self._starting(self.optimizer)
        self._layout(step, grads)
        self._hook()
        self._deliver(step, alerts)

    def _arm_zero(self, step: int, alerts: List[Alert]) -> None:
        """ZeRO stages 1 and 2: coordinates of each rank's partition of the float32 master weights (DeepSpeed clips
        with its own norm: not judged)."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        drawn, partitions = draw(self.zero, self.model, self.seed, step, rank)
        self._at = {"step": int(step), "drawn": drawn, "before": {}, "norm": 0.0, "params": partitions, "pending": []}
        assert self.optimizer is not None
        self._starting(self.optimizer)
        self._hook()
        self._deliver(step, alerts)

    def _hook(self) -> None:
        """The post-step hook, registered once, idle between checks (a hook never removes itself: torch iterates
        them)."""
        if not self._hooks:
            assert self.optimizer is not None
            self._hooks = [self.optimizer.register_step_pre_hook(self._pre),
                           self.optimizer.register_step_post_hook(self._post)]

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """A step begins: counted, so that only the outermost step is judged (a subclass whose ``step`` calls its
        base's runs the hooks twice, the base's inside: the update is judged as the subclass's step left it)."""
        self._depth += 1

    def _layout(self, step: int, grads: Mapping[str, torch.Tensor]) -> None:
        """Sharded, an optimizer with no elementwise form: one tensor a check (in turn, matrices first, the same on
        every rank) taken whole for :class:`~gradwatch.parallel.update_shards.Layout` (collectives: its bytes gathered
        twice a check, on every rank)."""
        if not self.sharded or algorithm(self.optimizer) is not None:
            return  # (a built-in optimizer is replayed elementwise on each rank's coordinates: exact there)
        held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}  # type: ignore[union-attr]
        # matrices first: an update that needs the whole tensor (an orthogonalization, a preconditioner) is a matrix's
        names = sorted((n for n, g in grads.items() if is_dtensor(g) and id(self._at["params"][n]) in held),
                       key=lambda n: (grads[n].dim() < 2, n))
        if names:
            name = names[self._checks % len(names)]
            self._checks += 1
            self.layout.take(name, self._at["params"][name], self.optimizer)
            self._at["layout"] = name

    def disarm(self) -> None:
        """Forget the step a check armed (one that never came: a skipped step); the hook stays, idle."""
        self._at = {}

    def close(self) -> None:
        """Remove the hook (the run's end)."""
        self._at = {}
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _structure(self, step: int) -> List[Alert]:
        assert self.optimizer is not None
        held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        trained = [n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is not None]
        missing = [n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is not None
                   and id(p) not in held] if self.zero is None else []  # (ZeRO's optimizer holds flat partitions)
        alerts = []
        if missing and len(missing) == len(trained):  # (some only: another optimizer's, as a GAN's two are)
            alerts += self._once(step, "update", f"missing:{','.join(missing)}", "error", (
                f"the optimizer holds none of {len(missing)} of the {len(trained)} trained tensors "
                f"({_listed(missing)}): its step cannot change them. It was built before the parameters were "
                "replaced (load_state_dict(assign=True), to_empty, fully_shard after the optimizer) — build the "
                "optimizer after the model's final parameters exist"),
                line("optimizer holds none of the trained tensors", "", f"{len(missing)} tensors", step))
        now = {n: p for n, p in self.model.named_parameters(remove_duplicate=False)}
        for tie in self.ties:
            tensors = [now.get(n) for n in tie]
            if any(t is None for t in tensors) or len({id(t) for t in tensors}) == 1:
                continue
            alerts += self._once(step, "tie", f"tie:{','.join(tie)}", "error", (
                f"{' and '.join(tie)} are declared tied (one parameter when the watch was built, or the config's "
                "tie_word_embeddings) but are now separate tensors: each gets only its own part of the gradient and "
                "they drift apart. They were untied by to_empty, a load or a copy — tie them again "
                "(model.tie_weights()) after it"), line("tied weights now separate tensors", " and ".join(tie), "", step))
        return alerts

    # ------------------------------------------------------------------ around the step
    def _starting(self, optimizer: Any) -> None:
        """What the step starts from, read at the check: each sampled coordinate's parameter and optimizer state (the
        step is the first to change them; under Lightning the check runs inside it, in its closure)."""
        at = self._at
        held = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        start, states, group_of = {}, {}, {}
        for name, coords in at["drawn"].items():
            p = at["params"][name]
            if id(p) not in held:
                continue
            start[name] = local(p.detach()).reshape(-1)[coords].clone()
            states[name] = {k: (local(v.detach()).reshape(-1)[coords].clone() if isinstance(v, torch.Tensor) and
                                v.shape == p.shape else (local(v).clone() if isinstance(v, torch.Tensor) else v))
                            for k, v in optimizer.state.get(p, {}).items()}
            group_of[name] = held[id(p)]
        at.update(start=start, states=states, group_of=group_of)

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Right after the step: ``.grad`` as it stepped with (clipped), the group's hyperparameters (the learning rate
        the scheduler set: it steps after), and the parameters. What raises here is gradwatch's own failure: said
        once, and the part stops; training's step is never failed by it."""
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return  # a base class's step inside the subclass's: the outermost step's end is judged
        at, self._at = self._at, {}
        if "start" not in at:
            return
        try:
            self._read(optimizer, at)
            if self.zero is not None and len(at["read"]) < len(at["start"]):
                self._at = at  # ZeRO steps one parameter group at a time: the others' calls come next
                return
            self._judge(optimizer, at)
        except Exception as exc:  # noqa: BLE001 - inside training's optimizer.step(): never raise there
            self.optimizer = None
            self._deliver(at["step"], self._once(at["step"], "not_checked", "raised", "warning", (
                f"step {at['step']} (update): the optimizer's step is not verified in this run: judging it raised "
                f"{type(exc).__name__}: {exc} — {_OWN_FAILURE}"), line("optimizer step not verified", "",
                                                                        f"judging it raised {type(exc).__name__}", at["step"])))

    def _read(self, optimizer: Any, at: Dict[str, Any]) -> None:
        """Right after the step, for the sampled tensors of the groups it stepped: the gradient it took, the group's
        hyperparameters and the parameter's new values (ZeRO steps one group a call: each call reads its own)."""
        params = at["params"]
        stepped = {id(p): {k: v for k, v in group.items() if k != "params"}
                   for group in optimizer.param_groups for p in group["params"]}
        reduced = {n: aligned(params[n], params[n].grad.detach()) for n in at["pending"]}  # (collectives, alike)
        read = at.setdefault("read", set())
        for n in at["start"]:
            p = params[n]
            if n in read or id(p) not in stepped:
                continue
            read.add(n)
            at.setdefault("hyper", {})[n] = stepped[id(p)]
            at.setdefault("end", {})[n] = local(p.detach()).reshape(-1)[at["drawn"][n]].clone()
            if p.grad is not None:
                at.setdefault("after", {})[n] = reduced.get(n, local(p.grad.detach())).reshape(-1)[at["drawn"][n]] \
                    .to(torch.float64)

    def _judge(self, optimizer: Any, at: Dict[str, Any]) -> None:
        step = at["step"]
        at.setdefault("after", {})
        at.setdefault("hyper", {})
        alerts: List[Alert] = []
        # sharded: every rank's factors, named with their ranks (a collective, on every rank)
        found, group_of, rank_of = gathered_factors(factors(at["before"], at["after"]), at["group_of"]) \
            if self.sharded else (factors(at["before"], at["after"]), at["group_of"], {})
        clipping = judge_clipping(found, group_of, at["norm"], self.asked, self.thresholds,
                                  value_bound(at["before"], at["after"]), rank_of)
        if clipping.factor is not None and clipping.threshold is not None and clipping.problem is None:
            self.thresholds.append(clipping.threshold)
        if clipping.problem is not None:
            alerts += self._once(step, "clipping", f"clipping:{clipping.kind}", "error",
                                 f"step {step} (update): {clipping.problem} — {_CLIPPING_TODO}",
                                 _clipping_headline(clipping, step))
        name_of_algorithm = algorithm(optimizer)
        updates: Dict[str, Any] = {}
        moved, pushed = False, False
        for name in at["drawn"]:
            if name not in at["after"]:
                continue
            p = at["params"][name]
            end = at["end"][name]
            moved |= bool((end != at["start"][name]).any())
            lr = at["hyper"][name].get("lr", 0.0)
            pushed |= bool(at["after"][name].any()) and float(lr) != 0.0
            if name_of_algorithm is None:
                continue
            expected = replay(optimizer, at["hyper"][name], at["start"][name], at["after"][name], at["states"][name])
            if expected is not None:
                check = judge_update(name, at["start"][name], end, expected, p.dtype)
                updates[name] = check.record()
                updates[name]["check"] = check
        if self.sharded:  # any rank's coordinates moved: the step happened (a rank's shard may be empty or unmoved)
            flags = all_reduce_cpu(torch.tensor([float(moved), float(pushed)], dtype=torch.float64),
                                   torch.distributed.ReduceOp.MAX)
            moved, pushed = bool(flags[0]), bool(flags[1])
        if "layout" in at:
            alerts += self._layout_alert(step, optimizer, at, updates)
        if pushed and not moved:
            alerts += self._once(step, "update", "unmoved", "error", (
                f"step {step} (update): optimizer.step() changed none of the sampled coordinates of any tensor, whose "
                "gradients were not zero: the optimizer steps other tensors than the model's (built before the "
                "parameters were replaced), or its step does nothing — build the optimizer after the model's final "
                "parameters exist, and look at what its step() does"),
                line("optimizer step moved no sampled coordinate", "", "the gradients were not zero", step))
        wrong = [n for n, u in updates.items() if "check" in u and u["check"].verdict.is_failure(u["check"].verdict.SUSPICIOUS)]
        if wrong and moved:
            worst = max((updates[n]["check"] for n in wrong), key=lambda c: c.judged_rel_diff)
            ratio = f"; training's update is {worst.ratio:.3g}x the algorithm's" if worst.ratio else ""
            alerts += self._once(step, "update", f"replay:{name_of_algorithm}", "error", (
                f"step {step} (update): the update of {len(wrong)} tensor{'s' if len(wrong) > 1 else ''} "
                f"({_listed(wrong)}) departs from {name_of_algorithm}'s algorithm replayed in float64 on the sampled "
                f"coordinates (rel_diff up to {worst.rel_diff:.1e}{ratio}): the optimizer's step ({type(optimizer).__name__}) "
                f"is not {name_of_algorithm}'s, or its state or hyperparameters were changed outside it — look at the "
                "optimizer's class and at what changes its state or its param_groups between steps"),
                line("WRONG optimizer update", f"{len(wrong)} tensor{'s' if len(wrong) > 1 else ''}",
                     f"not {name_of_algorithm}'s, rel_diff up to {worst.rel_diff:.1e}", step))
        for u in updates.values():
            u.pop("check", None)
        self.last = {"step": step, "clipping": clipping.record(), "algorithm": name_of_algorithm, "update": updates}
        if self.write is not None:
            self.write(self.last)  # the records: JSONL, TensorBoard (gradwatch.io.records.update_record)
        self._deliver(step, alerts)

    def _layout_alert(self, step: int, optimizer: Any, at: Dict[str, Any], updates: Dict[str, Any]) -> List[Alert]:
        """The sampled tensor's update against its optimizer class's on the gathered tensor (collectives)."""
        name = at["layout"]
        rel = self.layout.judge(optimizer, at["hyper"].get(name, optimizer.param_groups[0]))
        if rel is None:
            if self.layout.why is None:
                return []
            return self._once(step, "not_checked", "layout", "warning", (
                f"step {step} (update): the sharded update is not verified against the gathered one: "
                f"{self.layout.why}"), line("sharded update not verified", name, "", step))
        updates.setdefault(name, {})["layout_rel_diff"] = rel
        if rel <= LAYOUT_TOLERANCE:
            return []
        cls = type(optimizer).__name__
        return self._once(step, "update", "layout", "error", (
            f"step {step} (update): the update of {name} departs from the one {cls} computes on the gathered tensor in "
            f"one process (rel_diff {rel:.2e}): the step runs on each rank's shard where the algorithm needs the "
            "whole tensor (an orthogonalization, a preconditioner, a factored second moment) — gather the gradient "
            "before the step (full_tensor) or use the optimizer's distributed form"),
            line("WRONG sharded update", name, f"not {cls}'s on the whole tensor, rel_diff {rel:.1e}", step))

    # ------------------------------------------------------------------ alerts
    def _once(self, step: int, kind: str, key: str, severity: str, message: str, headline: str) -> List[Alert]:
        if key in self._said:
            return []
        self._said.add(key)
        return [Alert(int(step), WHOLE_CHECK, kind, severity, math.nan, None, message + ". Said once for the run",
                      "update", headline=headline)]

    def _deliver(self, step: int, alerts: List[Alert]) -> None:
        if not alerts:
            return
        self.alerts.extend(alerts)
        if self.emit is not None:
            self.emit(step, alerts)

    def state_dict(self) -> Dict[str, Any]:
        return {"update": {"said": sorted(self._said), "thresholds": list(self.thresholds)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        got = state.get("update", {})
        self._said = set(got.get("said", []))
        self.thresholds = [float(t) for t in got.get("thresholds", [])]


__all__ = ["COORDS", "Replicas", "UpdatePart", "declared_ties", "replica_hashes", "tensor_hash", "torch_optimizer"]
