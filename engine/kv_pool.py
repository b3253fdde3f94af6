"""The shared paged KV pool: one block-id space, one byte budget, per-layer pages.

Every layer of every attention group owns a page tensor of ``num_blocks`` blocks in its
group's dtype and the pool's resolved layout, so the target's and the draft's K/V never overlap.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attention.groups import GroupSpec
from attention.kv import LayerKV


class KVBudgetError(ValueError):
    """The KV budget cannot hold one request of ``max_model_len``."""


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    bytes_per_block: int


def plan_pool(
    groups: Sequence[GroupSpec],
    budget_bytes: int,
    max_model_len: int,
    lookahead: int,
    num_blocks_override: int | None = None,
    reserved_blocks: int = 0,
) -> PoolPlan:
    """Size the pool: ``num_blocks = budget // bytes_per_block`` (or the override), of which
    the last ``reserved_blocks`` are never handed to requests (CUDA graphs' pad block)."""
    bytes_per_block = sum(g.bytes_per_block_per_layer * len(g.layers) for g in groups)
    block_size = groups[0].block_size
    num_blocks = (
        num_blocks_override if num_blocks_override is not None else budget_bytes // bytes_per_block
    )
    needed = -(-(max_model_len + lookahead) // block_size) + reserved_blocks
    if num_blocks < needed:
        layers = sum(len(g.layers) for g in groups)
        raise KVBudgetError(
            f"KV cache budget {budget_bytes / 2**20:.1f} MiB holds {num_blocks} blocks of "
            f"{block_size} tokens ({bytes_per_block / 2**10:.1f} KiB per block across {layers} "
            f"layers); one request of max_model_len={max_model_len} plus {lookahead} look-ahead "
            f"tokens needs {needed - reserved_blocks} blocks"
            f"{f' (plus {reserved_blocks} reserved)' if reserved_blocks else ''}. Lower "
            f"--max-model-len or raise --kv-cache-memory to at least "
            f"{needed * bytes_per_block / 2**20:.1f} MiB"
        )
    return PoolPlan(num_blocks=num_blocks, bytes_per_block=bytes_per_block)


class KVPool:
    """Allocates each layer's pages and hands out ``LayerKV`` handles by layer name."""

    def __init__(
        self,
        groups: Sequence[GroupSpec],
        num_blocks: int,
        layout: str,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.groups = {g.name: g for g in groups}
        self._layers: dict[str, LayerKV] = {}
        for group in groups:
            for name in group.layers:
                shape = _physical_shape(group, num_blocks, layout)
                pages = torch.empty(shape, dtype=group.dtype, device=device)
                if device.type == "cpu":
                    advise_huge_pages(pages)  # before the first touch below
                pages.zero_()
                self._layers[name] = LayerKV(name=name, group=group, layout=layout, physical=pages)

    def layer(self, name: str) -> LayerKV:
        return self._layers[name]

    def layers(self, names: Sequence[str]) -> list[LayerKV]:
        return [self._layers[n] for n in names]


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of a CPU tensor's memory with transparent huge
    pages (``madvise(MADV_HUGEPAGE)``; honoured where THP is in ``madvise`` or ``always``
    mode). The attention kernel reads a step's K/V through far fewer TLB entries. Returns
    whether the call succeeded; anything else (another OS, a tensor under 2 MiB) is a no-op."""
    if not sys.platform.startswith("linux"):
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(first, last - first, MADV_HUGEPAGE) == 0


def _physical_shape(group: GroupSpec, num_blocks: int, layout: str) -> tuple[int, ...]:
    bs, h, d = group.block_size, group.num_kv_heads, group.head_size
    return (num_blocks, 2, bs, h, d) if layout == "NHD" else (num_blocks, 2, h, bs, d)
