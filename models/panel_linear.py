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
"""

from __future__ import annotations

import os

import torch

from attention import cpu_kernel
from models.onednn import DirectPacked


def enabled() -> bool:
    return os.environ.get("SPECSERVE_PANEL_LINEAR", "1") not in ("0", "false", "no", "off")


class PanelLinear:
    """A ``[out, in]`` bf16 weight as ``[ceil(out/16), in, 16]`` panels; ``forward(x, bias)``
    takes bf16 rows ``[..., in]``."""

    __slots__ = ("panels", "out_features", "in_features", "_ops")

    def __init__(self, ops, weight: torch.Tensor) -> None:
        self._ops = ops
        self.out_features, self.in_features = weight.shape
        self.panels = ops.bf16_linear_pack(weight.detach().contiguous())

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._ops.bf16_linear(x, self.panels, self.out_features, bias)


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
