"""The greedy choice of a step: PyTorch's ``argmax`` against the compiled one
(``models.layers.argmax``), and the sampler's whole call for a batch of greedy requests.

Scores are random, shaped as the LM head's (``[rows, 49152]``) and the shipped draft's
reduced vocabulary (``[rows, 8192]``), in float32 and bfloat16. Each cell is the median of
``--rounds`` timings of ``--calls`` calls in a row (warm caches: in a step the scores were just
written, so they are). The sampler rows are ``--requests`` greedy requests verifying ``k`` drafts
each (``k + 1`` rows a request). The indices of the two argmax ways are compared too.

    python benchmarks/bench_sampler.py --rows 1 8 32 56 --ks 0 3 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.request import Request  # noqa: E402
from engine.sampler import RowGroup, Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from models.layers import argmax  # noqa: E402

VOCABS = (49152, 8192)  # the target's vocabulary, the shipped draft's


def timed(fn, calls: int, rounds: int) -> float:
    """Median seconds of one call."""
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out)


def compare_argmax(rows: int, vocab: int, dtype: torch.dtype, calls: int, rounds: int) -> dict:
    scores = (torch.randn(rows, vocab) * 4).to(dtype)
    with torch.inference_mode():
        same = torch.equal(argmax(scores), scores.argmax(dim=-1))
        torch_s = timed(lambda: scores.argmax(dim=-1), calls, rounds)
        compiled_s = timed(lambda: argmax(scores), calls, rounds)
    return {"torch": torch_s, "compiled": compiled_s, "same": same}


def time_sampler(requests: int, k: int, vocab: int, dtype: torch.dtype, calls: int,
                 rounds: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1000)
    reqs = [Request(f"r{i}", list(range(100)), params) for i in range(requests)]
    groups = [RowGroup(r, i * (k + 1), [5] * k) for i, r in enumerate(reqs)]
    logits = torch.randn(requests * (k + 1), vocab).to(dtype)
    sampler = Sampler()
    with torch.inference_mode():
        return timed(lambda: sampler(logits, groups), calls, rounds)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 56])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 3, 7])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtypes]
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; us per call")
    print("| scores | rows | PyTorch argmax | compiled | same indices |")
    print("|---|---|---|---|---|")
    for vocab in VOCABS:
        for dtype in dtypes:
            for rows in args.rows:
                r = compare_argmax(rows, vocab, dtype, args.calls, args.rounds)
                print(f"| [rows, {vocab}] {str(dtype).removeprefix('torch.')} | {rows} | "
                      f"{r['torch'] * 1e6:.0f} | {r['compiled'] * 1e6:.0f} | {r['same']} |")
    print()
    print(f"| sampler call, {args.requests} greedy requests | k | us per call |")
    print("|---|---|---|")
    for dtype in dtypes:
        for k in args.ks:
            s = time_sampler(args.requests, k, VOCABS[0], dtype, args.calls, args.rounds)
            print(f"| scores in {str(dtype).removeprefix('torch.')} | {k} | {s * 1e6:.0f} |")


if __name__ == "__main__":
    main()
