"""``dtype auto``: the faster of bfloat16 and float32 for this model on this machine, measured.

On CUDA, auto is bfloat16 (float16 where the GPU lacks bf16). On the CPU the choice is a
measurement, never a guess from CPU flags: steps of a few decoder layers (the model's own
shapes, random weights, attention over a paged cache, every elementwise op) and the LM head,
timed in both dtypes per token for decode batches of 1, 4, 16 and 32 rows (up to
``max_num_seqs``) and for a 128-token prefill step. The winner serves a request (a prompt
token plus a generated token) faster in the geometric mean over the batch sizes, so one stream
and a full batch weigh alike. With PyTorch's AVX2 kernels bfloat16 decoded one stream 2x
faster than float32 but ran prefill and batches of 16-32 about 2x slower; a one-row figure alone
would have halved throughput under load. (Since bf16 products there come from this project's
panel kernel, ``models/panel_linear.py``, bfloat16 is faster at every size on an AVX2 EPYC:
16.2 / 5.3 / 3.4 / 2.9 / 2.5 ms per token at 1 / 4 / 16 / 32 rows and a prefill step, against
float32's 36.6 / 10.5 / 5.0 / 3.8 / 2.9.) The result is cached per machine and model shape
(``engine.measure_cache``) and logged with the figures.

``auto_products``: where bfloat16 serves on a CPU with the AVX512_BF16 pair kernel
(``models.panel_linear.pack_pairs``), the same decode steps are timed with the bf16 weights
multiplied by it and by oneDNN (``models.layers.pack_weight``), and the faster by the same
score is kept, cached alike. Both give every row the same bits whatever the row count, but
not the same bits as each other, so the choice is made once per machine, not at every start.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable

import torch

from engine import measure_cache
from models.layers import PRODUCTS, linear, pack_weight

log = logging.getLogger("specserve.engine")

CACHE_VERSION = 11  # 3: alternating rounds; 4: per batch size; 5: a whole layer, not matmuls;
# 6: packed weights; 7: fused layer ops, attention over all kv heads per task; 8: row padding;
# 9: AVX2 kernels' vectors kept in registers (their attention ~4x faster); 10: direct oneDNN;
# 11: bf16 products from the AVX2 panel kernel where oneDNN has no native bf16
DTYPES = ("float32", "bfloat16")
_HEAD_ROWS_MAX = 32768  # time at most this many LM-head rows, scaled to the vocabulary
CONTEXT = 256  # tokens of context per row in the timed steps
TIMED_LAYERS = 4  # decoder layers timed, scaled to the model's
ROWS = (1, 4, 16, 32)  # decode batch sizes timed (those up to max_num_seqs)
PREFILL = 128  # tokens of one step standing for prompt processing (a prefill chunk)


def on_a_thread_of_its_own(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` run on a thread that ends when it returns; its result is returned
    (its exception raised) here.

    GNU OpenMP keeps a team of worker threads for every thread that has opened a parallel
    region, for as long as that thread lives, and once the process holds more of them than it
    has CPUs its workers stop spinning between regions: every region then waits for its
    workers to be woken. The server builds its config (this measurement) on the main thread and
    runs the engine on another, so a measurement made on the main thread slowed every later
    step (2-vCPU Xeon: one-row steps 28.6 ms against 19.4 at startup calibration, held-out chat
    49 against 76 tok/s over HTTP; a [33, 3072] add 87 against 15 us). A thread that ends takes
    its team with it."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run, name="specserve-measure")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def auto_dtype(hf_config: dict, device: torch.device, max_num_seqs: int = 64) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    shapes = model_gemm_shapes(hf_config)
    rows = tuple(r for r in ROWS if r <= max(1, max_num_seqs)) + (PREFILL,)
    key = {"version": CACHE_VERSION, "machine": measure_cache.machine_signature(device),
           "shapes": shapes, "rows": rows}
    path = measure_cache.cache_path("dtype", key)
    times = cached_times(path, DTYPES, len(rows))
    if times is None:
        times = on_a_thread_of_its_own(measure_dtypes, hf_config, device, rows=rows)
        measure_cache.save(path, times)
    score = {name: request_score(t) for name, t in times.items()}
    choice = min(score, key=score.get)
    log.info("dtype auto: %s (ms per token, decode at %s rows / a %d-token prefill step: "
             "float32 %s, bfloat16 %s)", choice, "/".join(map(str, rows[:-1])), PREFILL,
             "/".join(f"{1e3 * t:.2f}" for t in times["float32"]),
             "/".join(f"{1e3 * t:.2f}" for t in times["bfloat16"]))
    return getattr(torch, choice)


PRODUCTS_CACHE_VERSION = 1


def auto_products(hf_config: dict, device: torch.device, dtype: torch.dtype,
                  max_num_seqs: int = 64) -> str:
    """How bf16 weights are multiplied (``models.layers.PRODUCTS``): ``"pairs"`` where the
    AVX512_BF16 pair kernel is built and its decode steps scored faster than oneDNN's (measured
    once per machine and model shape, cached), else ``"onednn"``."""
    from models import panel_linear

    if device.type != "cpu" or dtype != torch.bfloat16 or not panel_linear.pairs_available():
        return "onednn"
    rows = tuple(r for r in ROWS if r <= max(1, max_num_seqs)) + (PREFILL,)
    key = {"version": PRODUCTS_CACHE_VERSION, "machine": measure_cache.machine_signature(device),
           "shapes": model_gemm_shapes(hf_config), "rows": rows}
    path = measure_cache.cache_path("products", key)
    times = cached_times(path, PRODUCTS, len(rows))
    if times is None:
        times = on_a_thread_of_its_own(measure_dtypes, hf_config, device, rows=rows,
                                       names=("bfloat16",), products=PRODUCTS)
        times = {name: times[f"bfloat16/{name}"] for name in PRODUCTS}
        measure_cache.save(path, times)
    score = {name: request_score(t) for name, t in times.items()}
    choice = min(PRODUCTS, key=score.get)  # a tie keeps oneDNN
    log.info("bf16 products: %s (ms per token, decode at %s rows / a %d-token prefill step: %s)",
             choice, "/".join(map(str, rows[:-1])), PREFILL,
             ", ".join(f"{name} " + "/".join(f"{1e3 * t:.2f}" for t in times[name])
                       for name in PRODUCTS))
    return choice


def cached_times(path, names: tuple[str, ...], count: int) -> dict[str, list[float]] | None:
    """The cached timings at ``path``, ``count`` positive figures for each of ``names``;
    ``None`` when missing or unusable (logged), to be measured again."""
    cached = measure_cache.load(path)
    if cached is None:
        return None
    try:
        times = {name: [float(t) for t in cached[name]] for name in names}
        if any(len(t) != count or min(t) <= 0 for t in times.values()):
            raise ValueError("wrong number of timings")
        return times
    except (KeyError, TypeError, ValueError):
        log.warning("ignoring measurement cache %s; measuring again", path)
        return None


def request_score(times: list[float]) -> float:
    """``times``: seconds per token of decode steps at each batch size, then of a prefill step.
    A request costs about a prompt token's time plus a generated token's time per token (chat
    prompts and answers run to similar lengths); the score is the geometric mean of that sum
    over the batch sizes, so one stream and a full batch weigh alike."""
    *decode, prefill = times
    return math.exp(sum(math.log(d + prefill) for d in decode) / len(decode))


def model_gemm_shapes(hf: dict) -> dict:
    """``(in, out)`` of the fused projections of one layer, the head, and the layer count (the
    model's part of the measurement's cache key)."""
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


def measure_dtypes(hf: dict, device: torch.device, names: tuple[str, ...] = DTYPES,
                   rounds: int = 3, rows: tuple[int, ...] = ROWS,
                   products: tuple[str, ...] | None = None) -> dict[str, list[float]]:
    """Best seconds per dtype of a decode step per token, one figure per batch size in
    ``rows``. The dtypes are timed in alternating rounds, so a stretch of load on the machine
    hits both alike (timed one after the other, a busy second once made bf16 look 5x slower
    than float32 here, and that answer was cached). With ``products``, each dtype once per way
    of packing its weights (``models.layers.pack_weight``), keyed ``"dtype/products"``."""
    if products is None:
        timers = {name: decode_step_timer(hf, getattr(torch, name), device, rows)
                  for name in names}
    else:
        timers = {f"{name}/{way}": decode_step_timer(hf, getattr(torch, name), device, rows,
                                                     products=way)
                  for name in names for way in products}
    names = tuple(timers)
    best = {name: [math.inf] * len(rows) for name in names}
    for _ in range(rounds):
        for name, timer in timers.items():
            best[name] = [min(b, t) for b, t in zip(best[name], timer())]
    return best


def decode_step_timer(hf: dict, dtype: torch.dtype, device: torch.device,
                       rows: tuple[int, ...] = ROWS,
                       products: str = "onednn") -> Callable[[], list[float]]:
    """A function that times a decode step of the model once per batch size in ``rows``
    (seconds per token); built and warmed up here.

    The step is real, not the matrix products alone: ``TIMED_LAYERS`` decoder layers of the
    model's own shapes (random weights) with their paged KV cache in the same dtype, attention
    over ``CONTEXT`` tokens per row and every elementwise op, scaled to the number of layers,
    plus the LM head. Elementwise work decides too: with AVX2 kernels the bf16 matrix products
    of 4 rows took 29 ms where a whole 4-row bf16 step took 90 ms. The ``PREFILL`` entry is
    timed the same way, as 128 one-token rows: the matrix products of a 128-token prefill
    chunk, with decode-shaped attention."""
    from attention.backends.base import AttentionBatch
    from attention.backends.torch_backend import TorchBackend
    from attention.groups import LayerKVSpec, build_groups
    from engine.kv_pool import KVPool
    from engine.runner import slots_for
    from models.llama import LlamaForCausalLM
    from models.loader import decoder_config

    full = decoder_config(hf)
    # a few consecutive layers, each with its own weights, as in the real model (one layer
    # timed again and again keeps its weights in cache and measured 2x off the real step)
    layers = min(full.num_layers, TIMED_LAYERS)
    cfg = dataclasses.replace(full, num_layers=layers, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg, CONTEXT + 8).to(dtype).eval()
    head = model.embed_tokens.weight[:min(full.vocab_size, _HEAD_ROWS_MAX)]
    model.pack_weights(head=False, products=products)  # as loading does; the head timed is a
    head_packed = pack_weight(head, products)  # slice, packed here
    head_scale = full.vocab_size / head.shape[0]
    block = 16
    names = [f"layers.{i}" for i in range(layers)]
    specs = [LayerKVSpec(n, "target", cfg.num_kv_heads, cfg.head_dim, "auto", block) for n in names]
    blocks_per_row = -(-(CONTEXT + 1) // block)
    pages_rows = min(max(rows), max(ROWS))
    pool = KVPool(list(build_groups(specs, dtype).values()), pages_rows * blocks_per_row, "NHD",
                  device)
    kv = pool.layers(names)
    backend = TorchBackend()
    steps = []
    for m in rows:
        # rows past the first few share pages: a timing needs their reads, not their contents
        first = [r % pages_rows * blocks_per_row for r in range(m)]
        tables = [list(range(f, f + blocks_per_row)) for f in first]
        batch = AttentionBatch(
            q_lens=(1,) * m, kv_lens=(CONTEXT + 1,) * m, block_tables=tuple(map(tuple, tables)),
            slot_mapping=torch.cat([slots_for(t, CONTEXT, CONTEXT + 1, block) for t in tables]),
            causal=True, block_size=block)
        meta = backend.build_metadata(batch, device)
        pos = torch.full((m,), CONTEXT, dtype=torch.long, device=device)
        h = torch.randn(m, cfg.hidden_size, device=device).to(dtype)
        steps.append((meta, model.rotary.lookup(pos, dtype), h))

    @torch.inference_mode()
    def once() -> list[float]:
        out = []
        for m, (meta, rope, h) in zip(rows, steps):
            t0 = time.perf_counter()
            x = h
            for layer, layer_kv in zip(model.layers, kv):
                x = layer(rope, x, meta, layer_kv)
            t1 = time.perf_counter()
            linear(model.norm(x), head, packed=head_packed, min_rows=model.min_rows)
            t2 = time.perf_counter()
            out.append((full.num_layers / layers * (t1 - t0) + (t2 - t1) * head_scale) / m)
        return out

    for _ in range(2):  # the first calls of a shape pick and build its kernels (bf16: slow)
        once()
    return once
