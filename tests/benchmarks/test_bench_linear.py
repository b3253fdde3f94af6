"""``benchmarks/bench_linear.py``: one step's products timed both ways, and the bits compared."""

from __future__ import annotations

import torch

from benchmarks import bench_linear
from models.layers import pack_weight


def test_step_ms_times_both_products_and_compares_bits(monkeypatch):
    monkeypatch.setattr(bench_linear, "PROJECTIONS", ((16, 24),))
    monkeypatch.setattr(bench_linear, "HEAD", (16, 40))
    plain, packed, same = bench_linear.step_ms(torch.bfloat16, 3, layers=2, calls=1)
    assert plain > 0
    if pack_weight(torch.zeros(4, 4, dtype=torch.bfloat16)) is None:
        assert packed is None
    else:
        assert packed > 0 and same  # bf16 packed rows carry F.linear's bits
