"""Coverage: which rows of each parameter each part of the check has probed in the run, and which
modules' own code has been inside a checked unit.

A row is a parameter's first index (a Linear's output row, an Embedding's token row; a vector's
entries, a scalar's one). The backward part probes the rows of the units and slices it checked;
an Embedding's rows are probed only where the batch used the token (rows the data never reached
are counted as unreached, never as checked). The training part judges whole tensors.

Example:
    >>> cov = Coverage({"emb.weight": 10, "fc.bias": 3})
    >>> cov.probe("backward", "emb.weight", torch.tensor([1, 2]))
    >>> cov.probe("training", "fc.bias")
    >>> cov.fractions()
    {'emb.weight': {'backward': 0.2, 'training': 0.0}, 'fc.bias': {'backward': 0.0, 'training': 1.0}}
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

PARTS = ("backward", "training")


class Coverage:
    """Rows probed per tensor and part, and modules whose own code was checked.

    Args:
        rows: Tensor name -> its number of rows (``shape[0]``; 1 for a scalar).
    """

    def __init__(self, rows: Mapping[str, int]) -> None:
        self.rows = dict(rows)
        self.probed: Dict[str, Dict[str, torch.Tensor]] = {part: {} for part in PARTS}
        self.reached: Dict[str, torch.Tensor] = {}  # embedding rows some checked batch used
        self.modules: Dict[str, int] = {}  # module -> checks its code was inside a unit

    def _mask(self, part: str, name: str) -> torch.Tensor:
        masks = self.probed[part]
        if name not in masks:
            masks[name] = torch.zeros(max(1, self.rows.get(name, 1)), dtype=torch.bool)
        return masks[name]

    def probe(self, part: str, name: str, rows: Any = None) -> None:
        """``rows`` (a slice ``(first, end)``, a tensor of row indices, or None for all) of ``name`` were probed."""
        if name not in self.rows:
            return
        mask = self._mask(part, name)
        if rows is None:
            mask[:] = True
        elif isinstance(rows, tuple):
            mask[rows[0]:rows[1]] = True
        else:
            mask[torch.as_tensor(rows, dtype=torch.long)] = True

    def reach(self, name: str, rows: torch.Tensor) -> None:
        """A checked batch used these rows of an embedding ``name``."""
        if name not in self.rows:
            return
        if name not in self.reached:
            self.reached[name] = torch.zeros(max(1, self.rows[name]), dtype=torch.bool)
        self.reached[name][torch.as_tensor(rows, dtype=torch.long)] = True

    def module_checked(self, name: str) -> None:
        """The own code (or the whole forward) of module ``name`` was inside a checked unit."""
        self.modules[name] = self.modules.get(name, 0) + 1

    def fraction(self, part: str, name: str) -> float:
        """The share of ``name``'s rows that ``part`` has probed."""
        mask = self.probed[part].get(name)
        return 0.0 if mask is None else round(float(mask.float().mean()), 6)

    def fractions(self, names: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, float]]:
        """``{tensor: {"backward": fraction, "training": fraction}}``."""
        return {n: {part: self.fraction(part, n) for part in PARTS} for n in (names if names is not None else self.rows)}

    def unreached(self, name: str) -> Optional[int]:
        """Rows of an embedding that no checked batch used (None for other tensors)."""
        seen = self.reached.get(name)
        return None if seen is None else int((~seen).sum())

    def never(self, names: Optional[Sequence[str]] = None) -> Dict[str, List[str]]:
        """Per part, the tensors with no row probed yet."""
        names = list(names if names is not None else self.rows)
        return {part: [n for n in names if self.fraction(part, n) == 0.0] for part in PARTS}

    def state_dict(self) -> Dict[str, Any]:
        """Row masks as lists of probed indices (for a resumed run)."""
        def idx(mask: torch.Tensor) -> List[int]:
            return mask.nonzero().flatten().tolist()

        return {"probed": {p: {n: idx(m) for n, m in masks.items()} for p, masks in self.probed.items()},
                "reached": {n: idx(m) for n, m in self.reached.items()}, "modules": dict(self.modules)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Undo :meth:`state_dict` (tensors no longer in the model are dropped)."""
        for part, masks in state.get("probed", {}).items():
            for n, rows in masks.items():
                if part in self.probed and n in self.rows:
                    self.probe(part, n, torch.tensor(rows, dtype=torch.long))
        for n, rows in state.get("reached", {}).items():
            self.reach(n, torch.tensor(rows, dtype=torch.long))
        self.modules.update({str(k): int(v) for k, v in state.get("modules", {}).items()})
