"""Attention benchmarks: the SDPA path of the torch backend against the paged CPU kernel.

Micro (default): one attention layer.

One layer with SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64, block
size 16), block tables shuffled over the pool. A timed call is one layer's ``attend`` (K/V
write of the new tokens + attention) on metadata built once; ``build`` times the per-step
``build_metadata``. Old and new alternate call by call (interleaved, same inputs) and the
medians are reported, because the machine may be shared.

    python benchmarks/bench_attention.py --requests 1 8 32 --contexts 256 1024 \\
        --dtypes bfloat16 float32 --q-len 1

End to end (``--e2e``): one ``LLM`` (SmolLM2-135M-Instruct, no speculation), the same GSM8K
chat prompts at each concurrency, greedy with ``ignore_eos``; the kernel is switched through
``SPECSERVE_CPU_ATTENTION`` between runs (sdpa, paged, paged, sdpa, ...), so both see the same
machine state. ``--profile N`` then profiles N decode steps at the largest concurrency with
``torch.profiler`` and reports the share of the step spent in attention (the backend's
``attend``: K/V write plus attention), for each kernel.

    python benchmarks/bench_attention.py --e2e --concurrency 1 8 16 32 --max-tokens 128 \\
        --rounds 3 --profile 20
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
    cpu_t = {name: [] for name in backends}
    build = {name: [] for name in backends}
    for _ in range(args.repeats):
        for name in backends:  # interleaved: old, new, old, new, ...
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                metas[name].attend(q, k, v, kv, 0.125)
            times[name].append((time.perf_counter() - t0) / args.calls)
            cpu_t[name].append((time.process_time() - c0) / args.calls)
            t0 = time.perf_counter()
            backends[name].build_metadata(batch, cpu)
            build[name].append(time.perf_counter() - t0)
    old, new = statistics.median(times["sdpa"]), statistics.median(times["paged"])
    return {"requests": num_req, "context": ctx, "dtype": dtype_name, "q_len": args.q_len,
            "sdpa_ms": old * 1e3, "paged_ms": new * 1e3, "speedup": old / new,
            "sdpa_cpu_ms": statistics.median(cpu_t["sdpa"]) * 1e3,
            "paged_cpu_ms": statistics.median(cpu_t["paged"]) * 1e3,
            "build_sdpa_ms": statistics.median(build["sdpa"]) * 1e3,
            "build_paged_ms": statistics.median(build["paged"]) * 1e3, "max_abs_diff": err}


def run_e2e(args) -> None:
    import os

    from benchmarks import prompts as prompt_sets
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048,
              max_num_seqs=max(args.concurrency))
    questions = prompt_sets.load("gsm8k", max(args.concurrency))
    prompts = prompt_sets.chat(llm.get_tokenizer(), questions)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    kernels = ("sdpa", "paged")

    def generate(kernel: str, group: list[str]) -> tuple[float, float, list[list[int]]]:
        """Output tokens per wall second and per CPU second of this process."""
        os.environ["SPECSERVE_CPU_ATTENTION"] = kernel
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(group, params)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        toks = [list(o.outputs[0].token_ids) for o in outs]
        n = sum(map(len, toks))
        return n / seconds, n / cpu, toks

    for kernel in kernels:  # warm-up (and builds the kernel if needed)
        generate(kernel, prompts[:2])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}, "
          f"{args.max_tokens} tokens, {args.rounds} rounds (interleaved)")
    print("| concurrency | SDPA tok/s | paged tok/s | ratio | SDPA tok/CPU-s | paged tok/CPU-s | "
          "ratio (CPU) | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        rates: dict[str, list[float]] = {k: [] for k in kernels}
        cpu_rates: dict[str, list[float]] = {k: [] for k in kernels}
        tokens: dict[str, list[list[int]]] = {}
        for rnd in range(args.rounds):
            order = kernels if rnd % 2 == 0 else kernels[::-1]
            for kernel in order:
                rate, cpu_rate, toks = generate(kernel, prompts[:c])
                rates[kernel].append(rate)
                cpu_rates[kernel].append(cpu_rate)
                tokens.setdefault(kernel, toks)
        old, new = statistics.median(rates["sdpa"]), statistics.median(rates["paged"])
        cold, cnew = statistics.median(cpu_rates["sdpa"]), statistics.median(cpu_rates["paged"])
        same = sum(a == b for a, b in zip(tokens["sdpa"], tokens["paged"]))
        print(f"| {c} | {old:.1f} | {new:.1f} | {new / old:.2f}x | {cold:.1f} | {cnew:.1f} | "
              f"{cnew / cold:.2f}x | {same}/{c} |", flush=True)
        print(f"<!-- c={c} wall sdpa {[round(r, 1) for r in rates['sdpa']]} "
              f"paged {[round(r, 1) for r in rates['paged']]}; cpu sdpa "
              f"{[round(r, 1) for r in cpu_rates['sdpa']]} paged "
              f"{[round(r, 1) for r in cpu_rates['paged']]} -->", flush=True)
    if args.profile:
        profile_share(llm, prompts[: max(args.concurrency)], args)


def profile_share(llm, prompts: list[str], args) -> None:
    """Attention share of decode steps at the largest concurrency, from torch.profiler."""
    import os

    from torch.profiler import ProfilerActivity, profile, record_function

    from attention.backends import torch_backend
    from engine import SamplingParams

    originals = {}
    for cls in (torch_backend.TorchMetadata, torch_backend.PagedMetadata):
        originals[cls] = cls.attend

        def wrapped(self, *a, _orig=cls.attend, **kw):
            with record_function("attention.attend"):
                return _orig(self, *a, **kw)

        cls.attend = wrapped
    engine = llm.engine
    print()
    print("| kernel | decode steps | step ms (median) | step CPU ms (median) | "
          "attention ms/step | attention share |")
    print("|---|---|---|---|---|---|")
    try:
        for kernel in ("sdpa", "paged"):
            os.environ["SPECSERVE_CPU_ATTENTION"] = kernel
            # run prefill and a few decode steps outside the profiler, then profile decode steps
            params = SamplingParams(max_tokens=args.profile + 40, temperature=0, ignore_eos=True)
            tok = llm.get_tokenizer()
            for i, p in enumerate(prompts):
                engine.add_request(f"prof-{kernel}-{i}", tok.encode(p), params)
            for _ in range(20):
                engine.step()
            step_times, cpu_times = [], []
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.profile):
                    t0, c0 = time.perf_counter(), time.process_time()
                    engine.step()
                    step_times.append(time.perf_counter() - t0)
                    cpu_times.append(time.process_time() - c0)
            while engine.has_unfinished_requests():
                engine.step()
            attn = sum(e.cpu_time_total for e in prof.key_averages()
                       if e.key == "attention.attend") / 1e3 / args.profile
            total = sum(step_times) * 1e3 / args.profile
            print(f"| {kernel} | {args.profile} | {statistics.median(step_times) * 1e3:.1f} | "
                  f"{statistics.median(cpu_times) * 1e3:.1f} | {attn:.1f} | {attn / total:.0%} |",
                  flush=True)
    finally:
        for cls, fn in originals.items():
            cls.attend = fn


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
    p.add_argument("--e2e", action="store_true", help="end-to-end offline decode A/B instead")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="e2e: runs per kernel and concurrency")
    p.add_argument("--profile", type=int, default=0,
                   help="e2e: profile this many decode steps at the largest concurrency")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.e2e:
        run_e2e(args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, layout {args.layout}, "
          f"q_len {args.q_len}")
    print("| dtype | requests | context | SDPA ms/layer | paged ms/layer | speed-up | "
          "SDPA CPU ms | paged CPU ms | speed-up (CPU) | build SDPA ms | build paged ms | "
          "max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            for ctx in args.contexts:
                for num_req in args.requests:
                    r = bench_case(args, num_req, ctx, dtype_name)
                    print(f"| {dtype_name} | {num_req} | {ctx} | {r['sdpa_ms']:.3f} | "
                          f"{r['paged_ms']:.3f} | {r['speedup']:.2f}x | "
                          f"{r['sdpa_cpu_ms']:.3f} | {r['paged_cpu_ms']:.3f} | "
                          f"{r['sdpa_cpu_ms'] / r['paged_cpu_ms']:.2f}x | "
                          f"{r['build_sdpa_ms']:.3f} | {r['build_paged_ms']:.3f} | "
                          f"{r['max_abs_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
