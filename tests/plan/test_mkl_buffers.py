"""MKL's work buffers, kept by its allocator after a product, are given back after a check (gradwatch.plan.mkl_buffers).

The float64 products of a check left them counted in the process's RSS for the rest of the run: 22 MB of a 450 MB
peak on a transformer encoder at 1,024 tokens (benchmarks/shapes.py's ``encoder_long``, docs/costs.md)."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from gradwatch.plan.memory import release_freed
from gradwatch.plan.mkl_buffers import free_mkl_buffers

LINKED = sys.platform.startswith("linux") and torch.backends.mkl.is_available()


def _mkl_bytes() -> int:
    """Bytes MKL's allocator holds now (its own count: ``mkl_mem_stat``, named so inside torch's wheels)."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    stat = lib.mkl_serv_mem_stat
    stat.restype, stat.argtypes = ctypes.c_int64, [ctypes.POINTER(ctypes.c_int)]
    return int(stat(ctypes.byref(ctypes.c_int(0))))


@pytest.mark.skipif(not LINKED, reason="needs torch's wheel with MKL linked in, on Linux")
def test_the_buffers_a_float64_product_left_in_mkl_are_given_back():
    a = torch.randn(1024, 1024, dtype=torch.float64)
    (a @ a).sum()  # MKL keeps its packing buffers for the next product
    assert _mkl_bytes() > 2**20  # about 3 MB a thread for a 1,024 x 1,024 float64 product
    assert free_mkl_buffers() is True
    assert _mkl_bytes() == 0
    (a @ a).sum()
    assert _mkl_bytes() > 2**20
    release_freed()  # between a check's pieces: MKL's buffers kept for the next piece's products
    assert _mkl_bytes() > 2**20
    release_freed(mkl=True)  # as a check ends, before training goes on
    assert _mkl_bytes() == 0


def test_it_says_whether_it_found_mkl_where_torch_has_it():
    # torch's wheels link MKL in statically: its mkl_free_buffers goes by mkl_serv_free_buffers there
    assert free_mkl_buffers() is LINKED
