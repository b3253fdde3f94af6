"""``benchmarks/bench_linear.py``: one step's products timed five ways, and the direct and panel
rows' bits compared with the same rows inside a larger product."""

from __future__ import annotations

import torch

from benchmarks import bench_linear
from models import onednn, panel_linear


def test_compare_times_every_way_available_here(monkeypatch):
    monkeypatch.setattr(bench_linear, "PROJECTIONS", ((16, 24), (24, 16)))
    monkeypatch.setattr(bench_linear, "HEAD", (16, 40))
    weights = bench_linear.step_weights(torch.float32, layers=2)
    assert [tuple(w.shape) for w in weights] == [(24, 16), (16, 24), (24, 16), (16, 24), (40, 16)]
    res = bench_linear.compare(torch.float32, 3, layers=2, rounds=2)
    assert res["plain"] > 0
    if onednn.pack(torch.zeros(24, 16)) is None:
        assert res["direct"] is None and res["same_bits_direct"] is None
    else:
        assert res["direct"] > 0 and res["same_bits_direct"] is True
    assert res["panels"] is None and res["same_bits_panels"] is None  # bf16 weights only


def test_compare_times_the_panel_kernel_for_bf16_where_it_builds(monkeypatch):
    monkeypatch.setattr(bench_linear, "PROJECTIONS", ((16, 24), (24, 16)))
    monkeypatch.setattr(bench_linear, "HEAD", (16, 40))
    res = bench_linear.compare(torch.bfloat16, 5, layers=2, rounds=2)
    if panel_linear.pack(torch.zeros(24, 16, dtype=torch.bfloat16)) is None:
        assert res["panels"] is None
    else:
        assert res["panels"] > 0 and res["same_bits_panels"] is True


def test_compare_times_the_pair_kernel_for_bf16_where_it_builds(monkeypatch):
    monkeypatch.setattr(bench_linear, "PROJECTIONS", ((16, 24), (24, 16)))
    monkeypatch.setattr(bench_linear, "HEAD", (16, 40))
    res = bench_linear.compare(torch.bfloat16, 5, layers=2, rounds=2)
    if panel_linear.pack_pairs(torch.zeros(24, 16, dtype=torch.bfloat16)) is None:
        assert res["pairs"] is None and res["same_bits_pairs"] is None
    else:
        assert res["pairs"] > 0 and res["same_bits_pairs"] is True
    assert bench_linear.compare(torch.float32, 3, layers=2, rounds=1)["pairs"] is None
