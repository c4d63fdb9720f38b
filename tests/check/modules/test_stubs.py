"""Own code reads what it calls: a stub answers reads as the live module does, and calls replay the live outputs.

diffusers' ``UNet2DModel`` reads ``len(up_block.resnets)`` in its own forward, torch's ``nn.TransformerEncoder``
reads ``self.layers[0].self_attn.batch_first``: the own-code units of both were "not checked" (``'Stub' object
has no attribute ...``). Here they are checked, EXCELLENT on a correct model, and a wrong backward planted in the
parent's own code is still caught on that unit. A module with nothing to check (diffusers' ``Timesteps`` on
integer timesteps: no floating input, no trainable parameter) is no unit, and no alert.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradwatch import GradWatch, Verdict
from gradwatch.check.modules.localize import ModuleCheck
from gradwatch.check.modules.module_form import run_module_check
from gradwatch.check.modules.own_code import OwnCode, own_code_copy
from gradwatch.check.modules.stubs import LiveReads, ModuleView, Stub
from gradwatch.check.objective.terms import Objective
from gradwatch.options import CheckOptions
from gradwatch.plan.units import plan_units

F64 = torch.float64


class Doubled(torch.autograd.Function):
    """Identity forward, a backward twice the true one: the planted bug."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return 2 * g


def checked(model: nn.Module, loss_fn: Any, batch: Any, names: Sequence[str]) -> Dict[str, ModuleCheck]:
    """The module form's check of the units ``names`` only, by unit name."""
    units = [u for u in plan_units(model, loss_fn, batch) if u.name in names]
    assert sorted(u.name for u in units) == sorted(names)
    report = run_module_check(model, Objective(loss_fn), batch, CheckOptions(), units=units)
    return {m.name: m for m in report.localized}


def excellent(result: ModuleCheck) -> bool:
    return result.inconclusive is None and bool(result.tensors) and \
        all(t.verdict == Verdict.EXCELLENT for t in result.tensors.values())


# --------------------------------------------------------------------------- what a stub reads


def test_a_stub_reads_flags_submodules_and_containers_as_the_live_module():
    block = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.ReLU(), nn.LayerNorm(3)))
    stub = Stub("block", [torch.zeros(1, 3, dtype=F64)], block.eval())
    assert not stub.training
    assert len(stub) == 2
    assert bool(stub)
    first, inner = stub[0], stub[1]
    assert isinstance(first, ModuleView)
    assert isinstance(first, nn.Linear)
    assert first.out_features == 3
    assert [type(v).__name__ for v in inner] == ["ModuleView", "ModuleView"]
    assert isinstance(inner[-1], nn.LayerNorm) and inner[-1].normalized_shape == (3,)
    assert stub[0] is first and stub[1][0] is inner[0]  # one view per module
    assert not hasattr(stub, "resnets") and not hasattr(first, "skip_conv")
    with pytest.raises(RuntimeError, match="did not call in the live forward"):
        inner[0](torch.ones(3))


def test_tensors_read_are_constants_in_the_check_dtype_that_leave_the_live_module_as_it_was():
    fc = nn.Linear(3, 2)
    live = fc.weight.detach().clone()
    stub = Stub("fc", [torch.zeros(2, dtype=F64)], fc)
    w = stub.weight
    assert w.dtype == F64
    assert w.device == fc.weight.device
    assert not w.requires_grad
    assert stub.weight is w
    assert torch.equal(w, live.to(F64)) and [k for k, _ in stub.named_parameters()] == ["out0_0"]
    w.add_(1.0)  # own code that works in place on what it read
    assert torch.equal(fc.weight.detach(), live)


def test_methods_and_properties_run_on_the_stub():
    class Child(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

        @property
        def width(self) -> int:
            return self.inner.out_features * 2

        def scale(self) -> torch.Tensor:
            return self.inner.weight.abs().sum()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    class Sub(Child):
        def scale(self) -> torch.Tensor:
            return super().scale() + 1

    stub = Stub("child", [torch.zeros(2, dtype=F64)], Sub())
    assert stub.width == 4
    assert stub.scale().dtype == F64 and float(stub.scale()) == pytest.approx(float(stub.inner.weight.abs().sum()) + 1)


class Twice(nn.Module):
    """Calls ``a`` and, directly, ``a.b``, and reads ``a``'s flags and weight: every read of a stub at once."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        self.a.b = nn.Linear(3, 3)
        self.a.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.a.scale
        y = self.a.b(h).to(self.a[0].weight.dtype)
        return torch.sin(y) + y @ self.a[0].weight  # a called module's weight in the parent's own code


def test_a_module_called_directly_below_a_called_one_is_its_stub():
    model = Twice()
    outputs = {"a": [torch.ones(2, 3, dtype=F64)], "a.b": [torch.full((2, 3), 2.0, dtype=F64)]}
    local, stubs, params = own_code_copy(model, "", ["a", "a.b"], outputs, {})
    assert sorted(params) == ["a.b:output", "a:output"]
    with torch.no_grad():
        out, *given = OwnCode(local, stubs)(torch.zeros(2, 3, dtype=F64))
    y = torch.full((2, 3), 2.0, dtype=F64)
    assert torch.allclose(out, torch.sin(y) + y @ model.a[0].weight.detach().to(F64))
    assert [g.tolist() for g in given] == [[[0.0] * 3] * 2, [[0.5] * 3] * 2]  # what a and a.b were given


def test_reads_are_shared_by_the_stubs_of_one_copy():
    model = Twice()
    reads = LiveReads(model, dtype=F64)
    stub = Stub("a.b", [], model.a.b, F64, reads)
    reads.stubs["a.b"] = stub
    assert reads.module(model.a.b) is stub and reads.value(model.a[0].weight) is reads.value(model.a[0].weight)


# --------------------------------------------------------------------------- own code checked, bugs caught


def test_own_code_that_computes_with_a_called_modules_weight_is_checked():
    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(4, 3)
    result = checked(model, lambda m, b: m(b).square().mean(), x, [""])[""]
    assert excellent(result), result


class BadEncoder(nn.TransformerEncoder):
    def forward(self, src: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().forward(Doubled.apply(src), *args, **kwargs)


def encoder_case(batch_first: bool, mask: str, bad: bool = False, norm: bool = False) -> Any:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
    cls = BadEncoder if bad else nn.TransformerEncoder
    model = cls(layer, 2, norm=nn.LayerNorm(8) if norm else None, enable_nested_tensor=False)
    n, t = 2, 5
    x = torch.randn(n, t, 8) if batch_first else torch.randn(t, n, 8)
    kwargs: Dict[str, Any] = {}
    if mask == "causal":
        kwargs = {"mask": nn.Transformer.generate_square_subsequent_mask(t), "is_causal": True}
    elif mask == "padding":
        kwargs = {"src_key_padding_mask": torch.tensor([[False] * t, [False] * 3 + [True] * (t - 3)])}

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        out = m(b, **kwargs)
        return out.square().mean() if mask != "padding" else out.nan_to_num().square().mean()

    return model, loss_fn, x


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_transformer_encoder_own_code_is_checked(batch_first: bool, mask: str):
    model, loss_fn, x = encoder_case(batch_first, mask, norm=mask == "causal")
    result = checked(model, loss_fn, x, [""])[""]
    assert excellent(result), result


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_wrong_backward_in_the_encoders_own_code_is_caught_there(batch_first: bool):
    model, loss_fn, x = encoder_case(batch_first, "causal", bad=True)
    results = checked(model, loss_fn, x, ["", "layers.0"])
    assert excellent(results["layers.0"]), results["layers.0"]
    bad = results[""]
    assert bad.failed
    assert bad.tensors["input"].verdict == Verdict.WRONG
    assert "Doubled" in bad.functions
    assert "BadEncoder, own code" in bad.label and "2.00x" in bad.summary()


def test_the_watch_alerts_nothing_on_a_correct_encoder():
    model, loss_fn, x = encoder_case(True, "causal", norm=True)
    watch = GradWatch(model, loss_fn, every=1, log_dir=None, form="module")
    for _ in range(2):
        model.zero_grad()
        loss = loss_fn(model, x)
        loss.backward()
        report = watch.step(x, loss=loss)
        assert not [n for n in report.notes if "not checked" in n], report.notes
    assert watch.alerts == []


# --------------------------------------------------------------------------- nothing to check: no unit


class Steps(nn.Module):
    """Sinusoidal features of integer steps: no floating input, no parameter (as diffusers' ``Timesteps``)."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-torch.arange(4, dtype=torch.float32))
        return torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], dim=-1)


class Conditioned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.steps, self.frozen = Steps(), nn.Embedding(10, 8).requires_grad_(False)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.steps(t) + self.frozen(t))


def test_a_module_with_nothing_to_check_is_no_unit_and_no_alert():
    torch.manual_seed(0)
    model = Conditioned()
    batch = (torch.randn(4, 8), torch.randint(0, 10, (4,)))

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return m(*b).square().mean()

    assert [u.name for u in plan_units(model, loss_fn, batch)] == ["<loss_fn>", "", "fc"]
    watch = GradWatch(model, loss_fn, every=1, log_dir=None, form="module")
    for _ in range(2):
        model.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        report = watch.step(batch, loss=loss)
        assert not [n for n in report.notes if "not checked" in n], report.notes
    assert watch.alerts == []


# --------------------------------------------------------------------------- diffusers' UNet2DModel


def unet(bad: bool = False) -> Any:
    diffusers = pytest.importorskip("diffusers")

    class BadUNet(diffusers.UNet2DModel):
        def forward(self, sample: torch.Tensor, timestep: Any, **kwargs: Any) -> Any:
            return super().forward(Doubled.apply(sample), timestep, **kwargs)

    torch.manual_seed(0)
    model = (BadUNet if bad else diffusers.UNet2DModel)(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        norm_num_groups=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:  # the DDPM loss, its draws seeded by the check
        noise = torch.randn_like(x)
        t = torch.randint(0, 1000, (x.shape[0],))
        alpha = torch.cos(t.float() / 1000 * 1.5707963).view(-1, 1, 1, 1)
        return F.mse_loss(m(alpha * x + (1 - alpha ** 2).sqrt() * noise, t).sample, noise)

    return model, loss_fn, images


def test_unet_own_code_is_checked_and_its_timesteps_are_no_unit():
    model, loss_fn, images = unet()
    names = [u.name for u in plan_units(model, loss_fn, images)]
    assert "time_proj" not in names and "time_embedding" in names
    results = checked(model, loss_fn, images, ["", "up_blocks.0"])
    assert excellent(results[""]), results[""]
    assert excellent(results["up_blocks.0"]), results["up_blocks.0"]


def test_a_wrong_backward_in_the_unets_own_code_is_caught_there():
    model, loss_fn, images = unet(bad=True)
    bad = checked(model, loss_fn, images, [""])[""]
    assert bad.failed
    assert bad.tensors["input"].verdict == Verdict.WRONG
    assert "Doubled" in bad.functions
    assert "BadUNet, own code" in bad.label and "2.00x" in bad.summary()


def test_the_watch_alerts_nothing_on_a_correct_unet():
    model, loss_fn, images = unet()
    watch = GradWatch(model, loss_fn, every=1, log_dir=None, form="module")
    for _ in range(3):
        model.zero_grad()
        loss = loss_fn(model, images)
        loss.backward()
        report = watch.step(images, loss=loss)
        assert not [n for n in report.notes if "not checked" in n], report.notes
    assert watch.alerts == []


def test_a_class_that_forwards_what_it_lacks_forwards_it_on_the_stub_too():
    class Wrapper(nn.Module):  # as PEFT's models: what the wrapper lacks is the wrapped model's
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(2, 2)

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name == "model":
                    raise
                return getattr(self.model, name)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    stub = Stub("wrapper", [torch.zeros(2, dtype=F64)], Wrapper())
    assert stub.in_features == 2
    assert stub.weight.dtype == F64
    assert not hasattr(stub, "absent")
