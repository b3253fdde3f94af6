"""The attention backend interface and the batch description every backend plans from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from attention.kv import LayerKV


@dataclass(frozen=True)
class AttentionBatch:
    """One group's attention work for one step.

    Request ``i`` contributes ``q_lens[i]`` new tokens (packed in order) whose K/V go to the
    next ``q_lens[i]`` entries of ``slot_mapping``; it attends over ``kv_lens[i]`` positions
    (its new tokens included) through ``block_tables[i]``. ``causal`` aligns the queries to the
    end of the KV range (bottom-right); otherwise every query sees the whole range.

    ``tree_masks`` (optional, only with ``causal``): an int64 host tensor with one entry per
    packed query token (``num_tokens`` long), for verifying a tree of draft tokens in one
    step. Entry 0 keeps the usual causal rule. A nonzero entry ``m`` for query row ``i`` of a
    request with ``q_len``/``kv_len`` (``base = kv_len - q_len``) means: the row sees positions
    ``[0, base)`` plus the positions ``base + t`` of the query-block offsets ``t``
    (``0 <= t < min(q_len, 63)``) whose bit ``t`` is set in ``m``. The highest set bit must be
    ``i`` itself (a node sees its ancestors, which sit at lower offsets, and itself), and a
    request with any nonzero entry must have ``q_len <= 63``. A tree node ``j`` is stored at
    slot ``base + j`` while its logical position is ``base + depth(j)``; its mask holds the
    bits of its ancestors at depths ``0 .. depth - 1`` and its own. A row with a mask computes
    what a plain causal row would over the same K/V stored in logical order (the paged CPU
    kernel: bitwise so); ``m = 2**(i + 1) - 1`` is exactly the causal row. Backends without
    tree support (FlashInfer, CUDA graphs) refuse batches that carry masks.
    """

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    slot_mapping: torch.Tensor
    causal: bool
    block_size: int
    tree_masks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        masks = self.tree_masks
        if masks is None:
            return
        if not self.causal:
            raise ValueError("tree masks need causal attention")
        if masks.dtype != torch.int64 or masks.dim() != 1 or masks.device.type != "cpu":
            raise ValueError(f"tree_masks must be a 1-D int64 host tensor, got {masks.dtype} "
                             f"{tuple(masks.shape)} on {masks.device}")
        if masks.numel() != self.num_tokens:
            raise ValueError(f"tree_masks has {masks.numel()} entries for {self.num_tokens} "
                             "query tokens")

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens))


TREE_MAX_Q = 63  # a tree request's query block fits the bits of a (non-negative) int64


def check_tree_masks(q_lens: tuple[int, ...], masks: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every nonzero entry of ``masks`` (one per packed query token)
    has its highest set bit at its row's offset in the request's query block, and every request
    with a nonzero entry has ``q_len <= 63`` (the rule of ``AttentionBatch.tree_masks``)."""
    if masks.numel() == 0:
        return
    q = torch.tensor(q_lens, dtype=torch.long)
    req = torch.repeat_interleave(torch.arange(len(q_lens)), q)
    offset = torch.arange(masks.numel()) - torch.repeat_interleave(q.cumsum(0) - q, q)
    nonzero = masks != 0
    if not bool(nonzero.any()):
        return
    too_long = nonzero & (q[req] > TREE_MAX_Q)
    if bool(too_long.any()):
        b = int(req[too_long][0])
        raise ValueError(f"tree masks: request {b} has q_len {q_lens[b]} > {TREE_MAX_Q}")
    # the highest set bit is the offset i iff m >> i == 1 (m < 0, bit 63, never passes)
    bad = nonzero & ((masks >> offset.clamp(max=TREE_MAX_Q - 1)) != 1)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        b, i, m = int(req[row]), int(offset[row]), int(masks[row])
        top = m.bit_length() - 1 if m > 0 else 63
        raise ValueError(f"tree masks: request {b}, query row {i}: mask {m} has its highest "
                         f"set bit at {top}, must be the row's own offset {i}")


class AttentionMetadata(Protocol):
    """Per-step state a backend builds once per group and every layer reuses."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, scale: float
    ) -> torch.Tensor:
        """Write ``k``/``v`` ``[N, Hkv, D]`` into ``kv`` and return attention ``[N, Hq, D]``."""
        ...


class AttentionBackend(Protocol):
    name: str
    supported_layouts: tuple[str, ...]

    def check_support(
        self, kv_dtype: torch.dtype, q_dtype: torch.dtype, head_size: int, group: str
    ) -> None:
        """Raise ``ValueError`` naming the group if this backend cannot serve the combination."""
        ...

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> AttentionMetadata:
        ...
