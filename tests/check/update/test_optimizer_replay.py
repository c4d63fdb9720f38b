"""The update's math (issue 74): torch's optimizers replayed in float64 on sampled coordinates, and clipping read off
the gradients before and after it. Real torch optimizers in all their forms, stepping real tensors."""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.check.update.clipping import factors, judge_clipping, value_bound
from gradwatch.check.update.optimizer_replay import algorithm, judge_update, replay

CASES = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True}),
    (torch.optim.Adam, {"lr": 1e-3}),
    (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.1, "amsgrad": True, "foreach": False}),
    (torch.optim.Adam, {"lr": 1e-3, "fused": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True, "maximize": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "fused": True, "amsgrad": True}),
    (torch.optim.RMSprop, {"lr": 1e-2}),
    (torch.optim.RMSprop, {"lr": 1e-2, "centered": True, "momentum": 0.5, "weight_decay": 1e-2}),
    (torch.optim.Adagrad, {"lr": 1e-1, "lr_decay": 1e-2, "weight_decay": 1e-2, "initial_accumulator_value": 0.1}),
]

COORDS = torch.tensor([0, 5, 17, 40, 63])


class NoBiasCorrection(torch.optim.AdamW):
    """An AdamW whose step drops the bias correction (a subclass departing from its algorithm)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                s = self.state[p]
                if not s:
                    s["step"], s["exp_avg"], s["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                s["step"] += 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                s["exp_avg"].lerp_(p.grad, 1 - group["betas"][0])
                s["exp_avg_sq"].mul_(group["betas"][1]).addcmul_(p.grad, p.grad, value=1 - group["betas"][1])
                p.addcdiv_(s["exp_avg"], s["exp_avg_sq"].sqrt().add_(group["eps"]), value=-group["lr"])


def steps(cls, options, n=3, seed=0):
    """Each of ``n`` steps of ``cls`` on a random 8x8 parameter: (before, gradient, state, group, after) at COORDS."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    opt = cls([p], **options)
    out = []
    for _ in range(n):
        p.grad = torch.randn(8, 8, generator=gen)
        flat = lambda t: t.detach().reshape(-1)[COORDS].clone()  # noqa: E731
        state = {k: (flat(v) if isinstance(v, torch.Tensor) and v.shape == p.shape else
                     (v.clone() if isinstance(v, torch.Tensor) else v)) for k, v in opt.state[p].items()}
        group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        before, grad = flat(p), flat(p.grad)
        opt.step()
        out.append((before, grad, state, group, flat(p)))
    return opt, out


@pytest.mark.parametrize("cls,options", CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_every_step_of_torchs_optimizers_is_replayed_to_within_their_rounding(cls, options):
    opt, taken = steps(cls, options)
    for before, grad, state, group, after in taken:
        expected = replay(opt, group, before, grad, state)
        check = judge_update("w", before, after, expected, torch.float32)
        assert check.verdict.value == "excellent" and check.moved, (check, after, expected)


def test_an_adamw_subclass_without_bias_correction_is_wrong_and_says_its_ratio():
    assert algorithm(NoBiasCorrection) == "AdamW"
    opt, taken = steps(NoBiasCorrection, {"lr": 1e-2, "weight_decay": 0.0})
    before, grad, state, group, after = taken[0]
    check = judge_update("w", before, after, replay(opt, group, before, grad, state), torch.float32)
    assert check.verdict.value == "wrong", check
    # at step 1, (1 - beta1) m-hat over sqrt((1 - beta2) v-hat): about 0.1 / sqrt(0.001) = 3.16x smaller
    assert check.ratio == pytest.approx(0.1 / 0.001 ** 0.5, rel=2e-2), check


def test_a_step_that_changes_nothing_is_not_moved():
    before = torch.tensor([1.0, 2.0])
    check = judge_update("w", before, before.clone(), before.double() - 0.1, torch.float32)
    assert not check.moved and check.verdict.value == "wrong"


def test_torchs_clip_grad_norm_is_one_factor_at_the_asked_threshold():
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(16, generator=gen) * 3 for n in "abc"}
    params = {n: torch.nn.Parameter(torch.zeros(16)) for n in grads}
    for n, p in params.items():
        p.grad = grads[n].clone()
    norm = float(torch.linalg.vector_norm(torch.cat([g.double() for g in grads.values()])))
    torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
    found = judge_clipping(factors(grads, {n: p.grad for n, p in params.items()}), {n: 0 for n in grads}, norm, 1.0)
    assert found.problem is None and found.threshold == pytest.approx(1.0, rel=1e-6), found
    # the same clipping, judged without the asked threshold, at two steps of other norms: the same threshold
    again = judge_clipping(factors(grads, {n: p.grad for n, p in params.items()}), {n: 0 for n in grads}, norm,
                           before=[found.threshold])
    assert again.problem is None, again


def test_clipping_per_parameter_group_and_a_threshold_off_by_the_world_size_are_named():
    gen = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(16, generator=gen) * 3 for n in "abcd"}
    groups = {"a": 0, "b": 0, "c": 1, "d": 1}
    clipped = {n: g.clone() for n, g in grads.items()}
    for members in (["a", "b"], ["c", "d"]):  # each group clipped by its own norm
        torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(torch.zeros(16)) for _ in members], 1.0)
        norm = float(torch.linalg.vector_norm(torch.cat([grads[m] for m in members])))
        for m in members:
            clipped[m] = grads[m] * min(1.0, 1.0 / (norm + 1e-6))
    whole = float(torch.linalg.vector_norm(torch.cat(list(grads.values()))))
    found = judge_clipping(factors(grads, clipped), groups, whole, 1.0)
    assert found.kind == "groups" and "parameter group 0 (2 tensors)" in found.problem, found
    assert "parameter group 1 (2 tensors)" in found.problem and "its own norm" in found.problem
    halved = {n: g * (0.5 / whole) for n, g in grads.items()}  # clipped to max_norm / world_size, world size 2
    found = judge_clipping(factors(grads, halved), groups, whole, 1.0)
    assert found.kind == "threshold" and "divided by 2" in found.problem, found
    unasked = judge_clipping(factors(grads, halved), groups, whole, 0.0)
    assert unasked.kind == "unasked", unasked
    moved = judge_clipping(factors(grads, halved), groups, whole, None, before=[1.0])
    assert moved.kind == "threshold" and "moves with the gradient" in moved.problem, moved


def test_a_clipping_by_value_is_read_as_one_and_is_no_alert():
    gen = torch.Generator().manual_seed(2)
    grads = {n: torch.randn(16, generator=gen) for n in "ab"}
    params = {n: torch.nn.Parameter(torch.zeros(16)) for n in grads}
    for n, p in params.items():
        p.grad = grads[n].clone()
    torch.nn.utils.clip_grad_value_(params.values(), 0.5)
    after = {n: p.grad for n, p in params.items()}
    found = judge_clipping(factors(grads, after), {n: 0 for n in grads}, 1.0, by_value=value_bound(grads, after))
    assert found.problem is None and found.threshold == 0.5, found
    edited = {n: g.clone() for n, g in after.items()}
    edited["a"][0] += 0.25  # not a bound
    assert value_bound(grads, edited) is None
    assert judge_clipping(factors(grads, edited), {n: 0 for n in grads}, 1.0).kind == "not_scaling"


def test_a_threshold_off_by_the_precision_of_a_float32_norm_is_the_asked_one():
    """TRL's SFTTrainer (a Llama with a 32,000-token vocabulary) clipped to a norm the watch's float64 norm reads as
    1.000126 where 1 was asked: training's float32 norm over millions of entries. No alert; a factor of 2 still is."""
    grads = {"w": torch.tensor([3.0, 4.0])}
    clipped = {"w": grads["w"] * (1.000126 / 5.000001)}
    assert judge_clipping(factors(grads, clipped), {"w": 0}, 5.0, asked=1.0).problem is None
    halved = {"w": grads["w"] * (0.5 / 5.000001)}
    assert judge_clipping(factors(grads, halved), {"w": 0}, 5.0, asked=1.0).kind == "threshold"


def test_the_whole_gradients_norm_is_float64_exact_to_1e_6_from_float32_chunks_even_under_or_over_their_range():
    from gradwatch.parallel.update_shards import SQUARE_CHUNK, world_norm

    gen = torch.Generator().manual_seed(0)
    big = torch.randn(3 * SQUARE_CHUNK + 17, generator=gen) * 1e-3
    big[:100] *= 1e4  # a few large entries among many small ones
    grads = {"big": big, "tiny": torch.full((1000,), 1e-25), "zero": torch.zeros(SQUARE_CHUNK),
             "half": torch.randn(5000, generator=gen).to(torch.bfloat16), "double": torch.randn(10, dtype=torch.float64),
             "complex": torch.randn(100, dtype=torch.complex64, generator=gen)}
    exact = math.sqrt(sum(float(g.abs().double().pow(2).sum()) for g in grads.values()))
    assert abs(world_norm(grads) - exact) <= 1e-6 * exact
    only_tiny = {"tiny": torch.full((1000,), 1e-25)}  # its float32 squares underflow to 0: taken again in float64
    assert world_norm(only_tiny) == pytest.approx(math.sqrt(1000) * float(torch.tensor(1e-25).double()), rel=1e-12)
    assert world_norm({"huge": torch.full((4,), 1e30)}) == pytest.approx(2 * float(torch.tensor(1e30).double()), rel=1e-12)
