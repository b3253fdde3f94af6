"""benchmarks/bench_gpu.py smoke-tested on the CPU with its tiny shape (no profiler there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_gpu  # noqa: E402


def test_tiny_run_reports_every_case_and_greedy_equality(tmp_path):
    out = tmp_path / "bench.json"
    report = bench_gpu.main(["--tiny", "--batch", "1", "2", "--warmup-steps", "1",
                             "--decode-steps", "3", "--profile-steps", "2", "--spec-batch", "1",
                             "2", "--spec-tokens", "6", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["errors"] == []
    assert report["notes"] == ["torch/graphs: not captured here (graphs need CUDA and flashinfer)"]
    rows = report["results"]
    assert [(r["backend"], r["mode"], r["batch"]) for r in rows] == [
        ("torch", "eager", 1), ("torch", "eager", 2)]
    for r in rows:
        assert r["decode_steps"] == 3 and r["tokens_per_step"] == r["batch"]
        assert r["ms_per_step"] > 0 and r["tok_per_s"] > 0
        assert r["gpu_busy"] is None  # no device timeline on the CPU
    (spec,) = report["speculative"]
    assert spec["mode"] == "eager"
    assert [r["batch"] for r in spec["runs"]] == [1, 2]
    assert all(r["greedy_equal"] for r in spec["runs"])
    assert spec["drafts"]["num_drafts"] > 0  # drafts were really verified


def test_busy_time_is_the_union_of_device_intervals():
    import torch

    class Span:
        def __init__(self, a, b, device=torch.autograd.DeviceType.CUDA):
            self.time_range = type("R", (), {"start": a, "end": b})()
            self.device_type = device

    class Prof:
        def events(self):
            return [Span(0, 10), Span(5, 12), Span(20, 25), Span(21, 22),
                    Span(0, 100, torch.autograd.DeviceType.CPU)]

    assert bench_gpu._device_busy_us(Prof()) == 17
