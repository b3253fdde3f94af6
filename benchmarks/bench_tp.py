"""Tensor parallelism against one rank, offline: prefill time, greedy decode tok/s, and the
share of a step rank 0 spends in all-reduces (waiting for its peers included).

    python -m benchmarks.bench_tp --tp 1 3 [--model M] [--dtype float32] [--batch 1 8]
        [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from engine import LLM, SamplingParams


def run(model: str, tp: int, dtype: str, batches: list[int], prompt_len: int,
        new_tokens: int, load_format: str = "auto") -> dict:
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, speculative_config=None, tensor_parallel_size=tp,
              max_model_len=1024, kv_cache_memory="256MiB", load_format=load_format)
    out = {"tp": tp, "startup_s": round(time.perf_counter() - t0, 2)}
    comm = llm.engine.tp.comm if llm.engine.tp is not None else None
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine_config.model.vocab_size
    try:
        prompt = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([prompt[:32]], one)  # warm-up
        t0 = time.perf_counter()
        llm.generate([prompt], one)
        out["prefill_ms"] = round(1000 * (time.perf_counter() - t0), 1)
        for b in batches:
            prompts = [torch.randint(10, vocab, (16,), generator=g).tolist() for _ in range(b)]
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            reduce0 = comm.reduce_seconds if comm else 0.0
            calls0 = comm.reduce_calls if comm else 0
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            entry = {"tok_s": round(b * new_tokens / wall, 1),
                     "ms_per_step": round(1000 * wall / new_tokens, 2)}
            if comm:
                entry["allreduce_share"] = round((comm.reduce_seconds - reduce0) / wall, 3)
                entry["allreduces_per_step"] = round((comm.reduce_calls - calls0) / new_tokens, 1)
            out[f"decode_b{b}"] = entry
    finally:
        if llm.engine.tp is not None:
            llm.engine.tp.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--load-format", default="auto", help="dummy: random weights of the shape")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the engine process (TP divides them among ranks)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps({"load_avg": os.getloadavg(), "cores": os.cpu_count(),
                      "torch_threads": torch.get_num_threads()}))
    for tp in args.tp:
        print(json.dumps(run(args.model, tp, args.dtype, args.batch, args.prompt_len,
                             args.new_tokens, args.load_format)), flush=True)


if __name__ == "__main__":
    main()
