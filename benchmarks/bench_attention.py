"""Attention micro-benchmark: the SDPA path of the torch backend against the paged CPU kernel.

One layer with SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64, block
size 16), block tables shuffled over the pool. A timed call is one layer's ``attend`` (K/V
write of the new tokens + attention) on metadata built once; ``build`` times the per-step
``build_metadata``. Old and new alternate call by call (interleaved, same inputs) and the
medians are reported, because the machine may be shared.

    python benchmarks/bench_attention.py --requests 1 8 32 --contexts 256 1024 \\
        --dtypes bfloat16 float32 --q-len 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attention.backends.base import AttentionBatch  # noqa: E402
from attention.backends.torch_backend import TorchBackend  # noqa: E402
from attention.groups import GroupSpec  # noqa: E402
from attention.kv import LayerKV, write_kv  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
          "fp8_e4m3": torch.float8_e4m3fn}


def make_case(num_req: int, ctx: int, q_len: int, cache_dtype: torch.dtype,
              q_dtype: torch.dtype, layout: str, hq: int, hkv: int, d: int, bs: int, seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    per_req = -(-(ctx + q_len) // bs)
    num_blocks = num_req * per_req + 1
    group = GroupSpec("target", ("l0",), bs, hkv, d, cache_dtype, str(cache_dtype))
    shape = (num_blocks, 2, bs, hkv, d) if layout == "NHD" else (num_blocks, 2, hkv, bs, d)
    kv = LayerKV("l0", group, layout, torch.zeros(shape, dtype=cache_dtype))
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    for _ in range(num_req):
        table = [free.pop() for _ in range(per_req)]
        tables.append(tuple(table))
        pos = torch.arange(ctx + q_len)
        s = torch.tensor(table)[pos // bs] * bs + pos % bs
        k = torch.randn(ctx, hkv, d, generator=gen)
        write_kv(kv, k, torch.randn(ctx, hkv, d, generator=gen), s[:ctx])
        slots.append(s[ctx:])
    batch = AttentionBatch(q_lens=(q_len,) * num_req, kv_lens=(ctx + q_len,) * num_req,
                           block_tables=tuple(tables), slot_mapping=torch.cat(slots),
                           causal=True, block_size=bs)
    n = num_req * q_len
    q = torch.randn(n, hq, d, generator=gen).to(q_dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(q_dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(q_dtype)
    return kv, batch, q, k, v


def bench_case(args, num_req: int, ctx: int, dtype_name: str) -> dict:
    cache_dtype = DTYPES[dtype_name]
    q_dtype = torch.float32 if dtype_name == "float32" else torch.bfloat16
    kv, batch, q, k, v = make_case(num_req, ctx, args.q_len, cache_dtype, q_dtype, args.layout,
                                   9, 3, 64, 16, seed=num_req * 7 + ctx)
    cpu = torch.device("cpu")
    backends = {"sdpa": TorchBackend("sdpa"), "paged": TorchBackend("paged")}
    metas = {name: be.build_metadata(batch, cpu) for name, be in backends.items()}
    outs = {name: m.attend(q, k, v, kv, 0.125) for name, m in metas.items()}
    err = float((outs["sdpa"].float() - outs["paged"].float()).abs().max())
    times = {name: [] for name in backends}
    build = {name: [] for name in backends}
    for _ in range(args.repeats):
        for name in backends:  # interleaved: old, new, old, new, ...
            t0 = time.perf_counter()
            for _ in range(args.calls):
                metas[name].attend(q, k, v, kv, 0.125)
            times[name].append((time.perf_counter() - t0) / args.calls)
            t0 = time.perf_counter()
            backends[name].build_metadata(batch, cpu)
            build[name].append(time.perf_counter() - t0)
    old, new = statistics.median(times["sdpa"]), statistics.median(times["paged"])
    return {"requests": num_req, "context": ctx, "dtype": dtype_name, "q_len": args.q_len,
            "sdpa_ms": old * 1e3, "paged_ms": new * 1e3, "speedup": old / new,
            "build_sdpa_ms": statistics.median(build["sdpa"]) * 1e3,
            "build_paged_ms": statistics.median(build["paged"]) * 1e3, "max_abs_diff": err}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    p.add_argument("--q-len", type=int, default=1, help="1 = decode, K+1 = verify block")
    p.add_argument("--layout", default="NHD", choices=["NHD", "HND"])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--calls", type=int, default=5, help="calls per timed sample")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, layout {args.layout}, "
          f"q_len {args.q_len}")
    print("| dtype | requests | context | SDPA ms/layer | paged ms/layer | speed-up | "
          "build SDPA ms | build paged ms | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            for ctx in args.contexts:
                for num_req in args.requests:
                    r = bench_case(args, num_req, ctx, dtype_name)
                    print(f"| {dtype_name} | {num_req} | {ctx} | {r['sdpa_ms']:.3f} | "
                          f"{r['paged_ms']:.3f} | {r['speedup']:.2f}x | "
                          f"{r['build_sdpa_ms']:.3f} | {r['build_paged_ms']:.3f} | "
                          f"{r['max_abs_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
