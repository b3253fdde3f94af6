"""bfloat16 products from the compiled AVX2 kernel (``attention/csrc/linear_ops.cpp``), for CPUs
where oneDNN has no native bf16 product (AVX2 with FMA, no AVX512_BF16).

There PyTorch has no packed bf16 weight and its plain bf16 product slows down with every row:
a SmolLM2-135M step's products took 15.6 ms for one row and 109 ms for eight in bf16, against
24.6-36.1 ms for one to eight rows in packed float32 (2-vCPU AMD EPYC, Zen 3, AVX2 only,
``benchmarks/bench_linear.py``), so ``dtype auto`` chose float32 and every token read 540 MB
of weights. This kernel packs each weight once into panels of 16 output columns, reads them as
bf16 and widens them in registers: the same products took 9.5 ms for one row, 20.1 for eight
and 115 for 64 (packed float32: 130).

Each output element is one fused multiply-add chain over the inputs in order, so a row's bits
do not depend on the row count, its batch mates or the thread split: the weight is wrapped as a
:class:`models.onednn.DirectPacked`, whose products are row-count invariant by contract.
``SPECSERVE_PANEL_LINEAR=0`` turns this path off (for side-by-side measurements).

:func:`pack_pairs` is the AVX512_BF16 kernel of the same file: panels of input pairs, one
``vdpbf16ps`` (two bf16 products summed into a float) per row and 64-byte load, the activations
broadcast as they lie in memory. Also row-count invariant. On a 2-vCPU AVX-512-BF16 EPYC (Zen 4,
no AMX) a SmolLM2-135M step's products took 10.5 / 11.9 / 13.5 / 18.2 ms at 1 / 4 / 8 / 16 rows
against 15.3 / 13.1 / 15.2 / 18.7 for oneDNN's (its one row padded to four as served: 13.1).
Whether a model uses it is measured per machine (``engine.dtype_choice.auto_products``);
``SPECSERVE_PAIR_PRODUCTS=0`` leaves it out of that choice.
"""

from __future__ import annotations

import os

import torch

from attention import cpu_kernel
from models.onednn import DirectPacked


def enabled() -> bool:
    return os.environ.get("SPECSERVE_PANEL_LINEAR", "1") not in ("0", "false", "no", "off")


class PanelLinear:
    """A ``[out, in]`` bf16 weight as ``[ceil(out/16), in, 16]`` panels (AVX2), or with
    ``pairs`` as ``[ceil(out/16), in/2, 16]`` panels of input pairs (AVX512_BF16);
    ``forward(x, bias)`` takes bf16 rows ``[..., in]``."""

    __slots__ = ("panels", "out_features", "in_features", "_forward")

    def __init__(self, ops, weight: torch.Tensor, pairs: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().contiguous()
        if pairs:
            self.panels = ops.bf16_dp_linear_pack(weight)
            self._forward = ops.bf16_dp_linear
        else:
            self.panels = ops.bf16_linear_pack(weight)
            self._forward = ops.bf16_linear

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._forward(x, self.panels, self.out_features, bias)


def pack(weight: torch.Tensor) -> DirectPacked | None:
    """``weight`` packed for the kernel, or ``None`` where it does not serve: disabled, not a
    2-D bf16 CPU weight, or the kernels not built (no compiler) or built without AVX2 and FMA."""
    if not enabled() or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or \
            weight.dim() != 2:
        return None
    ops = cpu_kernel.load()
    if ops is None or not ops.bf16_linear_available():
        return None
    return DirectPacked(PanelLinear(ops, weight), weight.dtype)


def pairs_enabled() -> bool:
    return os.environ.get("SPECSERVE_PAIR_PRODUCTS", "1") not in ("0", "false", "no", "off")


def pairs_available() -> bool:
    """Whether the AVX512_BF16 pair kernel is built here (and not switched off)."""
    if not pairs_enabled():
        return False
    ops = cpu_kernel.load()
    return ops is not None and ops.bf16_dp_linear_available()


def pack_pairs(weight: torch.Tensor) -> DirectPacked | None:
    """``weight`` packed for the AVX512_BF16 pair kernel, or ``None`` where it does not serve:
    not a 2-D bf16 CPU weight with an even number of inputs, or the kernel not built."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or \
            weight.shape[1] % 2 or not pairs_available():
        return None
    return DirectPacked(PanelLinear(cpu_kernel.load(), weight, pairs=True), weight.dtype)
