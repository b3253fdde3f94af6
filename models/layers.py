"""Building blocks shared by the target and draft models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


_REDUCED = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over rows ``x [N, ..., in]`` whose every row comes out bitwise the same however
    many rows the product has, so a token's logits do not depend on its batch mates or on
    whether it is decoded alone or verified in a block of drafts.

    On the CPU, oneDNN multiplies a single bf16/fp16 row with a matrix-vector kernel that
    rounds differently from the matrix-matrix kernel used from two rows on (measured with
    SmolLM2-135M's real activations on an AVX-512-BF16 EPYC: 1,217 of 48,400 one-row products
    differed in the last bit, all in ``down_proj``; from two rows on none did, at any row count
    or offset; under AVX2 kernels none did either). So one row is multiplied as two identical
    rows: the extra row costs nothing measurable in a product bound by reading the weights.
    """
    if x.shape[0] == 1 and x.dtype in _REDUCED and x.device.type == "cpu":
        return F.linear(x.expand(2, *x.shape[1:]), weight, bias)[:1]
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` computed with :func:`linear` (row results independent of the row count)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Hugging Face Llama/Qwen do."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


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
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.max_positions = max_positions

    def _apply(self, fn, recurse=True):
        tables = {name: self._buffers[name] for name in ("cos", "sin")}
        super()._apply(fn, recurse)
        for name, table in tables.items():
            moved = self._buffers[name]
            if moved.dtype != table.dtype:  # a cast: keep float32 on the new device
                self._buffers[name] = table.to(moved.device)
        return self

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos/sin rows for ``positions`` ``[N]``, shaped ``[N, 1, D]`` to broadcast over heads.

        Computed once per forward pass and shared by every layer."""
        return (self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :])


Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """Gate and up projections fused into one matmul, then SiLU(gate) * up and down."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
