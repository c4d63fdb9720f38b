"""Small language models on padded, variable-length token batches, and the ways a step's loss gets cut.

Shared by the step-objective tests (one process, DDP workers, Lightning, Hugging Face) and
``benchmarks/step_objective.py``: what users train with (labels of -100 on padding, next-token
shift, micro-batches of unequal lengths and sizes), small enough for a test.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64


class TinyLM(nn.Module):
    """Embedding, one mixing layer, a head: every position apart (the samples of a batch never meet).

    With ``norm="batch"`` a train-mode BatchNorm over the features couples the samples of a batch.
    """

    def __init__(self, vocab: int = VOCAB, width: int = 16, norm: Optional[str] = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width) if norm == "batch" else None
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.emb(input_ids))
        if self.norm is not None:
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(h))


def padded_batch(lengths: List[int], gen: torch.Generator, vocab: int = VOCAB, pad_to: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Token rows of the given lengths, right-padded (id 0, label -100, mask 0) to the longest (or ``pad_to``)."""
    width = pad_to or max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, n in enumerate(lengths):
        row = torch.randint(1, vocab, (n,), generator=gen)
        ids[i, :n], mask[i, :n], labels[i, :n] = row, 1, row
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def uneven_micro_batches(k: int, gen: torch.Generator, sizes=(1, 4), lengths=(3, 24)) -> List[Dict[str, torch.Tensor]]:
    """``k`` micro-batches of 1-4 rows of 3-24 tokens each, each padded to its own longest row."""
    out = []
    for _ in range(k):
        n = int(torch.randint(sizes[0], sizes[1] + 1, (1,), generator=gen))
        out.append(padded_batch([int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen)) for _ in range(n)], gen))
    return out


def token_loss(model: nn.Module, batch: Dict[str, torch.Tensor], reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy over the labels that are not -100: the mean (the loss_fn a user writes) or the sum."""
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=-100, reduction=reduction)


def targets(batch: Dict[str, torch.Tensor]) -> int:
    """The target tokens of a batch (labels after the shift that are not -100)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def all_targets(batch: Dict[str, torch.Tensor]) -> int:
    """The labels that are not -100, before the shift (one per row more than the loss predicts: an off-by-one count)."""
    return int((batch["labels"] != -100).sum())


class Rows(torch.utils.data.Dataset):
    """Token rows of 3 to ``longest`` tokens, for a Trainer with :func:`collate` (padded per micro-batch, labels -100
    on padding)."""

    def __init__(self, n: int = 48, vocab: int = VOCAB, seed: int = 0, longest: int = 24) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(1, vocab, (int(torch.randint(3, longest + 1, (1,), generator=g)),), generator=g)
                     for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]}


def collate(rows: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Rows right-padded to the longest of the micro-batch: id 0, attention mask 0, label -100."""
    ids = [r["input_ids"] for r in rows]
    width = max(len(r) for r in ids)
    out = {"input_ids": torch.zeros(len(ids), width, dtype=torch.long)}
    out["attention_mask"] = torch.zeros_like(out["input_ids"])
    out["labels"] = torch.full_like(out["input_ids"], -100)
    for i, r in enumerate(ids):
        out["input_ids"][i, :len(r)], out["attention_mask"][i, :len(r)], out["labels"][i, :len(r)] = r, 1, r
    return out


class OwnLM(TinyLM):
    """A model of one's own for the Trainer: its forward returns the token mean and takes no num_items_in_batch."""

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,  # type: ignore[override]
                labels: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        logits = super().forward(input_ids)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = token_loss(lambda _ids: logits, {"input_ids": input_ids, "labels": labels})
        return out


def accumulation_run(model: nn.Module, watch: Any, steps: int, make: Callable[[torch.Generator], List[Any]],
                     backward: Callable[[nn.Module, List[Any], int], None], seed: int = 7) -> Tuple[List[Any], List[List[Any]]]:
    """``steps`` SGD steps of a plain loop with gradient accumulation under ``watch`` (a GradWatch): ``make(gen)``
    gives a step's micro-batches, ``backward(model, micro, i)`` runs micro-batch ``i``'s backward, each is handed to
    ``watch.accumulate``, then ``watch.step()``. Returns the reports and each step's micro-batches."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    reports, micro_batches = [], []
    for _ in range(steps):
        micro = make(gen)
        opt.zero_grad()
        for i, mb in enumerate(micro):
            backward(model, micro, i)
            watch.accumulate(mb)
        reports.append(watch.step())
        micro_batches.append(micro)
        opt.step()
    return reports, micro_batches
