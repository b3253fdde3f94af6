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
    """

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    slot_mapping: torch.Tensor
    causal: bool
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens))


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
