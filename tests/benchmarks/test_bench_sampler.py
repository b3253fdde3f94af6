"""``benchmarks/bench_sampler.py``: both argmax ways give the same indices, and every table
row is printed."""

from __future__ import annotations

import torch

from benchmarks import bench_sampler


def test_the_ways_agree_and_the_tables_print(capsys):
    r = bench_sampler.compare_argmax(3, 300, torch.bfloat16, calls=2, rounds=1)
    assert r["same"] is True and r["torch"] > 0 and r["compiled"] > 0
    assert bench_sampler.time_sampler(2, 3, 300, torch.float32, calls=2, rounds=1) > 0
    bench_sampler.main(["--rows", "2", "--ks", "0", "1", "--requests", "2", "--dtypes",
                        "bfloat16", "--calls", "1", "--rounds", "1"])
    out = capsys.readouterr().out
    assert out.count("| True |") == 2  # one vocabulary each
    assert "| scores in bfloat16 | 1 |" in out
