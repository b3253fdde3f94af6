"""``dtype auto``: the faster of bfloat16 and float32 for this model on this machine, measured.

On CUDA, auto is bfloat16 (float16 where the GPU lacks bf16). On the CPU the choice is a
measurement, never a guess from CPU flags: the matrix products of one decoder layer and the LM
head, at the model's own shapes, for a decode step (1 row) and a small batch or verify block
(8 rows), timed in both dtypes. The per-token weighting is ``layers x layer + head``. The result
is cached per machine and model shape (``engine.measure_cache``) and logged with both figures.
"""

from __future__ import annotations

import logging
import time

import torch

from engine import measure_cache

log = logging.getLogger("specserve.engine")

CACHE_VERSION = 2
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
            times = {name: float(cached[name]) for name in ("float32", "bfloat16")}
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring measurement cache %s; measuring again", path)
    if times is None:
        times = {name: time_forward_gemms(shapes, getattr(torch, name), device)
                 for name in ("float32", "bfloat16")}
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


def time_forward_gemms(shapes: dict, dtype: torch.dtype, device: torch.device,
                       rows: tuple[int, ...] = (1, 8), repeats: int = 5) -> float:
    """Seconds of the model's matrix products for one token, averaged over ``rows``."""
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = shapes["head"]
    head_rows = min(vocab, _HEAD_ROWS_MAX)
    weights = [torch.randn(o, i, generator=gen).to(device=device, dtype=dtype)
               for i, o in shapes["layer"]]
    head = torch.randn(head_rows, hidden, generator=gen).to(device=device, dtype=dtype)
    total = 0.0
    for m in rows:
        inputs = [torch.randn(m, i, generator=gen).to(device=device, dtype=dtype)
                  for i, _ in shapes["layer"]]
        head_in = torch.randn(m, hidden, generator=gen).to(device=device, dtype=dtype)

        def layer() -> None:
            for x, w in zip(inputs, weights):
                torch.nn.functional.linear(x, w)

        layer_t = _best_time(layer, repeats)
        head_t = _best_time(lambda: torch.nn.functional.linear(head_in, head), repeats)
        total += shapes["layers"] * layer_t + head_t * vocab / head_rows
    return total / len(rows)


def _best_time(fn, repeats: int, warmup: int = 8) -> float:
    for _ in range(warmup):  # the first calls of a shape pick and build its kernel (bf16: slow)
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
