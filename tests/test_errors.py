"""Bad input gets a clear error whose message names the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch
from gradwatch import ConfigError, GradWatchError, check_backward, check_model, check_numpy


@pytest.fixture
def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    return model, batch


def ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def test_config_error_is_a_gradwatch_value_error():
    assert issubclass(ConfigError, GradWatchError)
    assert issubclass(ConfigError, ValueError)


def test_non_scalar_loss_names_the_shape(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(ValueError, match=r"scalar.*\(8, 3\)"):
        check_model(model, lambda m, b: m(b[0]), batch)
    with pytest.raises(ValueError, match=r"\(8, 3\)"):
        check_model(model, lambda m, b: m(b[0]), batch, dtype=None)


def test_non_scalar_regularizer_names_it(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(ValueError, match=r"regularizer 'bad'.*\(6, 4\)"):
        check_model(model, ce, batch, regularizers={"bad": lambda m: m[0].weight})


def test_non_scalar_numpy_loss_names_the_shape():
    w = {"w": np.ones(3)}
    with pytest.raises(ValueError, match=r"scalar.*\(3,\)"):
        check_numpy(lambda: w["w"] * 2, w, {"w": np.full(3, 2.0)})
    with pytest.raises(TypeError, match=r"tuple.*\[0\]"):
        check_numpy(lambda: (float(w["w"].sum()), {}), w, {"w": np.ones(3)})


def test_model_without_trainable_parameters(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(ValueError, match="no trainable floating-point parameters"):
        check_model(nn.ReLU(), lambda m, b: m(b[0]).sum(), batch)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable.*frozen"):
        check_model(model, ce, batch)


@pytest.mark.parametrize("eps", [0, 0.0, -1e-3])
def test_eps_not_positive(model_and_batch, eps):
    model, batch = model_and_batch
    with pytest.raises(ConfigError, match=r"eps: got .*expected a number > 0"):
        check_model(model, ce, batch, eps=eps)
    w = {"w": np.ones(2)}
    with pytest.raises(ConfigError, match="eps"):
        check_numpy(lambda: float(w["w"].sum()), w, {"w": np.ones(2)}, eps=eps)
    with pytest.raises(ValueError, match="eps must be > 0"):
        check_backward(torch.tanh, np.ones(2), np.ones(2), eps=eps)
    with pytest.raises(ValueError, match="eps must be > 0"):
        gradwatch.numerical_grad(lambda: float(w["w"].sum()), w["w"], eps=eps)


@pytest.mark.parametrize("coords", [0, -3])
def test_coords_below_one(model_and_batch, coords):
    model, batch = model_and_batch
    with pytest.raises(ConfigError, match=rf"coords: got {coords}, expected an integer >= 1"):
        check_model(model, ce, batch, coords=coords)


def test_other_bad_options(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(ConfigError, match="coords: got 2.5"):
        check_model(model, ce, batch, coords=2.5)
    with pytest.raises(ConfigError, match="directions"):
        check_model(model, ce, batch, directions=-1)
    with pytest.raises(ConfigError, match="bands"):
        check_model(model, ce, batch, bands=(1e-2, 1e-4, 1e-7))
    with pytest.raises(ConfigError, match="fail_at"):
        check_model(model, ce, batch, fail_at="excellent")
    with pytest.raises(ConfigError, match="dtype"):
        check_model(model, ce, batch, dtype=torch.int64)
    with pytest.raises(TypeError, match="unexpected keyword"):
        check_model(model, ce, batch, cords=3)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        check_model(lambda x: x, ce, batch)
    with pytest.raises(ValueError, match="unknown built-in 'l3'"):
        check_model(model, ce, batch, regularizers={"l3": 1e-3})


def _grad_fn(grads):
    return lambda model, batch: grads


def test_grad_fn_wrong_names(model_and_batch):
    model, batch = model_and_batch
    good = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    wrong = {("layer." + n): g for n, g in good.items()}
    with pytest.raises(ValueError, match=r"grad_fn returned no gradient for \['0.weight'"):
        check_model(model, ce, batch, grad_fn=_grad_fn(wrong))
    with pytest.raises(TypeError, match="grad_fn must return a mapping"):
        check_model(model, ce, batch, grad_fn=_grad_fn([g for g in good.values()]))


def test_grad_fn_wrong_shapes(model_and_batch):
    model, batch = model_and_batch
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    grads["0.weight"] = grads["0.weight"].t()
    with pytest.raises(ValueError, match=r"'0.weight' has shape \(4, 6\), but the parameter has shape \(6, 4\)"):
        check_model(model, ce, batch, grad_fn=_grad_fn(grads))


def test_numpy_grads_wrong_names_and_shapes():
    params = {"W": np.ones((2, 3)), "b": np.zeros(3)}

    def loss():
        return float(params["W"].sum() + params["b"].sum())

    with pytest.raises(ValueError, match=r"grads returned no gradient for \['b'\]"):
        check_numpy(loss, params, {"W": np.ones((2, 3)), "B": np.ones(3)})
    with pytest.raises(ValueError, match=r"'W' has shape \(3, 2\).*\(2, 3\)"):
        check_numpy(loss, params, {"W": np.ones((3, 2)), "b": np.ones(3)})
    with pytest.raises(TypeError, match=r"params\['i'\] must be a floating numpy array"):
        check_numpy(loss, {"i": np.ones(3, dtype=np.int64)}, {"i": np.ones(3)})
    with pytest.raises(ValueError, match="dtype=None"):
        check_numpy(loss, params, {"W": np.ones((2, 3)), "b": np.ones(3)}, dtype="float64")


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_low_precision_in_place_refused(model_and_batch, low):
    model, batch = model_and_batch
    model.to(low)
    name = str(low).replace("torch.", "")
    with pytest.raises(ValueError, match=rf"dtype=None checks in place, but parameters are (torch\.)?{name}"):
        check_model(model, ce, (batch[0].to(low), batch[1]), dtype=None)
    # the default float64 shadow is the way out
    report = check_model(model, ce, (batch[0].to(low), batch[1]))
    assert report.ok and report.dtype == "float64"


def test_check_backward_bad_arguments():
    x = np.ones(3)
    with pytest.raises(TypeError, match="func must be callable"):
        check_backward(None, x, x)
    with pytest.raises(TypeError, match=r"x_data\[0\] must be a torch tensor or numpy array"):
        check_backward(torch.tanh, "abc", x)
    with pytest.raises(ValueError, match="y_grad has 2 arrays but func returned 1 outputs"):
        check_backward(torch.tanh, x, (x, x))
    with pytest.raises(ValueError, match="atol and rtol"):
        check_backward(torch.tanh, x, x, atol=-1)


def test_optimizer_must_be_an_optimizer(model_and_batch):
    model, batch = model_and_batch
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        check_model(model, ce, batch, optimizer={"weight_decay": 0.1})
