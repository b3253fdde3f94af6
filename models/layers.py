"""Building blocks shared by the target and draft models."""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from attention import cpu_kernel
from models import onednn, panel_linear
from models.onednn import DirectPacked

_REDUCED = (torch.bfloat16, torch.float16)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def cpu_ops(*tensors: torch.Tensor):
    """The compiled CPU layer ops (``attention/csrc/layer_ops.cpp``) when every tensor is a CPU
    float32/bfloat16/float16 tensor of one dtype, no gradient is recorded (they have no
    backward: training the drafts takes PyTorch's ops) and the kernels build here, else
    ``None``. Each row they compute does not depend on the row count, as :func:`linear`'s do
    not; they save a decoder layer about twenty small PyTorch ops."""
    # (asked a hundred times a step: ``is_cpu`` and dtype identity, not ``.device`` objects and a
    # generator, took 4% of a one-row SmolLM2-135M step on a 2-vCPU AVX2 EPYC)
    first = tensors[0]
    dtype = first.dtype
    if not first.is_cpu or dtype not in _FLOATS or torch.is_grad_enabled():
        return None
    for t in tensors[1:]:
        if t.dtype is not dtype or not t.is_cpu:
            return None
    return cpu_kernel.load()



def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``, the same indices (the first of equal maxima): on the CPU from the
    compiled kernel (``attention/csrc/sampling_ops.cpp``). Over the 49,152-token vocabulary it
    took 8-32 us for 1-8 rows where PyTorch took 73-288 us in float32 and 182-723 us in
    bfloat16 (2-vCPU Xeon, ``benchmarks/bench_sampler.py``); a verification step's rows and a
    draft's block all pass through one."""
    ops = cpu_ops(x) if x.dim() >= 1 and x.numel() > 0 and x.is_contiguous() else None
    return x.argmax(dim=-1) if ops is None else ops.argmax_rows(x)

Packed = torch.Tensor | DirectPacked  # what pack_weight returns


PRODUCTS = ("onednn", "pairs")  # how bf16 weights are multiplied on the CPU (pack_weight)


def pack_weight(weight: torch.Tensor, products: str = "onednn") -> Packed | None:
    """A ``[out, in]`` weight packed for the CPU's oneDNN products in :func:`linear`, or ``None``
    where it cannot be (not on the CPU, another dtype, or a CPU without the ISA it needs, e.g.
    bf16 without AVX-512). Where the direct path builds and its kernel's rows do not depend on
    the row count (:func:`models.onednn.pack`), a :class:`DirectPacked`; else, for bf16 on a CPU
    with AVX2 and FMA, one for the compiled panel kernel (:func:`models.panel_linear.pack`, also
    row-count invariant); else PyTorch's own packed copy (``mkldnn._reorder_linear_weight``).
    ``products="pairs"``: a bf16 weight goes to the AVX512_BF16 pair kernel
    (:func:`models.panel_linear.pack_pairs`, row-count invariant) where it is built, before
    all of those (the engine measures which is faster, ``engine.dtype_choice.auto_products``).

    A plain ``F.linear`` re-blocks the weight on every call (bf16) or goes to MKL (fp32). The
    packed products of a SmolLM2-135M step took 0.62-0.82x the time for 1-64 rows in bf16 with
    bitwise the same results, and 0.38-0.66x in fp32, where they are also row-count invariant
    (MKL's fp32 rows change from 1 to 11 rows); 2-core AVX-512-BF16 EPYC,
    ``benchmarks/bench_linear.py``."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if products not in PRODUCTS:
        raise ValueError(f"unknown products {products!r}; valid: {', '.join(PRODUCTS)}")
    direct = (panel_linear.pack_pairs(weight) if products == "pairs" else None) or \
        onednn.pack(weight) or panel_linear.pack(weight)
    if direct is not None:
        return direct
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:
        return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    packed: Packed | None = None,
    min_rows: int = 2,
) -> torch.Tensor:
    """``F.linear`` over rows ``x [N, ..., in]`` whose every row comes out bitwise the same however
    many rows the product has, so a token's logits do not depend on its batch mates or on
    whether it is decoded alone or verified in a block of drafts. ``packed`` (from
    :func:`pack_weight`) replaces ``weight``.

    On the CPU, PyTorch's oneDNN path multiplies a single row with a matrix-vector kernel that
    rounds differently from the matrix-matrix kernel used from two rows on (measured with
    SmolLM2-135M's real activations on an AVX-512-BF16 EPYC: 1,217 of 48,400 one-row bf16
    products differed in the last bit, all in ``down_proj``; from two rows on none did, at any
    row count or offset; packed fp32 ``down_proj`` rows differ the same way). So fewer than
    ``min_rows`` rows (at least 2 there) are multiplied padded to ``min_rows`` with copies of
    the first row: the same bits as any other row count from two on. A :class:`DirectPacked`
    weight is only made where every row count gives the same bits, so it pads only if
    ``min_rows`` asks (a speed choice, :func:`fastest_min_rows`).
    """
    n = x.shape[0]
    direct = isinstance(packed, DirectPacked)
    need = min_rows if direct else max(min_rows, 2)
    if 0 < n < need and x.device.type == "cpu" and (packed is not None or x.dtype in _REDUCED):
        rest = x.shape[1:]
        padded = x.expand(need, *rest) if n == 1 else torch.cat(
            (x, x[:1].expand(need - n, *rest)))
        return linear(padded, weight, bias, packed, min_rows)[:n]
    if direct:
        return packed(x, bias)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


PAD_CHOICES = (2, 4)  # row counts a single row may be padded to (both give the same bits)
DIRECT_PAD_CHOICES = (1, 2, 4)  # the same for DirectPacked weights (any row count does)


def fastest_min_rows(products: list[Packed], rounds: int = 5) -> int:
    """Of :data:`PAD_CHOICES` (:data:`DIRECT_PAD_CHOICES` when every product is a
    :class:`DirectPacked`), the padding under which one row through ``products`` (packed
    ``[out, in]`` weights in the order a step runs them, so each comes from memory as in a real
    step) takes least time: the median of ``rounds`` alternating timings.

    oneDNN picks a different kernel per row count: on a 2-core AVX-512-BF16 EPYC one row of a
    SmolLM2-135M step's products took 16.8-17.3 ms padded to 2 rows and 13.5-13.6 ms padded to
    4 in bf16 (36.1 vs 24.6 ms in fp32); with AVX2 kernels fp32 took 37.1 at 2 and 39.4 at 4."""
    if not products:
        return PAD_CHOICES[0]
    choices = DIRECT_PAD_CHOICES if all(isinstance(p, DirectPacked) for p in products) \
        else PAD_CHOICES
    inputs = {w.shape[1]: torch.zeros(1, w.shape[1], dtype=w.dtype) for w in products}

    def run(rows: int) -> float:
        start = time.perf_counter()
        for packed in products:
            linear(inputs[packed.shape[1]], None, packed=packed, min_rows=rows)
        return time.perf_counter() - start

    timings: dict[int, list[float]] = {rows: [] for rows in choices}
    with torch.inference_mode():
        for rows in choices:
            run(rows)  # warm-up: oneDNN builds its kernel for this shape once
        for _ in range(rounds):
            for rows in choices:
                timings[rows].append(run(rows))
    return min(choices, key=lambda rows: statistics.median(timings[rows]))


class PackedWeight:
    """Mixin for a module with a ``weight`` it multiplies with :func:`linear`: :meth:`pack` swaps
    the weight for oneDNN's packed copy, for good. The plain weight is dropped (no second copy
    of the model in memory), so pack only once weights are final. ``min_rows``: the padding of
    small products (:func:`linear`), set by the model once packed."""

    packed: Packed | None = None
    min_rows: int = 2

    def pack(self, products: str = "onednn") -> None:
        packed = pack_weight(self.weight, products)
        if packed is not None:
            self.packed = packed
            self.weight = None


class Linear(PackedWeight, nn.Linear):
    """``nn.Linear`` computed with :func:`linear` (row results independent of the row count)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if type(packed) is DirectPacked and x.shape[0] >= self.min_rows:
            return packed.op.forward(x, self.bias)  # what linear() does here, three calls fewer
        return linear(x, self.weight, self.bias, packed, self.min_rows)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Hugging Face Llama/Qwen do."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_ops(x, self.weight)
        if ops is not None:
            return ops.rms_norm(x.contiguous(), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(residual + x), residual + x)``, in one pass on the CPU."""
        ops = cpu_ops(x, residual, self.weight)
        if ops is not None:
            return tuple(ops.add_rms_norm(x.contiguous(), residual.contiguous(), self.weight,
                                          self.eps))
        residual = residual + x
        return self(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for rotary embeddings (``default`` or ``llama3`` scaling)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return inv_freq
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE from a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        # non-persistent buffers, so ``Module.to(device)`` moves them; ``_apply`` below keeps
        # them float32 when the model is cast (``Module.to(dtype)`` must not round the table)
        # ``sin`` carries rotate-half's sign: its first half is negated (see apply_rotary)
        sin = emb.sin()
        sin[:, : sin.shape[-1] // 2].neg_()
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.max_positions = max_positions
        # the tables rounded to a model dtype, made on first use (rounding whole tables gives
        # every row the bits of rounding it alone, one op per lookup fewer)
        self._rounded: dict[torch.dtype, Rope] = {}

    def _apply(self, fn, recurse=True):
        tables = {name: self._buffers[name] for name in ("cos", "sin")}
        super()._apply(fn, recurse)
        for name, table in tables.items():
            moved = self._buffers[name]
            if moved.dtype != table.dtype:  # a cast: keep float32 on the new device
                self._buffers[name] = table.to(moved.device)
        self._rounded = {}
        return self

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos/sin rows for ``positions`` ``[N]``, shaped ``[N, 1, D]`` to broadcast over heads.

        Computed once per forward pass and shared by every layer; ``sin``'s first half is
        negated, as :func:`apply_rotary` expects."""
        tables = self._rounded.get(dtype)
        if tables is None:
            tables = self._rounded[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        cos, sin = tables
        positions = positions.to(cos.device)  # (a no-op where they are already there)
        return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]


Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``sin`` from :meth:`RotaryEmbedding.lookup`,
    whose first half is negated in the table: ``x2 * -sin`` has the bits of ``-x2 * sin``, one
    op fewer per call."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


class SwiGLU(nn.Module):
    """Gate and up projections fused into one matmul, then SiLU(gate) * up and down."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # (direct calls: see models/llama.py)
        ops = cpu_ops(gate_up)
        if ops is not None:
            return self.down_proj.forward(ops.silu_mul(gate_up.contiguous()))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)
