"""A check that fits beside training: activations counted, not guessed; the whole objective cut to the samples that fit;
convolutions windowed where one sample does not fit; a planted border-row bug still caught on the windows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Sequence

import paths
import pytest
import torch
from test_reexamine import _NudgedSigmoid
from torch import nn
from torch.nn import functional as F

from gradwatch.check.modules.activations import WHOLE, saved_bytes
from gradwatch.check.modules.module_form import run_module_check
from gradwatch.check.objective.terms import Objective
from gradwatch.options import CheckOptions
from gradwatch.plan.memory import conv_workspace_bytes, objective_samples, release_freed


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))


def _ce(m: nn.Module, b):
    return F.cross_entropy(m(b[0]), b[1])


def test_saved_bytes_count_the_activations_of_the_whole_batch_from_two_samples():
    model = _mlp()
    n = 4096
    batch = (torch.randn(n, 64), torch.randint(0, 10, (n,)))
    counted = saved_bytes(model, _ce, batch)
    # what autograd saves: the input (the first Linear's), each tanh's output (the next Linear's input too, counted
    # once) and the logits' log-softmax; never the weights
    floats = n * (64 + 256 + 256 + 10)
    assert counted.samples == n
    assert 0.9 * 4 * floats <= counted.total <= 1.3 * 4 * floats, (counted.total, 4 * floats)
    assert counted.dtype_bytes == 4
    assert counted.scaled(8) == 2 * counted.total


def test_a_small_batch_is_counted_whole_and_loss_fn_sees_the_very_batch():
    model = _mlp()
    batch = (torch.randn(WHOLE, 64), torch.randint(0, 10, (WHOLE,)))
    seen = []

    def loss_fn(m, b):
        seen.append(b)
        return _ce(m, b)

    saved_bytes(model, loss_fn, batch)
    assert seen and all(b is batch for b in seen)


def _graphs_alive(before: Sequence[torch.Tensor] = ()) -> list:
    """Tensors with a graph alive now and not in ``before`` (what earlier tests of the same worker left is theirs)."""
    import gc

    gc.collect()
    seen = {id(t) for t in before}  # (``before`` is held by the caller: its ids are not reused meanwhile)
    return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.grad_fn is not None and id(t) not in seen]


def test_counting_leaves_no_graph_behind():
    # The count's pack hook returned each saved tensor as it was: a log-softmax's result, saved by its own node, then
    # held that node through its grad_fn (a cycle through C++ the collector cannot see), and with it the counting
    # forward's whole graph for the rest of the run (GPT-2's logits: 98 MB at batch 4 x 128)
    model = _mlp()
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    before = _graphs_alive()
    assert saved_bytes(model, _ce, batch).total > 0
    assert _graphs_alive(before) == []


def test_a_watched_run_holds_no_graph_between_steps():
    from gradwatch import GradWatch

    before = _graphs_alive()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = GradWatch(model, _ce, every=1, log_dir=None)
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    for _ in range(2):
        opt.zero_grad()
        loss = _ce(model, batch)
        loss.backward()
        assert watch.step(batch, loss=loss) is not None
        opt.step()
    del loss
    assert _graphs_alive(before) == []
    watch.close()


class _Head(nn.Module):
    """Own code around the modules it calls (checked with stubs in the module form)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.norm = nn.LayerNorm(10)

    def forward(self, x):
        return F.log_softmax(self.norm(self.body(x)) * 2.0, dim=-1)


def _cyclic_tensors(run) -> list:
    import gc

    gc.collect()
    gc.disable()
    try:
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return found


@pytest.mark.parametrize("form", ["module", "objective"])
def test_a_check_leaves_no_tensor_in_a_cycle(form):
    # Tensors in reference cycles live until Python's full collection comes round, which a training loop may not
    # reach for many steps: an own-code copy's stubs and their reads, a recursive closure, an evaluator and its
    # kink records each held a unit's float64 outputs or cotangents (GPT-2's logits of a window: 52 MB) past the check
    from gradwatch import GradWatch

    torch.manual_seed(0)
    model = _Head()
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))

    def nll(m, b):
        return F.nll_loss(m(b[0]), b[1])

    watch = GradWatch(model, nll, every=1, log_dir=None, form=form)

    def step():
        model.zero_grad()
        loss = nll(model, batch)
        loss.backward()
        report = watch.step(batch, loss=loss)
        assert report is not None
        assert report.form == form
        assert report.tensors

    assert _cyclic_tensors(step) == []
    watch.close()


def test_attention_saves_more_than_its_input_and_is_counted_per_module():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
            self.out = nn.Linear(32, 32)

        def forward(self, x):
            return self.out(self.attn(x, x, x)[0])

    counted = saved_bytes(Block(), lambda m, b: m(b).sum(), torch.randn(2, 512, 32))
    # its scores (4 heads x 512 x 512 a sample) dwarf its three 512 x 32 inputs
    assert counted.ratios["attn"] > 4, counted.ratios
    assert counted.ratios["out"] < 2, counted.ratios


def test_objective_samples_keep_what_fits_and_none_where_the_copy_alone_does_not():
    assert objective_samples(fixed=0, per_sample=10, samples=100, room=3000) == 100
    assert objective_samples(fixed=100, per_sample=10, samples=1000, room=3000) == 93
    assert objective_samples(fixed=2000, per_sample=10, samples=1000, room=3000) == 0


def _peak_mb() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) >> 10 for line in fh if line.startswith("VmHWM"))


def test_a_differentiated_input_is_costed_as_its_check_holds_it_and_the_pieces_keep_to_the_room():
    # The pooling's input (8 x 32 x 64 x 64, 8 MB in float64) is differentiated: its check holds its gradient, |grad|
    # and signs as a parameter's (about 64 MB in all). Costed at its three copies (24 MB) it was checked whole in a
    # 40 MB room and the check rose 110 MB.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                          nn.Linear(128, 3))
    batch = (torch.randn(8, 3, 64, 64), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
    run_module_check(model, Objective(_ce, {}, 0.0), (batch[0][:1, :, :8, :8], batch[1][:1]), CheckOptions())
    release_freed(mkl=True)  # what the tests this worker ran before left in the heap, then the peak from here on
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the process's peak")
    before = _peak_mb()
    room = 40 << 20
    report = run_module_check(model, Objective(_ce, {}, 0.0), batch, CheckOptions(seed=0), room=room)
    assert report.ok, str(report)
    assert "2:input" in report.tensors, sorted(report.tensors)
    # the room, and what the check's planning and its first forward hold before the pieces take their limit
    assert _peak_mb() - before < 1.5 * (room >> 20), (_peak_mb() - before, report.notes)


def test_the_conv_workspace_is_counted_from_its_unfolded_input():
    conv = nn.Conv2d(32, 64, 3)
    assert conv_workspace_bytes(conv, 64 * 100 * 8) == 3 * 32 * 9 * 100 * 8
    assert conv_workspace_bytes(nn.Linear(2, 2), 100) == 0


_HEAVY = """
import json, sys, torch
from test_memory_fits import _ce, _mlp
from gradwatch import GradWatch
model, n = _mlp(), 8192
batch = (torch.randn(n, 64), torch.randint(0, 10, (n,)))
watch = GradWatch(model, _ce, every=1, log_dir=None, form=sys.argv[1], training=False)
_ce(model, batch).backward()
report = watch.step(batch)
watch.close()
print(json.dumps({"form": report.form, "notes": report.notes, "tensors": sorted(report.tensors), "ok": report.ok,
                  "text": str(report)}))
"""


@pytest.mark.slow
def test_an_activation_heavy_model_is_checked_in_modules_and_an_explicit_objective_on_a_cut():
    # A fresh process: its room is what training's own peak leaves (a test worker's peak is earlier tests'). The whole
    # objective in float64 holds 3x what training's forward saved (8,192 samples), over that room.
    n = 8192
    names = sorted(name for name, _ in _mlp().named_parameters())
    for form, expected in (("auto", "module"), ("objective", "objective")):  # each in a process of its own
        run = subprocess.run([sys.executable, "-c", _HEAVY, form], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": paths.pythonpath()}, cwd=paths.ROOT)
        assert run.returncode == 0, run.stderr[-2000:]
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert report["form"] == expected, (form, report["notes"])
        if form == "objective":
            cut = [note for note in report["notes"] if note.startswith("form: objective: checked on ")]
            assert cut, report["notes"]
            assert f"of the batch's {n} samples" in cut[0]
            assert report["tensors"] == names
            assert report["ok"], report["text"]


class _BorderConv(torch.autograd.Function):
    """A 3x3 convolution whose input gradient is 1.3x too large on the first row (a border bug)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w, b)
        return F.conv2d(x, w, b, padding=1)

    @staticmethod
    def backward(ctx, g):
        x, w, b = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_, b_ = (t.detach().requires_grad_() for t in (x, w, b))
            gx, gw, gb = torch.autograd.grad(F.conv2d(x_, w_, b_, padding=1), (x_, w_, b_), g)
        gx = gx.clone()
        gx[:, :, 0, :] *= 1.3
        return gx, gw, gb


class _Conv(nn.Conv2d):
    def __init__(self, bug: bool) -> None:
        super().__init__(4, 8, 3, padding=1)
        self.bug = bug

    def forward(self, x):
        return _BorderConv.apply(x, self.weight, self.bias) if self.bug else super().forward(x)


def _cnn(bug: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), _Conv(bug), nn.Tanh(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 3))


def _conv_check(bug: bool, seed: int):
    model = _cnn(bug)
    batch = (torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0]))
    # a room under one sample's float64 check of the 4 -> 8 convolution at 64x64 (its unfolded input alone: 1.2 MB)
    return run_module_check(model, Objective(_ce, {}, 0.0), batch, CheckOptions(seed=seed), room=1_000_000)


def test_a_convolution_over_the_room_on_one_sample_is_checked_on_a_window_drawn_anew():
    notes = [_conv_check(False, seed).notes for seed in (0, 1)]
    # the rest of the check captured on one sample (a window of the batch), the convolution on a window of its positions
    windows = [[n for n in ns if n.startswith("module form: `2` (_Conv) checked on 1 of the window's 1 samples, a ")]
               for ns in notes]
    assert all(windows), notes
    assert windows[0] != windows[1]  # another draw at another check
    report = _conv_check(False, 0)
    assert report.ok, str(report)
    assert "2.weight" in report.tensors and "2:input" in report.tensors


def test_a_border_row_bug_in_a_convolution_backward_is_caught_on_its_window():
    report = _conv_check(True, 0)
    assert any("window" in n for n in report.notes), report.notes
    assert not report.ok
    assert "2:input" in {f.name for f in report.failures}, str(report)


class _Block(nn.Module):  # a UNet's resnet block: its own code (the activations, the sum) between the modules it calls
    def __init__(self, c: int, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.n1, self.c1, self.n2, self.c2 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c), \
            nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        h = self.n2(self.c1(F.silu(self.n1(x))))
        return x + self.c2(h * _NudgedSigmoid.apply(h, 1.1 if self.bug else 1.0))  # a SiLU, its backward wrong


def _block_check(bug: bool, seed: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _Block(8, bug), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 3))
    batch = (torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1]))
    # a room under one sample's check of the block's own code (its input and four stubs' outputs: about 8 MB)
    return run_module_check(model, Objective(_ce, {}, 0.0), batch, CheckOptions(seed=seed), room=3_000_000)


def test_a_blocks_own_code_over_the_room_on_one_sample_is_checked_on_a_window_and_its_bug_caught():
    ok, bad = _block_check(False, 0), _block_check(True, 0)
    windows = [n for n in ok.notes if n.startswith("module form: own code of `1` (_Block) checked on 1 of the ")
               and "window" in n]
    assert windows, ok.notes
    assert ok.ok and "1:input" in ok.tensors, str(ok)
    assert not bad.ok, str(bad)
    assert {f.name for f in bad.failures} == {"1.n2:output"}, str(bad)  # the input of the SiLU whose backward is wrong


_THRESHOLD = """
import json, sys, torch
from torch import nn
from gradwatch import GradWatch
from gradwatch.plan.malloc_thresholds import STEP, mmap_threshold
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10))
batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
loss_fn = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
watch = GradWatch(model, loss_fn, every=1, log_dir=None)
loss_fn(model, batch).backward()
before = mmap_threshold()
watch.step(batch)
at_check = mmap_threshold()
big = torch.ones(5_000_000)  # 20 MB, mapped, then freed: glibc's dynamic threshold would rise to it
del big
after = mmap_threshold()
watch.close()
print(json.dumps({"before": before, "at_check": at_check, "after": after, "step": STEP}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mmap threshold")
def test_a_check_holds_glibcs_mmap_threshold_where_training_left_it():
    """A freed mapped block no longer raises the threshold once the watch's first check held it (training's mid-sized
    tensors would otherwise come from the heap after a check's big frees, and training peak higher)."""
    run = subprocess.run([sys.executable, "-c", _THRESHOLD], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": paths.pythonpath()}, cwd=paths.ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # (what the watch's step does before its check may still move it a little: it is held at the check's start)
    assert got["before"] is not None and got["before"] <= got["at_check"] < 20_000_000, got
    assert got["after"] == got["at_check"], got  # the 20 MB block freed: dynamic, the threshold would be 20 MB
