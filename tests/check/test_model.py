"""check_model: no false alarms on correct models, real bugs caught, grad_fn path, kinks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import CorrectSigmoid
from helpers import tanh_wrong_in_channel
from torch import nn

import gradwatch
from gradwatch import Verdict, check_model


def ce_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


class SigmoidLayer(nn.Module):
    def forward(self, x):
        return CorrectSigmoid.apply(x)


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        return self.head(self.enc(self.emb(tokens)).mean(1))


def make_model(kind: str, seed: int):
    torch.manual_seed(seed)
    if kind == "mlp_dropout":
        model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        batch = (torch.randn(8, 5), torch.randint(0, 3, (8,)))
    elif kind == "cnn_bn_pool_dropout2d":
        model = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
            nn.Dropout2d(0.2), nn.Flatten(), nn.Linear(4 * 3 * 3, 3),
        )
        batch = (torch.randn(4, 2, 6, 6), torch.randint(0, 3, (4,)))
    elif kind == "lstm":
        model = LSTMNet()
        batch = (torch.randn(3, 5, 4), torch.randint(0, 2, (3,)))
    elif kind == "transformer_embedding":
        model = TinyTransformer()
        batch = (torch.randint(0, 11, (3, 5)), torch.randint(0, 3, (3,)))
    elif kind == "custom_function":
        model = nn.Sequential(nn.Linear(5, 8), SigmoidLayer(), nn.Linear(8, 3))
        batch = (torch.randn(6, 5), torch.randint(0, 3, (6,)))
    else:  # pragma: no cover
        raise ValueError(kind)
    return model.train(), batch


KINDS = ["mlp_dropout", "cnn_bn_pool_dropout2d", "lstm", "transformer_embedding", "custom_function"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_no_false_alarm_on_correct_models(kind, seed):
    model, batch = make_model(kind, seed)
    report = check_model(model, ce_loss, batch)
    assert report.ok, str(report)
    assert report.failures == []
    assert report.dtype == "float64"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert list(report.tensors) == trainable
    for t in report.tensors.values():
        assert t.verdict is not None
        assert not t.failed
        assert t.inconclusive is None
        assert t.verdict.rank <= Verdict.ACCEPTABLE.rank, (t.name, t.judged_rel_diff)


def test_no_false_alarm_with_transformer_in_eval_mode():
    model, batch = make_model("transformer_embedding", 0)
    report = check_model(model.eval(), ce_loss, batch)
    assert report.ok, str(report)


def test_float16_model_checked_on_float64_shadow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).half()
    batch = (torch.randn(6, 4).half(), torch.randint(0, 2, (6,)))
    report = check_model(model, ce_loss, batch)
    assert report.ok and report.dtype == "float64"
    assert model[0].weight.dtype == torch.float16


# ---- a bug in 1 channel of 64 --------------------------------------------------------


class ChannelNet(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1 = nn.Linear(10, 64)
        self.fc2 = nn.Linear(64, 3)
        self.act = act

    def forward(self, x):
        return self.fc2(self.act.apply(self.fc1(x)))


@pytest.mark.parametrize("factor", [0.0, 3.0])
def test_bug_in_one_of_64_channels_caught_on_first_call(factor):
    torch.manual_seed(0)
    model = ChannelNet(tanh_wrong_in_channel(17, factor))
    batch = (torch.randn(16, 10), torch.randint(0, 3, (16,)))
    report = check_model(model, ce_loss, batch)  # default options, first call
    assert not report.ok
    names = {t.name for t in report.failures}
    assert "fc1.weight" in names
    assert not ({"fc2.weight", "fc2.bias"} & names)
    w = report.tensors["fc1.weight"]
    # directions see every channel; sampled coordinates mostly miss channel 17
    assert w.directional_rel_diff is not None and w.directional_rel_diff > 1e-3
    assert w.directional_rel_diff > 1e3 * max(report.tensors["fc2.weight"].directional_rel_diff, 1e-9)
    assert w.diagnosis


def test_same_net_with_correct_channel_passes():
    torch.manual_seed(0)
    model = ChannelNet(tanh_wrong_in_channel(17, 1.0))
    batch = (torch.randn(16, 10), torch.randint(0, 3, (16,)))
    assert check_model(model, ce_loss, batch).ok


# ---- grad_fn: hand-written backprop of a torch model ---------------------------------


def _mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _hand_grad(scale_w: float = 1.0):
    def grad_fn(model, batch):
        x, y = batch
        r = model(x) - y  # (N, 1)
        n = r.numel()
        return {
            "weight": scale_w * (2.0 / n) * r.t() @ x,
            "bias": (2.0 / n) * r.sum(0),
        }

    return grad_fn


def test_grad_fn_correct_passes_and_2x_wrong_fails():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    batch = (torch.randn(10, 3), torch.randn(10, 1))
    ok = check_model(model, _mse, batch, grad_fn=_hand_grad(1.0))
    assert ok.ok, str(ok)
    bad = check_model(model, _mse, batch, grad_fn=_hand_grad(2.0))
    assert [t.name for t in bad.failures] == ["weight"]
    assert "2.00x" in bad.tensors["weight"].diagnosis
    assert not bad.tensors["bias"].failed
    with pytest.raises(gradwatch.GradientCheckError, match="weight"):
        bad.raise_for_failures()


# ---- kinks ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_relu_net_exactly_on_kinks_is_not_wrong(seed):
    """Zero biases and zero input rows put every hidden pre-activation of those rows exactly at 0.

    Observed: every sample of ``0.bias`` disagrees at the base step (numeric sees half the ReLU jump,
    analytic uses relu'(0) = 0); each is classified as a kink and excluded. Random directions cross
    all four kinks at once, so the analytic slope need not lie between the one-sided slopes there.
    Without kink detection the same check reports ``0.bias`` as failing.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3))
    with torch.no_grad():
        model[0].bias.zero_()
    x = torch.randn(6, 3)
    x[0] = 0.0
    x[3] = 0.0
    batch = (x, torch.randint(0, 3, (6,)))
    report = check_model(model, ce_loss, batch)
    assert report.ok, str(report)
    assert report.kinks > 0
    assert report.tensors["0.bias"].kinks > 0
    assert report.tensors["0.bias"].verdict is not Verdict.WRONG
    assert "kinks excluded" in str(report)
    raw = check_model(model, ce_loss, batch, detect_kinks=False)
    assert [t.name for t in raw.failures] == ["0.bias"]


def test_bug_still_caught_in_net_with_kinks():
    """Kink detection does not hide a wrong gradient at smooth points of the same net."""

    class DoubledReLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clamp(min=0)

        @staticmethod
        def backward(ctx, gy):
            (x,) = ctx.saved_tensors
            return 2.0 * gy * (x > 0).to(gy.dtype)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(3, 4)
            self.fc2 = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc2(DoubledReLU.apply(self.fc1(x)))

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc1.bias.zero_()
    x = torch.randn(6, 3)
    x[0] = 0.0
    report = check_model(model, ce_loss, (x, torch.randint(0, 3, (6,))))
    assert not report.ok
    assert "fc1.weight" in {t.name for t in report.failures}
    assert "2.00x" in report.tensors["fc1.weight"].diagnosis


# ---- options --------------------------------------------------------------------------


def test_tensors_option_and_sample_sizes():
    model, batch = make_model("mlp_dropout", 0)
    report = check_model(model, ce_loss, batch, tensors=["*.weight"], coords=3, directions=2, screen=False)
    assert list(report.tensors) == ["0.weight", "3.weight"]
    t = report.tensors["0.weight"]
    assert len(t.coords) == 3 and len(t.dir_analytic) == 2
    with pytest.raises(ValueError, match="matches no trainable parameter"):
        check_model(model, ce_loss, batch, tensors=["nope.*"])


def test_seed_changes_sampled_coordinates():
    model, batch = make_model("mlp_dropout", 0)
    a = check_model(model, ce_loss, batch, seed=0, screen=False)  # coordinates: the full sample
    b = check_model(model, ce_loss, batch, seed=0, screen=False)
    c = check_model(model, ce_loss, batch, seed=5, screen=False)
    assert a.tensors["0.weight"].coords == b.tensors["0.weight"].coords
    assert a.tensors["0.weight"].coords != c.tensors["0.weight"].coords


def _spy_on_run(monkeypatch):
    """Record the ``batched`` and ``screen`` each run_model_check of check_model is given."""
    import gradwatch.check.model as model_module

    seen, real = [], model_module.run_model_check

    def spy(*args, **kwargs):
        seen.append({k: kwargs[k] for k in ("batched", "screen")})
        return real(*args, **kwargs)

    monkeypatch.setattr(model_module, "run_model_check", spy)
    return seen


def test_localize_batched_and_screen_are_fields_of_check_options(monkeypatch):
    from gradwatch.options import CheckOptions

    assert (CheckOptions().localize, CheckOptions().batched, CheckOptions().screen) == (False, True, True)
    seen = _spy_on_run(monkeypatch)
    model, batch = make_model("mlp_dropout", 0)
    opts = CheckOptions(tensors=["*.weight"], coords=3, directions=2, screen=False, batched=False)
    by_field = check_model(model, ce_loss, batch, options=opts)
    by_keyword = check_model(model, ce_loss, batch, tensors=["*.weight"], coords=3, directions=2, screen=False,
                             batched=False)
    assert seen == [{"batched": False, "screen": False}] * 2
    assert by_field.tensors["0.weight"].coords == by_keyword.tensors["0.weight"].coords
    assert by_field.evaluations == by_keyword.evaluations
    check_model(model, ce_loss, batch)
    assert seen[-1] == {"batched": True, "screen": True}  # the fields' defaults, as the keywords' were


def test_the_keywords_override_the_options_fields(monkeypatch):
    from gradwatch.options import CheckOptions

    seen = _spy_on_run(monkeypatch)
    model, batch = make_model("mlp_dropout", 0)
    opts = CheckOptions(screen=False, batched=False, coords=5, directions=1)
    report = check_model(model, ce_loss, batch, options=opts, screen=True, batched=True, coords=3)
    assert seen == [{"batched": True, "screen": True}]
    assert (opts.screen, opts.batched, opts.coords) == (False, False, 5)  # the options given are left as they were
    assert all(len(t.coords) <= 3 for t in report.tensors.values())


def test_localize_as_a_field_and_as_a_keyword():
    from gradwatch.options import CheckOptions

    class WrongTanh(nn.Module):
        def forward(self, x):
            return tanh_wrong_in_channel(slice(None), 1.5).apply(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), WrongTanh(), nn.Linear(8, 3))
    batch = (torch.randn(6, 5), torch.randint(0, 3, (6,)))
    by_field = check_model(model, ce_loss, batch, options=CheckOptions(localize=True))
    by_keyword = check_model(model, ce_loss, batch, localize=True)
    unlocalized = check_model(model, ce_loss, batch, options=CheckOptions(localize=True), localize=False)
    assert not by_field.ok and [c.name for c in by_field.localized if c.failed] == ["1"]
    assert [c.name for c in by_keyword.localized if c.failed] == ["1"]
    assert unlocalized.localized == [] and not unlocalized.ok


@pytest.mark.parametrize("name", ["localize", "batched", "screen"])
def test_a_bad_one_shot_option_names_the_field_and_what_is_accepted(name):
    from gradwatch.errors import ConfigError
    from gradwatch.options import CheckOptions

    model, batch = make_model("mlp_dropout", 0)
    with pytest.raises(ConfigError, match=f"^{name}: got 'yes', expected true or false$"):
        check_model(model, ce_loss, batch, **{name: "yes"})
    with pytest.raises(ConfigError, match=f"^{name}: got 1, expected true or false$"):
        CheckOptions(**{name: 1})
    with pytest.raises(TypeError, match="options: got dict, expected a gradwatch.CheckOptions"):
        check_model(model, ce_loss, batch, options={name: True})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_conv_with_zero_bias_on_black_border_is_not_wrong(seed):
    """A realistic kink: zero-initialized conv bias on images with a black border.

    Every channel's pre-activation is exactly 0 wherever the 3x3 patch is all zero, so perturbing
    the conv bias crosses many ReLU kinks at once (for a direction: of mixed signs).
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3))
    with torch.no_grad():
        model[0].bias.zero_()
    x = torch.zeros(3, 1, 8, 8)
    x[:, :, 3:6, 3:6] = torch.randn(3, 1, 3, 3)
    report = check_model(model, ce_loss, (x, torch.randint(0, 3, (3,))))
    assert report.ok, str(report)
    assert report.tensors["0.bias"].kinks > 0
