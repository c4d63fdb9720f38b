"""Additive masks in the module form's captures: known by id, so their tensors stay alive with the capture.

A capture forward under a budget drops the captures of units that do not fit beside the others (captured again
by a later forward). A mask held only by a dropped capture was freed while its id stayed among the constants: a
later capture could get the same id, and a unit's real input was then taken for a mask (an
``nn.TransformerEncoderLayer``'s dropout reported "not checked: no floating input" on a correct model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch
from gradwatch.check.modules.module_form import capture
from gradwatch.plan.units import plan_units


class Encoder(nn.Module):
    """Token and position embeddings, causal ``nn.TransformerEncoderLayer``s (an additive -inf mask), a head."""

    def __init__(self, vocab: int = 500, d: int = 96, layers: int = 3, block: int = 24) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t))
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


def loss_fn(model, batch):
    return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


def batch(seed: int):
    ids = torch.randint(0, 500, (2, 25), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def test_every_id_among_the_constants_is_a_mask_the_capture_holds():
    torch.manual_seed(0)
    model, b = Encoder(), batch(0)
    units = plan_units(model, loss_fn, b, 0)
    # a budget that holds a few units' inputs at a time: later units, masks among their inputs, are dropped
    got = capture(model, loss_fn, b, units, 0, budget=60_000)
    assert got.deferred and got.constants
    assert {id(t) for t in got.masks} == got.constants
    assert all(not torch.isfinite(t).all() for t in got.masks)


def test_a_tight_room_never_takes_an_input_for_a_mask():
    torch.manual_seed(0)
    model = Encoder()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    reports = []
    with GradWatch(model, loss_fn, optimizer=opt, every=1, log_dir=None, form="module", memory_budget=0.005) as watch:
        for i in range(3):
            b = batch(i)
            opt.zero_grad()
            loss_fn(model, b).backward()
            reports.append(watch.step(b))
            opt.step()
    notes = [n for r in reports if r is not None for n in r.notes]
    assert not [n for n in notes if "no floating input" in n], notes
    assert not [a for a in watch.alerts if a.kind in ("threshold", "drift")], watch.alerts
