"""The memory budget of a check: what training's own peak is, and what each form of the check would add.

A check may use at most ``memory_budget`` (a fraction, 0.1 by default) above training's own peak:
on the CPU the peak resident set size (``VmHWM``; ``ru_maxrss`` where ``/proc`` is missing), on CUDA the peak
allocated memory (``torch.cuda.max_memory_allocated``). Both are monotone over a process, so the
meter keeps *training's* peak apart from the checks': it is read before each check, and only a
peak beyond the one the last check left counts as training's.

The room a check has is ``(1 + AIM * memory_budget) * training_peak - (in_use_now - residue)`` (:data:`AIM`
keeps a margin; on the CPU ``in_use_now`` is the resident set size now, ``/proc/self/statm``, where that
cannot be read the peak itself). ``residue`` is what the checks left held (heap they fragmented, kept by
the allocator), less what the process gave back before the next check: neither training's peak (it would raise
the bound check by check) nor in the next check's way (its allocations reuse it). Before a check, each form's cost
is estimated from the tensors it holds (pure functions below) and the form that fits is chosen
(:mod:`gradwatch.check.modules.module_form`).

Example:
    >>> from torch import nn
    >>> objective_bytes(nn.Linear(100, 10), ["weight"], torch.float64) > 8 * 1010
    True
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Iterable, Optional, Sequence

import torch
from torch import nn

from gradwatch.plan.malloc_thresholds import glibc, hold_thresholds
from gradwatch.plan.mkl_buffers import free_mkl_buffers
from gradwatch.trees import whole_numel

#: Share of the room an estimate may fill (estimates leave out allocator overhead and small temporaries).
SAFETY = 0.5
#: Share of ``memory_budget`` the room aims at: the rest is a margin for what no estimate sees (the transient
#: temporaries of a probe, the allocator's own, measurement noise of the peak). Without it a check that fills
#: its room lands on the bound itself (benchmarks/membench.py; the runs are in docs/guides/big-models.md and
#: docs/costs.md).
AIM = 0.5
#: Bytes per float64 parameter entry a module-form check holds at once: the float64 copy, its gradient, the
#: engine's saved copy and the transient ``|grad|`` of the coordinate choice (8 each), int8 signs, and what the
#: allocator keeps of freed temporaries (measured on a block of a Linear: docs/costs.md).
MODULE_BYTES_PER_ENTRY = 48
#: Bytes per float64 entry of a differentiated input (a module's floating input that required grad in training) a
#: module-form check holds beyond the three copies :func:`module_bytes` counts: its gradient, the transient ``|grad|``
#: of the coordinate choice, its signs and the allocator's share, a parameter's entry less its copy (measured on the
#: check of an ``AdaptiveAvgPool2d``'s float64 input: docs/costs.md, Stop 89).
INPUT_LEAF_BYTES_PER_ENTRY = MODULE_BYTES_PER_ENTRY - 8
#: Bytes per float64 entry of the model's output a check of ``loss_fn``'s own code holds at once: those of
#: :data:`MODULE_BYTES_PER_ENTRY` (the output is what its check perturbs), and as many again for the loss code's own
#: intermediates, which have the output's size (a log-softmax over the vocabulary and its gradient). Measured on the
#: check of a cross-entropy over one sample's logits, which held over twice what :data:`MODULE_BYTES_PER_ENTRY` alone
#: costed (docs/costs.md).
LOSS_CODE_BYTES_PER_ENTRY = 2 * MODULE_BYTES_PER_ENTRY
#: What a forward of the live model holds beyond its captures, per byte of the model's output: the output, what the
#: loss makes of it (a log-softmax over the vocabulary) and, under tensor parallel, its shards gathered whole.
#: Measured on the no-grad forwards of a check of benchmarks/parallel.py's model under tensor parallel, which ran to
#: the loss (docs/guides/parallel.md).
FORWARD_BYTES_PER_OUTPUT_BYTE = 3
#: The same for the whole-objective form, per entry of a checked tensor (gradient, saved copy, ``|grad|``, signs).
CHECKED_BYTES_PER_ENTRY = 8 * 3 + 4


def _rss_peak_bytes() -> int:
    """Peak resident set size of this process image: ``VmHWM`` from ``/proc/self/status``.

    Not ``ru_maxrss`` where ``/proc`` exists: Linux keeps ``ru_maxrss`` across ``execve``, so a
    process started by a bigger one (a test runner, a launcher, a benchmark driver) would read its
    parent's peak as its own. ``ru_maxrss`` is the fallback (macOS, no ``/proc``).
    """
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource  # POSIX only
    except ImportError:  # Windows: no peak reading; the room is then measured from the memory in use
        return _rss_now_bytes() or 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # Linux: kilobytes; macOS: bytes


def _rss_now_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


#: The least a measured limit allows the pieces of a check above what the process held when they began: a process's
#: first float64 evaluations take memory once that no piece holds (the pages of torch's float64 kernels, the autograd
#: engine's threads, at a fresh process's first piece, then none: docs/costs.md). Below it the pieces' estimates
#: alone bound them.
MEASURE_FLOOR = 16 << 20
#: A part of a check that freed this much gives it back to the system before the next part allocates (glibc's
#: ``malloc_trim`` walks the whole heap, which takes longer than a small piece's check itself); smaller frees are
#: reused by the next allocations.
TRIM_BYTES = 32 << 20


def release_freed(mkl: bool = False) -> None:
    """Give memory the check freed back to the system (glibc's ``malloc_trim``; elsewhere nothing). With ``mkl`` (once
    a check, as it ends), the buffers MKL's allocator holds unused too (:mod:`gradwatch.plan.mkl_buffers`: between a
    check's pieces its products would only take them again).

    Freed blocks below glibc's mmap threshold stay in the process's heap and count in its RSS:
    training's next forward would then peak above its own peak by what the check left there.
    """
    if mkl:
        free_mkl_buffers()
    libc = glibc()
    if libc is not None:
        try:
            libc.malloc_trim(0)
        except Exception:  # noqa: BLE001 - an optimization only
            pass


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: CUDA peak allocated on ``device``, else peak RSS.

    Example:
        >>> peak_bytes(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _rss_peak_bytes()


def in_use_bytes(device: torch.device) -> int:
    """Memory in use now (CUDA allocated, else RSS; the peak where RSS cannot be read).

    Example:
        >>> in_use_bytes(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    now = _rss_now_bytes()
    return now if now is not None else _rss_peak_bytes()


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU when it has none)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class MemoryMeter:
    """Training's own peak, and the room a check has under ``budget``.

    Call :meth:`observe` before each check and :meth:`checked` after it: the peak is monotone, so a
    peak read before a check that exceeds the one the last check left was reached by training.

    Args:
        budget: The fraction above training's peak a check may use (``memory_budget``); None: no bound.
        device: Where training's tensors live (CUDA: allocated memory; else RSS).

    Example:
        >>> meter = MemoryMeter(0.1, torch.device("cpu"))
        >>> meter.observe(); meter.room() is not None
        True
    """

    def __init__(self, budget: Optional[float], device: torch.device) -> None:
        self.budget = budget
        self.device = device
        self.training_peak = 0
        self._after_check = 0  # the peak as the last check left it
        self._before_check = 0  # what the process held when the last check began
        self._residue = 0  # what the checks left held (the CPU heap they fragmented): theirs, not training's
        self._held_after = 0  # what the process held when the last check ended

    def observe(self) -> None:
        """A training step ran: a peak beyond the last check's is training's own, and so is what the process
        holds now, before the check allocates (training's peak is at least that: a later step can peak above
        the check's peak unseen, e.g. once the optimizer's state exists). On the CPU what training freed is
        given back to the system first, so that it is not counted as held."""
        peak = peak_bytes(self.device)
        if peak > self._after_check:  # training peaked on top of what the checks left held
            self.training_peak = max(self.training_peak, peak - self._residue)
        if self.device.type != "cuda":
            hold_thresholds()  # before the check's first frees can move it: where training's step left it
            release_freed()
        self._before_check = in_use_bytes(self.device)
        # What the process gave back since the last check ended was the checks' left-overs (training held the same
        # between its steps): the residue is that much smaller. Without this it only grew, by what each check left
        # until training's next step freed it (under ZeRO-3 it grew at every check while the process held the same
        # before every check), and the room with it.
        self._residue = max(0, self._residue - max(0, self._held_after - self._before_check))
        self.training_peak = max(self.training_peak, self._before_check - self._residue)

    def checked(self) -> None:
        """A check ended: the peak now may be the check's (what it freed is given back to the system first), and
        what the process holds beyond what it held before the check is the check's too (kept apart from
        training's peak at the next :meth:`observe`: it would otherwise raise the bound check by check)."""
        if self.device.type != "cuda":
            release_freed()
        self._after_check = peak_bytes(self.device)
        if self._before_check:
            self._held_after = in_use_bytes(self.device)
            self._residue = max(0, self._residue + self._held_after - self._before_check)

    def room(self) -> Optional[int]:
        """Bytes a check may add now (None without a budget, or where this platform gives no peak to read)."""
        if self.budget is None:
            return None
        if not self.training_peak:
            self.observe()
        ceiling = self.ceiling()
        if ceiling is None:  # no /proc and no resource module (Windows): nothing to bound against
            return None
        return max(0, ceiling - in_use_bytes(self.device))

    def ceiling(self) -> Optional[int]:
        """The peak a check aims to stay under, in :func:`peak_bytes`' terms: training's peak and the part of the budget
        aimed at, plus what the checks left held (None without a budget or a peak to read). :meth:`room` is what the
        process may still add below it; a part that raised the process's peak above it overshot."""
        if self.budget is None or not self.training_peak:
            return None
        return int((1.0 + AIM * self.budget) * self.training_peak) + self._residue

    def aimed(self) -> Optional[int]:
        """Bytes the budget's aim allows above training's peak (:data:`AIM` of ``memory_budget`` times that peak; None
        without a budget or a peak to read): what may be held through a computation that peaks as training does."""
        if self.budget is None or not self.training_peak:
            return None
        return int(AIM * self.budget * self.training_peak)

    def transient(self, model: Optional[nn.Module] = None) -> int:
        """Training's peak above what is held now: its activations and temporaries, freed by now.

        With ``model``, at most the bytes of its parameters (an estimate of one forward's activations:
        the process's peak may be another computation's, e.g. an evaluation pass or an earlier model).
        """
        free = max(0, self.training_peak - in_use_bytes(self.device))
        if model is not None:
            free = min(free, sum(whole_numel(p) * p.element_size() for p in model.parameters()))
        return free

    def summary(self, room: Optional[int], estimate: Optional[int]) -> Dict[str, Any]:
        """The record's ``memory`` field: budget, training's peak, the room and the chosen form's estimate."""
        return {"memory_budget": self.budget, "training_peak_bytes": int(self.training_peak),
                "room_bytes": None if room is None else int(room),
                "estimate_bytes": None if estimate is None else int(estimate),
                "device": str(self.device)}


def numel_of(tensors: Iterable[torch.Tensor]) -> int:
    """Entries of ``tensors`` together.

    Example:
        >>> numel_of([torch.zeros(2, 3), torch.zeros(4)])
        10
    """
    return sum(int(t.numel()) for t in tensors)


def float_bytes(obj: Any, dtype: torch.dtype = torch.float64) -> int:
    """Bytes of the floating tensors inside ``obj`` (tensors, lists, tuples, dicts) once in ``dtype``.

    Example:
        >>> float_bytes((torch.ones(3), {"m": torch.ones(2, dtype=torch.long)}))
        24
    """
    size = torch.empty((), dtype=dtype).element_size()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * size if obj.is_floating_point() else 0
    if isinstance(obj, (list, tuple)):
        return sum(float_bytes(v, dtype) for v in obj)
    if isinstance(obj, dict):
        return sum(float_bytes(v, dtype) for v in obj.values())
    return 0


def objective_bytes(model: nn.Module, checked: Sequence[str], dtype: Optional[torch.dtype],
                    activations: int = 0) -> int:
    """What the whole-objective form holds: a ``dtype`` copy of every parameter and buffer, what the
    engine keeps per checked tensor, and the forward's activations in ``dtype``.

    ``dtype=None`` (in place) copies no model, but saves each checked tensor in its own dtype.
    ``activations``: training's own transient bytes (its forward), scaled to ``dtype``.

    Example:
        >>> objective_bytes(nn.Linear(10, 10), [], torch.float64)
        880
    """
    params = dict(model.named_parameters())
    if dtype is None:
        return sum(params[n].numel() * params[n].element_size() * 4 for n in checked if n in params) + activations
    size = torch.empty((), dtype=dtype).element_size()
    live = max((p.element_size() for p in params.values()), default=4)
    copy = (numel_of(params.values()) + numel_of(b for b in model.buffers() if b.is_floating_point())) * size
    engine = sum(params[n].numel() for n in checked if n in params) * CHECKED_BYTES_PER_ENTRY * size // 8
    return copy + engine + activations * size // live


#: What the whole objective's analytic pass holds per byte of activations a forward saves for its backward (in the
#: check's dtype): the saved activations, and the gradients of the largest of them alive at once in the backward.
OBJECTIVE_PER_SAVED_BYTE = 1.5


def objective_activations(per_sample: int, samples: int = 1) -> int:
    """What the whole objective's analytic pass holds for the activations of ``samples`` samples, each saving
    ``per_sample`` bytes for its backward in the check's dtype (:data:`OBJECTIVE_PER_SAVED_BYTE` of them).

    Example:
        >>> objective_activations(100, 4)
        600
    """
    return int(OBJECTIVE_PER_SAVED_BYTE * per_sample * samples)


def objective_samples(fixed: int, per_sample: int, samples: int, room: int) -> int:
    """Samples of a batch of ``samples`` whose whole-objective check fits :data:`SAFETY` of ``room``: ``fixed`` bytes
    held whatever the batch (the float64 copy of the model, the engine's copies of the checked tensors) and
    ``per_sample`` bytes of activations per sample (as counted, in the check's dtype). 0: not even one sample fits.

    Example:
        >>> objective_samples(10, 100, 16, 1000), objective_samples(10, 100, 4, 1000), objective_samples(600, 1, 4, 1000)
        (3, 3, 0)
    """
    free = SAFETY * room - fixed
    per = max(1, objective_activations(per_sample))
    if free < per:
        return 0
    return int(min(samples, free // per))


def module_bytes(params: Iterable[torch.Tensor], inputs: Any, outputs: int = 0, leaf_entries: int = 0) -> int:
    """What the module form holds for one module: its float64 copy, gradient and engine copies
    (:data:`MODULE_BYTES_PER_ENTRY` per parameter entry), its inputs three times (captured, working,
    fresh per call), the ``leaf_entries`` of them it differentiates as a parameter's
    (:data:`INPUT_LEAF_BYTES_PER_ENTRY` more each), and its output ``outputs`` bytes four times (output, cotangent,
    gradient, re-run).

    Example:
        >>> module_bytes(nn.Linear(10, 10).parameters(), torch.ones(4, 10), outputs=320)
        7520
        >>> module_bytes(nn.Linear(10, 10).parameters(), torch.ones(4, 10), outputs=320, leaf_entries=40)
        9120
    """
    return numel_of(params) * MODULE_BYTES_PER_ENTRY + 3 * float_bytes(inputs) + 4 * int(outputs) \
        + INPUT_LEAF_BYTES_PER_ENTRY * int(leaf_entries)


#: Copies of a convolution's unfolded input (im2col) its float64 check holds at once: torch's float64 convolutions
#: on the CPU unfold their input for the forward and again for each of the two gradients of the backward (measured
#: on a 3x3 Conv2d: docs/costs.md).
CONV_UNFOLD_COPIES = 3


#: Copies of what a unit's own ops save for backward (per byte of its input: ``Unit.saved_ratio``) the module form's
#: check of it holds at once: the analytic forward's, and their gradients in the backward.
MODULE_SAVED_COPIES = 2


def conv_workspace_bytes(module: nn.Module, output_bytes: int) -> int:
    """What a convolution's check holds beyond its inputs and outputs: :data:`CONV_UNFOLD_COPIES` copies of its
    unfolded input, from ``output_bytes`` (its output's bytes in the check's dtype: the unfolded input has as many
    positions, ``in_channels * prod(kernel_size)`` entries each); 0 for any other module.

    Example:
        >>> conv = nn.Conv2d(32, 32, 3)
        >>> conv_workspace_bytes(conv, 1000) == 3 * 1000 * 32 * 9 // 32, conv_workspace_bytes(nn.ReLU(), 1000)
        (True, 0)
    """
    if not isinstance(module, nn.modules.conv._ConvNd) or not output_bytes:
        return 0
    kernel = 1
    for k in module.kernel_size:
        kernel *= int(k)
    return CONV_UNFOLD_COPIES * int(output_bytes) * module.in_channels * kernel // max(1, module.out_channels)


def gradient_bytes(params: Iterable[torch.Tensor]) -> int:
    """What the training part holds per judged tensor: its replayed gradient, in the parameter's dtype (a ZeRO-3
    placeholder's at its whole shape: the replay's gradient is whole).

    Example:
        >>> gradient_bytes([torch.ones(10)])
        40
    """
    return sum(whole_numel(p) * p.element_size() for p in params)


def mb(n: Optional[float]) -> str:
    """Bytes as megabytes for messages.

    Example:
        >>> mb(3 * 2**20)
        '3.0 MB'
    """
    return "unbounded" if n is None else f"{n / 2**20:.1f} MB"
