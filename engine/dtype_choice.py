"""``dtype auto``: the faster of bfloat16 and float32 for this model on this machine, measured.

On CUDA, auto is bfloat16 (float16 where the GPU lacks bf16). On the CPU the choice is a
measurement, never a guess from CPU flags: the matrix products of one decoder layer and the LM
head, at the model's own shapes, for a decode step (1 row) and a small batch or verify block
(8 rows), timed in both dtypes. The per-token weighting is ``layers x layer + head``. The result
is cached per machine and model shape (``engine.measure_cache``) and logged with both figures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
import time

import torch

from engine import measure_cache

log = logging.getLogger("specserve.engine")

CACHE_VERSION = 3  # 3: dtypes timed in alternating rounds
DTYPES = ("float32", "bfloat16")
_HEAD_ROWS_MAX = 32768  # time at most this many LM-head rows, scaled to the vocabulary


def auto_dtype(hf_config: dict, device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    shapes = model_gemm_shapes(hf_config)
    key = {"version": CACHE_VERSION, "machine": measure_cache.machine_signature(device),
           "shapes": shapes}
    path = measure_cache.cache_path("dtype", key)
    cached = measure_cache.load(path)
    times = None
    if cached is not None:
        try:
            times = {name: float(cached[name]) for name in DTYPES}
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring measurement cache %s; measuring again", path)
    if times is None:
        times = measure_dtypes(shapes, device)
        measure_cache.save(path, times)
    choice = min(times, key=times.get)
    log.info("dtype auto: %s (model matmuls per token: float32 %.2f ms, bfloat16 %.2f ms)",
             choice, 1e3 * times["float32"], 1e3 * times["bfloat16"])
    return getattr(torch, choice)


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
                   rounds: int = 5) -> dict[str, float]:
    """Best seconds per dtype of the model's matrix products for one token. The dtypes are
    timed in alternating rounds, so a stretch of load on the machine hits both alike (timed
    one after the other, a busy second once made bf16 look 5x slower than float32 here, and
    that answer was cached)."""
    timers = {name: forward_gemm_timer(shapes, getattr(torch, name), device) for name in names}
    best = dict.fromkeys(names, float("inf"))
    for _ in range(rounds):
        for name, timer in timers.items():
            best[name] = min(best[name], timer())
    return best


def forward_gemm_timer(shapes: dict, dtype: torch.dtype, device: torch.device,
                       rows: tuple[int, ...] = (1, 8)) -> Callable[[], float]:
    """A function that times the model's matrix products for one token once (seconds,
    averaged over ``rows``); built and warmed up here."""
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

    def once() -> float:
        total = 0.0
        for layer_in, head_in in inputs:
            t0 = time.perf_counter()
            for x, w in zip(layer_in, weights):
                torch.nn.functional.linear(x, w)
            t1 = time.perf_counter()
            torch.nn.functional.linear(head_in, head)
            t2 = time.perf_counter()
            total += shapes["layers"] * (t1 - t0) + (t2 - t1) * vocab / head_rows
        return total / len(rows)

    for _ in range(8):  # the first calls of a shape pick and build its kernel (bf16: slow)
        once()
    return once
