"""The update part under DeepSpeed ZeRO stages 1 and 2: each rank's partition of the float32 master weights.

ZeRO's optimizer (``DeepSpeedZeroOptimizer``) is no ``torch.optim.Optimizer``: it wraps one (the optimizer the user
gave, ``.optimizer``) whose parameters are flat float32 partitions, one per parameter group, each rank stepping its
own. The step of each group runs that inner optimizer on one group at a time (``_optimizer_step``), its gradient
set to the partition of the reduced gradient, already unscaled and clipped by DeepSpeed.

The coordinates a check samples are drawn in each model tensor's fragment of this rank's partition
(``param._hp_mapping``: where its entries lie there), and named by the model tensor; the replay of the algorithm
then runs on the partition's values, gradient and optimizer state at those coordinates (:func:`draw`). Each rank
judges its own partition: nothing is gathered. The clipping is DeepSpeed's own (its norm over every rank's
partitions): not judged here. Stage 3 (its partitions of the parameters themselves) is not verified yet.

Example:
    >>> zero_of(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)) is None
    True
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from gradwatch.check.numerics.sampling import generator, tensor_seed
from gradwatch.trees import param_names

#: Coordinates drawn from each tensor's fragment at a check.
COORDS = 16


def zero_of(optimizer: Any) -> Optional[Any]:
    """DeepSpeed's ZeRO stage 1 or 2 optimizer in ``optimizer`` or the wrappers around it (None: there is none).

    Example:
        >>> zero_of(None) is None
        True
    """
    seen = 0
    while optimizer is not None and seen < 4:
        if hasattr(optimizer, "single_partition_of_fp32_groups") and hasattr(optimizer, "bit16_groups"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)  # (accelerate's wrapper is an Optimizer around ZeRO's)
        seen += 1
    return None


def inner(zero: Any) -> Optional[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` ZeRO steps its partitions with (None where it is not one: DeepSpeed's own C++
    optimizers without step hooks)."""
    opt = getattr(zero, "optimizer", None)
    return opt if isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_optimizer_step_pre_hooks") else None


def draw(zero: Any, model: nn.Module, seed: int, step: int, rank: int
         ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """``(drawn, partitions)``: for each model tensor with a fragment in this rank's partition, up to :data:`COORDS`
    indices into the group's flat float32 partition (``drawn[name]``), and that partition (``partitions[name]``).
    Model tensors are named as ``model.named_parameters()`` names them."""
    names = param_names(model)
    drawn: Dict[str, torch.Tensor] = {}
    partitions: Dict[str, torch.Tensor] = {}
    for group_no, lps in enumerate(zero.bit16_groups):
        partition = zero.single_partition_of_fp32_groups[group_no]
        for lp in lps:
            fragment = getattr(lp, "_hp_mapping", None)
            name = names.get(id(lp))
            if fragment is None or name is None:
                continue
            address = fragment.get_hp_fragment_address()
            count = int(address.numel)
            if count <= 0:
                continue
            gen = generator(tensor_seed(seed + step + 7919 * rank, name))
            coords = torch.unique(torch.randint(0, count, (min(COORDS, count),), generator=gen))
            drawn[name] = (coords + int(address.start)).to(partition.device)
            partitions[name] = partition
    return drawn, partitions


__all__ = ["COORDS", "draw", "inner", "zero_of"]
