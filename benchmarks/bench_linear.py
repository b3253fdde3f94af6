"""The matrix products of a decode step: ``F.linear`` against oneDNN-packed weights.

SmolLM2-135M-Instruct's shapes by default (QKV 576->960, O 576->576, gate/up 576->3072, down
1536->576 per layer, LM head 576->49152), random weights, the weight of each call hot in cache
(calls repeat). Prints, per row count, the milliseconds of one step's products (30 layers x 4
projections + the LM head) both ways, and whether the packed rows have ``F.linear``'s bits.

    python benchmarks/bench_linear.py --dtypes bfloat16 float32 --rows 1 8 32 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.layers import linear, pack_weight  # noqa: E402

PROJECTIONS = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out), once per layer
HEAD = (576, 49152)


def _ms(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def step_ms(dtype: torch.dtype, rows: int, layers: int, calls: int) -> tuple[float, float | None, bool]:
    """(plain ms, packed ms or None when oneDNN cannot pack, packed bits equal plain bits)."""
    plain = packed = 0.0
    same, can_pack = True, True
    for (k, n), times in [(s, layers) for s in PROJECTIONS] + [(HEAD, 1)]:
        w = (torch.randn(n, k) * 0.05).to(dtype)
        x = torch.randn(rows, k).to(dtype)
        plain += times * _ms(lambda: F.linear(x, w), calls)
        pw = pack_weight(w)
        if pw is None:
            can_pack = False
            continue
        packed += times * _ms(lambda: linear(x, None, packed=pw), calls)
        same = same and torch.equal(linear(x, None, packed=pw), linear(x, w))
    return plain, packed if can_pack else None, same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}")
    print("| dtype | rows | F.linear ms/step | packed ms/step | packed / plain | same bits |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for name in args.dtypes:
            for rows in args.rows:
                plain, packed, same = step_ms(getattr(torch, name), rows, args.layers, args.calls)
                if packed is None:
                    print(f"| {name} | {rows} | {plain:.1f} | cannot pack | - | - |")
                else:
                    print(f"| {name} | {rows} | {plain:.1f} | {packed:.1f} | {packed / plain:.2f} "
                          f"| {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
