"""Where the module form's capture forward stops on several ranks: the same point on every rank.

Shard by shard (tensor and sequence parallel), every rank runs the capture's forward of the live model, whose
collectives must pair up, while each rank captures only the units it checks. The forward may stop early (an LM
head's product and the loss over the vocabulary are not computed for nothing) only at a point that does not
depend on what a rank captures: once every unit *some* rank checks (``everyone``, the same list on every rank) has
made its first call. These tests run the capture in one process as each rank would, with different units wanted,
and compare the modules each run called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradwatch.check.modules.capture import capture
from gradwatch.plan.units import LOSS_FN, plan_units


class Net(nn.Module):
    """An embedding, two blocks with their own code (a residual), a final norm and an LM head."""

    def __init__(self, vocab: int = 300, d: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for fc in self.fc:
            x = x + torch.tanh(fc(x))
        return self.head(self.ln(x))


def loss_fn(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _run(model, units, wanted, everyone):
    """The capture as one rank runs it (``wanted``: its units; ``everyone``: every rank's), and the modules called."""
    called = []

    def recorded(name, forward):  # the capture suspends user hooks: the modules' own forwards say they ran
        def run(*args, **kwargs):
            called.append(name)
            return forward(*args, **kwargs)
        return run

    modules = dict(model.named_modules())
    for n, m in modules.items():
        m.forward = recorded(n, m.forward)
    try:
        got = capture(model, loss_fn, BATCH, [units[n] for n in wanted], seed=0, everyone=[units[n] for n in everyone],
                      agree=lambda *a: None, alone=True, early=True)
    finally:
        for m in modules.values():
            del m.forward
    return got, called


torch.manual_seed(0)
BATCH = torch.randint(0, 300, (3, 9))


def _units(model):
    return {u.name: u for u in plan_units(model, loss_fn, BATCH)}


def test_every_rank_stops_at_the_same_point_whatever_it_captures():
    model = Net()
    units = _units(model)
    everyone = ["emb", "fc.0", "ln"]
    runs = [_run(model, units, wanted, everyone) for wanted in (["emb", "ln"], ["fc.0"], [])]
    calls = [called for _, called in runs]
    assert calls[0] == calls[1] == calls[2], calls  # the same modules ran: the same collectives on every rank
    assert "head" not in calls[0] and "fc.1" in calls[0]  # stopped after the last unit some rank checks
    for got, _ in runs:
        assert got.loss is None  # the loss is not computed: the replay's objective stands for it
    assert sorted(runs[0][0].inputs) == ["emb", "ln"]
    assert list(runs[1][0].inputs) == ["fc.0"]
    assert not runs[2][0].inputs
    assert runs[0][0].output_bytes["ln"] == 3 * 8 * 24 * 8  # the norm's output, taken before the forward stopped


def test_a_plain_linear_settles_as_its_first_call_begins():
    """The head is known from its kind alone: the forward stops before its product, on every rank."""
    model = Net()
    units = _units(model)
    got, called = _run(model, units, ["head"], ["fc.1", "head"])
    assert "head" in got.inputs
    assert called[-1] == "ln"
    assert "head" not in called  # its forward never ran
    assert got.output_bytes["head"] == 3 * 8 * 300 * 8  # float64 bytes of the logits it did not compute
    _, others = _run(model, units, [], ["fc.1", "head"])
    assert others == called


def test_the_captures_are_those_of_a_whole_forward():
    model = Net()
    units = _units(model)
    stopped, _ = _run(model, units, ["fc.1"], ["fc.1"])
    whole = capture(model, loss_fn, BATCH, [units["fc.1"]], seed=0)
    assert whole.loss is not None
    (a, _), (b, _) = stopped.inputs["fc.1"], whole.inputs["fc.1"]
    assert torch.equal(a[0], b[0])


def test_a_check_of_loss_fn_runs_the_whole_forward():
    model = Net()
    units = _units(model)
    got, called = _run(model, units, [], ["emb", LOSS_FN])
    assert "head" in called
    assert got.loss is not None
    assert abs(got.loss - float(loss_fn(model, BATCH).detach())) < 1e-6
