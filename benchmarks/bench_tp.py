"""Tensor parallelism against one rank, offline: prefill time, greedy decode tok/s, the
share of a step rank 0 spends in all-reduces (waiting for its peers included) and in the LM
head (replicated: rank 0 alone computes the logits while the workers wait for the next step).

    python -m benchmarks.bench_tp --tp 1 3 [--model M] [--dtype float32] [--batch 1 8]
        [--threads N] [--comm-micro]

``--comm-micro`` also times, on a 2-rank gloo group of this machine, what a vocabulary-parallel
LM head would add per step (gathering each rank's ``vocab / 2`` logits on rank 0) against one
all-reduce of the hidden states, for the model's vocab and hidden sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch

from engine import LLM, SamplingParams


def run(model: str, tp: int, dtype: str, batches: list[int], prompt_len: int,
        new_tokens: int, load_format: str = "auto", device: str = "cpu") -> dict:
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, speculative_config=None, tensor_parallel_size=tp,
              max_model_len=1024, kv_cache_memory="256MiB", load_format=load_format,
              device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out = {"tp": tp, "startup_s": round(time.perf_counter() - t0, 2)}
    comm = llm.engine.tp.comm if llm.engine.tp is not None else None
    model = llm.engine.model
    head = {"s": 0.0, "calls": 0}
    compute_logits = model.compute_logits

    def timed_logits(hidden: torch.Tensor) -> torch.Tensor:
        sync()
        t = time.perf_counter()
        logits = compute_logits(hidden)
        sync()
        head["s"] += time.perf_counter() - t
        head["calls"] += 1
        return logits

    model.compute_logits = timed_logits  # the runner calls it once per sampling step
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
            head0 = head["s"]
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            entry = {"tok_s": round(b * new_tokens / wall, 1),
                     "ms_per_step": round(1000 * wall / new_tokens, 2),
                     "lm_head_share": round((head["s"] - head0) / wall, 3)}
            if comm:
                entry["allreduce_share"] = round((comm.reduce_seconds - reduce0) / wall, 3)
                entry["allreduces_per_step"] = round((comm.reduce_calls - calls0) / new_tokens, 1)
            out[f"decode_b{b}"] = entry
    finally:
        if llm.engine.tp is not None:
            llm.engine.tp.shutdown()
    return out


def _comm_rank(rank: int, port: int, shapes: list[tuple[int, int, int]], iters: int,
               queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=120))
    results = []
    for b, hidden, vocab_local in shapes:
        h = torch.randn(b, hidden)
        local = torch.randn(b, vocab_local)
        outs = [[torch.empty(b, vocab_local) for _ in range(2)]] if rank == 0 else []
        timings = {"allreduce_hidden": [], "gather_logits": []}
        for i in range(iters + 5):
            t = time.perf_counter()
            pg.allreduce([h]).wait()
            ar = time.perf_counter() - t
            t = time.perf_counter()
            pg.gather(outs, [local]).wait()  # root rank 0 (default options)
            ga = time.perf_counter() - t
            if i >= 5:
                timings["allreduce_hidden"].append(ar)
                timings["gather_logits"].append(ga)
        results.append({"batch": b, "hidden": hidden, "vocab_per_rank": vocab_local,
                        **{k: round(1e6 * sorted(v)[len(v) // 2], 1)
                           for k, v in timings.items()}})
    if rank == 0:
        queue.put(results)


def comm_micro(hidden: int, vocab: int, batches: list[int], iters: int = 200) -> list[dict]:
    """Median microseconds (rank 0) of one all-reduce of ``[b, hidden]`` and one gather of
    ``[b, vocab / 2]`` float32 logits to rank 0, on a 2-process gloo group."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    shapes = [(b, hidden, vocab // 2) for b in batches]
    procs = [ctx.Process(target=_comm_rank, args=(r, port, shapes, iters, queue))
             for r in range(2)]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=300)
    for proc in procs:
        proc.join(30)
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--load-format", default="auto", help="dummy: random weights of the shape")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (rank r on cuda:r, NCCL)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the engine process (TP divides them among ranks)")
    p.add_argument("--comm-micro", action="store_true",
                   help="also time a vocab-parallel head's logits gather against an all-reduce "
                        "(2-rank gloo group)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps({"load_avg": os.getloadavg(), "cores": os.cpu_count(),
                      "torch_threads": torch.get_num_threads()}))
    for tp in args.tp:
        print(json.dumps(run(args.model, tp, args.dtype, args.batch, args.prompt_len,
                             args.new_tokens, args.load_format, args.device)), flush=True)
    if args.comm_micro:
        from engine.args import EngineArgs

        mc = EngineArgs(model=args.model, speculative_config=None).create_engine_config().model
        hf = mc.hf_config
        for row in comm_micro(hf["hidden_size"], hf["vocab_size"], args.batch):
            print(json.dumps({"comm_micro_us": row}), flush=True)


if __name__ == "__main__":
    main()
