"""Sampling: the cheap top-k and sign draws pick exactly what the plain torch calls would."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradwatch.check.numerics.sampling import _SIGN_TABLE, _top_indices, choose_coords, generator, rademacher_signs

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    n=st.sampled_from([5, 10, 255, 32767, 32768, 32768 + 1, 70000, 65536]),
    k=st.integers(min_value=1, max_value=12),
    seed=st.integers(min_value=0, max_value=10_000),
    spikes=st.integers(min_value=0, max_value=12),
)
def test_top_indices_match_torch_topk(n, k, seed, spikes):
    k = min(k, n)
    gen = torch.Generator().manual_seed(seed)
    values = torch.rand(n, generator=gen, dtype=torch.float64)
    # Large values clustered in one block, and some at the very end (the partial last block).
    idx = torch.randint(0, n, (spikes,), generator=gen)
    values[idx] += 10.0 + torch.arange(spikes, dtype=torch.float64)
    values[-1] += 5.0
    got = sorted(_top_indices(values, k).tolist())
    want = sorted(torch.topk(values, k).indices.tolist())
    assert got == want


def test_top_indices_all_in_one_block():
    values = torch.zeros(40_000, dtype=torch.float64)
    values[1000:1008] = torch.arange(1.0, 9.0, dtype=torch.float64)
    assert sorted(_top_indices(values, 5).tolist()) == [1003, 1004, 1005, 1006, 1007]


def test_top_indices_with_nan_put_nan_first_like_topk():
    values = torch.rand(50_000, dtype=torch.float64)
    values[777] = float("nan")
    assert 777 in _top_indices(values, 3).tolist()
    assert 777 in torch.topk(values, 3).indices.tolist()


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 56, 57, 1000, 65536 + 3])
def test_rademacher_signs_equal_the_table_lookup(numel):
    got = rademacher_signs(numel, 3, generator(11))
    # The reference: the same random words expanded with advanced indexing.
    gen = generator(11)
    n_bytes = (numel + 7) // 8
    words = torch.randint(0, 2**62, (3, (n_bytes + 6) // 7), generator=gen)
    data = words.view(torch.uint8).reshape(3, -1, 8)[:, :, :7].reshape(3, -1)[:, :n_bytes]
    want = _SIGN_TABLE[data.long()].reshape(3, -1)[:, :numel]
    assert got.dtype == torch.int8 and got.shape == (3, numel)
    assert torch.equal(got, want)
    assert set(got.unique().tolist()) <= {-1, 1}


def test_choose_coords_takes_the_largest_gradients_of_a_large_tensor():
    g = torch.randn(300, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e-3
    g[17, 250] = 9.0
    g[299, 299] = -8.0
    g[0, 0] = 7.0
    flat = choose_coords(g, 6, generator(0)).tolist()
    assert {17 * 300 + 250, 299 * 300 + 299, 0} <= set(flat)
    assert len(flat) == len(set(flat)) == 6
    assert flat == sorted(flat)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_rademacher_signs_in_a_float_dtype_are_the_int8_signs(dtype):
    as_int8 = rademacher_signs(1001, 2, generator(5))
    as_float = rademacher_signs(1001, 2, generator(5), dtype=dtype)
    assert as_float.dtype == dtype
    assert torch.equal(as_float, as_int8.to(dtype))
