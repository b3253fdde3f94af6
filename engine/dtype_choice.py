"""``dtype auto``: the faster of bfloat16 and float32 for this model on this machine, measured.

On CUDA, auto is bfloat16 (float16 where the GPU lacks bf16). On the CPU the choice is a
measurement, never a guess from CPU flags: the matrix products of one decoder layer and the LM
head, at the model's own shapes, timed in both dtypes per token (``layers x layer + head``) for
batches of 1, 4, 16 and 32 rows (up to ``max_num_seqs``). The winner is the dtype with the
smaller geometric mean over those batch sizes, so every load, from one stream to a full batch,
weighs alike: with AVX2 kernels bfloat16 measured 2x faster than float32 at one row and 2x
slower at 16-32 (the one-row figure alone would have halved throughput under load). The result
is cached per machine and model shape (``engine.measure_cache``) and logged with the figures.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from engine import measure_cache
from models.layers import linear

log = logging.getLogger("specserve.engine")

CACHE_VERSION = 4  # 3: dtypes timed in alternating rounds; 4: per batch size
DTYPES = ("float32", "bfloat16")
_HEAD_ROWS_MAX = 32768  # time at most this many LM-head rows, scaled to the vocabulary
ROWS = (1, 4, 16, 32)  # batch sizes timed (those up to max_num_seqs)


def auto_dtype(hf_config: dict, device: torch.device, max_num_seqs: int = 64) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    shapes = model_gemm_shapes(hf_config)
    rows = tuple(r for r in ROWS if r <= max(1, max_num_seqs))
    key = {"version": CACHE_VERSION, "machine": measure_cache.machine_signature(device),
           "shapes": shapes, "rows": rows}
    path = measure_cache.cache_path("dtype", key)
    cached = measure_cache.load(path)
    times = None
    if cached is not None:
        try:
            times = {name: [float(t) for t in cached[name]] for name in DTYPES}
            if any(len(t) != len(rows) or min(t) <= 0 for t in times.values()):
                raise ValueError("wrong number of timings")
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring measurement cache %s; measuring again", path)
            times = None
    if times is None:
        times = measure_dtypes(shapes, device, rows=rows)
        measure_cache.save(path, times)
    score = {name: geometric_mean(t) for name, t in times.items()}
    choice = min(score, key=score.get)
    log.info("dtype auto: %s (model matmuls, ms per token at %s rows: float32 %s, bfloat16 %s)",
             choice, "/".join(map(str, rows)),
             "/".join(f"{1e3 * t:.2f}" for t in times["float32"]),
             "/".join(f"{1e3 * t:.2f}" for t in times["bfloat16"]))
    return getattr(torch, choice)


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def model_gemm_shapes(hf: dict) -> dict:
    """``(in, out)`` of the fused projections of one layer, the head, and the layer count."""
    hidden = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    inter = int(hf["intermediate_size"])
    vocab = int(hf["vocab_size"])
    return {
        "layer": [[hidden, (heads + 2 * kv_heads) * head_dim], [heads * head_dim, hidden],
                  [hidden, 2 * inter], [inter, hidden]],
        "head": [hidden, vocab],
        "layers": int(hf["num_hidden_layers"]),
    }


def measure_dtypes(shapes: dict, device: torch.device, names: tuple[str, ...] = DTYPES,
                   rounds: int = 5, rows: tuple[int, ...] = ROWS) -> dict[str, list[float]]:
    """Best seconds per dtype of the model's matrix products for one token, one figure per
    batch size in ``rows``. The dtypes are
    timed in alternating rounds, so a stretch of load on the machine hits both alike (timed
    one after the other, a busy second once made bf16 look 5x slower than float32 here, and
    that answer was cached)."""
    timers = {name: forward_gemm_timer(shapes, getattr(torch, name), device, rows)
              for name in names}
    best = {name: [math.inf] * len(rows) for name in names}
    for _ in range(rounds):
        for name, timer in timers.items():
            best[name] = [min(b, t) for b, t in zip(best[name], timer())]
    return best


def forward_gemm_timer(shapes: dict, dtype: torch.dtype, device: torch.device,
                       rows: tuple[int, ...] = ROWS) -> Callable[[], list[float]]:
    """A function that times the model's matrix products once per batch size in ``rows``
    (seconds per token); built and warmed up here."""
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = shapes["head"]
    head_rows = min(vocab, _HEAD_ROWS_MAX)
    weights = [torch.randn(o, i, generator=gen).to(device=device, dtype=dtype)
               for i, o in shapes["layer"]]
    head = torch.randn(head_rows, hidden, generator=gen).to(device=device, dtype=dtype)
    inputs = [([torch.randn(m, i, generator=gen).to(device=device, dtype=dtype)
                for i, _ in shapes["layer"]],
               torch.randn(m, hidden, generator=gen).to(device=device, dtype=dtype))
              for m in rows]

    def once() -> list[float]:
        out = []
        for m, (layer_in, head_in) in zip(rows, inputs):
            t0 = time.perf_counter()
            for x, w in zip(layer_in, weights):
                linear(x, w)
            t1 = time.perf_counter()
            linear(head_in, head)
            t2 = time.perf_counter()
            out.append((shapes["layers"] * (t1 - t0) + (t2 - t1) * vocab / head_rows) / m)
        return out

    for _ in range(8):  # the first calls of a shape pick and build its kernel (bf16: slow)
        once()
    return once
