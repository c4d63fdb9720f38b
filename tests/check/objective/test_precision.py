"""The shadow's precision never breaks a correct program (issue 72, item 2).

The float64 shadow makes a buffer created with ``dtype=torch.float32`` in float64, while a tensor the program makes
in float32 otherwise (an integer mask ``.to(torch.float32)``, ``torch.zeros(n)`` in the default dtype) stays float32.
Ops that require one dtype then raised where the float32 program did not: transformers' ``load_balancing_loss_func``
``scatter_add_`` of the float32 mask into its float32 (now float64) counts. An op given float64 and lower-precision
operands at once now runs as the float32 program ran it: in float64, or in the dtype of a lower-precision tensor it
writes into.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tanh_wrong_in_channel
from torch import nn

import gradwatch
from gradwatch.check.objective.precision import ShadowPrecision

IDX = torch.tensor([0, 1, 1, 3])
MASK = torch.tensor([True, False, True, False])

#: op -> what it computes from a float64 ``x``, a float32 ``s`` and a buffer made with ``dtype=b`` (float32 in the
#: program: float64 in the shadow).
MIXED = {
    "Tensor.scatter_add_": lambda x, s, b: torch.zeros(4, dtype=b).scatter_add_(0, IDX, s) * x,
    "Tensor.scatter_": lambda x, s, b: torch.zeros(4, dtype=b).scatter_(0, IDX, s) * x,
    "torch.scatter_add": lambda x, s, b: torch.scatter_add(x, 0, IDX, s),
    "Tensor.index_add_": lambda x, s, b: torch.zeros(4, dtype=b).index_add_(0, IDX, s) * x,
    "Tensor.index_copy_": lambda x, s, b: torch.zeros(4, dtype=b).index_copy_(0, torch.arange(4), s) * x,
    "Tensor.masked_scatter_": lambda x, s, b: torch.zeros(4, dtype=b).masked_scatter_(MASK, s) * x,
    "Tensor.index_put_": lambda x, s, b: torch.zeros(4, dtype=b).index_put_((IDX,), s) * x,
    "Tensor.__setitem__": lambda x, s, b: _set(torch.zeros(4, dtype=b), s) * x,
    "Tensor.matmul": lambda x, s, b: (x.view(2, 2) @ s.view(2, 2)).flatten(),
    "torch.lerp": lambda x, s, b: torch.lerp(x, s, 0.25),
}


def _set(buffer: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    buffer[IDX] = source
    return buffer


def operands():
    x = torch.linspace(0.5, 2.0, 4, dtype=torch.float64, requires_grad=True)
    s = torch.arange(1, 5).to(dtype=torch.float32)  # integers made float32: exact, and no factory dtype= to rewrite
    return x, s


@pytest.mark.parametrize("op", list(MIXED))
def test_an_op_mixing_float64_and_float32_operands_runs_in_float64(op):
    x, s = operands()
    with pytest.raises(RuntimeError):  # what the shadow computed before: the buffer float64, the source float32
        MIXED[op](x, s, torch.float64)
    assert MIXED[op](x.float(), s, torch.float32).dtype == torch.float32  # the program in float32 runs
    with ShadowPrecision(torch.float64) as mode:
        out = MIXED[op](x, s, torch.float32)
    expected = MIXED[op](x, s.double(), torch.float64)  # the float32 program, all in float64
    assert out.dtype == torch.float64 and torch.equal(out, expected)
    assert list(mode.mixed.values()) == ["the float32 operands cast to float64"]
    assert next(iter(mode.mixed)).endswith(op)
    (grad,) = torch.autograd.grad(out.sum(), x)  # differentiable through the cast
    assert torch.isfinite(grad).all()


def test_an_op_writing_into_a_float32_tensor_runs_in_float32_and_is_an_island():
    x, _ = operands()
    mode = ShadowPrecision(torch.float64)
    model = nn.Identity()
    with mode.tracing(model):
        out = torch.zeros(4).scatter_add_(0, IDX, model(x))  # default-dtype buffer: float32 in the program as written
    assert out.dtype == torch.float32 and out.requires_grad
    assert list(mode.mixed.values()) == ["it writes into a float32 tensor: the float64 operands cast to float32"]
    assert mode.islands and mode.eps() == torch.finfo(torch.float32).eps  # judged with float32's step and floor


def test_an_error_the_float32_program_has_too_is_the_one_raised():
    with pytest.raises(RuntimeError) as plain:
        torch.zeros(4).index_add_(0, torch.tensor([0, 1]), torch.ones(3))
    with ShadowPrecision(torch.float64), pytest.raises(RuntimeError) as shadowed:
        torch.zeros(4, dtype=torch.float32).index_add_(0, torch.tensor([0, 1]), torch.ones(3))
    assert str(shadowed.value) == str(plain.value)  # not a dtype error of gradwatch's making


# ---------------------------------------------------------------- a model checked in float64


#: tanh whose backward is 1.5x the true derivative (in every channel).
TanhTooSteep = tanh_wrong_in_channel(slice(None), 1.5)


class CountsTokens(nn.Module):
    """Weighs each of 4 buckets by the share of rows routed to it, counted as transformers' load balancing counts
    tokens: a float32 mask made from integers, ``scatter_add_``/``index_add_``/``index_put_`` into float32 buffers."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 4)
        self.out = nn.Linear(4, 1)
        self.wrong = wrong

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        route = h.detach().argmax(-1)
        flat = mask.to(dtype=torch.float32)  # float32 everywhere: not a cast of a float64 tensor
        counts = torch.zeros(4, dtype=torch.float32).scatter_add_(0, route, flat)
        load = torch.zeros(4, dtype=torch.float32).index_add_(0, route, flat)
        keep = torch.zeros(len(x), dtype=torch.float32)
        keep[mask.bool()] = flat[mask.bool()]
        act = TanhTooSteep.apply(h) if self.wrong else torch.tanh(h)
        share = (counts + load) / (2 * flat.sum())
        return self.out(act * share).squeeze(-1) * keep


def batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 6, generator=g)
    mask = (torch.rand(12, generator=g) > 0.2).long()
    return x, mask


def loss_fn(model, b):
    x, mask = b
    return model(x, mask).pow(2).mean()


def test_a_model_counting_tokens_in_float32_buffers_checks_clean_in_float64():
    model = CountsTokens()
    assert loss_fn(model, batch()).dtype == torch.float32  # the program as written runs
    report = gradwatch.check_model(model, loss_fn, batch())
    assert report.dtype == "float64"
    assert report.ok and not report.failures, str(report)
    assert {t.verdict for t in report.tensors.values()} == {gradwatch.Verdict.EXCELLENT}
    mixed = report.precision["mixed_dtypes"]
    assert {k.split(": ")[-1] for k in mixed} == {"Tensor.scatter_add_", "Tensor.index_add_", "Tensor.__setitem__"}
    assert report.precision["low_precision"] == {}  # every op ran in float64
    assert any("ran with them made one dtype" in n for n in report.notes)


def test_a_wrong_backward_next_to_the_float32_buffers_is_still_caught():
    report = gradwatch.check_model(CountsTokens(wrong=True), loss_fn, batch())
    assert report.tensors["lin.weight"].verdict == gradwatch.Verdict.WRONG, str(report)
    assert report.tensors["lin.bias"].verdict == gradwatch.Verdict.WRONG
    assert report.tensors["out.weight"].verdict == gradwatch.Verdict.EXCELLENT


def test_a_hand_written_moe_loss_collecting_router_logits_checks_in_float64():
    """The issue's second finding: Mixtral's load balancing loss in the user's own loss_fn, on a padded batch."""
    pytest.importorskip("transformers")
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=32)
    model = MixtralForCausalLM(config)
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0

    def moe_loss(model, b):
        ids, mask = b
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                    output_router_logits=True)
        aux = load_balancing_loss_func(out.router_logits, config.num_local_experts, config.num_experts_per_tok, mask)
        return out.loss - config.router_aux_loss_coef * out.aux_loss + 0.1 * aux  # the user's own weight

    report = gradwatch.check_model(model, moe_loss, (ids, mask), coords=2, directions=1)
    assert report.dtype == "float64" and report.ok, str(report)
    assert math.isfinite(report.objective)
    assert any(k.endswith("Tensor.scatter_add_") for k in report.precision["mixed_dtypes"])
