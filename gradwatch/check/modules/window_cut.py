"""A window of an image-like input: where one sample of a convolution's (or a norm's, an activation's, a pooling's)
input does not fit the room, its check runs on a window of that sample's positions, drawn anew at each check.

A convolution's weight gradient sums over samples and positions, so any window of the input is an input the module
computes on, and its backward is checked there as on the whole image (the window's own borders, padded as the
module pads, exercise the border rows at every check). Each check draws another window, so over a run the draws
cover the image. Only modules whose input is ``(N, C, *spatial)`` and whose computation is local in the spatial
dimensions (or over all of them alike) are windowed: convolutions, norms over channels, pools, elementwise
activations. So is a composite's own code (a UNet's resnet block: its sum, its activations and scaling between the
modules it calls) where every image among its inputs and its stubs' outputs has the first input's positions: each is
cut to the same window. Its check is of the own code's function on those tensors, whatever it computes from them.

Example:
    >>> x = torch.zeros(1, 3, 64, 64)
    >>> ((args, kwargs), children), _, what = window_all((((x,), {}), {}), (64, 64), 0.25, seed=0, constants=set())
    >>> args[0].shape, what.startswith("a 32x32 window at")
    (torch.Size([1, 3, 32, 32]), True)
"""

from __future__ import annotations

import math
import random
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from gradwatch.plan.units import Unit
from gradwatch.trees import rebuild, tensor_leaves

#: Leaf modules computed over an ``(N, C, *spatial)`` input locally in space (or alike over all of it): a window of
#: the input is an input they compute on.
WINDOWED = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.GroupNorm,
            nn.modules.instancenorm._InstanceNorm, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
            nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd,
            nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.Mish, nn.ELU, nn.SELU, nn.CELU, nn.Tanh, nn.Sigmoid,
            nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.PReLU, nn.Identity,
            nn.modules.dropout._DropoutNd)


def windowable(module: nn.Module, args: Any, kwargs: Any) -> bool:
    """Whether ``module`` on ``(args, kwargs)`` can be checked on a window: one of :data:`WINDOWED`, called on one
    floating ``(N, C, *spatial)`` tensor and nothing else that is a tensor.

    Example:
        >>> windowable(nn.Conv2d(3, 4, 3), (torch.zeros(2, 3, 8, 8),), {}), windowable(nn.Linear(3, 4), (torch.zeros(2, 3),), {})
        (True, False)
    """
    if not isinstance(module, WINDOWED) or not isinstance(args, tuple) or len(args) != 1:
        return False
    x = args[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 3:
        return False
    return not any(isinstance(v, torch.Tensor) for v in (kwargs or {}).values())


def shared_positions(tree: Any) -> Optional[Tuple[int, ...]]:
    """The positions every image in ``tree`` (a floating ``(N, C, *spatial)`` tensor, ``spatial`` of two dimensions or
    more) has: the first one's; None where one has others (a strided convolution's output, an upsampling's), where a
    floating tensor of three dimensions is among them (an attention's ``(N, positions, C)``), or where there is none.

    Example:
        >>> x, temb = torch.zeros(1, 8, 16, 16), torch.zeros(1, 32)
        >>> shared_positions(((x, temb), {"h": [torch.zeros(1, 4, 16, 16)]})), shared_positions((x, torch.zeros(1, 4, 8, 8)))
        ((16, 16), None)
    """
    floats = [t for t in tensor_leaves(tree) if t.is_floating_point() and t.dim() >= 3]
    if not floats or floats[0].dim() < 4:
        return None
    spatial = tuple(int(s) for s in floats[0].shape[2:])
    return spatial if all(tuple(int(s) for s in t.shape[2:]) == spatial and t.dim() == len(spatial) + 2
                          for t in floats) else None


def window_all(tree: Any, spatial: Tuple[int, ...], share: float, seed: int, constants: Set[int], smallest: int = 4
               ) -> Tuple[Any, Set[int], str]:
    """``tree`` with every image of ``spatial`` positions cut to one window of about ``share`` of them (each side
    scaled alike, at least ``smallest`` positions; :func:`shared_positions`) at an offset drawn from ``seed``, the ids
    of the constants among its tensors after the cut, and where, said.

    Example:
        >>> x, temb = torch.zeros(1, 8, 16, 16), torch.zeros(1, 32)
        >>> (a, t), kept, what = window_all((x, temb), (16, 16), 0.25, 0, {id(temb)})
        >>> a.shape[2:], t is temb, kept == {id(temb)}
        (torch.Size([8, 8]), True, True)
        >>> window_all(torch.zeros(1, 2, 10, 40), (10, 40), 0.5, 3, set())[2].split(" at ")[0]
        'a 7x28 window'
    """
    scale = max(0.0, min(1.0, share)) ** (1.0 / len(spatial))
    sides = [max(min(n, smallest), min(n, int(math.floor(n * scale)))) for n in spatial]
    rng = random.Random(seed)
    starts = [rng.randint(0, n - w) for n, w in zip(spatial, sides)]
    index = (slice(None), slice(None)) + tuple(slice(a, a + w) for a, w in zip(starts, sides))
    what = (f"a {'x'.join(map(str, sides))} window at ({', '.join(map(str, starts))}) of its "
            f"{'x'.join(map(str, spatial))} positions, drawn anew at each check")
    kept: Set[int] = set()

    def cut(t: torch.Tensor) -> torch.Tensor:
        c = t[index].contiguous() if t.dim() == len(spatial) + 2 and tuple(t.shape[2:]) == spatial else t
        if id(t) in constants:
            kept.add(id(c))
        return c

    return rebuild(tree, cut), kept, what


def positions_share(fixed: int, cost: int, room: int) -> Optional[float]:
    """The share of a sample's positions whose check fits ``room``, where the whole sample's costs ``cost`` of which
    ``fixed`` (the parameters' copies) whatever the positions; None where not even the parameters fit.

    Example:
        >>> positions_share(100, 1100, 600), positions_share(700, 1100, 600)
        (0.45, None)
    """
    if fixed >= room:
        return None
    return 0.9 * (room - fixed) / max(1, cost - fixed)


def windowed_piece(unit: Unit, one: Optional[Tuple[Tuple[Any, Any], Dict[str, List[Any]], int, Set[int]]], fixed: int,
                   room: int, seed: int, size: int
                   ) -> Optional[Tuple[Tuple[Any, Any], Dict[str, List[Any]], int, str, Set[int]]]:
    """A convolution (a norm, a pooling, an activation), or a composite's own code among images, whose check does not
    fit on one sample (``one``: its capture, its stubs' outputs, its cost and constants): on a window of that sample's
    positions, as the module form's cuts give it, ``(inputs, children, bytes, what, constants)``; None where it cannot
    be windowed or its parameters alone fill the room."""
    if one is None:
        return None
    (args, kwargs), children, cost, constants = one
    spatial: Optional[Tuple[int, ...]] = None
    if unit.kind == "own":
        spatial = shared_positions(((args, kwargs), children))
    elif unit.kind == "module" and not children and windowable(unit.module, args, kwargs):
        spatial = tuple(int(n) for n in args[0].shape[2:])
    share = positions_share(fixed, cost, room)
    if spatial is None or share is None:
        return None
    (inputs, cut), kept_constants, where = window_all(((args, kwargs), children), spatial, share, seed, constants)
    first, windowed = (next(t for t in tensor_leaves(tree) if t.is_floating_point() and t.dim() >= 3)
                       for tree in (((args, kwargs), children), (inputs, cut)))
    kept = windowed.numel() / max(1, first.numel())
    return inputs, cut, fixed + int((cost - fixed) * kept), f"1 of the batch's {size} samples, {where}", kept_constants


__all__ = ["WINDOWED", "positions_share", "shared_positions", "window_all", "windowable", "windowed_piece"]
