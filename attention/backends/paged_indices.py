"""FlashInfer-style paged index arrays, built by plain code (tested on CPU).

For request ``i``: queries ``qo_indptr[i]:qo_indptr[i+1]``; its pages are
``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` in order; the last page holds
``kv_last_page_len[i]`` (1..page_size) valid entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.backends.base import AttentionBatch


@dataclass(frozen=True)
class PagedIndices:
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [total pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    page_size: int

    def to(self, device: torch.device) -> PagedIndices:
        return PagedIndices(
            self.qo_indptr.to(device), self.kv_indptr.to(device), self.kv_indices.to(device),
            self.kv_last_page_len.to(device), self.page_size,
        )


def build_paged_indices(batch: AttentionBatch) -> PagedIndices:
    bs = batch.block_size
    qo, kvp, last = [0], [0], []
    pages: list[int] = []
    for q_len, kv_len, table in zip(batch.q_lens, batch.kv_lens, batch.block_tables):
        if kv_len < 1:
            raise ValueError(f"kv_len must be >= 1, got {kv_len}")
        n = -(-kv_len // bs)
        if n > len(table):
            raise ValueError(f"block table has {len(table)} pages, {n} needed for {kv_len} tokens")
        pages.extend(table[:n])
        qo.append(qo[-1] + q_len)
        kvp.append(kvp[-1] + n)
        last.append(kv_len - (n - 1) * bs)
    as32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return PagedIndices(as32(qo), as32(kvp), as32(pages), as32(last), bs)

