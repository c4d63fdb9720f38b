"""The pre-clip gradient folded into the clipped tensors for the check, and the clipped bits given back after it."""

import pytest
import torch
from torch import nn

from gradwatch.integrations.pre_clip import PreClip


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).clone()


def model_with_grads(dtype, seed=0, scale=3.0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(500, 48), nn.Linear(48, 40), nn.Linear(40, 7)).to(dtype)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape) * scale).to(dtype)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("foreach", [False, True])
def test_torchs_clip_is_folded_and_its_bits_given_back(dtype, foreach):
    model = model_with_grads(dtype)
    params = list(model.parameters())
    pre = [(p, p.grad.detach().clone()) for p in params]
    objects = [p.grad for p in params]
    torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, foreach=foreach)
    clipped = [bits(p.grad) for p in params]
    assert not all(torch.equal(c, bits(g)) for c, (_, g) in zip(clipped, pre))  # the clip changed .grad

    held = PreClip(pre)
    folded = held.fold()
    assert folded == len(params)  # the largest element's ratio finds the factor, in float32 or the gradients' dtype
    for (_, grad), (_, copy) in zip(held.pairs, pre):
        assert torch.equal(bits(grad), bits(copy)), "the check reads the backward's values"
    assert all(grad is obj for (_, grad), obj in zip(held.pairs, objects)), "written into the very tensors"
    for p, grad in held.pairs:
        p.grad = grad
    for p, obj in zip(params, objects):
        p.grad = obj
    held.restore()
    assert all(torch.equal(bits(p.grad), c) for p, c in zip(params, clipped)), "the clipped bits, back"
    assert all(p.grad is obj for p, obj in zip(params, objects))


def test_a_tensor_scaled_by_another_factor_keeps_its_copy():
    model = model_with_grads(torch.float32)
    params = list(model.parameters())
    pre = [(p, p.grad.detach().clone()) for p in params]
    torch.nn.utils.clip_grad_norm_(params[:-1], max_norm=0.5)  # the embedding (the largest) by one factor
    params[-1].grad.mul_(0.123)  # the last by another
    clipped = [bits(p.grad) for p in params]

    held = PreClip(pre)
    assert held.fold() == len(params) - 1  # the last bias kept its copy
    assert held.pairs[-1][1] is pre[-1][1] and held.pairs[-2][1] is not pre[-2][1]
    assert all(torch.equal(bits(g), bits(c)) for (_, g), (_, c) in zip(held.pairs, pre))
    held.restore()
    assert all(torch.equal(bits(p.grad), c) for p, c in zip(params, clipped))


def test_nothing_clipped_folds_with_factor_one_and_a_nan_gradient_is_never_folded():
    model = model_with_grads(torch.float32, scale=1e-3)
    params = list(model.parameters())
    pre = [(p, p.grad.detach().clone()) for p in params]
    torch.nn.utils.clip_grad_norm_(params, max_norm=1e3)  # under the threshold: scaled by 1.0
    held = PreClip(pre)
    assert held.fold() == len(params) and float(held.factor) == 1.0

    model = model_with_grads(torch.float32, seed=1)
    params = list(model.parameters())
    params[0].grad[3, 4] = float("nan")
    pre = [(p, p.grad.detach().clone()) for p in params]
    torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
    clipped = [bits(p.grad) for p in params]
    held = PreClip(pre)
    assert held.fold() == 0 and held.factor is None
    assert all(copy is mine for (_, copy), (_, mine) in zip(held.pairs, pre))
    held.restore()  # nothing to give back: .grad untouched
    assert all(torch.equal(bits(p.grad), c) for p, c in zip(params, clipped))


def test_a_parameter_without_grad_and_an_empty_list():
    assert PreClip([]).fold() == 0
    w = nn.Parameter(torch.ones(3))
    held = PreClip([(w, torch.ones(3))])  # .grad None now (set to None by the Trainer? never: kept as given)
    assert held.fold() == 0 and held.pairs[0][1].tolist() == [1.0, 1.0, 1.0]


def test_gradients_viewing_one_bucket_stay_views_of_it():
    """DDP's ``gradient_as_bucket_view``: each ``.grad`` a view into one flat bucket. Folded by a copy into the view, not
    by taking another storage: after the check the bucket still holds the clipped gradients the optimizer steps with."""
    model = model_with_grads(torch.float32)
    params = list(model.parameters())
    bucket = torch.cat([p.grad.reshape(-1) for p in params])
    at = 0
    for p in params:
        p.grad = bucket[at:at + p.numel()].view(p.shape)
        at += p.numel()
    pre = [(p, p.grad.detach().clone()) for p in params]
    torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
    clipped = bits(bucket)
    held = PreClip(pre)
    assert held.fold() == len(params)
    assert torch.equal(bucket, torch.cat([c.reshape(-1) for _, c in pre])), "the bucket holds the backward's values"
    held.restore()
    assert torch.equal(bits(bucket), clipped)
    assert all(p.grad.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr() for p in params)
