"""Per-layer KV handles over the shared paged pool, and the shared K/V writer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention import cpu_kernel
from attention.dtypes import is_fp8
from attention.groups import GroupSpec


@dataclass(frozen=True)
class LayerKV:
    """One layer's pages in the pool, bound by the engine after allocation.

    ``physical`` is stored in the pool's resolved layout: NHD ``[blocks, 2, bs, H, D]`` or HND
    ``[blocks, 2, H, bs, D]``; ``logical`` is always ``[blocks, 2, bs, H, D]`` (a view).
    The layout and dtype come from the pool and the layer's group, never from a model config.
    """

    name: str
    group: GroupSpec
    layout: str
    physical: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def logical(self) -> torch.Tensor:
        return self.physical if self.layout == "NHD" else self.physical.transpose(2, 3)

    @property
    def dtype(self) -> torch.dtype:
        return self.physical.dtype

    @property
    def block_size(self) -> int:
        return self.group.block_size


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cast to the cache dtype; FP8 divides by the layer scale and clamps to the format's max."""
    if not is_fp8(dtype):
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-fmax, fmax).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Convert cache contents to ``dtype`` for arithmetic (FP8 multiplies by its scale)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    out = x.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


@dataclass(frozen=True)
class SlotIndex:
    """Where a step's new tokens go, computed once per step and reused by every layer."""

    keep: torch.Tensor | None  # indices of the rows with a real slot (None: all rows)
    blocks: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def build(
        cls, slot_mapping: torch.Tensor, block_size: int, device: torch.device | None = None
    ) -> SlotIndex:
        """Split slots into (block, offset) on ``device`` (default: the slots' device).

        Padding rows carry -1 and are dropped by index. The test for padding runs where the
        slot mapping was built (the runner builds it on the host), so a step on an accelerator
        makes no device-to-host sync here, and no layer does boolean-mask indexing."""
        device = slot_mapping.device if device is None else device
        keep = None
        if slot_mapping.numel() and bool((slot_mapping < 0).any()):
            keep = torch.nonzero(slot_mapping >= 0).flatten()
            slot_mapping = slot_mapping.index_select(0, keep)
            keep = keep.to(device)
        slot_mapping = slot_mapping.to(device)
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        return cls(keep, blocks, slot_mapping - blocks * block_size)


def write_kv(
    kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | SlotIndex
) -> None:
    """Write ``k``/``v`` ``[N, H, D]`` to their slots (a ``[N]`` long slot mapping or a
    prebuilt ``SlotIndex``); negative slots (padding) are skipped."""
    if k.shape[0] == 0:
        return
    idx = slots if isinstance(slots, SlotIndex) else SlotIndex.build(slots, kv.block_size)
    if idx.keep is not None:
        k, v = k.index_select(0, idx.keep), v.index_select(0, idx.keep)
    ops = _store_ops(kv, k, v)
    if ops is not None:  # the same copies in one call (no stack, no index_put)
        ops.store_kv(kv.logical, k, v, idx.blocks, idx.offsets)
        return
    kv_new = torch.stack((quantize(k, kv.dtype, kv.k_scale), quantize(v, kv.dtype, kv.v_scale)), 1)
    kv.logical[idx.blocks, :, idx.offsets] = kv_new  # [N, 2, H, D]


def _store_ops(kv: LayerKV, k: torch.Tensor, v: torch.Tensor):
    """The compiled CPU writer when it applies: a CPU cache in the dtype of ``k`` and ``v``
    (nothing to quantize), no gradient recorded, last dims contiguous; else ``None``."""
    if (kv.physical.device.type != "cpu" or k.dtype != kv.dtype or v.dtype != kv.dtype
            or torch.is_grad_enabled() or k.stride(-1) != 1 or v.stride(-1) != 1):
        return None
    return cpu_kernel.load()


def gather_kv(
    kv: LayerKV, block_tables: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather pages for padded block tables ``[B, nblk]`` as ``[B, H, nblk*bs, D]`` K and V.

    NHD pages gather in one copy each and are returned as strided views; HND needs a second
    copy to put the token axis next to the head axis.
    """
    b, nblk = block_tables.shape
    h, d, bs = kv.group.num_kv_heads, kv.group.head_size, kv.block_size
    out = []
    for which, scale in ((0, kv.k_scale), (1, kv.v_scale)):
        pages = kv.physical[:, which][block_tables]  # [B, nblk, bs, H, D] or [B, nblk, H, bs, D]
        if kv.layout == "NHD":
            x = pages.view(b, nblk * bs, h, d).transpose(1, 2)
        else:
            x = pages.transpose(1, 2).reshape(b, h, nblk * bs, d)
        out.append(dequantize(x, out_dtype, scale))
    return out[0], out[1]
